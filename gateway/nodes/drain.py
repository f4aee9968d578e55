"""This process's own node's drain switch, kept in memory for the paths that cannot afford a read."""

from __future__ import annotations


class DrainFlag:
    """Whether this process's node drains, as this process last read or wrote it.

    The forks of the snapshots this process holds check it instead of reading the database
    (a read per fork, even in the records' thread beside the restore, cost it ~0.7 ms).
    Each heartbeat reads the flag from the database; a drain or undrain through this process
    (the API, the console) sets it at once. One written by another process (``forkyard nodes
    drain``) reaches it within one heartbeat.
    """

    def __init__(self, node: str) -> None:
        self.node = node
        self.draining = False

    def saw(self, name: str, draining: bool) -> None:
        """Note that node ``name`` was set to drain (or not); only this process's node matters here."""
        if name == self.node:
            self.draining = draining

"""Snapshots: branch points of sessions (snapshot, fork, pin, delete, garbage collection)."""

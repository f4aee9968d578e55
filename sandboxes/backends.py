"""Pick and build a sandbox backend by name; backend modules are imported lazily."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from sandboxes.base import SandboxBackend
from sandboxes.errors import BackendUnavailableError

logger = logging.getLogger(__name__)

BACKEND_KINDS = ("local", "docker", "auto")


def docker_available(docker_url: str | None = None) -> bool:
    """Tell whether a Docker engine answers at ``docker_url`` (or DOCKER_HOST / the default socket)."""
    try:
        import docker
    except ImportError:
        return False
    try:
        client = docker.DockerClient(base_url=docker_url, timeout=5) if docker_url else docker.from_env(timeout=5)
    except Exception:  # noqa: BLE001 - any failure means "no engine here"
        return False
    try:
        client.ping()
        return True
    except Exception:  # noqa: BLE001
        return False
    finally:
        client.close()


def create_backend(
    kind: str,
    *,
    node: str,
    root_dir: str | os.PathLike,
    docker_url: str | None = None,
    isolation: str = "standard",
    runtime: str | None = None,
    egress_ports: Sequence[int] | None = None,
    egress_networks: Sequence[str] = (),
) -> SandboxBackend:
    """Build the ``local``, ``docker`` or (``auto``) best available sandbox backend.

    ``isolation`` and ``runtime`` choose the local backend's tier and OCI runtime
    (:mod:`sandboxes.oci`); ``egress_ports`` and ``egress_networks`` what networked
    sandboxes of either backend may reach (:mod:`sandboxes.network`).

    Raises:
        BackendUnavailableError: the host cannot run the chosen backend.
        ValueError: ``kind`` is not one of local, docker, auto.
    """
    if kind not in BACKEND_KINDS:
        raise ValueError(f"unknown sandbox backend {kind!r}; expected one of {', '.join(BACKEND_KINDS)}")
    if kind == "auto":
        kind = "docker" if docker_available(docker_url) else "local"
        logger.info("sandbox backend auto-selected: %s", kind)
    from sandboxes.network import EgressPolicy

    egress = EgressPolicy(
        tcp_ports=tuple(egress_ports) if egress_ports is not None else (80, 443),
        allow_networks=tuple(egress_networks),
    )
    if kind == "local":
        from sandboxes.local import LocalBackend

        return LocalBackend(Path(root_dir), node, isolation=isolation, runtime=runtime, egress=egress)
    try:
        from sandboxes.docker import DockerBackend
    except ImportError as exc:
        raise BackendUnavailableError(f"The docker sandbox backend cannot be loaded: {exc}.") from exc
    return DockerBackend(node, base_url=docker_url, egress=egress)


__all__ = ["BACKEND_KINDS", "create_backend", "docker_available"]

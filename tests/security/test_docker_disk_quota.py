"""Disk fill on the docker backend, on an engine whose storage can limit a container's disk.

This machine's engine keeps its layers in overlay2 on ext4, which cannot (the escape
suite's disk-fill test is a strict xfail there). This module starts a second, private
dockerd on a btrfs loop filesystem (its own socket, data root, containerd namespace and
network namespace, no bridge, no iptables), imports the base image into it and fills a sandbox: the
backend asks for ``size`` = the task's ``disk_mb`` plus the image (btrfs counts both).
Everything is stopped and removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from sandboxes.backends import create_backend
from sandboxes.base import Resources, SandboxSpec
from tests.conftest import base_image

pytestmark = [pytest.mark.docker, pytest.mark.timeout(300)]

_TOOLS = ("dockerd", "mkfs.btrfs", "unshare")


def _wait_for(path: Path, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def btrfs_engine():
    """Yield the URL of a private dockerd whose storage driver is btrfs; stop and remove it after."""
    missing = [t for t in _TOOLS if shutil.which(t) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)}")
    base = Path(tempfile.mkdtemp(prefix="fy-dockerd-"))
    image, root, sock, pidfile = base / "disk.img", base / "root", base / "docker.sock", base / "dockerd.pid"
    ns = f"fytest-{uuid.uuid4().hex[:6]}"
    host_links = set(os.listdir("/sys/class/net"))
    proc = None
    root.mkdir()
    try:
        with open(image, "wb") as fh:
            fh.truncate(3 << 30)  # sparse
        subprocess.run(["mkfs.btrfs", "-q", "-f", str(image)], check=True, capture_output=True, timeout=60)
        subprocess.run(["mount", "-o", "loop", str(image), str(root)], check=True, capture_output=True, timeout=60)
        with open(base / "dockerd.log", "wb") as log:
            proc = subprocess.Popen(
                # In a network namespace of its own: a dockerd without a bridge deletes docker0,
                # which would cut the host's engine off its network.
                ["unshare", "--net", "--", "dockerd", f"--data-root={root}", f"--exec-root={base / 'exec'}", f"--pidfile={pidfile}",
                 f"--host=unix://{sock}", "--storage-driver=btrfs", "--bridge=none", "--iptables=false",
                 "--ip-masq=false", f"--containerd-namespace={ns}", f"--containerd-plugins-namespace={ns}-plugins"],
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        if not _wait_for(sock, 60):
            pytest.fail(f"the private dockerd did not start: {(base / 'dockerd.log').read_text()[-2000:]}")
        yield f"unix://{sock}"
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        # dockerd leaves its own mounts (netns, containers) under the data root and exec root.
        for mnt in sorted(_mounts_under(base), key=len, reverse=True):
            subprocess.run(["umount", "-l", mnt], capture_output=True, timeout=60, check=False)
        shutil.rmtree(base, ignore_errors=True)
    assert host_links <= set(os.listdir("/sys/class/net")), "the private dockerd changed the host's network links"


def _mounts_under(path: Path) -> list[str]:
    with open("/proc/self/mountinfo") as fh:
        points = [line.split()[4] for line in fh]
    return [p for p in points if p == str(path) or p.startswith(f"{path}/")]


async def test_disk_fill_stops_at_the_quota_on_an_engine_that_has_them(btrfs_engine, node_name):
    backend = create_backend("docker", node=f"{node_name}-quota", root_dir="/nonexistent", docker_url=btrfs_engine)
    sid = None
    try:
        assert backend._disk_quota == "rootfs"
        ref = await base_image(backend)
        info = await backend.create(SandboxSpec(image=ref, resources=Resources(disk_mb=64)))
        sid = info.id
        r = await backend.exec(info.id, "dd if=/dev/zero of=/tmp/fill bs=1M count=256 2>&1; sync; "
                                        "du -sm /tmp/fill | cut -f1", timeout_s=120)  # fmt: skip
        assert "Disk quota exceeded" in r.stdout or "No space left" in r.stdout, r
        # The image's size is rounded up to whole MiB and btrfs counts metadata: a little slack.
        assert int(r.stdout.split()[-1]) <= 64 + 8, r
        assert (await backend.exec(info.id, "rm /tmp/fill && echo freed")).stdout == "freed\n"
        assert (await backend.exec(info.id, "head -c 8M /dev/zero > /tmp/small && echo fits")).stdout == "fits\n"
    finally:
        if sid is not None:
            await backend.destroy(sid)
        await backend.aclose()

"""How the ``local`` backend starts a restored branch: its shell starts in the snapshot's state.

Also how the layers a sandbox is being made on outlive a concurrent delete of their snapshot or image.
"""

from __future__ import annotations

import asyncio
import json
import threading
import uuid
from pathlib import Path

import pytest

from sandboxes import local
from sandboxes.base import ImageConfig, Resources, SandboxSpec
from sandboxes.cgroups import SandboxCgroup
from sandboxes.errors import SandboxError
from sandboxes.local import LocalBackend
from sandboxes.snapshots import SHELL_OWNED_VARS
from tests.sandboxes.conftest import (
    BASE_REF,
    local_backend,
)

pytestmark = pytest.mark.local


@pytest.fixture
async def lb(backend_root, base_rootfs, node_name):
    """A LocalBackend with the base image; afterwards its sandboxes and snapshots are gone, checked by id."""
    async for backend in local_backend(backend_root, base_rootfs, node_name):
        yield backend


async def _exports(backend: LocalBackend, sandbox_id: str) -> set[str]:
    r = await backend.exec(sandbox_id, "compgen -e")
    return set(r.stdout.split()) - SHELL_OWNED_VARS


async def test_branch_exports_exactly_the_snapshot_variables(lb):
    info = await lb.create(SandboxSpec(image=BASE_REF))
    setup = (
        "mkdir -p /srv/real && ln -s /srv/real /srv/link && cd /srv/link && "
        "unset LANG TERM && export LC_ALL=C.UTF-8 MULTI=$'a\\nb'"
    )
    assert (await lb.exec(info.id, setup)).exit_code == 0
    snap = await lb.snapshot(info.id)
    original = await _exports(lb, info.id)
    assert "LANG" not in original and {"LC_ALL", "MULTI"} <= original

    branches = await lb.restore(snap, 2, spec=SandboxSpec(image=BASE_REF, env={"EXTRA": "1"}))
    for branch in branches:
        assert await _exports(lb, branch.id) == original | {"EXTRA"}
        r = await lb.exec(branch.id, 'pwd; printf "%s|%s|%s" "${LANG-unset}" "$LC_ALL" "$MULTI"')
        assert (r.stdout, r.cwd) == ("/srv/link\nunset|C.UTF-8|a\nb", "/srv/link")  # the logical cwd


async def test_branch_cgroup_has_the_limits_and_holds_the_shell_and_its_children(lb):
    info = await lb.create(SandboxSpec(image=BASE_REF))
    snap = await lb.snapshot(info.id)
    branches = await lb.restore(snap, 3, spec=SandboxSpec(image=BASE_REF, resources=Resources(pids=77)))
    for branch in branches:
        limits = [p / "pids.max" for p in SandboxCgroup(branch.id).paths if (p / "pids.max").exists()]
        assert limits and all(f.read_text().strip() == "77" for f in limits)
        r = await lb.exec(branch.id, "sleep 30 & cat /proc/1/cgroup /proc/$!/cgroup /proc/self/cgroup")
        mark = f"/forkyard/{branch.id}"
        hierarchies = len(SandboxCgroup(branch.id).paths)
        # The bash, a background job and `cat`, each in every hierarchy of the branch.
        assert sum(line.endswith(mark) for line in r.stdout.splitlines()) == 3 * hierarchies, r.stdout


async def test_restore_into_a_cwd_that_is_gone_fails_and_leaves_nothing(lb, backend_root):
    info = await lb.create(SandboxSpec(image=BASE_REF))
    assert (await lb.exec(info.id, "mkdir /gone && cd /gone && rmdir /gone")).exit_code == 0
    snap = await lb.snapshot(info.id)
    assert snap.cwd == "/gone"
    with pytest.raises(SandboxError, match="/gone"):
        await lb.restore(snap, 2)
    assert [i.id for i in await lb.list()] == [info.id]
    assert [p.name for p in (backend_root / "sandboxes").iterdir()] == [info.id]


async def while_mounting(monkeypatch, starting, meanwhile):
    """Run ``starting`` (a create or restore), and ``meanwhile`` while its overlay is mounted but not yet recorded."""
    mounted, go_on = threading.Event(), threading.Event()
    real_mount = local._mount_overlay

    def mount_then_wait(*args):
        ok = real_mount(*args)
        mounted.set()
        go_on.wait(30)
        return ok

    monkeypatch.setattr(local, "_mount_overlay", mount_then_wait)
    task = asyncio.create_task(starting)
    try:
        assert await asyncio.to_thread(mounted.wait, 30), "the overlay was never mounted"
        await meanwhile
    finally:
        go_on.set()
    return await task


async def test_a_snapshot_deleted_while_a_branch_mounts_it_keeps_its_layers(lb, monkeypatch):
    """The overlay is mounted before meta.json names its layers: a delete in between must not free them."""
    info = await lb.create(SandboxSpec(image=BASE_REF))
    assert (await lb.exec(info.id, "echo kept > /kept")).exit_code == 0
    snap = await lb.snapshot(info.id)
    [branch] = await while_mounting(monkeypatch, lb.restore(snap), lb.delete_snapshot(snap.id))

    assert snap.id not in {s.id for s in await lb.list_snapshots()}
    assert await lb.read_file(branch.id, "/kept") == b"kept\n"
    # Freed by the next collection once the branch is gone.
    await lb.destroy(branch.id)
    await lb.delete_snapshot(snap.id)
    assert not Path(snap.layers[-1]).exists()


async def test_an_image_removed_while_a_sandbox_mounts_it_keeps_its_layers(lb, backend_root, monkeypatch):
    """create() reads the manifest before meta.json names its layers: a remove_image in between must not free them."""
    tag = f"pinned-{uuid.uuid4().hex[:8]}"
    ref = f"forkyard/test:{tag}"
    source = await lb.create(SandboxSpec(image=BASE_REF))
    assert (await lb.exec(source.id, "echo kept > /kept")).exit_code == 0
    await lb.commit(source.id, ref, ImageConfig())
    await lb.destroy(source.id)  # the image is now the only owner of its top layer
    layer = Path(json.loads((backend_root / f"images/forkyard/test/{tag}.json").read_text())["layers"][-1])
    info = await while_mounting(monkeypatch, lb.create(SandboxSpec(image=ref)), lb.remove_image(ref))
    monkeypatch.undo()

    assert not await lb.has_image(ref)
    assert layer.is_dir()
    assert await lb.read_file(info.id, "/kept") == b"kept\n"
    r = await lb.exec(info.id, "cat /kept && ls /bin/bash")
    assert (r.exit_code, r.stdout) == (0, "kept\n/bin/bash\n"), r
    # As before, a sandbox still using the layers keeps them through another collection...
    await lb.remove_image(ref)
    assert layer.is_dir()
    # ...and once it is gone the next one frees them.
    await lb.destroy(info.id)
    await lb.remove_image(ref)
    assert not layer.exists()

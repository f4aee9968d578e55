"""Snapshot and restore on every backend: branches start from one state and diverge."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from sandboxes.base import Revert, SandboxSpec, on_launched
from sandboxes.layers import ChangeKind, diff
from sandboxes.shell import TIMEOUT_EXIT_CODE
from sandboxes.snapshots import (
    BACKGROUND_PROCESSES_KEY,
    BACKGROUND_PROCESSES_NOT_CAPTURED,
    Snapshot,
)
from tests.sandboxes.conftest import BASE_REF

SPEC = SandboxSpec(image=BASE_REF)
TRICKY = "two\nlines 'single' \"double\" $dollar \\back"


def _storage_present(backend, snap: Snapshot) -> bool:
    """Tell whether the snapshot's own storage (top layer dir or image) still exists."""
    if backend.name == "local":
        from pathlib import Path

        return Path(snap.layers[-1]).exists()
    import docker

    client = docker.from_env()
    try:
        client.images.get(snap.digest)
        return True
    except docker.errors.ImageNotFound:
        return False
    finally:
        client.close()


def _layer_count(backend) -> int:
    return sum(
        1 for p in (backend.root_dir / "layers").iterdir() if not p.name.startswith(".")
    )


@pytest.fixture
async def snaps(backend):
    """Snapshots made by the test; after it, sandboxes go first, then the snapshots, checked by id."""
    made: list[Snapshot] = []
    yield made
    for info in await backend.list():
        await backend.destroy(info.id)
    for snap in made:
        await backend.delete_snapshot(snap.id)
    left = [s.id for s in made if _storage_present(backend, s)]
    known = {s.id for s in await backend.list_snapshots()}
    assert left == [] and not known & {s.id for s in made}, (
        f"snapshots left behind: {left} {known}"
    )


async def _sleep_count(backend, sid: str) -> int:
    r = await backend.exec(sid, "ps -eo comm= | grep -c '^sleep$' || true")
    return int(r.stdout.strip())


async def test_a_files_only_snapshot_needs_nothing_of_the_sandboxs_programs(backend, snaps):
    """shell_state=False: the files alone, taken without a word to a shell whose bash is gone."""
    info = await backend.create(SPEC)
    await backend.exec(info.id, "export GONE=1 && mkdir -p /work && echo kept > /work/f && cd /work && rm /usr/bin/bash")
    snap = await backend.snapshot(info.id, shell_state=False)
    snaps.append(snap)
    assert snap.env == {} and snap.cwd == snap.workdir
    changes = {c.path: c.kind for c in diff(await backend.filesystem(BASE_REF), await backend.filesystem(snap))}
    assert changes["/usr/bin/bash"] is ChangeKind.DELETED and changes["/work/f"] is ChangeKind.ADDED, changes


async def test_a_restore_can_put_paths_back_as_the_image_has_them(backend, snaps):
    """revert: each branch shows the image's file, a whiteout for an added one; shell_state=False: no exports."""
    info = await backend.create(SPEC)
    await backend.exec(info.id, "printf '#!/bin/sh\\necho forged\\n' > /usr/bin/env && echo mine > /usr/bin/added && "
                                "mkdir -p /work && echo kept > /work/f && export SECRET=agent")
    snap = await backend.snapshot(info.id)
    snaps.append(snap)
    [plain] = await backend.restore(snap, 1)
    assert "forged" in (await backend.exec(plain.id, "/usr/bin/env true; echo $SECRET")).stdout
    branches = await backend.restore(snap, 2, revert=Revert(("/usr/bin/env", "/usr/bin/added"), BASE_REF),
                                     shell_state=False)
    for branch in branches:
        out = (await backend.exec(branch.id, "env | grep -c '^SECRET=' ; test -e /usr/bin/added || echo hidden; "
                                             "cat /work/f; env -i A=1 /usr/bin/env")).stdout.split()
        assert out == ["0", "hidden", "kept", "A=1"], out
    # The agent's sandbox and the snapshot keep what they had.
    assert (await backend.exec(info.id, "cat /usr/bin/added")).stdout == "mine\n"


async def test_branches_start_from_the_snapshot_and_diverge(backend, snaps):
    info = await backend.create(SPEC)
    setup = (
        "mkdir -p /work/sub && echo original > /work/state.txt && rm /etc/issue.net && "
        f"export TRICKY={_squote(TRICKY)} && export PLAIN=plain && unset FORKYARD_TEST_IMAGE && cd /work/sub"
    )
    r = await backend.exec(info.id, setup)
    assert r.exit_code == 0, r.stderr
    await backend.exec(info.id, "(sleep 1000 &) ; true")
    assert await _sleep_count(backend, info.id) == 1

    snap = await backend.snapshot(info.id, metadata={"step": "3"})
    snaps.append(snap)
    assert snap.backend == backend.name
    assert snap.metadata[BACKGROUND_PROCESSES_KEY] == BACKGROUND_PROCESSES_NOT_CAPTURED
    assert snap.metadata["step"] == "3"
    assert snap.cwd == "/work/sub"
    assert snap.env["TRICKY"] == TRICKY and "FORKYARD_TEST_IMAGE" not in snap.env
    assert snap.id in {s.id for s in await backend.list_snapshots()}

    # The original goes on, and what it does after the snapshot stays its own.
    r = await backend.exec(
        info.id, "echo after > /work/state.txt && export PLAIN=changed && pwd"
    )
    assert r.stdout == "/work/sub\n"

    _, mark = backend.made_after(0)
    branches = await backend.restore(snap, 3)
    assert len({b.id for b in branches}) == 3 and info.id not in {
        b.id for b in branches
    }
    # The backend's ledger holds the branches as it does what create made.
    assert sorted(m.id for m in backend.made_after(mark)[0]) == sorted(b.id for b in branches)
    for i, branch in enumerate(branches):
        r = await backend.exec(
            branch.id,
            'pwd; printf "%s|" "$TRICKY" "$PLAIN" "${FORKYARD_TEST_IMAGE-unset}"',
        )
        assert r.stdout == f"/work/sub\n{TRICKY}|plain|unset|", r
        assert await backend.read_file(branch.id, "/work/state.txt") == b"original\n"
        r = await backend.exec(
            branch.id, "test -e /etc/issue.net && echo present || echo deleted"
        )
        assert r.stdout == "deleted\n"
        assert await _sleep_count(backend, branch.id) == 0
        r = await backend.exec(
            branch.id, f"echo branch-{i} > ../state.txt"
        )  # relative to the restored cwd
        assert r.exit_code == 0
    for i, branch in enumerate(branches):
        r = await backend.exec(branch.id, "cat /work/state.txt")
        assert r.stdout == f"branch-{i}\n"
    r = await backend.exec(
        info.id,
        'cat /work/state.txt; echo "$PLAIN"; test -e /etc/issue.net || echo deleted',
    )
    assert r.stdout == "after\nchanged\ndeleted\n"
    assert await _sleep_count(backend, info.id) == 1


def _squote(text: str) -> str:
    return "'" + text.replace("'", "'\\''") + "'"


async def test_a_restored_sandbox_keeps_the_contract(backend, snaps):
    info = await backend.create(SPEC)
    await backend.exec(info.id, "mkdir -p /srv && cd /srv && export KEEP=1")
    snap = await backend.snapshot(info.id)
    snaps.append(snap)
    [branch] = await backend.restore(
        snap, spec=SandboxSpec(image=BASE_REF, env={"EXTRA": "x"}, labels={"k": "v"})
    )
    assert branch.labels["k"] == "v"

    r = await backend.exec(branch.id, 'echo "$KEEP$EXTRA"; false')
    assert (r.stdout, r.exit_code, r.cwd) == ("1x\n", 1, "/srv")
    await backend.write_file(branch.id, "/srv/data.bin", bytes(range(256)))
    assert await backend.read_file(branch.id, "/srv/data.bin") == bytes(range(256))
    r = await backend.exec(branch.id, "sleep 100", timeout_s=1)
    assert r.timed_out and r.exit_code == TIMEOUT_EXIT_CODE
    assert await _sleep_count(backend, branch.id) == 0
    r = await backend.exec(branch.id, 'pwd; echo "$KEEP"')
    assert r.stdout == "/srv\n1\n"
    # A snapshot of a branch is a snapshot like any other.
    await backend.exec(branch.id, "echo second > gen2.txt")
    snap2 = await backend.snapshot(branch.id)
    snaps.append(snap2)
    assert snap2.id != snap.id
    [grandchild] = await backend.restore(snap2)
    r = await backend.exec(grandchild.id, "cat gen2.txt; cat data.bin | wc -c")
    assert r.stdout == "second\n256\n"


async def test_a_restore_says_when_each_branch_is_launched_and_before_it_is_ready(backend, snaps):
    """``on_launched``: called once per branch, before the restore answers; a restore outside it calls nothing."""
    info = await backend.create(SPEC)
    snap = await backend.snapshot(info.id)
    snaps.append(snap)
    launches: list[int] = []
    with on_launched(lambda: launches.append(len(launches))):
        restoring = asyncio.ensure_future(backend.restore(snap, 2))  # a task started in the block counts too
    branches = await restoring
    assert launches == [0, 1] and len(branches) == 2
    for branch in branches:
        assert (await backend.exec(branch.id, "echo up")).stdout == "up\n"
    await backend.restore(snap, 1)
    assert launches == [0, 1]


async def test_delete_snapshot_frees_its_storage_once_unused(backend, snaps):
    info = await backend.create(SPEC)
    await backend.write_file(info.id, "/data/blob", b"x" * 4096)
    before = _layer_count(backend) if backend.name == "local" else None
    snap = await backend.snapshot(info.id)
    snaps.append(snap)
    assert _storage_present(backend, snap)
    if before is not None:
        assert _layer_count(backend) == before + 1
    [branch] = await backend.restore(snap)
    [second] = await backend.restore(snap)

    # Deleted while branches use it: forgotten at once, freed when the last branch goes
    # (no later call needed).
    await backend.delete_snapshot(snap.id)
    assert snap.id not in {s.id for s in await backend.list_snapshots()}
    assert await backend.read_file(branch.id, "/data/blob") == b"x" * 4096
    r = await backend.exec(branch.id, "echo ok")
    assert r.stdout == "ok\n"
    await backend.destroy(branch.id)
    assert _storage_present(backend, snap)  # the second branch still stands on it
    assert await backend.read_file(second.id, "/data/blob") == b"x" * 4096
    await backend.destroy(second.id)
    assert not _storage_present(backend, snap)
    if before is not None:
        assert _layer_count(backend) == before
    await backend.delete_snapshot(snap.id)  # idempotent
    await backend.delete_snapshot("0" * 32)  # unknown id
    # The original sandbox never depended on the snapshot.
    assert await backend.read_file(info.id, "/data/blob") == b"x" * 4096


@pytest.mark.local
@pytest.mark.parametrize("backend", ["local"], indirect=True)  # layer chains are a local backend matter
async def test_deep_chains_are_squashed(backend, snaps):
    backend.max_snapshot_layers = 3
    current = await backend.create(SPEC)
    await backend.exec(current.id, "echo 0 > /gen0 && rm /etc/issue.net")
    for gen in range(1, 5):
        snap = await backend.snapshot(current.id)
        snaps.append(snap)
        assert len(snap.layers) <= 3
        [current] = await backend.restore(snap)
        await backend.exec(
            current.id,
            f"echo {gen} > /gen{gen} && rm /gen{gen - 1} && mkdir -p /dir{gen}",
        )
    r = await backend.exec(
        current.id,
        "cat /gen4; ls / | grep -c '^gen'; ls -d /dir* | wc -l; test -e /etc/issue.net || echo gone",
    )
    assert r.stdout == "4\n1\n4\ngone\n"
    assert (
        snaps[-1].layers[0] == snaps[0].layers[0]
    )  # the image's base layer is never copied


@pytest.mark.local
@pytest.mark.parametrize("backend", ["local"], indirect=True)
async def test_a_local_snapshot_digest_lists_its_top_layer(backend, snaps):
    """The digest (taken of the copy before it is moved into place) is that of the layer kept; squashed too."""
    from sandboxes.snapshots import tree_digest

    backend.max_snapshot_layers = 2
    info = await backend.create(SPEC)
    await backend.exec(info.id, "mkdir -p /d && echo a > /d/a && rm /etc/issue.net")
    plain = await backend.snapshot(info.id)
    snaps.append(plain)
    [branch] = await backend.restore(plain)
    await backend.exec(branch.id, "echo b > /d/b")
    squashed = await backend.snapshot(branch.id)  # three layers: the top two are merged
    snaps.append(squashed)
    assert len(plain.layers) == 2 and len(squashed.layers) == 2 and squashed.layers[-1] != plain.layers[-1]
    for snap in (plain, squashed):
        assert snap.digest == tree_digest(snap.layers[-1])
    assert plain.digest != squashed.digest


def _docker_layers(image_id: str) -> int:
    import docker

    client = docker.from_env()
    try:
        return len(client.images.get(image_id).attrs["RootFS"]["Layers"])
    finally:
        client.close()


@pytest.mark.parametrize("backend", ["docker"], indirect=True)
async def test_deep_docker_chains_are_flattened(backend, snaps):
    """Every commit adds a layer; past the bound a snapshot image is flattened with the same files and config."""
    base_depth = _docker_layers(BASE_REF)
    backend.max_snapshot_layers = base_depth + 2
    current = await backend.create(SPEC)
    await backend.exec(current.id, "mkdir -p /work && cd /work && echo 0 > gen0 && rm /etc/issue.net")
    depths = []
    for gen in range(1, 6):
        await backend.exec(current.id, f"export GEN={gen}")
        snap = await backend.snapshot(current.id)
        snaps.append(snap)
        depths.append(_docker_layers(snap.digest))
        [current] = await backend.restore(snap)
        await backend.exec(current.id, f"echo {gen} > gen{gen} && rm gen{gen - 1}")
    assert max(depths) <= base_depth + 2 and min(depths) < base_depth  # at least one was flattened
    r = await backend.exec(current.id, 'echo "$PWD|$GEN|$FORKYARD_TEST_IMAGE"; ls; test -e /etc/issue.net || echo gone')
    assert r.stdout == "/work|5|base\ngen5\ngone\n", r


#: The engine calls snapshot() makes once its image exists, up to the tag that names it.
_SNAPSHOT_STEPS = {
    "commit a snapshot", "inspect a snapshot image", "create a container to flatten", "export a snapshot",
    "import a flattened snapshot", "create a container to label", "commit a flattened snapshot",
    "remove a container", "tag a snapshot",
}  # fmt: skip


@pytest.mark.parametrize("backend", ["docker"], indirect=True)
@pytest.mark.parametrize("flatten", [False, True], ids=["plain", "flattened"])
async def test_a_docker_snapshot_being_made_survives_concurrent_deletes(backend, snaps, monkeypatch, flatten):
    """delete_snapshot sweeps unused untagged snapshot images; one still being made is never among them."""
    import docker

    if flatten:
        backend.max_snapshot_layers = 1  # every commit adds a layer to the base's: always flattened
    info = await backend.create(SPEC)
    await backend.exec(info.id, "echo kept > /kept")
    real_call = backend._call
    sweeps: list[str] = []

    async def call_then_sweep(what, fn, *args, **kwargs):
        out = await real_call(what, fn, *args, **kwargs)
        if what in _SNAPSHOT_STEPS:
            sweeps.append(what)
            await backend.delete_snapshot("0" * 32)  # deletes nothing, sweeps every unused leftover
        return out

    monkeypatch.setattr(backend, "_call", call_then_sweep)
    snap = await backend.snapshot(info.id)
    snaps.append(snap)
    monkeypatch.undo()
    assert "tag a snapshot" in sweeps and ("import a flattened snapshot" in sweeps) == flatten

    assert snap.id in {s.id for s in await backend.list_snapshots()}
    [branch] = await backend.restore(snap)
    assert await backend.read_file(branch.id, "/kept") == b"kept\n"
    client = docker.from_env()
    try:
        # Flattened, the labelled commit sits on the imported flat image; plain, on the base image.
        parent = client.images.get(snap.digest).attrs.get("Parent") or ""
        assert parent
        await backend.destroy(branch.id)
        await backend.delete_snapshot(snap.id)
        assert not _storage_present(backend, snap)
        if flatten:  # deleting the snapshot frees the intermediate that made it
            with pytest.raises(docker.errors.ImageNotFound):
                client.images.get(parent)
        left = client.images.list(filters={"label": f"forkyard.snapshot.node={backend.node}"})
        assert left == [], f"snapshot images of this node left behind: {left}"
    finally:
        client.close()


@pytest.mark.parametrize("backend", ["docker"], indirect=True)
async def test_a_docker_branch_of_a_live_snapshot_goes_without_an_image_call(backend, snaps, monkeypatch):
    """Only a branch of a snapshot deleted here may take an image with it; the others ask the engine nothing."""
    info = await backend.create(SPEC)
    snap = await backend.snapshot(info.id)
    snaps.append(snap)
    [branch] = await backend.restore(snap)
    removed: list[str] = []
    remove_image = backend._api.remove_image

    def spying(image, *args, **kwargs):
        removed.append(image)
        return remove_image(image, *args, **kwargs)

    monkeypatch.setattr(backend._api, "remove_image", spying)
    await backend.destroy(branch.id)
    assert removed == []
    [branch] = await backend.restore(snap)
    await backend.delete_snapshot(snap.id)  # in use: retired
    removed.clear()
    await backend.destroy(branch.id)
    assert removed == [f"forkyard/snapshot-retired:{snap.id}"]
    assert not _storage_present(backend, snap)


@pytest.mark.parametrize("backend", ["docker"], indirect=True)
async def test_delete_snapshot_sweeps_build_tags_of_abandoned_docker_snapshots(backend, monkeypatch):
    """A snapshot() cancelled while the engine commits leaves a build tag: kept while fresh, swept once stale."""
    import docker

    from sandboxes import docker as docker_backend

    info = await backend.create(SPEC)
    client = docker.from_env()
    image = None
    try:
        image = client.containers.get(info.id).commit(
            repository=docker_backend.BUILD_REPOSITORY,
            tag=f"abandoned-{uuid.uuid4().hex[:8]}",
            conf={"Labels": {docker_backend.LABEL_SNAPSHOT_NODE: backend.node}},
        )
        await backend.delete_snapshot("0" * 32)
        assert client.images.get(image.id).tags  # fresh: a snapshot() may still be making it
        monkeypatch.setattr(docker_backend, "_ABANDONED_BUILD_S", -60)  # every build tag is stale now
        await backend.delete_snapshot("0" * 32)
        with pytest.raises(docker.errors.ImageNotFound):
            client.images.get(image.id)
    finally:
        if image is not None:
            try:
                client.images.remove(image.id, force=True)
            except docker.errors.ImageNotFound:
                pass
        client.close()


@pytest.mark.parametrize("backend", ["docker"], indirect=True)
async def test_delete_snapshot_leaves_an_untagged_image_of_its_node_alone(backend):
    """The engine makes a commit's image before it tags it: an untagged image may be a snapshot being made.

    Seen when two sandboxes ran their verifiers at once: one's delete_snapshot removed the
    image the other's commit had just made, and its tag call failed with "No such image".
    """
    import docker

    from sandboxes import docker as docker_backend

    info = await backend.create(SPEC)
    client = docker.from_env()
    image_id = None
    try:
        # What a concurrent snapshot() has between the engine's image create and its tag.
        image_id = client.api.commit(info.id, conf={"Labels": {docker_backend.LABEL_SNAPSHOT_NODE: backend.node}})["Id"]
        assert client.images.get(image_id).tags == []
        snap = await backend.snapshot(info.id)
        await backend.delete_snapshot(snap.id)
        await backend.delete_snapshot("0" * 32)
        assert client.images.get(image_id).id == image_id
        with pytest.raises(docker.errors.ImageNotFound):
            client.images.get(snap.digest)
    finally:
        if image_id is not None:
            try:
                client.images.remove(image_id, force=True)
            except docker.errors.ImageNotFound:
                pass
        client.close()


@pytest.mark.parametrize("backend", ["docker"], indirect=True)
@pytest.mark.parametrize("step", ["create a container to label", "commit a flattened snapshot"])
async def test_a_failed_docker_flattening_leaves_no_image(backend, monkeypatch, step):
    """The imported image of a flattening has no tag or label to sweep it by: a failure after the import deletes it."""
    import docker

    from sandboxes import docker as docker_backend
    from sandboxes.errors import SandboxError

    backend.max_snapshot_layers = 1  # every commit adds a layer to the base's: always flattened
    info = await backend.create(SPEC)
    real_call = backend._call
    made: dict[str, str] = {}  # step -> image id

    async def call_failing_at_step(what, fn, *args, **kwargs):
        if what == step:
            raise SandboxError(f"injected failure to {what}")
        out = await real_call(what, fn, *args, **kwargs)
        if what == "commit a snapshot":
            made[what] = out["Id"]
        elif what == "import a flattened snapshot":
            made[what] = docker_backend._imported_image_id(out, "a flattened snapshot")
        return out

    client = docker.from_env()
    try:
        before = {image.id for image in client.images.list(all=True)}
        monkeypatch.setattr(backend, "_call", call_failing_at_step)
        with pytest.raises(SandboxError, match="injected failure"):
            await backend.snapshot(info.id)
        monkeypatch.undo()

        assert set(made) == {"commit a snapshot", "import a flattened snapshot"} and all(made.values()), made
        assert not set(made.values()) & before, "the images checked were not made by this snapshot()"
        after = {image.id for image in client.images.list(all=True)}
        assert not set(made.values()) & after, f"images of the failed snapshot left behind: {made}"
        assert client.images.list(all=True, filters={"label": f"forkyard.snapshot.node={backend.node}"}) == []
        assert client.containers.list(all=True, filters={"label": f"forkyard.squash={backend.node}"}) == []
        assert await backend.list_snapshots() == []
    finally:
        client.close()

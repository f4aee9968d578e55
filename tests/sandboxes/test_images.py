"""The offline base image: recipe digest, atomic locked builds, and one real debootstrap.

The real build uses the production cache (/var/cache/forkyard/images) on purpose: it
is built once per host and reused by every later run, test or not. The lock, crash and
failure paths use a stand-in ``debootstrap`` script on PATH so they run in seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
import threading
import uuid
from pathlib import Path

import pytest

from sandboxes import images
from sandboxes.images import (
    BASE_IMAGE_CONFIG,
    DEFAULT_IMAGE_CACHE,
    BaseImageError,
    base_image_ref,
    build_base_rootfs,
    cached_base_rootfs,
    ensure_base_image,
)


@pytest.fixture
def cache_dir():
    path = Path(tempfile.mkdtemp(prefix="forkyard-imgtest-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def fake_debootstrap(monkeypatch):
    """Put a stand-in debootstrap on PATH; return a function that writes its behaviour."""
    bindir = Path(tempfile.mkdtemp(prefix="forkyard-fakebin-"))
    calls = bindir / "calls"

    def install(*, exit_code: int = 0, sleep_s: float = 0.0) -> Path:
        script = f"""#!/bin/bash
if [ "$1" = --version ]; then echo "debootstrap 0.0-fake"; exit 0; fi
target="${{@: -2:1}}"
echo "$*" >> {calls}
echo "I: Retrieving Release (fake)"
echo "some chatter that is not a status line"
mkdir -p "$target"/etc "$target"/usr/bin "$target"/var/cache/apt/archives/partial \\
         "$target"/var/lib/apt/lists/partial "$target"/debootstrap
echo "nameserver 10.0.0.1" > "$target"/etc/resolv.conf
touch "$target"/var/cache/apt/archives/bash_5.2_amd64.deb "$target"/var/lib/apt/lists/deb_Packages
sleep {sleep_s}
if [ {exit_code} -ne 0 ]; then echo "E: Couldn't download packages (fake)"; exit {exit_code}; fi
echo "I: Base system installed successfully."
"""
        path = bindir / "debootstrap"
        path.write_text(script)
        path.chmod(0o755)
        return calls

    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    try:
        yield install
    finally:
        shutil.rmtree(bindir, ignore_errors=True)


def _leftovers(cache_dir: Path) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir() if not p.name.endswith(".lock"))


def test_base_image_ref_is_a_digest_of_the_recipe(monkeypatch):
    ref = base_image_ref()
    name, _, tag = ref.partition(":")
    assert name == "forkyard/base"
    assert len(tag) == 12 and int(tag, 16) >= 0
    assert base_image_ref() == ref
    monkeypatch.setattr(images, "BASE_PACKAGES", images.BASE_PACKAGES + ("curl",))
    assert base_image_ref() != ref
    monkeypatch.setattr(images, "BASE_PACKAGES", tuple(reversed(images.BASE_PACKAGES[:-1])))
    assert base_image_ref() == ref  # order of the package list does not matter


def test_missing_debootstrap_is_a_clear_error(cache_dir, monkeypatch):
    empty = cache_dir / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    with pytest.raises(BaseImageError, match=r"debootstrap is not installed: apt-get install debootstrap"):
        build_base_rootfs(cache_dir / "images")


def test_build_finishes_the_tree_and_is_reused(cache_dir, fake_debootstrap):
    calls = fake_debootstrap()
    lines: list[str] = []
    rootfs = build_base_rootfs(cache_dir, mirror="http://mirror.invalid/debian", progress=lines.append)

    assert rootfs == cache_dir / base_image_ref().split(":")[1] / "rootfs"
    assert cached_base_rootfs(cache_dir) == rootfs
    argv = calls.read_text().split()
    assert "--variant=minbase" in argv and argv[-1] == "http://mirror.invalid/debian"
    assert any(a.startswith("--include=") and "python3" in a.split("=", 1)[1].split(",") for a in argv)
    assert "I: Retrieving Release (fake)" in lines
    assert not any("chatter" in line for line in lines)
    # Post-processing: caches gone, sticky dirs, hostname, no host resolver, no debootstrap dir.
    assert list((rootfs / "var/cache/apt/archives").iterdir()) == [rootfs / "var/cache/apt/archives/partial"]
    assert [p.name for p in (rootfs / "var/lib/apt/lists").iterdir()] == ["partial"]
    for rel in ("tmp", "var/tmp", "logs"):
        assert stat.S_IMODE((rootfs / rel).stat().st_mode) == 0o1777, rel
    assert (rootfs / "etc/hostname").read_text().strip()
    assert "10.0.0.1" not in (rootfs / "etc/resolv.conf").read_text()
    assert not (rootfs / "debootstrap").exists()
    manifest = json.loads((rootfs.parent / "recipe.json").read_text())
    assert manifest["ref"] == base_image_ref()
    assert manifest["mirror"] == "http://mirror.invalid/debian"
    assert _leftovers(cache_dir) == [rootfs.parent.name]

    lines.clear()
    assert build_base_rootfs(cache_dir, progress=lines.append) == rootfs
    assert lines == []
    assert len(calls.read_text().splitlines()) == 1


def test_failed_build_leaves_nothing_that_looks_finished(cache_dir, fake_debootstrap):
    fake_debootstrap(exit_code=3)
    lines: list[str] = []
    with pytest.raises(BaseImageError) as info:
        build_base_rootfs(cache_dir, progress=lines.append)
    assert "exit code 3" in str(info.value)
    assert "Couldn't download packages" in str(info.value)
    assert "E: Couldn't download packages (fake)" in lines
    assert cached_base_rootfs(cache_dir) is None
    assert _leftovers(cache_dir) == []


def test_wreck_of_a_crashed_build_is_ignored_then_cleaned(cache_dir, fake_debootstrap):
    fake_debootstrap()
    tag = base_image_ref().split(":")[1]
    wreck = cache_dir / f".{tag}.tmp-crashed"
    (wreck / "rootfs/usr/bin").mkdir(parents=True)
    (wreck / "rootfs/usr/bin/half-written").write_bytes(b"\0" * 10)
    half = cache_dir / tag / "rootfs"  # an entry with no recipe.json is not finished either
    half.mkdir(parents=True)

    assert cached_base_rootfs(cache_dir) is None
    rootfs = build_base_rootfs(cache_dir)
    assert not wreck.exists()
    assert (rootfs.parent / "recipe.json").is_file()
    assert _leftovers(cache_dir) == [tag]


def test_concurrent_builds_run_debootstrap_once(cache_dir, fake_debootstrap):
    calls = fake_debootstrap(sleep_s=1.0)
    results: list[Path] = []
    errors: list[BaseException] = []
    lines: list[str] = []

    def build() -> None:
        try:
            results.append(build_base_rootfs(cache_dir, progress=lines.append))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert errors == []
    assert len(results) == 3 and len(set(results)) == 1
    assert len(calls.read_text().splitlines()) == 1
    assert _leftovers(cache_dir) == [results[0].parent.name]


def test_real_debootstrap_build_in_the_shared_cache():
    """Build (or reuse) the production base rootfs and check what it holds."""
    was_built = cached_base_rootfs(DEFAULT_IMAGE_CACHE) is not None
    lines: list[str] = []
    rootfs = build_base_rootfs(DEFAULT_IMAGE_CACHE, progress=lines.append)
    if not was_built:
        assert any(line.startswith("I: ") for line in lines)
    for rel in ("usr/bin/bash", "usr/bin/python3", "usr/bin/git", "usr/bin/ps", "usr/bin/setpriv", "usr/bin/xz"):
        assert (rootfs / rel).exists(), rel
    assert (rootfs / "usr/lib/python3/dist-packages/pytest").is_dir()
    assert not list((rootfs / "var/cache/apt/archives").glob("*.deb"))
    assert stat.S_IMODE((rootfs / "tmp").stat().st_mode) == 0o1777
    assert (rootfs / "logs").is_dir()
    assert json.loads((rootfs.parent / "recipe.json").read_text())["packages"] == sorted(images.BASE_PACKAGES)
    lines.clear()
    assert build_base_rootfs(DEFAULT_IMAGE_CACHE, progress=lines.append) == rootfs
    assert lines == []


@pytest.mark.parametrize("kind", ["local", "docker"])
async def test_ensure_base_image_imports_once(kind):
    from sandboxes.backends import create_backend

    root_dir = Path(tempfile.mkdtemp(prefix="forkyard-imgtest-root-"))
    backend = create_backend(kind, node=f"imgtest-{uuid.uuid4().hex[:8]}", root_dir=root_dir)
    ref = base_image_ref()
    had_image = await backend.has_image(ref)
    sandbox_id = None
    try:
        lines: list[str] = []
        assert await ensure_base_image(backend, DEFAULT_IMAGE_CACHE, progress=lines.append) == ref
        assert await backend.has_image(ref)
        if not had_image:
            assert any("importing" in line for line in lines)
        lines.clear()
        assert await ensure_base_image(backend, DEFAULT_IMAGE_CACHE, progress=lines.append) == ref
        assert lines == []

        from sandboxes.base import SandboxSpec

        info = await backend.create(SandboxSpec(image=ref))
        sandbox_id = info.id
        result = await backend.exec(sandbox_id, "python3 -c 'import pytest, sys; print(sys.version_info[0])'; echo $LANG")
        assert result.exit_code == 0, result
        assert result.stdout.split() == ["3", BASE_IMAGE_CONFIG.env["LANG"]]
    finally:
        if sandbox_id is not None:
            await backend.destroy(sandbox_id)
        if not had_image:
            await backend.remove_image(ref)
        await backend.aclose()
        shutil.rmtree(root_dir, ignore_errors=True)

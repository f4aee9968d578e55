"""Synthesized SWE instances: the mutators, synthesis from a local project, and real PyPI projects."""

from __future__ import annotations

import ast
import asyncio
import os
import subprocess
import uuid
from pathlib import Path

import pytest

from sandboxes.base import LABEL_OWNER
from tests.conftest import DEFAULT_IMAGE_CACHE
from tests.workers.conftest import SWE_EXAMPLES, BuildBackend
from workers.envs.base import Action, run_actions
from workers.envs.swe import FAMILY
from workers.envs.swe.repos import RepoStore
from workers.envs.swe.synth import (
    KINDS,
    find_mutations,
    is_source_file,
    pick,
    synthesize,
    unpack_sdist,
)
from workers.envs.swe.task import parse_jsonl
from workers.runtime import WorkerRuntime

ROOT = Path(__file__).resolve().parents[3]
SOURCE = '''"""Doc."""


def window(items, size):
    """Doc."""
    if size <= 0:
        raise ValueError("size")
    out = []
    for i in range(len(items) - size + 1):
        out.append(items[i:i + size])
    log("done", len(out))
    return out


def is_empty(items):
    return len(items) == 0


def log(*parts):
    print(*parts)
    return True
'''


def test_every_kind_of_mutation_is_found_and_parses() -> None:
    mutations = find_mutations("pkg/core.py", SOURCE)
    assert {m.kind for m in mutations} == set(KINDS)
    by_kind = {m.kind: m for m in mutations}
    assert any(m.before == "size <= 0" and m.after == "size < 0" for m in mutations)
    assert any(m.before == "len(items) - size + 1" and m.after == "len(items) - size + 2" for m in mutations)
    assert any(m.before == "return True" and m.after == "return False" for m in mutations)
    assert any(m.before == 'log("done", len(out))' and m.after == "pass" for m in mutations)
    assert any(m.before == 'log("done", len(out))' and m.after == "log(len(out), 'done')" for m in mutations)
    assert not any('"""Doc."""' in m.before for m in mutations)  # docstrings are never dropped
    for mutation in mutations:
        ast.parse(mutation.text)
        assert mutation.text != SOURCE and mutation.text.count("\n") >= SOURCE.count("\n") - 1
    assert by_kind["compare"].patch(SOURCE).startswith("diff --git a/pkg/core.py b/pkg/core.py\n--- a/pkg/core.py")


def test_a_mutation_patch_applies_with_git_and_reverses(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "core.py").write_text(SOURCE)
    for mutation in find_mutations("pkg/core.py", SOURCE):
        patch = mutation.patch(SOURCE).encode()
        subprocess.run(["git", "apply", "-"], input=patch, cwd=tmp_path, check=True)
        assert (tmp_path / "pkg" / "core.py").read_text() == mutation.text
        subprocess.run(["git", "apply", "-R", "-"], input=patch, cwd=tmp_path, check=True)
        assert (tmp_path / "pkg" / "core.py").read_text() == SOURCE


def test_sources_pick_and_sdists() -> None:
    assert is_source_file("toolz/itertoolz.py") and not is_source_file("toolz/tests/test_x.py")
    assert not is_source_file("setup.py") and not is_source_file("docs/conf.py") and not is_source_file("x.txt")
    mutations = find_mutations("a.py", SOURCE) * 3
    chosen = pick(mutations, limit=5, seed=1)
    assert [m.kind for m in chosen] == list(KINDS) and pick(mutations, limit=5, seed=1) == chosen
    import io
    import tarfile

    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, data in (("pkg-1.0/pkg/a.py", b"x = 1\n"), ("pkg-1.0/../evil", b"no"), ("pkg-1.0/tests/t.py", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    assert unpack_sdist(raw.getvalue()) == {"pkg/a.py": b"x = 1\n", "tests/t.py": b""}


async def _check_gold_and_empty(runtime: WorkerRuntime, tasks, owner: str, *, concurrency: int = 3) -> None:
    """Every task: its gold patch scores 1, submitting nothing scores 0 (a few sandboxes at a time)."""
    images = {}
    for task in tasks:  # one image per repository version, built before the checks share it
        images[task.instance_id] = await runtime.task_image(task)
    slots = asyncio.Semaphore(concurrency)

    async def check(task, actions, reward) -> None:
        async with slots:
            env = runtime.new_env(task, image=images[task.instance_id], labels={LABEL_OWNER: owner})
            try:
                await env.reset()
                result = await run_actions(env, actions)
            finally:
                await env.close()
        assert result.reward == reward, (task.instance_id, result.info)

    await asyncio.gather(*(check(task, actions, reward) for task in tasks
                           for actions, reward in ((FAMILY.oracle(task), 1.0), ([Action("submit", {})], 0.0))))


async def test_synthesis_from_a_local_project(build_backend: BuildBackend, tmp_path: Path) -> None:
    """textkit, as a directory: kept candidates break some tests, keep others, and are solved by their gold patch."""
    from workers.archives import read_dir

    store = RepoStore(tmp_path / "store")
    before = FAMILY.repos
    FAMILY.configure(repo_store=store.root)
    runtime = WorkerRuntime(build_backend.backend, image_cache_dir=DEFAULT_IMAGE_CACHE, base_image=build_backend.base)
    try:
        files = read_dir(SWE_EXAMPLES / "repos" / "textkit", max_bytes=1 << 20, max_files=100)
        lines: list[str] = []
        tasks = await synthesize(runtime, store, files=dict(files), name="local/textkit", max_instances=4,
                                 max_candidates=40, seed=3, progress=lines.append)
        assert 1 <= len(tasks) <= 4 and any("tests pass on the clean tree" in line for line in lines)
        for task in tasks:
            assert task.patch_kind == "bug" and task.fail_to_pass and task.pass_to_pass
            assert not set(task.fail_to_pass) & set(task.pass_to_pass)
            assert task.extra["synth"]["kind"] in KINDS and task.fail_to_pass[0] in task.problem_statement
        assert parse_jsonl("\n".join(__import__("json").dumps(t.to_json()) for t in tasks).encode())
        await _check_gold_and_empty(runtime, tasks, f"test-synth-{uuid.uuid4().hex[:6]}")
    finally:
        FAMILY.repos = before
    assert not [s for s in await build_backend.backend.list() if s.labels.get(LABEL_OWNER, "").startswith(
        ("test-synth", "forkyard-swe-synth"))]


@pytest.fixture(scope="session")
def pypi_synth() -> Path:
    """Run examples/swe/synth_pypi.sh (cached across runs) and return its cache directory."""
    out = subprocess.run(["bash", str(ROOT / "examples" / "swe" / "synth_pypi.sh")], capture_output=True, text=True,
                         timeout=1800, env={**os.environ})
    assert out.returncode == 0, out.stderr[-3000:]
    return Path(out.stdout.strip().splitlines()[-1])


# One backend: the instances are graded by the SWE family, the same on both (test_synthesis_from_a_local_project
# and tests/workers/swe/test_swe_env.py run it on each); 24 more gold runs on docker cost the suite a minute.
@pytest.mark.parametrize("build_backend", ["local"], indirect=True)
async def test_instances_synthesized_from_real_pypi_projects_are_solved_by_gold_only(
    build_backend: BuildBackend, pypi_synth: Path
) -> None:
    tasks = []
    for name in ("inflection", "toolz"):
        tasks += parse_jsonl((pypi_synth / f"{name}.jsonl").read_bytes())
    assert len(tasks) >= 20 and {t.repo for t in tasks} == {"pypi/inflection", "pypi/toolz"}
    assert {t.extra["synth"]["kind"] for t in tasks} >= {"compare", "off_by_one", "return"}
    # Synthesis kept each instance only after running the suite on it (its tests fail, the clean
    # tree's pass); grading goes through a different path, the SWE family's. One instance of
    # each kind per project is graded here (48 graded runs of all 24 took a minute).
    sample = list({(t.repo, t.extra["synth"]["kind"]): t for t in tasks}.values())
    assert len(sample) >= 6
    before = FAMILY.repos
    FAMILY.configure(repo_store=pypi_synth / "repos")
    runtime = WorkerRuntime(build_backend.backend, image_cache_dir=DEFAULT_IMAGE_CACHE, base_image=build_backend.base)
    try:
        await _check_gold_and_empty(runtime, sample, f"test-synth-{uuid.uuid4().hex[:6]}")
    finally:
        FAMILY.repos = before

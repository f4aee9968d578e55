"""Make SWE-smith-style instances from a real Python project: inject bugs, keep those the tests catch.

:func:`synthesize` takes a project (a local directory, or ``NAME==VERSION``, whose source
distribution is downloaded inside a sandbox: nothing of the package runs on the host),
makes a repository of it in the store, and builds its environment image like any instance's.
It then walks the project's non-test modules for bug candidates by AST mutation:

- ``compare``: a comparison operator moved by one (``<`` to ``<=``, ``==`` to ``!=``, ``in`` to ``not in``...);
- ``off_by_one``: an integer constant added or subtracted, or a slice bound, moved by one;
- ``return``: a returned value replaced (``True``/``False`` swapped, anything else by ``None``);
- ``drop_call``: a call made for its effect removed;
- ``swap_args``: the first two positional arguments of a call swapped.

Each candidate runs the test suite in a fork of the clean sandbox. A candidate is kept
only if it makes at least one passing test fail and leaves at least one passing; its
FAIL_TO_PASS and PASS_TO_PASS lists are those runs' results, and its ``patch`` (kind
``bug``) is the candidate's diff, whose reverse is the gold solution.
"""

from __future__ import annotations

import ast
import asyncio
import copy
import difflib
import io
import logging
import random
import re
import shlex
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sandboxes.base import LABEL_OWNER, SandboxSpec
from workers.envs.swe.grading import PASSED, XFAIL, read_log
from workers.envs.swe.repos import RepoStore, head_commit
from workers.envs.swe.task import DEFAULT_WORKDIR, SWETask
from workers.errors import TaskFormatError
from workers.protocol import SYNTH_OWNER

if TYPE_CHECKING:
    from workers.runtime import WorkerRuntime

logger = logging.getLogger(__name__)

KINDS = ("compare", "off_by_one", "return", "drop_call", "swap_args")
_PASSING = frozenset({PASSED, XFAIL})
_TEST_FILE = re.compile(r"(^|/)(tests?|testing)/|(^|/)test_[^/]*\.py$|_tests?\.py$|(^|/)conftest\.py$|(^|/)setup\.py$"
                        r"|(^|/)docs?/")
_COMPARE_SHIFT = {ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq,
                  ast.NotEq: ast.Eq, ast.In: ast.NotIn, ast.NotIn: ast.In, ast.Is: ast.IsNot, ast.IsNot: ast.Is}
#: The most of a project's source files read, and of one sdist unpacked.
MAX_SOURCE_FILES = 2000
MAX_SDIST_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Mutation:
    """One bug candidate: a file, where in it, what kind, and the file's new text."""

    path: str
    kind: str
    line: int
    before: str
    after: str
    text: str
    """The whole file with the mutation in place."""

    def patch(self, original: str) -> str:
        """Return the candidate as a git-style unified diff of ``path``."""
        diff = difflib.unified_diff(original.splitlines(keepends=True), self.text.splitlines(keepends=True),
                                    fromfile=f"a/{self.path}", tofile=f"b/{self.path}")
        return f"diff --git a/{self.path} b/{self.path}\n" + "".join(diff)


def _mutants(node: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Yield (kind, replacement) for each way ``node`` can be mutated."""
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and type(node.ops[0]) in _COMPARE_SHIFT:
        new = copy.deepcopy(node)
        new.ops = [_COMPARE_SHIFT[type(node.ops[0])]()]
        yield "compare", new
    if (isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub)) and isinstance(node.right, ast.Constant)
            and type(node.right.value) is int):
        new = copy.deepcopy(node)
        new.right = ast.Constant(node.right.value + 1)
        yield "off_by_one", new
    if isinstance(node, ast.Slice):
        for bound in ("lower", "upper"):
            value = getattr(node, bound)
            if isinstance(value, ast.Constant) and type(value.value) is int:
                new = copy.deepcopy(node)
                setattr(new, bound, ast.Constant(value.value + 1))
                yield "off_by_one", new
    if isinstance(node, ast.Return) and node.value is not None:
        value = node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, bool):
            yield "return", ast.Return(ast.Constant(not value.value))
        elif not (isinstance(value, ast.Constant) and value.value is None):
            yield "return", ast.Return(ast.Constant(None))
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call):
        yield "drop_call", ast.Pass()
    if (isinstance(node, ast.Call) and len(node.args) >= 2 and not any(isinstance(a, ast.Starred) for a in node.args[:2])
            and ast.dump(node.args[0]) != ast.dump(node.args[1])):
        new = copy.deepcopy(node)
        new.args[0], new.args[1] = new.args[1], new.args[0]
        yield "swap_args", new


def _offset(lines: list[bytes], line: int, col: int) -> int:
    return sum(len(x) for x in lines[: line - 1]) + col


def find_mutations(path: str, text: str) -> list[Mutation]:
    """Return every bug candidate in one Python file (none if it does not parse)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    data = text.encode()
    lines = data.splitlines(keepends=True)
    found: list[Mutation] = []
    docstrings = {id(n.body[0]) for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef,
                                                                          ast.ClassDef)) and n.body and
                  isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    for node in ast.walk(tree):
        if id(node) in docstrings or not hasattr(node, "end_lineno") or node.end_lineno is None:
            continue
        for kind, replacement in _mutants(node):
            start = _offset(lines, node.lineno, node.col_offset)
            end = _offset(lines, node.end_lineno, node.end_col_offset or 0)
            before = data[start:end].decode()
            after = ast.unparse(replacement)
            if after == before:
                continue
            new_text = (data[:start] + after.encode() + data[end:]).decode()
            try:
                ast.parse(new_text)
            except SyntaxError:
                continue
            found.append(Mutation(path, kind, node.lineno, before, after, new_text))
    return found


def is_source_file(path: str) -> bool:
    """Tell whether ``path`` is a module of the project (not a test, docs or setup.py)."""
    return path.endswith(".py") and not _TEST_FILE.search(path)


def pick(mutations: list[Mutation], *, limit: int, seed: int) -> list[Mutation]:
    """Return up to ``limit`` candidates, round-robin over kinds and files, in a seeded order."""
    rng = random.Random(seed)
    pools: dict[str, list[Mutation]] = {}
    for mutation in mutations:
        pools.setdefault(mutation.kind, []).append(mutation)
    for pool in pools.values():
        rng.shuffle(pool)
    chosen: list[Mutation] = []
    while len(chosen) < limit and any(pools.values()):
        for kind in KINDS:
            if pools.get(kind) and len(chosen) < limit:
                chosen.append(pools[kind].pop())
    return chosen


def unpack_sdist(data: bytes) -> dict[str, str | bytes]:
    """Return the files of a source distribution (tar.gz or zip) under its top folder, refusing unsafe members."""
    from workers.archives import ArchiveLimits, iter_members

    files: dict[str, str | bytes] = {}
    if data[:2] == b"PK":
        import zipfile

        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            members = [(i.filename, archive.read(i)) for i in archive.infolist() if not i.is_dir()]
    else:
        members = [(m.name, content) for m, content in iter_members(data, ArchiveLimits(max_unpacked_bytes=MAX_SDIST_BYTES))
                   if m.isfile() and content is not None]
    for name, content in members:
        parts = [p for p in name.split("/") if p not in ("", ".")]
        if name.startswith("/") or ".." in parts or len(parts) < 2:
            continue
        files["/".join(parts[1:])] = content
    if not files:
        raise TaskFormatError("the source distribution holds no files under a top folder")
    return files


async def fetch_sdist(runtime: WorkerRuntime, spec: str) -> bytes:
    """Download ``NAME==VERSION``'s source distribution with pip inside a networked sandbox; return its bytes."""
    from workers.standins import stand_in_image
    from workers.trust import CA_BUNDLE_PATH, ca_env

    if runtime.base_image is None:
        await runtime.start()
    assert runtime.base_image is not None
    backend = runtime.backend
    image = await stand_in_image(backend, "python", base_image=runtime.base_image, ca_bundle=runtime.ca_bundle)
    env = ca_env() if runtime.ca_bundle is not None else {}
    info = await backend.create(SandboxSpec(image=image, network=True, env=env,
                                            labels={LABEL_OWNER: SYNTH_OWNER}))
    try:
        if runtime.ca_bundle is not None:
            await backend.write_file(info.id, CA_BUNDLE_PATH, runtime.ca_bundle)
        result = await backend.exec(
            info.id, f"pip download --quiet --no-binary :all: --no-deps --no-build-isolation -d /tmp/sdist "
                     f"{shlex.quote(spec)} && ls /tmp/sdist", timeout_s=600)
        names = result.stdout.split()
        if result.exit_code != 0 or not names:
            raise TaskFormatError(f"cannot download the source distribution of {spec}: "
                                  f"{(result.stderr or result.stdout).strip()[-500:]}")
        return await backend.read_file(info.id, f"/tmp/sdist/{names[-1]}", max_bytes=MAX_SDIST_BYTES)
    finally:
        await backend.destroy(info.id)


def problem_statement(name: str, f2p: list[str]) -> str:
    """Return the issue text of a synthesized instance: which tests fail, not where the bug is."""
    shown = "\n".join(f"- {t}" for t in f2p[:8]) + (f"\n- ... and {len(f2p) - 8} more" if len(f2p) > 8 else "")
    return (f"After a recent change to {name}, these tests fail:\n{shown}\n\nThe tests are right; the library code "
            "is wrong. Find the bug and fix it so that they pass again, without breaking the other tests.")


async def synthesize(
    runtime: WorkerRuntime,
    repos: RepoStore,
    *,
    files: dict[str, str | bytes],
    name: str,
    install: tuple[str, ...] = ("pip install --quiet pytest", "pip install --quiet --no-build-isolation -e ."),
    test_cmd: str = "pytest -rA -p no:cacheprovider",
    max_instances: int = 20,
    max_candidates: int = 120,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[SWETask]:
    """Make up to ``max_instances`` bug instances of the project given as ``files``; return them.

    ``repos`` must be the store the ``swe`` family is configured with (its images and
    resets read the repository from there).

    Raises:
        TaskFormatError: the project's tests do not run, or none pass on the clean tree.
    """
    say = progress or (lambda line: logger.info("synth %s: %s", name, line))
    with tempfile.TemporaryDirectory(prefix="forkyard-synth-") as tmp:
        for rel, content in files.items():
            target = Path(tmp) / "src" / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content if isinstance(content, bytes) else content.encode())
        base_commit = head_commit(await asyncio.to_thread(repos.add, Path(tmp) / "src", name=name))
    slug = re.sub(r"[^A-Za-z0-9._-]", "_", name.replace("/", "__"))
    clean = SWETask(instance_id=f"{slug}.clean", repo=name, base_commit=base_commit, problem_statement="(clean)",
                    fail_to_pass=("(none)",), install=install, test_cmd=test_cmd, workdir=DEFAULT_WORKDIR)
    say(f"repository at {base_commit[:12]}; building its environment image")
    image = await runtime.task_image(clean)
    from workers.envs.swe.env import SWEEnv, run_tests

    env = runtime.new_env(clean, image=image, labels={LABEL_OWNER: SYNTH_OWNER})
    assert isinstance(env, SWEEnv)
    snapshot = None
    try:
        await env.reset()
        assert env.sandbox is not None
        baseline, problem = _statuses(await run_tests(runtime.backend, env.sandbox.id, clean, patches=[]))
        passing = sorted(t for t, s in baseline.items() if s in _PASSING)
        if problem or not passing:
            raise TaskFormatError(f"{name}: the tests do not run on the clean tree ({problem or 'none passes'})")
        say(f"{len(passing)} of {len(baseline)} tests pass on the clean tree")
        texts = {rel: c if isinstance(c, str) else c.decode("utf-8", "replace")
                 for rel, c in sorted(files.items()) if is_source_file(rel)}
        candidates = pick([m for rel, text in list(texts.items())[:MAX_SOURCE_FILES] for m in find_mutations(rel, text)],
                          limit=max_candidates, seed=seed)
        say(f"{len(candidates)} candidate bug(s) to try")
        snapshot = await runtime.backend.snapshot(env.sandbox.id, metadata={"forkyard.kind": "synth"})
        spec = SandboxSpec(image=snapshot.image, resources=snapshot.resources, labels={LABEL_OWNER: SYNTH_OWNER})
        made: list[SWETask] = []
        for number, mutation in enumerate(candidates, start=1):
            if len(made) >= max_instances:
                break
            patch = mutation.patch(texts[mutation.path])
            (fork,) = await runtime.backend.restore(snapshot, 1, spec=spec)
            try:
                log = await run_tests(runtime.backend, fork.id, clean, patches=[("bug", patch)])
            except Exception as exc:  # a candidate that hangs the tests or breaks the run is not an instance
                say(f"candidate {number} ({mutation.kind} in {mutation.path}:{mutation.line}) dropped: {exc}")
                continue
            finally:
                await runtime.backend.destroy(fork.id)
            statuses, problem = _statuses(log)
            if problem:
                continue
            f2p = [t for t in passing if statuses.get(t) not in _PASSING]
            p2p = [t for t in passing if statuses.get(t) in _PASSING]
            if not f2p or not p2p:
                continue
            made.append(SWETask(
                instance_id=f"{slug}.{mutation.kind}.{len(made) + 1}", repo=name, base_commit=base_commit,
                problem_statement=problem_statement(name, f2p), patch=patch, patch_kind="bug",
                fail_to_pass=tuple(f2p), pass_to_pass=tuple(p2p), install=install, test_cmd=test_cmd,
                created_at="synthesized", extra={"synth": {"kind": mutation.kind, "file": mutation.path,
                                                          "line": mutation.line, "seed": seed}},
            ))
            say(f"instance {len(made)}: {mutation.kind} at {mutation.path}:{mutation.line} breaks {len(f2p)} test(s)")
        return made
    finally:
        await env.close()
        if snapshot is not None:
            await runtime.backend.delete_snapshot(snapshot.id)


def _statuses(log: str) -> tuple[dict[str, str], str | None]:
    statuses, _, problem = read_log(log, "pytest")
    return statuses, problem


__all__ = ["KINDS", "Mutation", "fetch_sdist", "find_mutations", "is_source_file", "pick", "problem_statement",
           "synthesize", "unpack_sdist"]

"""Tests of the Harbor-style task loader: examples, bad inputs, archives."""

from __future__ import annotations

import gzip
import io
import os
import tarfile
from pathlib import Path

import pytest

from workers.envs.terminal import task as tasks_module
from workers.envs.terminal.task import (
    TerminalTask,
    load_task_dir,
    load_task_files,
    task_to_tar,
    tasks_from_tar,
)
from workers.errors import TaskFormatError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "terminal"
EXAMPLE_DIRS = sorted(p for p in EXAMPLES.iterdir() if p.is_dir())

GOOD_TOML = """\
version = "1.0"

[metadata]
author_name = "tester"
tags = ["a", "b"]

[agent]
timeout_sec = 120

[verifier]
timeout_sec = 30.5

[environment]
cpus = 2
memory_mb = 2048
network = true
build_timeout_sec = 600.0
"""


def minimal_files(**overrides: bytes | None) -> dict[str, bytes]:
    """Return a valid in-memory task; a None override removes that file."""
    files: dict[str, bytes | None] = {
        "instruction.md": b"Do the thing.\n",
        "task.toml": GOOD_TOML.encode(),
        "environment/Dockerfile": b"FROM ubuntu:24.04\nWORKDIR /app\n",
        "tests/test.sh": b"#!/bin/bash\necho 1 > /logs/verifier/reward.txt\n",
        "solution/solve.sh": b"#!/bin/bash\ntrue\n",
    }
    files.update(overrides)
    return {path: data for path, data in files.items() if data is not None}


def make_tar(entries: list[tarfile.TarInfo | tuple[str, bytes]], *, compression: str = "gz") -> bytes:
    """Build a tar archive from (name, data) pairs or ready TarInfo entries (links...)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=f"w:{compression}" if compression else "w") as archive:
        for entry in entries:
            if isinstance(entry, tarfile.TarInfo):
                archive.addfile(entry)
            else:
                name, data = entry
                info = tarfile.TarInfo(name)
                info.size = len(data)
                archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_examples_are_at_least_six() -> None:
    assert len(EXAMPLE_DIRS) >= 6, [p.name for p in EXAMPLE_DIRS]


@pytest.mark.parametrize("task_dir", EXAMPLE_DIRS, ids=lambda p: p.name)
def test_every_example_loads(task_dir: Path) -> None:
    task = load_task_dir(task_dir)
    assert task.name == task_dir.name
    assert task.instruction == (task_dir / "instruction.md").read_text()
    assert task.instruction.strip()
    assert task.has_solution
    assert "tests/test.sh" in task.files
    assert task.dockerfile is not None and task.dockerfile.startswith("FROM ubuntu:24.04")
    assert "Dockerfile" in task.environment_context
    assert "test.sh" in task.test_files and "solve.sh" in task.solution_files
    assert task.metadata["author_name"] == "Forkyard"
    assert task.agent_timeout_s > 0 and task.verifier_timeout_s > 0
    assert task.network is False and task.docker_image is None
    on_disk = {p.relative_to(task_dir).as_posix() for p in task_dir.rglob("*") if p.is_file()}
    assert set(task.files) == on_disk
    assert list(task.files) == sorted(task.files)


def test_one_example_gives_partial_credit_through_reward_json() -> None:
    scripts = [
        load_task_dir(d).files["tests/test.sh"] + load_task_dir(d).files.get("tests/check.py", b"")
        for d in EXAMPLE_DIRS
    ]
    assert any(b"reward.json" in script for script in scripts)


def test_fields_are_read_from_task_toml() -> None:
    task = load_task_files("my-task_1.0", minimal_files())
    assert task.name == "my-task_1.0"
    assert task.instruction == "Do the thing.\n"
    assert task.metadata == {"author_name": "tester", "tags": ["a", "b"]}
    assert (task.agent_timeout_s, task.verifier_timeout_s) == (120.0, 30.5)
    assert (task.cpus, task.memory_mb, task.network) == (2.0, 2048, True)
    assert task.docker_image is None


def test_defaults_when_tables_are_missing_are_harbors() -> None:
    task = load_task_files("t", minimal_files(**{"task.toml": b'version = "1.0"\n'}))
    assert task.metadata == {} and task.warnings == ()
    assert (task.agent_timeout_s, task.verifier_timeout_s) == (600.0, 600.0)
    assert (task.cpus, task.memory_mb, task.disk_mb, task.network, task.docker_image) == (1.0, 2048, 10240, True, None)


@pytest.mark.parametrize(("environment", "network"), [
    ("allow_internet = false", False),
    ("allow_internet = true", True),
    ("network = false", False),
    ("network = false\nallow_internet = true", False),  # Forkyard's own key wins (and the clash is reported)
])
def test_allow_internet_is_harbors_network(environment: str, network: bool) -> None:
    task = load_task_files("t", minimal_files(**{"task.toml": f"[environment]\n{environment}\n".encode()}))
    assert task.network is network
    assert any("disagree" in w for w in task.warnings) == ("true" in environment and "network" in environment)


def test_schema_1_1_with_a_task_table_and_unused_fields_reported() -> None:
    toml = (b'schema_version = "1.1"\nsource = "somewhere"\n[task]\nname = "org/renamed"\nkeywords = ["x"]\n'
            b'[verifier]\ntimeout_sec = 30\nenv = { TOKEN = "x" }\n[environment]\nbuild_timeout_sec = 900\n'
            b'gpus = 0\nallow_internet = false\n[solution]\nenv = {}\n[agent]\nuser = "agent"\n')
    task = load_task_files("t", minimal_files(**{"task.toml": toml}))
    assert task.metadata["package"] == {"name": "org/renamed", "keywords": ["x"]}
    assert task.verifier_timeout_s == 30.0 and task.network is False
    assert sorted(w.removeprefix("task.toml: ").removesuffix(" is not used by Forkyard") for w in task.warnings) == [
        "[agent] user", "[environment] build_timeout_sec", "[environment] gpus", "source"]
    assert dict(task.verifier_env) == {"TOKEN": "x"} and dict(task.solution_env) == {}
    # A task at an archive's top level takes its name from [task] name.
    (top,) = tasks_from_tar(make_tar(list(minimal_files(**{"task.toml": toml}).items())))
    assert top.name == "renamed" and top.warnings == task.warnings
    with pytest.raises(TaskFormatError, match="schema_version must be a string"):
        load_task_files("t", minimal_files(**{"task.toml": b"schema_version = 1.1\n"}))


def test_docker_image_replaces_the_dockerfile() -> None:
    toml = b'[environment]\ndocker_image = "ubuntu:24.04"\n'
    task = load_task_files("t", minimal_files(**{"task.toml": toml, "environment/Dockerfile": None}))
    assert task.docker_image == "ubuntu:24.04"
    assert task.dockerfile is None


def test_harbor_memory_string_is_understood() -> None:
    task = load_task_files("t", minimal_files(**{"task.toml": b'[environment]\nmemory = "2G"\n'}))
    assert task.memory_mb == 2048


@pytest.mark.parametrize(
    ("toml", "disk_mb"),
    [(b'version = "1.0"\n', 10240), (b'[environment]\nstorage = "2G"\n', 2048), (b"[environment]\nstorage_mb = 512\n", 512)],
)
def test_storage_sets_the_sandbox_disk_quota(toml: bytes, disk_mb: int) -> None:
    assert load_task_files("t", minimal_files(**{"task.toml": toml})).disk_mb == disk_mb


def test_solution_is_optional() -> None:
    task = load_task_files("t", minimal_files(**{"solution/solve.sh": None}))
    assert not task.has_solution


def test_content_hash_depends_on_name_and_every_byte() -> None:
    base = load_task_files("t", minimal_files())
    assert base.content_hash == load_task_files("t", dict(reversed(list(minimal_files().items())))).content_hash
    assert base.content_hash != load_task_files("u", minimal_files()).content_hash
    changed = minimal_files(**{"tests/test.sh": minimal_files()["tests/test.sh"] + b"\n"})
    assert base.content_hash != load_task_files("t", changed).content_hash
    extra = minimal_files(**{"tests/data.txt": b""})
    assert base.content_hash != load_task_files("t", extra).content_hash
    assert len(base.content_hash) == 64 and int(base.content_hash, 16) >= 0


def test_tasks_compare_and_hash_by_content() -> None:
    a = load_task_files("t", minimal_files())
    b = load_task_files("t", minimal_files())
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1


# ------------------------------------------------------------------ bad inputs


@pytest.mark.parametrize(
    ("files", "file", "field", "words"),
    [
        (minimal_files(**{"instruction.md": None}), "instruction.md", None, "missing"),
        (minimal_files(**{"instruction.md": b"  \n\t\n"}), "instruction.md", None, "empty"),
        (minimal_files(**{"instruction.md": b"\xff\xfe bad"}), "instruction.md", None, "UTF-8"),
        (minimal_files(**{"task.toml": None}), "task.toml", None, "missing"),
        (minimal_files(**{"task.toml": b"[agent\ntimeout_sec = 1\n"}), "task.toml", None, "invalid TOML"),
        (minimal_files(**{"task.toml": b'[agent]\ntimeout_sec = "abc"\n'}), "task.toml", "agent.timeout_sec", "'abc'"),
        (minimal_files(**{"task.toml": b"[agent]\ntimeout_sec = -5\n"}), "task.toml", "agent.timeout_sec", "positive"),
        (minimal_files(**{"task.toml": b"[agent]\ntimeout_sec = true\n"}), "task.toml", "agent.timeout_sec", "True"),
        (minimal_files(**{"task.toml": b"[agent]\ntimeout_sec = nan\n"}), "task.toml", "agent.timeout_sec", "nan"),
        (
            minimal_files(**{"task.toml": b"[verifier]\ntimeout_sec = 0\n"}),
            "task.toml",
            "verifier.timeout_sec",
            "positive",
        ),
        (minimal_files(**{"task.toml": b'[environment]\ncpus = "two"\n'}), "task.toml", "environment.cpus", "'two'"),
        (
            minimal_files(**{"task.toml": b"[environment]\nmemory_mb = 1.5\n"}),
            "task.toml",
            "environment.memory_mb",
            "whole",
        ),
        (
            minimal_files(**{"task.toml": b'[environment]\nmemory = "lots"\n'}),
            "task.toml",
            "environment.memory",
            "'lots'",
        ),
        (
            minimal_files(**{"task.toml": b'[environment]\nstorage = "a lot"\n'}),
            "task.toml",
            "environment.storage",
            "'a lot'",
        ),
        (minimal_files(**{"task.toml": b"[environment]\nstorage_mb = 0\n"}), "task.toml", "environment.storage_mb", "whole"),
        (
            minimal_files(**{"task.toml": b'[environment]\nnetwork = "yes"\n'}),
            "task.toml",
            "environment.network",
            "true or false",
        ),
        (
            minimal_files(**{"task.toml": b"[environment]\ndocker_image = 3\n"}),
            "task.toml",
            "environment.docker_image",
            "string",
        ),
        (minimal_files(**{"task.toml": b'agent = "fast"\n'}), "task.toml", "agent", "table"),
        (minimal_files(**{"tests/test.sh": None}), "tests/test.sh", None, "missing"),
        (
            minimal_files(**{"environment/Dockerfile": None}),
            "environment/Dockerfile",
            "environment.docker_image",
            "missing",
        ),
        (minimal_files(**{"../escape.sh": b"x"}), "../escape.sh", None, ".."),
        (minimal_files(**{"/etc/passwd": b"x"}), "/etc/passwd", None, "absolute"),
        (minimal_files(tests=b"x"), "tests", None, "both a file and a directory"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_task_names_the_file_and_field(files: dict[str, bytes], file: str, field: str | None, words: str) -> None:
    with pytest.raises(TaskFormatError) as caught:
        load_task_files("t", files)
    error = caught.value
    assert error.file == file
    assert error.field == field
    assert file in str(error) and words in str(error)
    if field is not None:
        assert field.split(".")[-1] in str(error)


def test_unknown_keys_are_ignored() -> None:
    toml = GOOD_TOML + "\n[solution]\nenv = {}\n\n[agent.extra]\nx = 1\n"
    task = load_task_files("t", minimal_files(**{"task.toml": toml.encode()}))
    assert task.agent_timeout_s == 120.0


@pytest.mark.parametrize("name", ["", "..", ".hidden", "a/b", "sp ace", "x" * 129, "naïve", "-dash"])
def test_bad_task_names_are_refused(name: str) -> None:
    with pytest.raises(TaskFormatError) as caught:
        load_task_files(name, minimal_files())
    assert caught.value.field == "name"
    assert "task name" in str(caught.value)


def test_oversized_task_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    big = b"\0" * (tasks_module.MAX_TASK_BYTES + 1 - sum(len(v) for v in minimal_files().values()))
    with pytest.raises(TaskFormatError) as caught:
        load_task_files("t", minimal_files(**{"environment/blob.bin": big}))
    assert caught.value.file is not None and "MiB limit" in str(caught.value)


def test_oversized_task_dir_is_refused_before_reading_everything(tmp_path: Path) -> None:
    for path, data in minimal_files().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_bytes(data)
    with open(tmp_path / "environment" / "huge.bin", "wb") as handle:
        handle.truncate(tasks_module.MAX_TASK_BYTES + 1)  # sparse: no real disk use
    with pytest.raises(TaskFormatError) as caught:
        load_task_dir(tmp_path)
    assert caught.value.file == "environment/huge.bin"
    assert "MiB limit" in str(caught.value)


def test_task_dir_with_symlink_is_refused(tmp_path: Path) -> None:
    task_dir = tmp_path / "linked"
    for path, data in minimal_files().items():
        (task_dir / path).parent.mkdir(parents=True, exist_ok=True)
        (task_dir / path).write_bytes(data)
    (task_dir / "environment" / "passwd").symlink_to("/etc/passwd")
    with pytest.raises(TaskFormatError) as caught:
        load_task_dir(task_dir)
    assert caught.value.file == "environment/passwd" and "symbolic link" in str(caught.value)


def test_missing_task_dir_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TaskFormatError, match="does not exist"):
        load_task_dir(tmp_path / "nope")


# ------------------------------------------------------------------ archives


@pytest.mark.parametrize("task_dir", EXAMPLE_DIRS, ids=lambda p: p.name)
def test_tar_round_trip_is_exact_and_deterministic(task_dir: Path) -> None:
    task = load_task_dir(task_dir)
    data = task_to_tar(task)
    assert data == task_to_tar(load_task_dir(task_dir))
    (back,) = tasks_from_tar(data)
    assert back == task
    assert back.content_hash == task.content_hash
    assert task_to_tar(back) == data
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
        members = archive.getmembers()
    assert [m.name for m in members] == sorted(m.name for m in members)
    assert all(m.mtime == 0 and m.uid == 0 and m.gid == 0 and m.uname == "" for m in members)
    assert all(m.name.startswith(f"{task.name}/") for m in members)
    script = next(m for m in members if m.name.endswith("tests/test.sh"))
    assert script.mode == 0o755


def test_archive_of_several_task_dirs() -> None:
    one = load_task_dir(EXAMPLE_DIRS[0])
    two = load_task_dir(EXAMPLE_DIRS[1])
    entries = [(f"{t.name}/{p}", d) for t in (two, one) for p, d in t.files.items()]
    entries.append(("README.md", b"not a task"))
    got = tasks_from_tar(make_tar(entries))
    assert [t.name for t in got] == sorted([one.name, two.name])
    assert {t.content_hash for t in got} == {one.content_hash, two.content_hash}


def test_archive_with_a_wrapping_folder_and_plain_tar() -> None:
    one = load_task_dir(EXAMPLE_DIRS[0])
    two = load_task_dir(EXAMPLE_DIRS[1])
    entries = [(f"./bundle/{t.name}/{p}", d) for t in (one, two) for p, d in t.files.items()]
    got = tasks_from_tar(make_tar(entries, compression=""))
    assert {t.content_hash for t in got} == {one.content_hash, two.content_hash}


def test_archive_with_the_task_at_its_top_takes_the_metadata_name() -> None:
    toml = GOOD_TOML.replace('author_name = "tester"', 'name = "top-level"').encode()
    files = minimal_files(**{"task.toml": toml})
    (task,) = tasks_from_tar(make_tar([(f"./{p}", d) for p, d in files.items()]))
    assert task.name == "top-level"
    assert task == load_task_files("top-level", files)


def test_archive_with_the_task_at_its_top_and_no_name_is_refused() -> None:
    with pytest.raises(TaskFormatError) as caught:
        tasks_from_tar(make_tar(list(minimal_files().items())))
    assert (caught.value.file, caught.value.field) == ("task.toml", "metadata.name")


def test_archive_skips_macos_junk() -> None:
    entries = [(f"t/{p}", d) for p, d in minimal_files().items()]
    entries += [("__MACOSX/t/._task.toml", b"junk"), ("t/._instruction.md", b"junk"), ("t/.DS_Store", b"junk")]
    (task,) = tasks_from_tar(make_tar(entries))
    assert task == load_task_files("t", minimal_files())


@pytest.mark.parametrize(
    ("bad_name", "words"),
    [("t/../../etc/cron.d/x", ".."), ("../t/instruction.md", ".."), ("/abs/task.toml", "absolute")],
)
def test_archive_with_unsafe_paths_is_refused(bad_name: str, words: str) -> None:
    entries = [(f"t/{p}", d) for p, d in minimal_files().items()] + [(bad_name, b"x")]
    with pytest.raises(TaskFormatError) as caught:
        tasks_from_tar(make_tar(entries))
    assert caught.value.file == bad_name and words in str(caught.value)


@pytest.mark.parametrize("link_type", [tarfile.SYMTYPE, tarfile.LNKTYPE])
def test_archive_with_links_is_refused(link_type: bytes) -> None:
    link = tarfile.TarInfo("t/environment/shadow")
    link.type = link_type
    link.linkname = "/etc/shadow"
    entries: list = [(f"t/{p}", d) for p, d in minimal_files().items()] + [link]
    with pytest.raises(TaskFormatError) as caught:
        tasks_from_tar(make_tar(entries))
    assert caught.value.file == "t/environment/shadow" and "links" in str(caught.value)


def test_archive_with_a_bad_task_names_its_path() -> None:
    entries = [(f"t/{p}", d) for p, d in minimal_files(**{"tests/test.sh": None}).items()]
    with pytest.raises(TaskFormatError) as caught:
        tasks_from_tar(make_tar(entries))
    assert caught.value.file == "t/tests/test.sh" and "'t'" in str(caught.value)


def test_oversized_task_in_an_archive_is_refused() -> None:
    entries = [(f"t/{p}", d) for p, d in minimal_files().items()]
    # Incompressible: a thousandfold run of zeros would be refused first as a ratio bomb.
    entries.append(("t/environment/blob.bin", os.urandom(tasks_module.MAX_TASK_BYTES + 1)))
    with pytest.raises(TaskFormatError) as caught:
        tasks_from_tar(make_tar(entries))
    assert "MiB limit" in str(caught.value)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"definitely not a tar",
        gzip.compress(b"not a tar inside a gzip"),
        make_tar([("t/a", b"x" * 4096)], compression="")[:1000],
        make_tar([("t/a", bytes(range(256)) * 64)])[:300],
    ],
    ids=["empty", "text", "gzip-of-text", "truncated-tar", "truncated-gzip"],
)
def test_unreadable_archives_are_refused(data: bytes) -> None:
    with pytest.raises(TaskFormatError) as caught:
        tasks_from_tar(data)
    assert caught.value.file == "<archive>"


def test_archive_without_tasks_is_refused() -> None:
    with pytest.raises(TaskFormatError, match="no task directory"):
        tasks_from_tar(make_tar([("docs/README.md", b"hi"), ("notes.txt", b"x")]))


def test_task_is_a_frozen_value() -> None:
    task: TerminalTask = load_task_files("t", minimal_files())
    with pytest.raises(AttributeError):
        task.name = "other"  # type: ignore[misc]
    with pytest.raises(TypeError):
        task.files["x"] = b"y"  # type: ignore[index]


def test_multi_step_tasks_are_refused_not_graded_by_their_placeholder_tests():
    """Harbor's [[steps]] run each step's own tests; the top-level tests/ of such a task may just write 1."""
    files = {"instruction.md": b"x\n", "task.toml": b'[[steps]]\nname = "one"\n[[steps]]\nname = "two"\n',
             "environment/Dockerfile": b"FROM ubuntu:24.04\n", "tests/test.sh": b"echo 1 > /logs/verifier/reward.txt\n"}
    with pytest.raises(TaskFormatError, match=r"\[\[steps\]\].*not supported") as caught:
        load_task_files("multi", files)
    assert caught.value.field == "steps"
    # Such a task often has no top-level instruction.md (each step has its own): the answer says why all the same.
    del files["instruction.md"]
    with pytest.raises(TaskFormatError, match=r"\[\[steps\]\].*not supported"):
        load_task_files("multi", files)


@pytest.mark.parametrize(("toml", "message"), [
    (b"[verifier]\nenv = 3\n", "must be a table"),
    (b'[verifier]\nenv = { "1BAD" = "x" }\n', "not a variable name"),
    (b"[solution]\nenv = { N = 3 }\n", "must be a string"),
])
def test_env_tables_are_validated(toml, message):
    files = {"instruction.md": b"x\n", "task.toml": toml, "environment/Dockerfile": b"FROM ubuntu:24.04\n",
             "tests/test.sh": b"true\n"}
    with pytest.raises(TaskFormatError, match=message):
        load_task_files("envs", files)


def test_env_tables_are_read_and_host_templates_are_reported_not_expanded():
    files = {"instruction.md": b"x\n", "environment/Dockerfile": b"FROM ubuntu:24.04\n", "tests/test.sh": b"true\n",
             "task.toml": b'[environment]\nenv = { A = "1" }\n[verifier]\nenv = { KEY = "${OPENAI_API_KEY}" }\n'}
    task = load_task_files("envs", files)
    assert dict(task.environment_env) == {"A": "1"} and dict(task.verifier_env) == {"KEY": "${OPENAI_API_KEY}"}
    assert dict(task.solution_env) == {}
    assert any("[verifier] env KEY: passed as written" in w for w in task.warnings)
    assert not any("is not used" in w for w in task.warnings)

"""SWE instances: the schema, JSONL import (all or nothing), the repository store."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.workers.conftest import SWE_EXAMPLES
from workers.envs.swe.repos import RepoStore, head_commit, store_name
from workers.envs.swe.task import (
    DEFAULT_WORKDIR,
    SWETask,
    decode_instance,
    encode_instance,
    parse_jsonl,
)
from workers.envs.tamper import TamperPolicy
from workers.errors import TaskFormatError

MINIMAL = {"instance_id": "me__calc-1", "repo": "me/calc", "base_commit": "0123abc",
           "problem_statement": "fix it", "FAIL_TO_PASS": ["tests/t.py::a"]}


def _jsonl(*objects: object) -> bytes:
    return "\n".join(o if isinstance(o, str) else json.dumps(o) for o in objects).encode()


def test_a_minimal_instance_takes_the_defaults() -> None:
    (task,) = parse_jsonl(_jsonl(MINIMAL))
    assert task.family == "swe" and task.name == "me__calc-1" and task.workdir == DEFAULT_WORKDIR
    assert task.patch_kind == "fix" and task.log_parser == "pytest" and task.pass_to_pass == ()
    assert task.setup_commit == "0123abc" and "fix it" in task.instruction and "/testbed" in task.instruction


def test_fail_to_pass_as_a_json_string_or_a_list_is_the_same_instance() -> None:
    as_list = parse_jsonl(_jsonl({**MINIMAL, "PASS_TO_PASS": ["tests/t.py::b"]}))[0]
    as_text = parse_jsonl(_jsonl({**MINIMAL, "FAIL_TO_PASS": json.dumps(["tests/t.py::a"]),
                                  "PASS_TO_PASS": '["tests/t.py::b"]'}))[0]
    assert as_list.fail_to_pass == as_text.fail_to_pass == ("tests/t.py::a",)
    assert as_list.content_hash == as_text.content_hash


def test_encoding_round_trips_with_unknown_fields_kept() -> None:
    (task,) = parse_jsonl(_jsonl({**MINIMAL, "hints_text": "look at x", "FAIL_TO_FAIL": ["z"]}))
    assert task.warnings and "FAIL_TO_FAIL" in task.warnings[0]
    again = decode_instance(encode_instance(task))
    assert again.content_hash == task.content_hash and again.extra == {"FAIL_TO_FAIL": ["z"]}
    assert encode_instance(again) == encode_instance(task)


def test_the_tamper_policy_defaults_to_fail_and_keeps_old_hashes() -> None:
    """An instance that does not set ``tamper`` hashes as it did before the field existed."""
    (default,) = parse_jsonl(_jsonl(MINIMAL))
    (failing,) = parse_jsonl(_jsonl({**MINIMAL, "tamper": "fail"}))
    (reporting,) = parse_jsonl(_jsonl({**MINIMAL, "tamper": "report"}))
    assert default.tamper is failing.tamper is TamperPolicy.FAIL and reporting.tamper is TamperPolicy.REPORT
    assert "tamper" not in default.to_json() and default.content_hash == failing.content_hash
    assert reporting.to_json()["tamper"] == "report" and reporting.content_hash != default.content_hash
    assert decode_instance(encode_instance(reporting)).tamper is TamperPolicy.REPORT
    assert not reporting.warnings


@pytest.mark.parametrize(("line", "field"), [
    ({k: v for k, v in MINIMAL.items() if k != "repo"}, "repo: is required"),
    ({**MINIMAL, "base_commit": "not-a-commit"}, "base_commit: must be a hex commit id"),
    ({**MINIMAL, "FAIL_TO_PASS": "[not json"}, "FAIL_TO_PASS: a JSON-encoded string"),
    ({**MINIMAL, "FAIL_TO_PASS": []}, "FAIL_TO_PASS: must name at least one test"),
    ({**MINIMAL, "PASS_TO_PASS": [1, 2]}, "PASS_TO_PASS: must be a list of test ids"),
    ({**MINIMAL, "patch_kind": "feature"}, "patch_kind: must be one of fix, bug"),
    ({**MINIMAL, "patch_kind": "bug"}, "patch: a patch_kind 'bug' instance needs"),
    ({**MINIMAL, "log_parser": "jest"}, "log_parser: must be one of pytest, unittest"),
    ({**MINIMAL, "workdir": "relative"}, "workdir: must be an absolute path"),
    ({**MINIMAL, "install": "pip install x"}, None),  # one command may be a string
    ({**MINIMAL, "install": [3]}, "install: must be a list of shell commands"),
    ({**MINIMAL, "instance_id": "a b"}, "instance_id: use letters"),
    ({**MINIMAL, "agent_timeout_sec": -1}, "agent_timeout_sec: must be a number"),
    ({**MINIMAL, "tamper": "ignore"}, "tamper: must be \"fail\" or \"report\", got 'ignore'"),
    ({**MINIMAL, "tamper": ["report"]}, "tamper: must be \"fail\" or \"report\""),
    ("[1, 2]", "an instance must be a JSON object"),
    ("{oops", "not valid JSON"),
])
def test_a_bad_line_is_named_and_nothing_is_imported(line: object, field: str | None) -> None:
    data = _jsonl(MINIMAL | {"instance_id": "ok-1"}, line)
    if field is None:
        assert len(parse_jsonl(data)) == 2
        return
    with pytest.raises(TaskFormatError, match="nothing imported") as info:
        parse_jsonl(data)
    assert f"line 2: {field}" in str(info.value) or ("line 2" in str(info.value) and field in str(info.value))
    assert "line 1" not in str(info.value)


def test_every_bad_line_is_reported_at_once_with_duplicates() -> None:
    data = _jsonl(MINIMAL, "", {**MINIMAL, "repo": ""}, MINIMAL)
    with pytest.raises(TaskFormatError) as info:
        parse_jsonl(data)
    message = str(info.value)
    assert message.startswith("2 bad line(s)") and "line 3: repo" in message
    assert "line 4: instance_id: 'me__calc-1' is also on line 1" in message


def test_an_empty_or_binary_file_is_refused() -> None:
    with pytest.raises(TaskFormatError, match="holds no instance"):
        parse_jsonl(b"\n \n")
    with pytest.raises(TaskFormatError, match="not UTF-8"):
        parse_jsonl(b"\xff\xfe{}")


def test_a_plain_directory_becomes_the_same_commit_everywhere(tmp_path: Path) -> None:
    first = RepoStore(tmp_path / "a").add(SWE_EXAMPLES / "repos" / "calc", name="forkyard/calc")
    second = RepoStore(tmp_path / "b").add(SWE_EXAMPLES / "repos" / "calc", name="forkyard/calc")
    assert head_commit(first) == head_commit(second)
    shipped = {json.loads(line)["base_commit"] for line in (SWE_EXAMPLES / "instances.jsonl").read_text().splitlines()
               if json.loads(line)["repo"] == "forkyard/calc"}
    assert shipped == {head_commit(first)}, "instances.jsonl names the commit `forkyard repos add` makes"
    assert first.name == store_name("forkyard/calc") == "forkyard__calc.git"


def test_the_store_takes_checkouts_and_bundles_and_refuses_the_rest(tmp_path: Path) -> None:
    work = tmp_path / "work"
    subprocess.run(["git", "clone", "-q", str(RepoStore(tmp_path / "s").add(SWE_EXAMPLES / "repos" / "textkit",
                                                                               name="t")), str(work)], check=True)
    bundle = tmp_path / "textkit.bundle"
    subprocess.run(["git", "bundle", "create", "-q", str(bundle), "--all"], cwd=work, check=True)
    store = RepoStore(tmp_path / "store")
    store.add(work, name="me/from-checkout")
    store.add(bundle, name="me/from-bundle")
    commit = head_commit(work)
    assert store.resolve("me/from-checkout", commit[:10]) == commit == store.resolve("me/from-bundle", commit)
    assert store.repos() == ["me__from-bundle.git", "me__from-checkout.git"]
    with pytest.raises(TaskFormatError, match="not in the repository store"):
        store.resolve("me/nothing", commit)
    with pytest.raises(TaskFormatError, match="has no commit 'deadbeef'"):
        store.resolve("me/from-bundle", "deadbeef")
    junk = tmp_path / "junk.bundle"
    junk.write_bytes(b"not a bundle")
    with pytest.raises(TaskFormatError, match="not a git repository or bundle"):
        store.add(junk, name="me/junk")
    assert not store.has("me/junk") and not list(store.root.glob(".*"))  # no staging dir left


def test_import_checks_repositories_and_commits_against_the_store(swe_store) -> None:
    from workers.envs.registry import get_family

    store, tasks = swe_store
    family = get_family("swe")
    assert len(tasks) >= 12 and {t.repo for t in tasks} == {"forkyard/calc", "forkyard/textkit"}
    good = tasks[0].to_json()
    lines = _jsonl(good, {**good, "instance_id": "x-1", "repo": "someone/else"},
                   {**good, "instance_id": "x-2", "base_commit": "abcdef0"})
    with pytest.raises(TaskFormatError) as info:
        family.parse_tasks(lines)
    assert "x-1: repository 'someone/else' is not in the repository store" in str(info.value)
    assert "x-2: repository 'forkyard/calc' has no commit 'abcdef0'" in str(info.value)
    assert tasks[0].instance_id not in str(info.value)


def test_load_task_takes_one_instance_file(monkeypatch: pytest.MonkeyPatch) -> None:
    from workers.envs.swe import FAMILY

    monkeypatch.setattr(FAMILY, "repos", None)  # no store: the schema alone is checked
    task = FAMILY.load_task("me__calc-1", {"instance.json": json.dumps(MINIMAL).encode()})
    assert isinstance(task, SWETask)
    with pytest.raises(TaskFormatError, match="instance_id is 'me__calc-1'"):
        FAMILY.load_task("other", {"instance.json": json.dumps(MINIMAL).encode()})
    with pytest.raises(TaskFormatError, match="one file, instance.json"):
        FAMILY.load_task("me__calc-1", {"task.toml": b""})

"""The Dockerfile builder: pure parsing/planning, then real builds on both backends."""

from __future__ import annotations

import asyncio
import io
import tarfile

import pytest

from sandboxes.base import ImageConfig, SandboxSpec
from workers.dockerfile import (
    DEFAULT_ALIASES,
    CopyStep,
    DockerfileError,
    ExtractStep,
    Instruction,
    NoteStep,
    RunStep,
    WorkdirStep,
    build_task_image,
    compile_stage,
    env_image_ref,
    expand_word,
    expand_words,
    normalize_image_name,
    parse_dockerfile,
    parse_exec_form,
    parse_flags,
    parse_key_values,
    parse_stage,
    resolve_alias,
    split_words,
)
from workers.errors import ImageBuildError

CONFIG = ImageConfig(env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, workdir="/", user="root")


def plan(dockerfile: str, context: dict[str, bytes] | None = None, **kw):
    """Parse and compile ``dockerfile`` against CONFIG; return (steps, final config)."""
    stage = parse_stage(parse_dockerfile(dockerfile), kw.get("build_args"))
    return compile_stage(stage, config=CONFIG, context=context or {}, **kw)


def error_line(excinfo: pytest.ExceptionInfo[DockerfileError]) -> int:
    assert str(excinfo.value).startswith(f"Dockerfile line {excinfo.value.line}: ")
    return excinfo.value.line


# --------------------------------------------------------------------------- parser


def test_continuations_comments_and_line_numbers():
    text = (
        "# syntax=docker/dockerfile:1\n"
        "\n"
        "from ubuntu:24.04\n"
        "# a comment\n"
        "RUN apt-get update && \\\n"
        "    # a comment inside the continuation is dropped\n"
        "\n"
        "    echo done \\   \n"
        "    && true\n"
        "  env A=1\n"
    )
    assert parse_dockerfile(text) == [
        Instruction(3, "FROM", "ubuntu:24.04"),
        Instruction(5, "RUN", "apt-get update &&     echo done     && true"),
        Instruction(10, "ENV", "A=1"),
    ]


def test_crlf_and_a_continuation_at_end_of_file():
    assert parse_dockerfile("FROM base\r\nRUN echo a \\\r\n") == [
        Instruction(1, "FROM", "base"),
        Instruction(2, "RUN", "echo a"),
    ]


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("FROM base\nRUN true\nFROBNICATE x\n", 3, "unknown instruction 'FROBNICATE'"),
        ("FROM base\n\nRUN\n", 3, "RUN needs at least one argument"),
        ("FROM base\nRUN <<EOF\necho hi\nEOF-not\n", 2, "heredoc <<EOF is not closed"),
        ("FROM base\nCOPY <<-'END' /x\nhi\nEND\n", 2, "heredocs (<<EOF) in COPY are not supported"),
        ("# escape=`\nFROM base\n", 1, "escape directive"),
    ],
)
def test_parse_errors_name_the_line(text, line, fragment):
    with pytest.raises(DockerfileError) as info:
        parse_dockerfile(text)
    assert error_line(info) == line
    assert fragment in str(info.value)


def test_run_heredocs_take_their_lines_and_a_bare_one_is_the_script():
    from workers.dockerfile import _heredoc_script

    parsed = parse_dockerfile(
        "FROM base\nRUN <<EOF\necho a\necho b\nEOF\nRUN cat > /f <<'X' && cat - <<-Y\nkept $HOME\nX\n\tthen\n\tY\n"
        "RUN echo after\n"
    )
    assert [(i.line, i.op) for i in parsed] == [(1, "FROM"), (2, "RUN"), (6, "RUN"), (11, "RUN")]
    assert parsed[1].args == "<<EOF\necho a\necho b\nEOF" and _heredoc_script(parsed[1].args) == "echo a\necho b"
    assert parsed[2].args == "cat > /f <<'X' && cat - <<-Y\nkept $HOME\nX\n\tthen\nY"
    assert _heredoc_script(parsed[2].args) == parsed[2].args  # the shell reads these itself
    shebang = _heredoc_script("<<-EOF\n\t#!/bin/bash\n\techo $BASH_VERSION\nEOF")
    assert "#!/bin/bash\necho $BASH_VERSION" in shebang and shebang.startswith("f=$(mktemp)")


def test_herestrings_and_shifts_are_not_heredocs():
    parsed = parse_dockerfile('FROM base\nRUN cat <<< "x" && echo $((1<<4))\n')
    assert parsed[1].args == 'cat <<< "x" && echo $((1<<4))'


def test_exec_form_detection():
    assert parse_exec_form('["python3", "-c", "print(1)"]') == ["python3", "-c", "print(1)"]
    assert parse_exec_form("  []  ") == []
    assert parse_exec_form("[ -f x ] && echo y") is None  # shell test command, not JSON
    assert parse_exec_form('["a", 1]') is None
    assert parse_exec_form("echo hi") is None


def test_flags_are_split_from_arguments():
    assert parse_flags("--chown=app:app --link src/ /dst/") == ({"chown": "app:app", "link": None}, "src/ /dst/")
    assert parse_flags("--mount=type=cache,target=/root/.cache pip install x") == (
        {"mount": "type=cache,target=/root/.cache"},
        "pip install x",
    )
    assert parse_flags("echo --not-a-flag") == ({}, "echo --not-a-flag")


# --------------------------------------------------------------------------- words


def test_split_words_keeps_quotes_for_expansion():
    assert split_words('a "b c" d\\ e \'f g\'') == ["a", '"b c"', "d\\ e", "'f g'"]


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("$A/x", "1/x"),
        ("${A}y", "1y"),
        ("'$A'", "$A"),
        ('"$A $B"', "1 two words"),
        ("\\$A", "$A"),
        ('"a\\"b"', 'a"b'),
        ('"a\\nb"', "a\\nb"),
        ("${UNSET:-dflt}", "dflt"),
        ("${EMPTY:-dflt}", "dflt"),
        ("${EMPTY-dflt}", ""),
        ("${UNSET-dflt}", "dflt"),
        ("${A:+alt}", "alt"),
        ("${EMPTY:+alt}", ""),
        ("${EMPTY+alt}", "alt"),
        ("${UNSET:-$A-nested}", "1-nested"),
        ("$UNSET", ""),
        ("cost $5", "cost "),
        ("a$", "a$"),
        ("$-x", "$-x"),
    ],
)
def test_expand_word(word, expected):
    assert expand_word(word, {"A": "1", "B": "two words", "EMPTY": ""}) == expected


@pytest.mark.parametrize("word", ['"open', "'open", "${A", "${A:-x", "${}", "${A%x}", "${UNSET:?must be set}"])
def test_expand_word_errors(word):
    with pytest.raises(ValueError):
        expand_word(word, {"A": "1"})


def test_expand_words_splits_after_quotes():
    assert expand_words('"my file.txt" $D/', {"D": "/dst"}) == ["my file.txt", "/dst/"]


def test_key_value_forms():
    env = {"X": "ex"}
    assert parse_key_values('A=1 B="two words" C=$X D=', env) == [("A", "1"), ("B", "two words"), ("C", "ex"), ("D", "")]
    assert parse_key_values("LEGACY value with  spaces", env) == [("LEGACY", "value with  spaces")]
    assert parse_key_values('LEGACY "quoted $X"', env) == [("LEGACY", "quoted ex")]
    with pytest.raises(ValueError, match="name=value"):
        parse_key_values("A=1 B", env)
    with pytest.raises(ValueError, match="no value"):
        parse_key_values("ONLYKEY", env)


# --------------------------------------------------------------------------- FROM and aliases


def test_stage_expands_global_args_in_from():
    text = "ARG TAG=22.04\nARG UNUSED\nFROM ubuntu:${TAG} AS build\nARG TAG\nRUN echo $TAG\n"
    assert parse_stage(parse_dockerfile(text)).from_image == "ubuntu:22.04"
    stage = parse_stage(parse_dockerfile(text), {"TAG": "24.04"})
    assert stage.from_image == "ubuntu:24.04"
    assert [i.op for i in stage.body] == ["ARG", "RUN"]
    steps, _ = compile_stage(stage, config=CONFIG, context={}, build_args={})
    run = steps[-1]
    assert isinstance(run, RunStep) and run.env["TAG"] == "24.04"  # re-declared ARG inherits the global value


@pytest.mark.parametrize(
    ("text", "line", "fragment"),
    [
        ("RUN true\nFROM base\n", 1, "before FROM"),
        ("ARG A=1\n", 1, "no FROM"),
        ("FROM base\nRUN true\nFROM base\n", 3, "multi-stage"),
        ("FROM scratch\n", 1, "scratch"),
        ("FROM a b\n", 1, "one image name"),
        ("FROM --quiet base\n", 1, "--quiet"),
    ],
)
def test_stage_errors(text, line, fragment):
    with pytest.raises(DockerfileError) as info:
        parse_stage(parse_dockerfile(text))
    assert error_line(info) == line
    assert fragment in str(info.value)


def test_aliases_resolve_public_names_to_the_base():
    base = "forkyard/base:abc"
    for name in ("ubuntu:24.04", "docker.io/library/ubuntu:24.04", "python:3.12-slim", "debian:bookworm-slim"):
        assert resolve_alias(name, DEFAULT_ALIASES, base) == base, name
    assert resolve_alias("debian", DEFAULT_ALIASES, base) == base  # no tag means :latest
    assert resolve_alias("ubuntu@sha256:" + "0" * 64, {"ubuntu:latest": "base"}, base) == base
    assert resolve_alias("base", {}, base) == base
    assert resolve_alias(base, {}, base) == base
    assert resolve_alias("ghcr.io/org/tool:1", DEFAULT_ALIASES, base) is None
    assert resolve_alias("mine:1", {"mine:1": "forkyard/env:0123"}, base) == "forkyard/env:0123"
    assert normalize_image_name("library/alpine") == "alpine:latest"
    assert normalize_image_name("localhost:5000/app") == "localhost:5000/app:latest"


# --------------------------------------------------------------------------- planning


def test_env_workdir_user_and_run_state():
    steps, final = plan(
        "FROM base\n"
        "ARG MODE=fast\n"
        "ENV APP=/srv/app NAME=x\n"
        "ENV APP=/opt/app COPY_OF_APP=$APP\n"  # one ENV sees the values from before it
        "WORKDIR $APP\n"
        "WORKDIR sub/../lib\n"
        "USER 1000:1000\n"
        "RUN echo $MODE\n"
        'RUN ["python3", "-V"]\n'
        'SHELL ["/bin/bash", "-o", "pipefail", "-c"]\n'
        "RUN echo in bash\n"
        "CMD [\"sleep\", \"infinity\"]\n",
        build_args={"MODE": "slow"},
    )
    assert [type(s) for s in steps] == [
        NoteStep, NoteStep, NoteStep, WorkdirStep, WorkdirStep, NoteStep, RunStep, RunStep, NoteStep, RunStep, NoteStep,
    ]  # fmt: skip
    assert steps[3].path == "/opt/app" and steps[4].path == "/opt/app/lib"
    run1, run2, run3 = (s for s in steps if isinstance(s, RunStep))
    assert run1.argv == ("/bin/sh", "-c", "echo $MODE")  # RUN text is left to the shell
    assert run1.env["MODE"] == "slow" and run1.env["COPY_OF_APP"] == "/srv/app"
    assert (run1.workdir, run1.user) == ("/opt/app/lib", "1000:1000")
    assert run2.argv == ("python3", "-V")
    assert run3.argv == ("/bin/bash", "-o", "pipefail", "-c", "echo in bash")
    assert "ignored" in steps[-1].note
    assert final.workdir == "/opt/app/lib" and final.user == "1000:1000"
    assert final.env == {**CONFIG.env, "APP": "/opt/app", "NAME": "x", "COPY_OF_APP": "/srv/app"}
    assert "MODE" not in final.env  # ARG values do not persist in the image


def test_env_overrides_arg_and_run_gets_default_path():
    steps, _ = compile_stage(
        parse_stage(parse_dockerfile("FROM base\nARG V=arg\nENV V=env\nRUN true\n")),
        config=ImageConfig(env={}, workdir="/", user="root"),
        context={},
    )
    run = steps[-1]
    assert run.env["V"] == "env" and run.env["PATH"].startswith("/usr/local/sbin")


CTX = {
    "hello.txt": b"hello\n",
    "run.sh": b"#!/bin/sh\necho run\n",
    "app/main.py": b"print('main')\n",
    "app/pkg/util.py": b"X = 1\n",
    "docs/a.md": b"a",
    "docs/b.md": b"b",
}


def copy_step(line: str, workdir: str = "/") -> CopyStep:
    steps, _ = plan(f"FROM base\nWORKDIR {workdir}\n{line}\n", CTX)
    step = steps[-1]
    assert isinstance(step, CopyStep)
    return step


def test_copy_single_file_modes_and_destinations():
    step = copy_step("COPY hello.txt /etc/greeting")
    assert (step.dest, step.into_dir, step.files) == ("/etc/greeting", False, (("hello.txt", b"hello\n", 0o644),))
    step = copy_step("COPY run.sh .", workdir="/work")
    assert (step.dest, step.into_dir, step.files[0][2]) == ("/work", True, 0o755)  # shebang keeps +x
    step = copy_step("COPY --chmod=600 --chown=app:staff run.sh bin/", workdir="/opt")
    assert (step.dest, step.into_dir, step.files[0][2], step.chown) == ("/opt/bin", True, 0o600, "app:staff")


def test_copy_directories_globs_and_whole_context():
    step = copy_step("COPY app /srv")
    assert step.into_dir and sorted(f[0] for f in step.files) == ["main.py", "pkg/util.py"]
    step = copy_step("COPY docs/*.md /d/")
    assert sorted(f[0] for f in step.files) == ["a.md", "b.md"]
    step = copy_step("COPY a* /x/")  # a glob matching a directory copies its contents
    assert sorted(f[0] for f in step.files) == ["main.py", "pkg/util.py"]
    step = copy_step("COPY . /ctx")
    assert sorted(f[0] for f in step.files) == sorted(CTX)
    step = copy_step('COPY ["hello.txt", "run.sh", "/two/"]')
    assert [f[0] for f in step.files] == ["hello.txt", "run.sh"]


@pytest.mark.parametrize(
    ("line", "fragment"),
    [
        ("COPY missing.txt /x", "no files in the build context match 'missing.txt'"),
        ("COPY hello.txt run.sh /dir", "must end with '/'"),
        ("COPY docs/*.md /dir", "must end with '/'"),
        ("COPY ../etc/passwd /x", "outside the build context"),
        ("COPY --from=builder /a /b", "--from"),
        ("COPY --chmod=u+x run.sh /x", "octal"),
        ("COPY --exclude=*.md . /x", "--exclude"),
        ("COPY onlyone", "source and a destination"),
        ("ADD https://example.com/x.tgz /x", "ADD of URLs"),
        ("RUN --mount=type=bind,source=.,target=/src make", "--mount"),
        ("RUN --security=insecure true", "--security"),
        ("ENV A=1 B", "name=value"),
        ("USER :grp", "user[:group]"),
        ('SHELL /bin/bash -c', "JSON form"),
        ("WORKDIR ${X:?need X}", "need X"),
    ],
)
def test_plan_errors_name_the_line(line, fragment):
    with pytest.raises(DockerfileError) as info:
        plan(f"FROM base\nRUN true\n{line}\n", CTX)
    assert error_line(info) == 3
    assert fragment in str(info.value)


def _tar(files: dict[str, bytes], compress: str = "") -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode=f"w:{compress}") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


@pytest.mark.parametrize("compress", ["", "gz", "bz2", "xz"])
def test_add_of_a_local_archive_extracts_it(compress):
    archive = _tar({"pkg/a.txt": b"A"}, compress)
    steps, _ = plan("FROM base\nADD vendor.tar /opt/vendor\nCOPY vendor.tar /keep/\n", {"vendor.tar": archive})
    extract, copy = steps
    assert isinstance(extract, ExtractStep) and extract.dest == "/opt/vendor"
    with tarfile.open(fileobj=io.BytesIO(extract.archive), mode="r:") as tar:  # stored uncompressed
        assert tar.getnames() == ["pkg/a.txt"]
    assert isinstance(copy, CopyStep) and copy.files[0][1] == archive  # COPY never extracts


def test_image_ref_is_a_content_hash():
    ref = env_image_ref("FROM base\n", {"a": b"1", "b": b"2"}, "forkyard/base:x")
    name, _, tag = ref.partition(":")
    assert name == "forkyard/env" and len(tag) == 16 and int(tag, 16) >= 0
    assert env_image_ref("FROM base\n", {"b": b"2", "a": b"1"}, "forkyard/base:x") == ref
    assert env_image_ref("FROM base\n", {"a": b"1", "b": b"3"}, "forkyard/base:x") != ref
    assert env_image_ref("FROM base\n", {"a": b"1", "b": b"2"}, "forkyard/base:y") != ref
    assert env_image_ref("FROM base \n", {"a": b"1", "b": b"2"}, "forkyard/base:x") != ref
    assert env_image_ref("FROM base\n", {"a": b"1", "b": b"2"}, "forkyard/base:x", {"K": "v"}) != ref


# --------------------------------------------------------------------------- real builds

BUILD_DOCKERFILE = """\
FROM ubuntu:24.04
ARG GREETING=hello
ENV APP_HOME=/srv/app \\
    MESSAGE="${GREETING} world"
ENV LEGACY value with spaces
LABEL maintainer="someone"
WORKDIR $APP_HOME
COPY hello.txt ./
COPY data/ data/
COPY --chown=1234:1234 scripts/run.sh /usr/local/bin/run-app
ADD vendor.tar.gz /opt/vendor
RUN useradd -m -u 1500 appuser && mkdir -p out && echo "$MESSAGE" > out/msg.txt
RUN ["python3", "-c", "import os; open('py.txt', 'w').write(os.getcwd() + ' ' + os.environ['GREETING'])"]
USER appuser
WORKDIR work
RUN id -un > whoami.txt && echo "$HOME" > home.txt && touch mine.txt
EXPOSE 8080
CMD ["sleep", "infinity"]
"""


def build_context() -> dict[str, bytes]:
    return {
        "Dockerfile": BUILD_DOCKERFILE.encode(),
        "hello.txt": b"hi there\n",
        "data/a.txt": b"A\n",
        "data/sub/b.txt": b"B\n",
        "scripts/run.sh": b"#!/bin/sh\necho running as $(id -u)\n",
        "vendor.tar.gz": _tar({"lib/v.txt": b"vendored\n"}, "gz"),
    }


class CountingBackend:
    """Delegate to a real backend, counting the sandboxes created through it."""

    def __init__(self, backend) -> None:
        self._backend = backend
        self.created = 0

    async def create(self, spec):
        self.created += 1
        return await self._backend.create(spec)

    def __getattr__(self, name):
        return getattr(self._backend, name)


async def _sh(backend, sandbox_id: str, command: str) -> str:
    result = await backend.exec(sandbox_id, command, timeout_s=60)
    assert result.exit_code == 0, (command, result)
    return result.stdout.strip()


async def test_build_applies_every_instruction(build_backend):
    backend, base = build_backend.backend, build_backend.base
    counting = CountingBackend(backend)
    lines: list[str] = []
    context = build_context()
    ref = await build_task_image(
        counting, dockerfile=BUILD_DOCKERFILE, context=context, base_image=base, progress=lines.append
    )
    sandbox_id = None
    try:
        assert ref.startswith("forkyard/env:") and await backend.has_image(ref)
        assert counting.created == 1
        assert any("CMD ignored" in line for line in lines)
        assert not [s for s in await backend.list() if s.labels.get("forkyard.purpose") == "image-build"]

        sandbox_id = (await backend.create(SandboxSpec(image=ref))).id
        assert await _sh(backend, sandbox_id, "pwd") == "/srv/app/work"
        assert await _sh(backend, sandbox_id, "id -un") == "appuser"
        assert await _sh(backend, sandbox_id, 'echo "$MESSAGE|$LEGACY|${GREETING:-unset}"') == (
            "hello world|value with spaces|unset"
        )
        assert await _sh(backend, sandbox_id, "cat /srv/app/hello.txt") == "hi there"
        assert await _sh(backend, sandbox_id, "cat /srv/app/data/a.txt /srv/app/data/sub/b.txt") == "A\nB"
        assert await _sh(backend, sandbox_id, "stat -c '%u:%g %a' /usr/local/bin/run-app") == "1234:1234 755"
        assert await _sh(backend, sandbox_id, "run-app") == "running as 1500"
        assert await _sh(backend, sandbox_id, "cat /opt/vendor/lib/v.txt") == "vendored"
        assert await _sh(backend, sandbox_id, "cat /srv/app/out/msg.txt") == "hello world"
        assert await _sh(backend, sandbox_id, "cat /srv/app/py.txt") == "/srv/app hello"
        assert await _sh(backend, sandbox_id, "cat whoami.txt home.txt") == "appuser\n/home/appuser"
        assert await _sh(backend, sandbox_id, "stat -c %U /srv/app/work mine.txt") == "appuser\nappuser"
        assert await _sh(backend, sandbox_id, "stat -c %U /srv/app/hello.txt") == "root"

        # Same Dockerfile, context and base: the image is reused, no sandbox is made.
        lines.clear()
        again = await build_task_image(
            counting, dockerfile=BUILD_DOCKERFILE, context=dict(context), base_image=base, progress=lines.append
        )
        assert again == ref and counting.created == 1
        assert lines == [f"using cached {ref}"]
    finally:
        if sandbox_id is not None:
            await backend.destroy(sandbox_id)
        await backend.remove_image(ref)


async def test_run_heredocs_build_as_buildkit_runs_them(build_backend):
    """4 of 116 Dockerfiles in two public TB2 suites use RUN heredocs (BuildKit syntax)."""
    backend, base = build_backend.backend, build_backend.base
    dockerfile = (
        "FROM debian:bookworm\n"
        "ENV WHO=builder\n"
        "RUN <<EOF\nmkdir -p /out\necho \"one $WHO\" > /out/bare\nEOF\n"
        "RUN <<'EOF'\n#!/bin/bash\n[[ -n $BASH_VERSION ]] && echo bash > /out/shebang\nEOF\n"
        "RUN cat > /out/quoted <<'END' && cat > /out/expanded <<END2\n$WHO stays\nEND\n$WHO expands\nEND2\n"
    )
    ref = await build_task_image(backend, dockerfile=dockerfile, context={}, base_image=base)
    sandbox_id = (await backend.create(SandboxSpec(image=ref))).id
    try:
        assert await _sh(backend, sandbox_id, "cat /out/bare /out/shebang /out/quoted /out/expanded") == (
            "one builder\nbash\n$WHO stays\nbuilder expands"
        )
    finally:
        await backend.destroy(sandbox_id)
        await backend.remove_image(ref)


async def test_failing_run_names_the_line_and_keeps_nothing(build_backend):
    backend, base = build_backend.backend, build_backend.base
    dockerfile = "FROM debian:bookworm\nRUN echo ok\nRUN echo some-output && echo to-stderr >&2 && exit 7\nRUN echo never\n"
    ref = env_image_ref(dockerfile, {}, base)
    with pytest.raises(DockerfileError) as info:
        await build_task_image(backend, dockerfile=dockerfile, context={}, base_image=base)
    assert info.value.line == 3
    message = str(info.value)
    assert "exit code 7" in message and "some-output" in message and "to-stderr" in message
    assert not await backend.has_image(ref)
    assert await backend.list() == []  # the build sandbox was destroyed


async def test_run_has_network_but_never_the_host_and_unknown_users_fail(build_backend):
    import socket
    import subprocess

    backend, base = build_backend.backend, build_backend.base
    with pytest.raises(DockerfileError) as info:
        await build_task_image(
            backend,
            dockerfile="FROM base\nUSER nobody-here\nRUN true\n",
            context={},
            base_image=base,
        )
    assert info.value.line == 3 and "nobody-here" in str(info.value)
    host_ip = subprocess.run(["hostname", "-I"], capture_output=True, text=True, check=True).stdout.split()[0]
    with socket.create_server(("0.0.0.0", 0)) as server:  # the host's own services: never reachable
        port = server.getsockname()[1]
        probe = (
            "import socket, sys\n"
            "s = socket.socket(); s.settimeout(3)\n"
            "try:\n    s.connect((sys.argv[1], int(sys.argv[2]))); print('reached')\nexcept OSError: print('refused')\n"
        )
        for network in (True, False):
            dockerfile = (f"FROM base\nCOPY probe.py /\nRUN test \"$(python3 /probe.py 127.0.0.1 {port})\" = refused\n"
                          f"RUN test \"$(python3 /probe.py {host_ip} {port})\" = refused\n"
                          f"RUN getent hosts deb.debian.org {'' if network else '&& false || true'}\n")
            ref = await build_task_image(backend, dockerfile=dockerfile, context={"probe.py": probe.encode()},
                                         base_image=base, network=network)
            await backend.remove_image(ref)
    assert await backend.list() == []


async def test_unsupported_or_unknown_input_fails_before_any_sandbox(build_backend):
    backend, base = build_backend.backend, build_backend.base
    counting = CountingBackend(backend)
    cases = [
        ("FROM base\nRUN true\nONBUILD RUN x\nSTOPSIGNAL 9\nCOPY --from=x /a /b\n", 5, "--from"),
        ("FROM base\nRUN true\nSQUASH\n", 3, "unknown instruction"),
        ("FROM ghcr.io/acme/private:1\nRUN true\n", 1, "no registry is reachable"),
    ]
    for dockerfile, line, fragment in cases:
        with pytest.raises(ImageBuildError) as info:
            await build_task_image(counting, dockerfile=dockerfile, context={}, base_image=base)
        assert isinstance(info.value, DockerfileError) and info.value.line == line, dockerfile
        assert fragment in str(info.value)
    with pytest.raises(DockerfileError) as info:
        await build_task_image(counting, dockerfile="FROM ubuntu:24.04\n", context={}, base_image=base + "-missing")
    assert info.value.line == 1 and "forkyard images build base" in str(info.value)
    assert counting.created == 0


async def test_concurrent_builds_share_one_and_local_images_can_be_built_on(build_backend):
    backend, base = build_backend.backend, build_backend.base
    counting = CountingBackend(backend)
    parent_file = "FROM base\nENV X=1\nWORKDIR /w\nRUN echo parent > /w/parent.txt\n"
    refs = await asyncio.gather(
        *(build_task_image(counting, dockerfile=parent_file, context={}, base_image=base) for _ in range(3))
    )
    parent = refs[0]
    child = sandbox_id = None
    try:
        assert refs == [parent] * 3 and counting.created == 1
        # FROM an image the backend has, by alias: its config is read from a sandbox of it.
        child_file = "FROM mine:1\nENV Y=$X-2\nRUN test \"$X\" = 1 && cat parent.txt > child.txt\n"
        child = await build_task_image(
            backend, dockerfile=child_file, context={}, base_image=base, aliases={"mine:1": parent}
        )
        assert child != parent
        sandbox_id = (await backend.create(SandboxSpec(image=child))).id
        assert await _sh(backend, sandbox_id, 'echo "$(pwd) $X $Y $(cat child.txt)"') == "/w 1 1-2 parent"
        env_keys = set((await _sh(backend, sandbox_id, "env -0 | cut -z -d= -f1 | tr '\\0' ' '")).split())
        assert {"X", "Y", "PATH", "LANG"} <= env_keys
    finally:
        if sandbox_id is not None:
            await backend.destroy(sandbox_id)
        if child is not None:
            await backend.remove_image(child)
        await backend.remove_image(parent)

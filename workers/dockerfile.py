"""Build a task's ``environment/Dockerfile`` on any sandbox backend, with no image registry.

No image registry is reachable, so ``FROM`` must name an image the backend already has:
a real local image, else a stand-in (an alias such as ``ubuntu:24.04`` of the base image).
The build runs in a sandbox made from that image: ``RUN`` goes through the sandbox's
persistent shell (as the current ``USER``, in the current ``WORKDIR``, with exactly the
current ``ENV`` and ``ARG`` values, and outbound network under the sandbox's egress rules,
trusting the host's CA bundle: :mod:`workers.trust`), ``COPY``/``ADD`` write the
build context in as one tar archive, and the result is committed as
``forkyard/env:<16 hex>``, a digest of the Dockerfile, the context, the build arguments
and the ``FROM`` image, so the same task is built once per backend.

Parsing and planning are pure functions (:func:`parse_dockerfile`, :func:`parse_stage`,
:func:`compile_stage`); only :func:`build_task_image` talks to a backend. One stage
only: a second ``FROM``, ``COPY --from`` and heredocs outside ``RUN`` are refused with the line
number. ``RUN`` heredocs run as BuildKit runs them (the shell reads them; a bare one is the script).
"""

from __future__ import annotations

import asyncio
import bz2
import fnmatch
import gzip
import hashlib
import io
import json
import logging
import lzma
import posixpath
import re
import secrets
import shlex
import tarfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from sandboxes.base import ExecResult, ImageConfig, Resources, SandboxBackend, SandboxSpec
from workers.errors import ImageBuildError
from workers.trust import CA_BUNDLE_PATH, ca_env

logger = logging.getLogger(__name__)

#: What an alias value of "base" stands for: the base image passed to the builder.
BASE = "base"
#: Public image names that resolve to a local image (no registry is reachable).
DEFAULT_ALIASES: dict[str, str] = {
    name: BASE
    for name in (
        "ubuntu:24.04",
        "ubuntu:22.04",
        "ubuntu:20.04",
        "ubuntu:noble",
        "ubuntu:jammy",
        "ubuntu:latest",
        "debian:bookworm",
        "debian:bookworm-slim",
        "debian:12",
        "debian:12-slim",
        "debian:stable",
        "debian:stable-slim",
        "debian:latest",
        "python:3.13-slim",
        "python:3.12-slim",
        "python:3.11-slim",
        "python:3.10-slim",
        "python:3.12-slim-bookworm",
        "python:3.11-slim-bookworm",
        "python:3.13",
        "python:3.12",
        "python:3.11",
        "python:3.10",
        "python:3-slim",
        "python:latest",
        "buildpack-deps:bookworm",
    )
}
#: Repository name of built environment images.
ENV_IMAGE_NAME = "forkyard/env"
#: Bump when the builder's semantics change, so old cached images are not reused.
BUILDER_VERSION = 1
#: Limits of the sandbox a Dockerfile is built in.
BUILD_RESOURCES = Resources(cpus=2.0, memory_mb=4096, pids=4096)
#: Default time one RUN may take.
DEFAULT_RUN_TIMEOUT_S = 1800.0
#: Labels stamped on build sandboxes (callers add an owner label so a reaper spares them).
BUILD_LABELS = {"forkyard.purpose": "image-build"}
#: PATH a RUN gets when the image sets none (Docker's default).
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"

KNOWN_OPS = frozenset(
    {
        "FROM", "RUN", "CMD", "LABEL", "MAINTAINER", "EXPOSE", "ENV", "ADD", "COPY",
        "ENTRYPOINT", "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL",
        "HEALTHCHECK", "SHELL",
    }
)  # fmt: skip
#: Instructions that only describe how to run the image; the sandbox backends decide that.
METADATA_OPS = frozenset(
    {"LABEL", "MAINTAINER", "EXPOSE", "CMD", "ENTRYPOINT", "VOLUME", "STOPSIGNAL", "HEALTHCHECK", "ONBUILD"}
)
_NEEDS_ARGS = KNOWN_OPS - {"HEALTHCHECK"}
_CONTINUATION = re.compile(r"\\[ \t]*$")
_DIRECTIVE = re.compile(r"^#\s*([A-Za-z][A-Za-z0-9_-]*)\s*=\s*(.*?)\s*$")
_HEREDOC = re.compile(r"(?<![<\w])<<(-?)\s*([\"']?)([A-Za-z_][\w.-]*)\2")
#: A RUN whose command is one heredoc and nothing else: the heredoc is the script (BuildKit's rule).
_BARE_HEREDOC = re.compile(r"^<<(-?)\s*([\"']?)([A-Za-z_][\w.-]*)\2$")
_NAME_CHARS = re.compile(r"[A-Za-z0-9_]+")
_GLOB_CHARS = re.compile(r"[*?\[]")


class DockerfileError(ImageBuildError):
    """A Dockerfile instruction cannot be parsed or built; ``line`` says which."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"Dockerfile line {line}: {message}")
        self.line = line


@dataclass(frozen=True)
class Instruction:
    """One Dockerfile instruction: its first line, upper-case keyword and raw arguments."""

    line: int
    op: str
    args: str

    @property
    def text(self) -> str:
        """Return the instruction as written (continuations joined)."""
        return f"{self.op} {self.args}".rstrip()


# --------------------------------------------------------------------------- parsing


def parse_dockerfile(text: str) -> list[Instruction]:
    """Split a Dockerfile into instructions, joining ``\\`` continuations and dropping comments.

    Raises:
        DockerfileError: an unknown instruction, a heredoc, a missing argument or an
            ``escape`` directive other than backslash.
    """
    lines = text.splitlines()
    instructions: list[Instruction] = []
    i = 0
    # Parser directives: only leading "# key=value" comments count.
    while i < len(lines):
        m = _DIRECTIVE.match(lines[i].strip())
        if not m:
            break
        key, value = m.group(1).lower(), m.group(2)
        if key == "escape" and value != "\\":
            raise DockerfileError(i + 1, f"escape directive {value!r} is not supported (only '\\')")
        i += 1
    while i < len(lines):
        raw = lines[i]
        stripped = raw.strip()
        i += 1
        if not stripped or stripped.startswith("#"):
            continue
        start = i
        content = raw.lstrip()
        while True:
            m = _CONTINUATION.search(content)
            if not m:
                break
            content = content[: m.start()]
            # Comment and blank lines inside a continuation are skipped, as Docker does.
            while i < len(lines) and (not lines[i].strip() or lines[i].lstrip().startswith("#")):
                i += 1
            if i >= len(lines):
                break
            content += lines[i]
            i += 1
        parts = content.strip().split(None, 1)
        if not parts:
            continue
        op = parts[0].upper()
        args = parts[1].strip() if len(parts) > 1 else ""
        if op not in KNOWN_OPS:
            raise DockerfileError(start, f"unknown instruction {parts[0]!r}")
        if op in _NEEDS_ARGS and not args:
            raise DockerfileError(start, f"{op} needs at least one argument")
        markers = list(_HEREDOC.finditer(args)) if op in ("RUN", "COPY", "ADD") else []
        if markers and op != "RUN":
            raise DockerfileError(start, f"heredocs (<<EOF) in {op} are not supported (in RUN they are)")
        for marker in markers:  # each heredoc's lines follow the instruction's, in order, as in a shell
            strip_tabs, delimiter = marker.group(1) == "-", marker.group(3)
            body: list[str] = []
            while True:
                if i >= len(lines):
                    raise DockerfileError(start, f"the heredoc <<{delimiter} is not closed by a line {delimiter}")
                line = lines[i]
                i += 1
                if (line.lstrip("\t") if strip_tabs else line) == delimiter:
                    break
                body.append(line)
            args += "\n" + "\n".join([*body, delimiter])
        instructions.append(Instruction(start, op, args))
    return instructions


def _heredoc_script(command: str) -> str:
    """Return the shell text of a RUN command; a command that is one bare heredoc runs its body as the script.

    ``RUN <<EOF`` (BuildKit) runs the heredoc's lines, or the program its ``#!`` line names;
    any other command holding heredocs is shell text as it stands (the shell reads them).
    """
    first, _, rest = command.partition("\n")
    bare = _BARE_HEREDOC.match(first.strip())
    if bare is None or not rest:
        return command
    body = rest.split("\n")[:-1]  # the last line is the delimiter
    if bare.group(1) == "-":
        body = [line.lstrip("\t") for line in body]
    script = "\n".join(body)
    if not script.startswith("#!"):
        return script
    # A script with its own interpreter runs as a file, as BuildKit runs it.
    fence = "FORKYARD_HEREDOC_" + hashlib.sha256(script.encode()).hexdigest()[:12]
    return (f'f=$(mktemp) && cat > "$f" <<\'{fence}\'\n{script}\n{fence}\n'
            'chmod +x "$f" && "$f"; status=$?; rm -f "$f"; exit $status')


def parse_exec_form(args: str) -> list[str] | None:
    """Return the JSON (exec) form ``["a", "b"]`` as a list, or None for the shell form."""
    s = args.strip()
    if not s.startswith("["):
        return None
    try:
        value = json.loads(s)
    except ValueError:
        return None
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return value
    return None


def parse_flags(args: str) -> tuple[dict[str, str | None], str]:
    """Split leading ``--name=value`` / ``--name`` flags from an instruction's arguments."""
    flags: dict[str, str | None] = {}
    rest = args.strip()
    while rest.startswith("--"):
        token, _, remainder = rest.partition(" ")
        name, eq, value = token[2:].partition("=")
        if not name:
            break
        flags[name.lower()] = value if eq else None
        rest = remainder.strip()
    return flags, rest


def split_words(text: str) -> list[str]:
    """Split on unquoted whitespace, keeping quotes and escapes for :func:`expand_word`."""
    words: list[str] = []
    cur: list[str] = []
    in_word = False
    quote: str | None = None
    i = 0
    while i < len(text):
        ch = text[i]
        if quote is None and ch.isspace():
            if in_word:
                words.append("".join(cur))
                cur, in_word = [], False
            i += 1
            continue
        in_word = True
        if ch == "\\" and quote != "'" and i + 1 < len(text):
            cur.append(text[i : i + 2])
            i += 2
            continue
        if quote is None and ch in "'\"":
            quote = ch
        elif ch == quote:
            quote = None
        cur.append(ch)
        i += 1
    if in_word:
        words.append("".join(cur))
    return words


class _Expander:
    """Docker's word processing: quote removal, backslash escapes and $VAR expansion."""

    def __init__(self, text: str, variables: Mapping[str, str]) -> None:
        self.text = text
        self.vars = variables
        self.pos = 0

    def word(self, stop: str = "") -> str:
        text, out = self.text, []
        while self.pos < len(text):
            ch = text[self.pos]
            if ch in stop:
                break
            if ch == "\\":
                self.pos += 1
                if self.pos < len(text):
                    out.append(text[self.pos])
                    self.pos += 1
            elif ch == "'":
                end = text.find("'", self.pos + 1)
                if end < 0:
                    raise ValueError("unterminated single quote")
                out.append(text[self.pos + 1 : end])
                self.pos = end + 1
            elif ch == '"':
                self.pos += 1
                out.append(self._double())
            elif ch == "$":
                out.append(self._dollar())
            else:
                out.append(ch)
                self.pos += 1
        return "".join(out)

    def _double(self) -> str:
        text, out = self.text, []
        while True:
            if self.pos >= len(text):
                raise ValueError("unterminated double quote")
            ch = text[self.pos]
            if ch == '"':
                self.pos += 1
                return "".join(out)
            if ch == "$":
                out.append(self._dollar())
                continue
            if ch == "\\" and self.pos + 1 < len(text) and text[self.pos + 1] in '"$\\':
                out.append(text[self.pos + 1])
                self.pos += 2
                continue
            out.append(ch)
            self.pos += 1

    def _dollar(self) -> str:
        text = self.text
        self.pos += 1  # the "$"
        if self.pos >= len(text):
            return "$"
        if text[self.pos] != "{":
            m = _NAME_CHARS.match(text, self.pos)
            if not m:
                return "$"
            self.pos = m.end()
            return self.vars.get(m.group(), "")
        self.pos += 1
        m = _NAME_CHARS.match(text, self.pos)
        if not m:
            raise ValueError(f"bad substitution in {text!r}")
        name = m.group()
        self.pos = m.end()
        if self.pos >= len(text):
            raise ValueError(f"missing '}}' in {text!r}")
        if text[self.pos] == "}":
            self.pos += 1
            return self.vars.get(name, "")
        colon = text[self.pos] == ":"
        if colon:
            self.pos += 1
        modifier = text[self.pos] if self.pos < len(text) else ""
        if modifier not in ("-", "+", "?"):
            raise ValueError(f"unsupported substitution in {text!r} (supported: ${{x}}, ${{x:-d}}, ${{x:+a}}, ${{x:?e}})")
        self.pos += 1
        alternative = self.word(stop="}")
        if self.pos >= len(text):
            raise ValueError(f"missing '}}' in {text!r}")
        self.pos += 1
        value = self.vars.get(name)
        is_set = value is not None and (value != "" or not colon)
        if modifier == "-":
            return value if is_set else alternative  # type: ignore[return-value]
        if modifier == "+":
            return alternative if is_set else ""
        if not is_set:
            raise ValueError(f"{name}: {alternative or 'parameter not set'}")
        return value  # type: ignore[return-value]


def expand_word(word: str, variables: Mapping[str, str]) -> str:
    """Remove quotes and escapes from ``word`` and expand ``$VAR`` / ``${VAR...}`` forms.

    Raises:
        ValueError: unterminated quotes, a bad ``${...}`` form, or ``${x:?msg}`` with x unset.
    """
    return _Expander(word, variables).word()


def expand_words(text: str, variables: Mapping[str, str]) -> list[str]:
    """Split ``text`` into words and expand each (how COPY, ADD and ARG read arguments)."""
    return [expand_word(w, variables) for w in split_words(text)]


def parse_key_values(args: str, variables: Mapping[str, str], *, legacy: bool = True) -> list[tuple[str, str]]:
    """Parse ``k=v k2="v 2"`` (or the legacy single ``k v w`` form) with expansion.

    Raises:
        ValueError: a word without ``=`` in the ``k=v`` form, or a legacy form without a value.
    """
    words = split_words(args)
    if not words:
        raise ValueError("needs at least one name=value pair")
    if "=" not in words[0] and legacy:
        parts = args.strip().split(None, 1)
        if len(parts) < 2:
            raise ValueError(f"{parts[0]!r} has no value (write {parts[0]}=value)")
        return [(expand_word(parts[0], variables), expand_word(parts[1].strip(), variables))]
    pairs = []
    for word in words:
        if "=" not in word:
            raise ValueError(f"{word!r} is not of the form name=value")
        key, _, value = expand_word(word, variables).partition("=")
        if not key:
            raise ValueError(f"{word!r} has an empty name")
        pairs.append((key, value))
    return pairs


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Stage:
    """The single build stage: its FROM image (ARGs expanded) and the instructions after it."""

    from_image: str
    from_line: int
    global_args: Mapping[str, str | None]
    body: tuple[Instruction, ...]


def parse_stage(instructions: Sequence[Instruction], build_args: Mapping[str, str] | None = None) -> Stage:
    """Find the one FROM, the ARGs before it, and the instructions of the stage.

    Raises:
        DockerfileError: no FROM, more than one FROM, or an instruction other than ARG before FROM.
    """
    build_args = dict(build_args or {})
    global_args: dict[str, str | None] = {}
    from_ins: Instruction | None = None
    body: list[Instruction] = []
    for ins in instructions:
        if ins.op == "FROM":
            if from_ins is not None:
                raise DockerfileError(ins.line, "multi-stage builds (a second FROM) are not supported")
            from_ins = ins
        elif from_ins is None:
            if ins.op != "ARG":
                raise DockerfileError(ins.line, f"{ins.op} comes before FROM (only ARG may)")
            for name, default in _parse_arg_decls(ins, _known(global_args)):
                global_args[name] = build_args.get(name, default)
        else:
            body.append(ins)
    if from_ins is None:
        line = instructions[-1].line if instructions else 1
        raise DockerfileError(line, "the Dockerfile has no FROM instruction")
    flags, rest = parse_flags(from_ins.args)
    unknown = set(flags) - {"platform"}
    if unknown:
        raise DockerfileError(from_ins.line, f"FROM --{sorted(unknown)[0]} is not supported")
    try:
        words = expand_words(rest, _known(global_args))
    except ValueError as exc:
        raise DockerfileError(from_ins.line, f"FROM: {exc}") from None
    if len(words) == 3 and words[1].lower() == "as":
        words = words[:1]  # a stage name is harmless with one stage
    if len(words) != 1 or not words[0]:
        raise DockerfileError(from_ins.line, f"FROM takes one image name (optionally 'AS name'), got {rest!r}")
    if words[0] == "scratch":
        raise DockerfileError(from_ins.line, "FROM scratch is not supported: start from the base image")
    return Stage(words[0], from_ins.line, global_args, tuple(body))


def _known(args: Mapping[str, str | None]) -> dict[str, str]:
    return {k: v for k, v in args.items() if v is not None}


def _parse_arg_decls(ins: Instruction, variables: Mapping[str, str]) -> list[tuple[str, str | None]]:
    decls: list[tuple[str, str | None]] = []
    try:
        for word in split_words(ins.args):
            if "=" in word:
                name, _, value = expand_word(word, variables).partition("=")
                decls.append((name, value))
            else:
                decls.append((expand_word(word, variables), None))
    except ValueError as exc:
        raise DockerfileError(ins.line, f"ARG: {exc}") from None
    for name, _ in decls:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise DockerfileError(ins.line, f"ARG name {name!r} is not a valid variable name")
    return decls


def normalize_image_name(name: str) -> str:
    """Return ``name`` without registry/library prefixes or digest, with a tag (default ``latest``)."""
    name = name.split("@", 1)[0]
    # Docker Hub's official images, also as its public mirrors name them (TB2 tasks use ECR's).
    for prefix in ("docker.io/library/", "index.docker.io/library/", "registry-1.docker.io/library/",
                   "public.ecr.aws/docker/library/", "mirror.gcr.io/library/", "mirror.gcr.io/",
                   "docker.io/", "index.docker.io/", "library/"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    last = name.rsplit("/", 1)[-1]
    if ":" not in last:
        name += ":latest"
    return name


def resolve_alias(name: str, aliases: Mapping[str, str], base_image: str) -> str | None:
    """Return the local image an alias names (``"base"`` = ``base_image``), or None."""
    wanted = normalize_image_name(name)
    for key, target in aliases.items():
        if key == name or normalize_image_name(key) == wanted:
            return base_image if target == BASE else target
    if name in (BASE, base_image):
        return base_image
    return None


@dataclass(frozen=True)
class RunStep:
    """Run ``argv`` as ``user`` in ``workdir`` with exactly ``env``."""

    line: int
    text: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    workdir: str
    user: str


@dataclass(frozen=True)
class WorkdirStep:
    """Create ``path`` (owned by ``user`` when it is not root) if it does not exist."""

    line: int
    text: str
    path: str
    user: str


@dataclass(frozen=True)
class CopyStep:
    """Write context files under ``dest``; a single file may land on ``dest`` itself.

    ``files`` holds (path relative to the destination directory, data, mode). When
    ``into_dir`` is False there is exactly one file, and it becomes ``dest`` unless
    ``dest`` already is a directory in the image.
    """

    line: int
    text: str
    files: tuple[tuple[str, bytes, int], ...]
    dest: str
    into_dir: bool
    chown: str | None = None


@dataclass(frozen=True)
class ExtractStep:
    """Unpack an uncompressed tar archive from the context into the directory ``dest``."""

    line: int
    text: str
    archive: bytes
    dest: str
    chown: str | None = None


@dataclass(frozen=True)
class NoteStep:
    """An instruction with no effect on the filesystem (ENV, ARG, USER, SHELL, metadata)."""

    line: int
    text: str
    note: str = ""


Step = RunStep | WorkdirStep | CopyStep | ExtractStep | NoteStep


@dataclass
class _State:
    env: dict[str, str]
    args: dict[str, str | None]
    workdir: str
    user: str
    shell: tuple[str, ...] = ("/bin/sh", "-c")

    def variables(self) -> dict[str, str]:
        # ENV wins over an ARG of the same name.
        return {**_known(self.args), **self.env}


def compile_stage(
    stage: Stage,
    *,
    config: ImageConfig,
    context: Mapping[str, bytes],
    build_args: Mapping[str, str] | None = None,
) -> tuple[list[Step], ImageConfig]:
    """Turn the stage's instructions into build steps and the resulting image config.

    ``config`` is the FROM image's config. Pure: nothing runs here.

    Raises:
        DockerfileError: an unsupported instruction or flag, bad syntax, or a COPY
            source that matches nothing in the context.
    """
    build_args = dict(build_args or {})
    files = _index_context(context)
    state = _State(env=dict(config.env), args={}, workdir=config.workdir or "/", user=config.user or "root")
    steps: list[Step] = []
    for ins in stage.body:
        try:
            steps.extend(_compile(ins, state, files, build_args, stage.global_args))
        except ValueError as exc:
            raise DockerfileError(ins.line, f"{ins.op}: {exc}") from None
    return steps, ImageConfig(env=dict(state.env), workdir=state.workdir, user=state.user)


def _compile(
    ins: Instruction,
    state: _State,
    files: Mapping[str, bytes],
    build_args: Mapping[str, str],
    global_args: Mapping[str, str | None],
) -> list[Step]:
    op, line, text = ins.op, ins.line, ins.text
    if op in METADATA_OPS:
        return [NoteStep(line, text, f"{op} ignored (image metadata)")]
    if op == "ARG":
        for name, default in _parse_arg_decls(ins, state.variables()):
            if name in build_args:
                state.args[name] = build_args[name]
            elif default is not None:
                state.args[name] = default
            else:
                state.args[name] = global_args.get(name)
        return [NoteStep(line, text)]
    if op == "ENV":
        for key, value in parse_key_values(ins.args, state.variables()):
            state.env[key] = value
        return [NoteStep(line, text)]
    if op == "USER":
        user = expand_word(ins.args.strip(), state.variables()).strip()
        if not user or user.startswith(":") or user.endswith(":"):
            raise ValueError(f"{ins.args!r} is not a user[:group]")
        state.user = user
        return [NoteStep(line, text)]
    if op == "WORKDIR":
        path = expand_word(ins.args.strip(), state.variables())
        state.workdir = posixpath.normpath(posixpath.join(state.workdir, path))
        if state.workdir.startswith("//"):
            state.workdir = "/" + state.workdir.lstrip("/")
        return [WorkdirStep(line, text, state.workdir, state.user)]
    if op == "SHELL":
        shell = parse_exec_form(ins.args)
        if not shell:
            raise ValueError('needs the JSON form, e.g. SHELL ["/bin/bash", "-c"]')
        state.shell = tuple(shell)
        return [NoteStep(line, text)]
    if op == "RUN":
        return [_compile_run(ins, state)]
    if op in ("COPY", "ADD"):
        return _compile_copy(ins, state, files)
    raise ValueError("is not supported")  # pragma: no cover - KNOWN_OPS are all handled


def _compile_run(ins: Instruction, state: _State) -> RunStep:
    flags, rest = parse_flags(ins.args)
    for name, value in flags.items():
        if name == "network":
            logger.info("Dockerfile line %d: RUN --network=%s ignored: every RUN has the build's network",
                        ins.line, value)
        elif name == "mount":
            if "type=cache" not in (value or "") and "type=tmpfs" not in (value or ""):
                raise ValueError(f"--mount={value} is not supported (only type=cache and type=tmpfs, which are ignored)")
            logger.info("Dockerfile line %d: RUN --mount=%s ignored", ins.line, value)
        else:
            raise ValueError(f"--{name} is not supported")
    if not rest:
        raise ValueError("needs a command")
    argv = parse_exec_form(rest)
    if argv is None:
        argv = [*state.shell, _heredoc_script(rest)]
    elif not argv:
        raise ValueError("has an empty command")
    env = state.variables()
    env.setdefault("PATH", DEFAULT_PATH)
    return RunStep(ins.line, ins.text, tuple(argv), env, state.workdir, state.user)


def _compile_copy(ins: Instruction, state: _State, files: Mapping[str, bytes]) -> list[Step]:
    flags, rest = parse_flags(ins.args)
    chown = None
    chmod = None
    for name, value in flags.items():
        if name == "from":
            raise ValueError("--from is not supported (one build stage only)")
        if name == "chown":
            chown = expand_word(value or "", state.variables()) or None
        elif name == "chmod":
            if not value or not re.fullmatch(r"[0-7]{3,4}", value):
                raise ValueError(f"--chmod={value} must be an octal mode like 755")
            chmod = int(value, 8)
        elif name == "link":
            pass  # layer linking means nothing here
        else:
            raise ValueError(f"--{name} is not supported")
    words = parse_exec_form(rest)
    if words is None:
        words = expand_words(rest, state.variables())
    else:
        words = [expand_word(w, state.variables()) for w in words]
    if len(words) < 2:
        raise ValueError("needs at least one source and a destination")
    *sources, dest_word = words
    dest = posixpath.join(state.workdir, dest_word)
    explicit_dir = dest_word.endswith("/") or dest_word in (".", "./") or dest_word.endswith("/.")
    dest = posixpath.normpath(dest)
    if dest.startswith("//"):
        dest = "/" + dest.lstrip("/")

    steps: list[Step] = []
    plain: list[tuple[str, bytes, int]] = []
    items = 0
    copied_dir = False
    for source in sources:
        if ins.op == "ADD" and re.match(r"^[a-z][a-z0-9+.-]*://", source, re.I):
            raise ValueError(f"cannot fetch {source}: ADD of URLs is not supported; RUN curl (builds have network)")
        if ins.op == "ADD" and source.startswith("git@"):
            raise ValueError(f"cannot clone {source}: ADD of git repositories is not supported; RUN git clone")
        matches = _match_source(source, files)
        if not matches:
            raise ValueError(f"no files in the build context match {source!r}")
        for match in matches:
            items += 1
            if isinstance(match, _DirMatch):
                copied_dir = True
                for rel, data in match.files:
                    plain.append((rel, data, chmod if chmod is not None else _default_mode(data)))
                continue
            rel, data = match
            archive = _as_plain_tar(data) if ins.op == "ADD" else None
            if archive is not None:
                steps.append(ExtractStep(ins.line, ins.text, archive, dest, chown))
            else:
                plain.append((rel, data, chmod if chmod is not None else _default_mode(data)))
    if items > 1 and not explicit_dir:
        raise ValueError(f"with more than one source the destination must end with '/', got {dest_word!r}")
    if plain:
        last: dict[str, int] = {}
        for idx, (rel, _, _) in enumerate(plain):
            last[rel] = idx  # a later source overwrites an earlier one, as in Docker
        deduped = tuple(plain[i] for i in sorted(last.values()))
        into_dir = explicit_dir or copied_dir or items > 1
        steps.insert(0, CopyStep(ins.line, ins.text, deduped, dest, into_dir, chown))
    return steps


def _index_context(context: Mapping[str, bytes]) -> dict[str, bytes]:
    files: dict[str, bytes] = {}
    for key, data in context.items():
        path = posixpath.normpath(key.replace("\\", "/").lstrip("/"))
        if path in (".", "") or path == ".." or path.startswith("../"):
            continue
        files[path] = data
    return files


@dataclass(frozen=True)
class _DirMatch:
    """A directory of the context: its files by path relative to it."""

    files: tuple[tuple[str, bytes], ...]


def _match_source(source: str, files: Mapping[str, bytes]) -> list[tuple[str, bytes] | _DirMatch]:
    """Return what one COPY source names: files (by base name) and directories."""
    norm = posixpath.normpath(source.lstrip("/")) if source.strip("/") else "."
    if norm == ".." or norm.startswith("../"):
        raise ValueError(f"source {source!r} is outside the build context")
    if norm == ".":
        return [_DirMatch(tuple(sorted(files.items())))] if files else []
    if not _GLOB_CHARS.search(norm):
        if norm in files:
            return [(posixpath.basename(norm), files[norm])]
        prefix = norm + "/"
        members = tuple((p[len(prefix) :], d) for p, d in sorted(files.items()) if p.startswith(prefix))
        return [_DirMatch(members)] if members else []
    pattern = norm.split("/")
    found: dict[str, tuple[str, bytes] | list[tuple[str, bytes]]] = {}
    for path, data in sorted(files.items()):
        parts = path.split("/")
        if len(parts) < len(pattern):
            continue
        head = parts[: len(pattern)]
        if not all(fnmatch.fnmatchcase(p, q) for p, q in zip(head, pattern, strict=True)):
            continue
        key = "/".join(head)
        if len(parts) == len(pattern):
            found[key] = (parts[-1], data)
        else:  # a matched directory copies its contents, like a directory source
            entry = found.setdefault(key, [])
            assert isinstance(entry, list)
            entry.append(("/".join(parts[len(pattern) :]), data))
    return [_DirMatch(tuple(v)) if isinstance(v, list) else v for _, v in sorted(found.items())]


def _default_mode(data: bytes) -> int:
    # The context carries bytes only; scripts and binaries keep their executable bit.
    return 0o755 if data.startswith((b"#!", b"\x7fELF")) else 0o644


def _as_plain_tar(data: bytes) -> bytes | None:
    """Return ``data`` as an uncompressed tar if it is a (possibly compressed) tar archive."""
    try:
        if data.startswith(b"\x1f\x8b"):
            raw = gzip.decompress(data)
        elif data.startswith(b"BZh"):
            raw = bz2.decompress(data)
        elif data.startswith(b"\xfd7zXZ\x00"):
            raw = lzma.decompress(data)
        else:
            raw = data
    except (OSError, EOFError, ValueError, lzma.LZMAError):
        return None
    if len(raw) < 512:
        return None
    try:
        with tarfile.open(fileobj=io.BytesIO(raw), mode="r:") as tar:
            tar.getmembers()
    except (tarfile.TarError, EOFError):
        return None
    return raw


def env_image_ref(
    dockerfile: str,
    context: Mapping[str, bytes],
    from_image: str,
    build_args: Mapping[str, str] | None = None,
) -> str:
    """Return ``forkyard/env:<16 hex>``, a digest of everything the build depends on."""
    h = hashlib.sha256()
    h.update(json.dumps({"builder": BUILDER_VERSION, "from": from_image}, sort_keys=True).encode())
    h.update(b"\0dockerfile\0" + dockerfile.encode())
    for path in sorted(context):
        h.update(b"\0file\0" + path.encode() + b"\0" + hashlib.sha256(context[path]).digest())
    for key in sorted(build_args or {}):
        h.update(b"\0arg\0" + key.encode() + b"=" + (build_args or {})[key].encode())
    return f"{ENV_IMAGE_NAME}:{h.hexdigest()[:16]}"


# --------------------------------------------------------------------------- building

#: In-flight builds of this process: (event loop id, ref) -> [lock, callers].
_build_locks: dict[tuple[int, str], list] = {}


async def build_task_image(
    backend: SandboxBackend,
    *,
    dockerfile: str,
    context: Mapping[str, bytes],
    base_image: str,
    aliases: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
    build_args: Mapping[str, str] | None = None,
    base_config: ImageConfig | None = None,
    labels: Mapping[str, str] | None = None,
    run_timeout_s: float = DEFAULT_RUN_TIMEOUT_S,
    resources: Resources = BUILD_RESOURCES,
    network: bool = True,
    ca_bundle: bytes | None = None,
) -> str:
    """Build ``dockerfile`` with ``context`` on ``backend`` once; return the image ref.

    Args:
        context: the build context, files by path relative to the context root.
        base_image: the ref aliases of ``"base"`` stand for (the base image).
        aliases: public image names to local refs; defaults to :data:`DEFAULT_ALIASES`.
        base_config: the base image's config; defaults to the one
            :mod:`sandboxes.images` imports it with. Other FROM images are probed.
        labels: added to the build sandbox's labels (an owner label keeps reapers off).
        network: give RUN outbound network (the sandbox's egress rules: never the host or
            private networks), so ``apt-get install`` and ``pip install`` reach the registries.
        ca_bundle: PEM certificates RUN trusts (:mod:`workers.trust`); not kept in the image.

    Raises:
        ImageBuildError: (a :class:`DockerfileError` naming the line) for an unsupported
            instruction, a FROM naming no local image, a failing or timed-out RUN.
    """
    aliases = DEFAULT_ALIASES if aliases is None else aliases
    stage = parse_stage(parse_dockerfile(dockerfile), build_args)
    # The real image when this host has it (imported, or pulled before); else its stand-in.
    from_ref = stage.from_image if await backend.has_image(stage.from_image) else None
    from_ref = from_ref or resolve_alias(stage.from_image, aliases, base_image)
    if from_ref is None:
        raise DockerfileError(
            stage.from_line,
            f"FROM {stage.from_image}: no such local image and no registry is reachable; import it, or map it "
            "to a stand-in (FORKYARD_IMAGES__STAND_INS: base, python, gcc, golang, node, rust)",
        )
    if not await backend.has_image(from_ref):
        hint = " (import it first: forkyard images build base)" if from_ref == base_image else ""
        raise DockerfileError(
            stage.from_line, f"FROM {stage.from_image}: image {from_ref} is not on the {backend.name} backend{hint}"
        )
    ref = env_image_ref(dockerfile, context, from_ref, build_args)
    if await backend.has_image(ref):
        _emit(progress, f"using cached {ref}")
        return ref
    # Sessions of one task often start together: the first caller builds, the rest wait.
    key = (id(asyncio.get_running_loop()), ref)
    entry = _build_locks.setdefault(key, [asyncio.Lock(), 0])
    entry[1] += 1
    try:
        async with entry[0]:
            if await backend.has_image(ref):
                _emit(progress, f"using cached {ref}")
                return ref
            await _Build(backend, stage, from_ref, ref, progress, run_timeout_s, network, ca_bundle).run(
                context=context,
                build_args=build_args or {},
                config=_base_config(base_config) if from_ref == base_image else None,
                labels={**BUILD_LABELS, **(labels or {})},
                resources=resources,
            )
    finally:
        entry[1] -= 1
        if entry[1] == 0:
            del _build_locks[key]
    return ref


def _base_config(config: ImageConfig | None) -> ImageConfig:
    if config is not None:
        return config
    from sandboxes.images import BASE_IMAGE_CONFIG

    return BASE_IMAGE_CONFIG


def _emit(progress: Callable[[str], None] | None, line: str) -> None:
    logger.info("%s", line)
    if progress is not None:
        progress(line)


@dataclass
class _User:
    uid: int
    gid: int
    home: str
    known: bool  # has a passwd entry (supplementary groups can be initialised)


#: Variables a shell sets for itself; they are not part of an image's ENV.
_VOLATILE_ENV = frozenset({"HOSTNAME", "PWD", "OLDPWD", "SHLVL", "_", "HOME", "TERM", "SHELL", "USER", "LOGNAME"})
_EXEC_TIMEOUT_S = 300.0
_ERROR_TAIL_LINES = 25


@dataclass
class _Build:
    backend: SandboxBackend
    stage: Stage
    from_ref: str
    ref: str
    progress: Callable[[str], None] | None
    run_timeout_s: float
    network: bool = True
    ca_bundle: bytes | None = None
    sandbox_id: str = ""
    shell_uid: int = 0

    async def run(
        self,
        *,
        context: Mapping[str, bytes],
        build_args: Mapping[str, str],
        config: ImageConfig | None,
        labels: Mapping[str, str],
        resources: Resources,
    ) -> None:
        compiled = None
        if config is not None:  # fail on a bad Dockerfile before starting a sandbox
            compiled = compile_stage(self.stage, config=config, context=context, build_args=build_args)
        _emit(self.progress, f"building {self.ref} from {self.from_ref}")
        info = await self.backend.create(
            SandboxSpec(image=self.from_ref, resources=resources, network=self.network, labels=dict(labels))
        )
        self.sandbox_id = info.id
        try:
            self.shell_uid = int((await self._sh("id -u", "probe")).strip())
            if self.ca_bundle is not None and self.network:
                await self.backend.write_file(self.sandbox_id, CA_BUNDLE_PATH, self.ca_bundle, mode=0o644)
            if compiled is None:
                config = await self._probe_config()
                compiled = compile_stage(self.stage, config=config, context=context, build_args=build_args)
            steps, final = compiled
            for n, step in enumerate(steps, 1):
                _emit(self.progress, f"step {n}/{len(steps)} (line {step.line}): {_short(step.text)}")
                if isinstance(step, NoteStep):
                    if step.note:
                        _emit(self.progress, f"  {step.note}")
                    continue
                if isinstance(step, RunStep):
                    await self._run(step)
                elif isinstance(step, WorkdirStep):
                    await self._workdir(step)
                elif isinstance(step, CopyStep):
                    await self._copy(step)
                elif isinstance(step, ExtractStep):
                    await self._extract(step)
            if self.ca_bundle is not None and self.network:
                await self._sh(f"rm -f {CA_BUNDLE_PATH}; rmdir {posixpath.dirname(CA_BUNDLE_PATH)} 2>/dev/null; true",
                               "removing the host's CA bundle")
            _emit(self.progress, f"committing {self.ref}")
            await self.backend.commit(self.sandbox_id, self.ref, final)
        finally:
            await self.backend.destroy(self.sandbox_id)

    async def _sh(self, command: str, what: str, *, line: int | None = None, timeout_s: float = _EXEC_TIMEOUT_S) -> str:
        """Run a helper command in the build shell; return its stdout or raise."""
        result = await self.backend.exec(self.sandbox_id, command, timeout_s=timeout_s)
        if result.exit_code != 0 or result.timed_out:
            detail = (result.stderr or result.stdout).strip()
            message = f"{what} failed (exit code {result.exit_code}): {detail}"
            if line is None:
                raise ImageBuildError(f"building {self.ref}: {message}")
            raise DockerfileError(line, message)
        return result.stdout

    async def _probe_config(self) -> ImageConfig:
        out = await self._sh("id -un 2>/dev/null || id -u; pwd; env -0", "reading the FROM image's config")
        user, workdir, env_blob = out.split("\n", 2)
        env = {}
        for item in env_blob.split("\0"):
            key, eq, value = item.partition("=")
            if eq and key and key not in _VOLATILE_ENV and not key.startswith("FORKYARD_"):
                env[key] = value
        return ImageConfig(env=env, workdir=workdir or "/", user=user or "root")

    async def _user(self, spec: str, line: int) -> _User:
        # Looked up at each use: an earlier RUN may have added the user.
        name, _, group = spec.partition(":")
        if name in ("root", "0") and group in ("", "root", "0"):
            return _User(0, 0, "/root", True)
        result = await self.backend.exec(self.sandbox_id, f"getent passwd -- {shlex.quote(name)}", timeout_s=60)
        fields = result.stdout.strip().split("\n")[0].split(":") if result.exit_code == 0 else []
        if len(fields) >= 6:
            user = _User(int(fields[2]), int(fields[3]), fields[5] or "/", True)
        elif name.isdigit():
            user = _User(int(name), int(name), "/", False)
        else:
            raise DockerfileError(line, f"unable to find user {name!r} in the image")
        if group:
            if group.isdigit():
                user.gid = int(group)
            else:
                result = await self.backend.exec(self.sandbox_id, f"getent group -- {shlex.quote(group)}", timeout_s=60)
                gfields = result.stdout.strip().split(":")
                if result.exit_code != 0 or len(gfields) < 3:
                    raise DockerfileError(line, f"unable to find group {group!r} in the image")
                user.gid = int(gfields[2])
        return user

    def _need_root(self, line: int, why: str) -> None:
        if self.shell_uid != 0:
            raise DockerfileError(line, f"{why} needs root, but the FROM image's shell runs as uid {self.shell_uid}")

    async def _run(self, step: RunStep) -> None:
        user = await self._user(step.user, step.line)
        env = dict(step.env)
        env.setdefault("HOME", user.home)
        if self.ca_bundle is not None and self.network:
            for name, value in ca_env().items():
                env.setdefault(name, value)
        inner = [
            "env", "-i", *(f"{k}={v}" for k, v in env.items()),
            "/bin/sh", "-c", 'cd -- "$1" || exit 1; shift; exec "$@"', "forkyard-run", step.workdir,
            *step.argv,
        ]  # fmt: skip
        switch = (user.uid, user.gid) != (0, 0) if self.shell_uid == 0 else user.uid != self.shell_uid
        if switch:
            self._need_root(step.line, f"RUN as {step.user}")
            groups = "--init-groups" if user.known else "--clear-groups"
            inner = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", groups, *inner]
        result = await self.backend.exec(
            self.sandbox_id, shlex.join(inner), timeout_s=self.run_timeout_s, max_output_bytes=256 * 1024
        )
        for text in (result.stdout, result.stderr):
            for out_line in text.splitlines()[-5:]:
                logger.debug("line %d: %s", step.line, out_line)
        if result.timed_out:
            raise DockerfileError(
                step.line, f"RUN timed out after {self.run_timeout_s:g}s: {_short(step.text)}{_tail(result)}"
            )
        if result.exit_code != 0:
            raise DockerfileError(
                step.line, f"RUN failed with exit code {result.exit_code}: {_short(step.text)}{_tail(result)}"
            )

    async def _workdir(self, step: WorkdirStep) -> None:
        user = await self._user(step.user, step.line)
        path = shlex.quote(step.path)
        command = f"mkdir -p -- {path}"
        if user.uid != 0 and self.shell_uid == 0:
            # BuildKit creates a missing WORKDIR owned by the current USER.
            command = f"[ -d {path} ] || {{ mkdir -p -- {path} && chown -- {user.uid}:{user.gid} {path}; }}"
        await self._sh(command, "WORKDIR", line=step.line)

    async def _owner(self, chown: str | None, line: int) -> tuple[int, int]:
        if chown is None:
            return 0, 0
        self._need_root(line, "--chown")
        user = await self._user(chown, line)
        if ":" not in chown:
            return user.uid, user.uid  # Docker: no group means the gid is the uid's number
        return user.uid, user.gid

    async def _copy(self, step: CopyStep) -> None:
        uid, gid = await self._owner(step.chown, step.line)
        if step.into_dir:
            target_dir, names = step.dest, [rel for rel, _, _ in step.files]
        else:
            is_dir = await self.backend.exec(self.sandbox_id, f"test -d {shlex.quote(step.dest)}", timeout_s=60)
            if is_dir.exit_code == 0:
                target_dir, names = step.dest, [step.files[0][0]]
            else:
                target_dir, names = posixpath.dirname(step.dest), [posixpath.basename(step.dest)]
        buf = io.BytesIO()
        now = int(time.time())
        with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for name, (_, data, mode) in zip(names, step.files, strict=True):
                member = tarfile.TarInfo(posixpath.join(target_dir, name).lstrip("/"))
                member.size, member.mode, member.mtime = len(data), mode, now
                member.uid, member.gid = uid, gid
                tar.addfile(member, io.BytesIO(data))
        await self._untar(buf.getvalue(), "/", step.line, step.text.split(None, 1)[0])

    async def _extract(self, step: ExtractStep) -> None:
        archive = step.archive
        if step.chown is not None:
            uid, gid = await self._owner(step.chown, step.line)
            archive = _rewrite_owner(archive, uid, gid)
        await self._sh(f"mkdir -p -- {shlex.quote(step.dest)}", "ADD", line=step.line)
        await self._untar(archive, step.dest, step.line, "ADD")

    async def _untar(self, archive: bytes, directory: str, line: int, what: str) -> None:
        path = f"/tmp/.forkyard-build-{secrets.token_hex(6)}.tar"
        await self.backend.write_file(self.sandbox_id, path, archive, mode=0o600)
        numeric = "--numeric-owner" if self.shell_uid == 0 else "--no-same-owner"
        script = 'tar -xf "$1" -C "$2" ' + numeric + '; rc=$?; rm -f -- "$1"; exit $rc'
        await self._sh(shlex.join(["sh", "-c", script, "untar", path, directory]), what, line=line)


def _rewrite_owner(archive: bytes, uid: int, gid: int) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(archive), mode="r:") as src, tarfile.open(
        fileobj=out, mode="w", format=tarfile.PAX_FORMAT
    ) as dst:
        for member in src.getmembers():
            member.uid, member.gid, member.uname, member.gname = uid, gid, "", ""
            dst.addfile(member, src.extractfile(member) if member.isreg() else None)
    return out.getvalue()


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _tail(result: ExecResult) -> str:
    lines = (result.stdout.rstrip("\n") + "\n" + result.stderr.rstrip("\n")).strip("\n").splitlines()
    if not lines:
        return ""
    return "\n" + "\n".join(lines[-_ERROR_TAIL_LINES:])

"""``str_replace_editor``: view, create and edit files of the workdir, as SWE-agent's tool does.

Commands (all take an absolute ``path`` inside the workdir):

- ``view``: a file with line numbers (``view_range [start, end]``, 1-based, ``end = -1``
  to the end) or a directory two levels deep (hidden entries left out);
- ``create``: a new file with ``file_text`` (an existing file is refused);
- ``str_replace``: replace ``old_str`` by ``new_str``; ``old_str`` must occur exactly once;
- ``insert``: ``new_str`` after line ``insert_line`` (0: at the top);
- ``undo_edit``: put back the file as it was before its last edit by this tool.

Files are read and written host-side through the backend (no helper runs in the
sandbox); the path is resolved inside the sandbox first, so a symlink out of the
workdir is refused like any path outside it. Every mistake is an
:class:`~workers.errors.ActionError` the agent sees, never a failed episode.
"""

from __future__ import annotations

import posixpath
import shlex
from collections.abc import Mapping
from typing import Any

from sandboxes.base import SandboxBackend
from sandboxes.errors import FileTooLargeError
from workers.envs.base import ToolSpec
from workers.errors import ActionError

COMMANDS = ("view", "create", "str_replace", "insert", "undo_edit")
#: Largest file the editor reads or writes.
MAX_FILE_BYTES = 1024 * 1024
#: Characters of a view shown before it is cut with a marker.
MAX_VIEW_CHARS = 16 * 1024
#: Bytes of undo history kept per env (oldest dropped first); it travels with snapshots.
MAX_HISTORY_BYTES = 512 * 1024
_STANDARD_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
_ARGUMENTS = {
    "view": ({"path"}, {"view_range"}),
    "create": ({"path", "file_text"}, set()),
    "str_replace": ({"path", "old_str"}, {"new_str"}),
    "insert": ({"path", "insert_line", "new_str"}, set()),
    "undo_edit": ({"path"}, set()),
}

EDITOR_TOOL = ToolSpec(
    name="str_replace_editor",
    description=(
        "View, create and edit files. `view` shows a file with line numbers (optionally `view_range` "
        "[start, end], end -1 for the end of the file) or lists a directory; `create` writes a new file; "
        "`str_replace` replaces `old_str` (which must occur exactly once, whitespace included) by `new_str`; "
        "`insert` puts `new_str` after line `insert_line`; `undo_edit` reverts the last edit of `path`. "
        "Paths are absolute."
    ),
    parameters={
        "type": "object",
        "properties": {
            "command": {"type": "string", "enum": list(COMMANDS)},
            "path": {"type": "string", "description": "Absolute path of a file or directory."},
            "file_text": {"type": "string", "description": "`create`: the file's content."},
            "old_str": {"type": "string", "description": "`str_replace`: the exact text to replace."},
            "new_str": {"type": "string", "description": "`str_replace`/`insert`: the new text."},
            "insert_line": {"type": "integer", "description": "`insert`: the line after which to insert."},
            "view_range": {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 2},
        },
        "required": ["command", "path"],
        "additionalProperties": False,
    },
)


class Editor:
    """The editor of one sandbox, with its undo history."""

    def __init__(self, backend: SandboxBackend, workdir: str, history: Mapping[str, list[str]] | None = None) -> None:
        self.backend = backend
        self.workdir = workdir.rstrip("/") or "/"
        self.history: dict[str, list[str]] = {p: list(v) for p, v in (history or {}).items()}
        """Earlier contents of each edited file, the latest last."""

    def export_history(self) -> dict[str, list[str]]:
        """Return the undo history, cut to :data:`MAX_HISTORY_BYTES` (oldest versions dropped first)."""
        versions = [(path, i, text) for path, texts in self.history.items() for i, text in enumerate(texts)]
        total = sum(len(t.encode()) for _, _, t in versions)
        keep = {path: list(texts) for path, texts in self.history.items()}
        for path, _, text in sorted(versions, key=lambda v: v[1]):
            if total <= MAX_HISTORY_BYTES:
                break
            keep[path].pop(0)
            total -= len(text.encode())
        return {path: texts for path, texts in keep.items() if texts}

    async def run(self, sandbox_id: str, arguments: Mapping[str, Any]) -> str:
        """Run one editor command and return its observation.

        Raises:
            ActionError: invalid arguments, a path outside the workdir, a missing or
                binary file, a non-unique ``old_str``...
        """
        command = arguments.get("command")
        if command not in COMMANDS:
            raise ActionError(f"str_replace_editor: command must be one of {', '.join(COMMANDS)}, got {command!r}")
        required, optional = _ARGUMENTS[command]
        given = set(arguments) - {"command"}
        missing = sorted(required - given)
        if missing:
            raise ActionError(f"str_replace_editor {command} needs {', '.join(missing)}")
        unknown = sorted(given - required - optional)
        if unknown:
            raise ActionError(f"str_replace_editor {command} does not take {', '.join(unknown)}")
        path = arguments["path"]
        if not isinstance(path, str) or not path.startswith("/"):
            raise ActionError(f"str_replace_editor: path must be an absolute path, got {path!r}")
        kind, real = await self._probe(sandbox_id, path)
        if command == "view":
            if kind == "dir":
                return await self._list(sandbox_id, real)
            text = await self._read_text(sandbox_id, path, real, kind)
            return _numbered(text, arguments.get("view_range"), path)
        if command == "create":
            content = _string(arguments, "file_text")
            if kind != "none":
                raise ActionError(f"{path} already exists; create makes new files (use str_replace to edit)")
            await self._write(sandbox_id, real, content)
            self.history.setdefault(real, []).append("\0absent")
            return f"File created: {path}"
        text = await self._read_text(sandbox_id, path, real, kind)
        if command == "str_replace":
            old = _string(arguments, "old_str")
            new = _string(arguments, "new_str") if "new_str" in arguments else ""
            if not old:
                raise ActionError("str_replace needs a non-empty old_str")
            count = text.count(old)
            if count == 0:
                raise ActionError(f"old_str does not occur in {path} (it must match exactly, whitespace included)")
            if count > 1:
                lines = [str(text[: i].count("\n") + 1) for i in _positions(text, old)]
                raise ActionError(f"old_str occurs {count} times in {path} (lines {', '.join(lines)}); "
                                  "include more context so it is unique")
            updated = text.replace(old, new, 1)
            start = text[: text.index(old)].count("\n") + 1
            await self._edit(sandbox_id, real, text, updated)
            return f"Edited {path}:\n" + _numbered(updated, [max(1, start - 3), start + new.count("\n") + 3], path)
        if command == "insert":
            new = _string(arguments, "new_str")
            at = arguments["insert_line"]
            lines = text.split("\n")
            count = len(lines) - 1 if text.endswith("\n") else len(lines)
            if isinstance(at, bool) or not isinstance(at, int) or not 0 <= at <= count:
                raise ActionError(f"insert_line must be a line number from 0 to {count}, got {at!r}")
            head = "".join(line + "\n" for line in lines[:at])
            rest = text[len(head):]
            if head and not text.endswith("\n") and at == count:
                head, rest = text + "\n", ""
            updated = head + (new if new.endswith("\n") else new + "\n") + rest
            await self._edit(sandbox_id, real, text, updated)
            return f"Inserted after line {at} of {path}:\n" + _numbered(updated, [max(1, at - 2), at + new.count("\n") + 3],
                                                                         path)
        # undo_edit
        versions = self.history.get(real)
        if not versions:
            raise ActionError(f"no edit of {path} to undo")
        previous = versions.pop()
        if previous == "\0absent":
            await self._sh(sandbox_id, f"rm -f -- {shlex.quote(real)}")
            return f"Undid the creation of {path} (removed)"
        await self._write(sandbox_id, real, previous)
        return f"Undid the last edit of {path}:\n" + _numbered(previous, None, path)

    async def _edit(self, sandbox_id: str, real: str, before: str, after: str) -> None:
        await self._write(sandbox_id, real, after)
        self.history.setdefault(real, []).append(before)

    async def _sh(self, sandbox_id: str, command: str) -> str:
        result = await self.backend.exec(sandbox_id, f"(PATH={_STANDARD_PATH}; {command})", timeout_s=30)
        if result.exit_code != 0:
            raise ActionError(f"str_replace_editor: {(result.stderr or result.stdout).strip()[-300:]}")
        return result.stdout

    async def _probe(self, sandbox_id: str, path: str) -> tuple[str, str]:
        """Return (kind: file|dir|none|other, resolved path) of ``path``, refusing one outside the workdir.

        The common case costs no process in the sandbox: the path is normalized here and
        the shell's own ``test`` checks that no component is a symlink; only a path through
        a symlink is resolved by ``realpath`` there.
        """
        normal = posixpath.normpath(path)
        prefixes = [normal[:i] for i in range(1, len(normal) + 1) if normal[i:i + 1] in ("/", "")]
        # ".." after a symlink is not lexical: such a path always takes realpath.
        links = "true" if ".." in path.split("/") else " || ".join(f"builtin test -L {shlex.quote(p)}" for p in prefixes)
        quoted = shlex.quote(normal)
        result = await self.backend.exec(
            sandbox_id, f"if {links}; then builtin echo link; elif builtin test -d {quoted}; then builtin echo dir; "
                        f"elif builtin test -f {quoted}; then builtin echo file; elif builtin test -e {quoted}; "
                        "then builtin echo other; else builtin echo none; fi", timeout_s=30)
        kind, real = result.stdout.strip(), normal
        if kind == "link":
            out = await self._sh(sandbox_id, f"r=$(realpath -m -- {quoted}) && printf '%s\\n' \"$r\" && "
                                             f"if [ -d \"$r\" ]; then echo dir; elif [ -f \"$r\" ]; then echo file; "
                                             "elif [ -e \"$r\" ]; then echo other; else echo none; fi")
            real, _, kind = out.strip().rpartition("\n")
        if kind not in ("dir", "file", "other", "none"):
            raise ActionError(f"str_replace_editor: cannot tell what {path} is ({result.stderr.strip()[-200:]})")
        if real != self.workdir and not real.startswith(self.workdir + "/"):
            raise ActionError(f"{path} is outside the repository ({self.workdir}); the editor works inside it "
                              "(use bash for anything else)")
        return kind, real

    async def _read_text(self, sandbox_id: str, path: str, real: str, kind: str) -> str:
        if kind == "none":
            raise ActionError(f"{path} does not exist")
        if kind != "file":
            raise ActionError(f"{path} is not a regular file")
        try:
            data = await self.backend.read_file(sandbox_id, real, max_bytes=MAX_FILE_BYTES)
        except FileTooLargeError:
            raise ActionError(f"{path} is larger than the editor's {MAX_FILE_BYTES // 1024} KiB; use bash") from None
        if b"\0" in data:
            raise ActionError(f"{path} is a binary file; the editor shows and edits text only (use bash)")
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ActionError(f"{path} is not UTF-8 text; the editor shows and edits text only (use bash)") from None

    async def _write(self, sandbox_id: str, real: str, text: str) -> None:
        data = text.encode("utf-8")
        if len(data) > MAX_FILE_BYTES:
            raise ActionError(f"the new content is {len(data)} bytes, more than the editor's {MAX_FILE_BYTES // 1024} KiB")
        await self.backend.write_file(sandbox_id, real, data, mode=0o644)

    async def _list(self, sandbox_id: str, real: str) -> str:
        out = await self._sh(sandbox_id, f"cd {shlex.quote(real)} && find . -maxdepth 2 -not -path '*/.*' | sort")
        entries = [line[2:] for line in out.splitlines() if line not in (".", "")]
        body = "\n".join(entries) if entries else "(empty)"
        return _cut(f"Files and directories in {real}, two levels deep (hidden ones left out):\n{body}")


def _string(arguments: Mapping[str, Any], key: str) -> str:
    value = arguments[key]
    if not isinstance(value, str):
        raise ActionError(f"str_replace_editor: {key} must be a string, got {type(value).__name__}")
    return value


def _positions(text: str, part: str) -> list[int]:
    found, start = [], text.find(part)
    while start != -1:
        found.append(start)
        start = text.find(part, start + 1)
    return found


def _numbered(text: str, view_range: object, path: str) -> str:
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    start, end = 1, len(lines)
    if view_range is not None:
        if (not isinstance(view_range, list) or len(view_range) != 2
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in view_range)):
            raise ActionError(f"view_range must be [start, end], got {view_range!r}")
        start, end = view_range
        end = len(lines) if end == -1 else min(end, len(lines))
        if not 1 <= start <= max(len(lines), 1) or end < start:
            raise ActionError(f"view_range {view_range} is not within the file's {len(lines)} lines "
                              "(1-based; end -1 for the last line)")
    shown = "\n".join(f"{n:6}\t{lines[n - 1]}" for n in range(start, end + 1) if n <= len(lines))
    return _cut(shown if shown else f"({path} is empty)")


def _cut(text: str) -> str:
    if len(text) <= MAX_VIEW_CHARS:
        return text
    return text[:MAX_VIEW_CHARS] + "\n[output truncated: view a smaller range]"


__all__ = ["COMMANDS", "EDITOR_TOOL", "Editor"]

"""Read the tool calls out of a sampled assistant turn.

Two formats:

- ``hermes`` (Qwen, Hermes; the default): any text with zero or more
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks in it.
  ``arguments`` may also be a JSON string holding the object. Text around the
  blocks is the model's own prose and is ignored here.
- ``json``: the whole turn is one JSON object ``{"name": ..., "arguments": {...}}``
  (a Markdown code fence around it is tolerated), or a list of such objects.

A malformed call raises :class:`ToolCallParseError`, whose message is written for the
model: it says what was wrong and shows the expected format, so the runner can
send it back as the observation.
"""

from __future__ import annotations

import json
import re
from typing import Any

from workers.errors import WorkerError

TOOL_CALL_FORMATS = ("hermes", "json")
TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

_HERMES_EXAMPLE = '<tool_call>\n{"name": "<tool-name>", "arguments": {"<arg>": <value>}}\n</tool_call>'
_JSON_EXAMPLE = '{"name": "<tool-name>", "arguments": {"<arg>": <value>}}'
# Whitespace and an optional Markdown fence opener before a block's JSON, and after it.
_OPENING_RE = re.compile(r"\s*(?:```[A-Za-z0-9_-]*[ \t]*\n)?\s*")
_CLOSING_RE = re.compile(r"\s*(?:```)?\s*")
_FENCE_RE = re.compile(r"\A```[A-Za-z0-9_-]*[ \t]*\n?(.*?)\n?```\Z", re.DOTALL)
# Longest piece of the offending text quoted back to the model.
_QUOTE_CHARS = 120


class ToolCallParseError(WorkerError):
    """A sampled turn holds a malformed tool call; the message is meant for the model."""


def _quote(text: str) -> str:
    text = text.strip()
    return repr(text if len(text) <= _QUOTE_CHARS else text[:_QUOTE_CHARS] + "...")


def _strip_fence(text: str) -> str:
    match = _FENCE_RE.match(text.strip())
    return match.group(1).strip() if match else text.strip()


def _call_from_object(obj: Any, *, where: str, example: str) -> dict[str, Any]:
    """Validate one decoded call and return it as ``{"name", "arguments"}``."""
    if not isinstance(obj, dict):
        raise ToolCallParseError(
            f"{where} must be a JSON object with \"name\" and \"arguments\", not a JSON "
            f"{type(obj).__name__}. Expected format: {example}"
        )
    if "function" in obj and isinstance(obj["function"], dict) and "name" not in obj:
        obj = obj["function"]  # the OpenAI {"type": "function", "function": {...}} shape
    name = obj.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ToolCallParseError(f'{where} has no "name" string naming the tool. Expected format: {example}')
    unknown = sorted(set(obj) - {"name", "arguments", "parameters", "type", "id"})
    if unknown:
        raise ToolCallParseError(
            f'{where} has unexpected keys {", ".join(map(repr, unknown))}; put the tool\'s inputs inside '
            f'"arguments". Expected format: {example}'
        )
    arguments = obj.get("arguments", obj.get("parameters"))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as exc:
            raise ToolCallParseError(
                f'{where} (tool {name.strip()!r}) has "arguments" as a string that is not valid JSON '
                f"({exc.msg} at position {exc.pos}). Give the arguments as a JSON object. Expected format: {example}"
            ) from None
    if not isinstance(arguments, dict):
        raise ToolCallParseError(
            f'{where} (tool {name.strip()!r}) has "arguments" that is a JSON {type(arguments).__name__}, not an '
            f"object. Expected format: {example}"
        )
    return {"name": name.strip(), "arguments": arguments}


def _decode(body: str, *, where: str, example: str) -> Any:
    body = _strip_fence(body)
    if not body:
        raise ToolCallParseError(f"{where} is empty. Expected format: {example}")
    try:
        return json.loads(body)
    except json.JSONDecodeError as exc:
        raise ToolCallParseError(
            f"{where} is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): {_quote(body)}. "
            f"Expected format: {example}"
        ) from None


def _parse_hermes(text: str) -> list[dict[str, Any]]:
    calls: list[dict[str, Any]] = []
    decoder = json.JSONDecoder()
    pos = 0
    while True:
        start = text.find(TOOL_CALL_OPEN, pos)
        stray = text.find(TOOL_CALL_CLOSE, pos)
        if stray != -1 and (start == -1 or stray < start):
            raise ToolCallParseError(
                f"found {TOOL_CALL_CLOSE} without a matching {TOOL_CALL_OPEN} before it. "
                f"Write each tool call as: {_HERMES_EXAMPLE}"
            )
        if start == -1:
            return calls
        where = f"tool call {len(calls) + 1}"
        body_start = start + len(TOOL_CALL_OPEN)
        # Decode the JSON value itself rather than cutting at the next </tool_call>: an
        # argument may well contain that text (a command that writes a parser, say).
        try:
            obj, after = decoder.raw_decode(text, _OPENING_RE.match(text, body_start).end())
        except json.JSONDecodeError:
            _raise_for_body(text, body_start, where)
        tail = _CLOSING_RE.match(text, after).end()
        if text.startswith(TOOL_CALL_CLOSE, tail):
            calls.append(_call_from_object(obj, where=where, example=_HERMES_EXAMPLE))
            pos = tail + len(TOOL_CALL_CLOSE)
            continue
        if tail == len(text):
            # A turn cut off (or ended) right after a complete JSON object is still a clear call.
            calls.append(_call_from_object(obj, where=where, example=_HERMES_EXAMPLE))
            return calls
        if text.startswith(TOOL_CALL_OPEN, tail):
            raise ToolCallParseError(
                f"{where} is not closed with {TOOL_CALL_CLOSE} before the next {TOOL_CALL_OPEN}. "
                f"Write each tool call as: {_HERMES_EXAMPLE}"
            )
        raise ToolCallParseError(
            f"{where} has text after its JSON object and before {TOOL_CALL_CLOSE}: {_quote(text[tail:tail + 60])}. "
            f"Put exactly one JSON object in each block: {_HERMES_EXAMPLE}"
        )


def _raise_for_body(text: str, body_start: int, where: str) -> None:
    """Raise the most helpful error for a tool-call block whose JSON does not decode."""
    end = text.find(TOOL_CALL_CLOSE, body_start)
    nested = text.find(TOOL_CALL_OPEN, body_start)
    if nested != -1 and (end == -1 or nested < end):
        raise ToolCallParseError(
            f"{where} is not closed with {TOOL_CALL_CLOSE} before the next {TOOL_CALL_OPEN}. "
            f"Write each tool call as: {_HERMES_EXAMPLE}"
        )
    if end == -1:
        raise ToolCallParseError(
            f"{where} is not closed with {TOOL_CALL_CLOSE} and its JSON is incomplete: {_quote(text[body_start:])}. "
            f"Write each tool call as: {_HERMES_EXAMPLE}"
        )
    _decode(text[body_start:end], where=where, example=_HERMES_EXAMPLE)
    # The block decodes on its own but not in place: something odd around the JSON.
    raise ToolCallParseError(f"{where} is malformed. Write each tool call as: {_HERMES_EXAMPLE}")


def _parse_json(text: str) -> list[dict[str, Any]]:
    body = _strip_fence(text)
    if not body:
        raise ToolCallParseError(f"the reply is empty; reply with one tool call as a JSON object: {_JSON_EXAMPLE}")
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as exc:
        # Tolerate prose before or after one JSON value, as long as one decodes cleanly.
        brace = min((i for i in (body.find("{"), body.find("[")) if i != -1), default=-1)
        if brace == -1:
            raise ToolCallParseError(
                f"the reply holds no JSON object: {_quote(body)}. Reply with one tool call as a JSON object: "
                f"{_JSON_EXAMPLE}"
            ) from None
        try:
            obj, _ = json.JSONDecoder().raw_decode(body, brace)
        except json.JSONDecodeError:
            raise ToolCallParseError(
                f"the reply is not valid JSON ({exc.msg} at line {exc.lineno} column {exc.colno}): {_quote(body)}. "
                f"Reply with one tool call as a JSON object: {_JSON_EXAMPLE}"
            ) from None
    items = obj if isinstance(obj, list) else [obj]
    if not items:
        raise ToolCallParseError(f"the reply is an empty JSON list. Reply with one tool call as: {_JSON_EXAMPLE}")
    where = "the tool call" if len(items) == 1 else "tool call {}"
    return [
        _call_from_object(item, where=where.format(i + 1), example=_JSON_EXAMPLE) for i, item in enumerate(items)
    ]


def parse_tool_calls(text: str, fmt: str = "hermes") -> list[dict[str, Any]]:
    """Return the tool calls in ``text`` as ``[{"name", "arguments"}]`` (empty if a hermes turn has none).

    Raises:
        ToolCallParseError: a call is malformed; the message tells the model what to fix.
        ValueError: ``fmt`` is not one of :data:`TOOL_CALL_FORMATS`.
    """
    if fmt == "hermes":
        return _parse_hermes(text)
    if fmt == "json":
        return _parse_json(text)
    raise ValueError(f"unknown tool_call_format {fmt!r}; expected one of {', '.join(TOOL_CALL_FORMATS)}")


def format_tool_call(name: str, arguments: dict[str, Any], fmt: str = "hermes") -> str:
    """Render one tool call the way a model writes it in ``fmt`` (what :func:`parse_tool_calls` reads)."""
    call = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
    if fmt == "hermes":
        return f"{TOOL_CALL_OPEN}\n{call}\n{TOOL_CALL_CLOSE}"
    if fmt == "json":
        return call
    raise ValueError(f"unknown tool_call_format {fmt!r}; expected one of {', '.join(TOOL_CALL_FORMATS)}")


__all__ = ["TOOL_CALL_FORMATS", "ToolCallParseError", "format_tool_call", "parse_tool_calls"]

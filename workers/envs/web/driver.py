"""The browser driver that runs inside a web sandbox: Playwright driving Debian's Chromium.

This file is copied into the sandbox and run there with the image's ``python3`` (it
imports nothing of Forkyard). It starts one headless Chromium, serves the task's
static site (if it has one) on 127.0.0.1, and answers requests from the environment
on the host over a loopback TCP port, one JSON line in and one JSON line out per
connection (the host side is a bash ``/dev/tcp`` client run with the backend's exec, so
a step costs one exec and no new interpreter). Each request carries a token the host
made: page scripts of the site, which share the loopback, cannot drive the browser.

Operations: ``start`` (open the start page, run the task's ``setup_js``), ``act``
(one BrowserGym-style action, then the observation and the task's reward/done
expressions), ``observe``, ``screenshot``, ``state`` (what a fork restores from) and
``restore`` (load that state and replay the actions since the last page load).

The task's ``reward_js``/``done_js`` are read where no page script reaches. The globals they
read (``window.X``, ``window['X']``, bare names that no blank page's window answers, and
MiniWoB's ``WOB_*`` always: :func:`reward_globals`) are guarded in every document by a context
init script that runs before the page's own (:data:`_CAPTURE_JS`): each is a non-configurable
accessor whose value lives in the script's closure, so the page's ``var X = 1``, ``X = 1`` and
``window.X = 1`` still store it but nothing can redefine, delete or shadow it. The values are
read through CDP without running code a page script wrote or can reach, then the expressions
run in an isolated world (``Page.createIsolatedWorld``: the page's DOM and storage, pristine
builtins) with those values bound to the bare names and to a proxied ``window``. So a reward
input must be plain data the page stored (a number, string, boolean, array or plain object):
a page function, a getter, a node, or a guarded name the page declares with a top-level
``function``/``let``/``const``/``class`` (a SyntaxError once guarded) is a verifier error,
as is a name the expression computes at run time (``window[k]``), which resolves in the
isolated world, where the page's globals are not.

Documents of a static site (``site/`` served here) come with a Content-Security-Policy
(:func:`document_csp`): the site's own script files, and the inline ``<script>`` blocks, event
handler attributes and ``javascript:`` URLs the document ships, by hash; nothing else inline
(markup a page builds from an agent's text cannot run script), no ``eval``, no plugins, no
``<base>`` the document does not ship. The driver's own scripts (setup_js, the guards, the
bids, the verdict) go through CDP, which the policy does not govern. An app a task serves
itself (``[site] serve``) writes its own HTML, agent-stored text included: it gets no policy,
and this protection does not apply to it.

The observation's accessibility tree is Chromium's own (CDP ``Accessibility.getFullAXTree``);
every element of the page's body carries a ``bid`` attribute the driver sets in DOM order
and keeps across observations, and the tree's lines show it as ``[bid]`` (BrowserGym's
convention). The pure functions here (tree formatting, URL checks) are unit-tested on
the host; only :func:`main` needs Playwright.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import functools
import hashlib
import html.parser
import http.server
import json
import re
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from collections.abc import Container, Iterable, Mapping
from typing import Any

#: Debian's chromium-headless-shell (the old headless mode, as Playwright's own headless build): no
#: compositor pacing input events and frames to a display, so actions wait fewer frames.
CHROMIUM = "/usr/lib/chromium/chromium-headless-shell"
#: Seconds a connection may take to send its request line.
_REQUEST_READ_TIMEOUT_S = 10.0
#: The element attribute holding each element's id (BrowserGym's name).
BID_ATTRIBUTE = "bid"
# Sets a bid on each body element that has none (DOM order, continuing the page's counter).
_MARK_BIDS_JS = """() => {
  if (!document.body) return document.title;
  let next = window.__forkyard_next_bid || 0;
  const mark = (el) => { if (!el.hasAttribute('bid')) el.setAttribute('bid', String(next++)); };
  mark(document.body);
  for (const el of document.body.querySelectorAll('*')) mark(el);
  window.__forkyard_next_bid = next;
  return document.title;
}"""
# Guards the page's reward inputs, before any page script of a document runs: each becomes a
# non-configurable accessor on window whose value lives in this closure. The page's own
# `var X = ...`, `X = ...` and `window.X = ...` go through the setter; redefining, deleting or
# shadowing X no longer can. The reader is how the harness reads the values: a non-writable,
# non-configurable function that uses operators and literals only, so no builtin a page script
# replaces later runs in it. Without `raw` it gives the plain values (primitives JSON carries)
# and the kind of the others; with `raw`, all of them (for a copy through CDP's descriptors).
_CAPTURE_JS = """((names, reader) => {
  const define = Object.defineProperty;
  const values = {__proto__: null};
  for (let i = 0; i < names.length; i++) {
    const name = names[i];
    try {
      define(window, name, {get() { return values[name]; }, set(v) { values[name] = v; }, enumerable: true,
                            configurable: false});
    } catch (e) {}
  }
  const read = (raw) => {
    const plain = {__proto__: null}, exotic = {__proto__: null};
    for (let i = 0; i < names.length; i++) {
      const name = names[i], v = values[name], kind = typeof v;
      const json = kind === "string" || kind === "boolean" || kind === "undefined" || v === null
        || (kind === "number" && v === v && v !== 1 / 0 && v !== -1 / 0 && (v !== 0 || 1 / v > 0));
      if (raw || json) plain[name] = v; else exotic[name] = kind;
    }
    return raw ? plain : {__proto__: null, plain, exotic};
  };
  try { define(window, reader, {value: read, writable: false, enumerable: false, configurable: false}); } catch (e) {}
})(%s, %s);"""
#: The window property of the reader of the guarded values (:data:`_CAPTURE_JS`).
INPUTS_READER = "__forkyard_reward_inputs"
# The world the task's expressions run in: Chromium's isolated world, with pristine builtins and
# the page's DOM and storage; its `window` answers the captured names with their values.
_VERDICT_WORLD = "forkyard-verdict"
_VERDICT_JS = """function (%(params)s) {
  const values = {__proto__: null, %(values)s};
  const own = window;
  const proxy = new Proxy(own, {
    get(target, key) {
      if (key in values) return values[key];
      const value = Reflect.get(target, key);
      // The window's own methods want the window, not the proxy, as `this`.
      return typeof value === "function" && Object.prototype.hasOwnProperty.call(target, key)
        && !/^[A-Z]/.test(String(key)) ? value.bind(target) : value;
    },
    has(target, key) { return key in values || key in target; },
  });
  const out = {};
  // What CDP can return by value: JSON's forms, a non-finite number or a bigint as its text.
  const keep = (key, value) => {
    if (typeof value === "number" && !Number.isFinite(value) || typeof value === "bigint") value = String(value);
    else if (typeof value === "object" && value !== null) {
      try { value = JSON.parse(JSON.stringify(value)); } catch (e) { value = String(value); }
    }
    out[key] = value === undefined ? null : value;
  };
  ((window, self, globalThis%(names)s) => {
%(checks)s
  })(proxy, proxy, proxy%(args)s);
  return out;
}"""
_CHECK_JS = """    try { keep(%s, (%s)); } catch (e) { keep(%s, String(e && e.name ? e.name + ': ' + e.message : e)); }"""
# Math.random seeded per page load (mulberry32), so a page that randomizes itself is replayable.
_SEED_JS = """(() => {
  let s = %d >>> 0;
  Math.random = function () {
    s = (s + 0x6D2B79F5) >>> 0;
    let t = s;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
})();"""
# The names a blank page's window and its prototypes answer.
_BUILTINS_JS = """() => {
  const names = new Set();
  for (let o = window; o; o = Object.getPrototypeOf(o)) for (const n of Object.getOwnPropertyNames(o)) names.add(n);
  return [...names];
}"""
# The page's origin and session storage (run in the verdict world).
_SESSION_STORAGE_READ_JS = """function () {
  return [location.origin, Object.fromEntries(Object.entries(sessionStorage))];
}"""
# How V8 refuses a top-level declaration of a name that already is a non-configurable global.
_REDECLARED = re.compile(r"Identifier '([^']+)' has already been declared")
#: Plain objects a verdict copies out of the page's reward inputs, at most, and how deep.
_MAX_INPUT_OBJECTS = 1000
_MAX_INPUT_DEPTH = 16
# Restores sessionStorage before a page's own scripts run (storage_state does not carry it).
_SESSION_STORAGE_JS = """((origin, items) => {
  if (window.location.origin !== origin || window.__forkyard_session_restored) return;
  window.__forkyard_session_restored = true;
  for (const [k, v] of Object.entries(items)) window.sessionStorage.setItem(k, v);
})(%s, %s);"""

# Roles whose nodes are structure only: without a name or a state they are skipped and
# their children shown one level up.
_STRUCTURAL_ROLES = frozenset({"generic", "none", "presentation", "LineBreak", "InlineTextBox", "paragraph",
                               "group", "Section", "div", "ListMarker"})
# AX properties shown on a line, and how.
_SHOWN_PROPERTIES = ("focused", "checked", "selected", "expanded", "pressed", "disabled", "required",
                     "readonly", "invalid", "multiselectable", "level", "valuemin", "valuemax")
# Max characters of one name or value on a tree line.
_MAX_TEXT = 200


# --------------------------------------------------------------------------- pure helpers


def _value(field: Any) -> Any:
    return field.get("value") if isinstance(field, Mapping) else None


def _quote(text: str) -> str:
    text = " ".join(text.split())
    if len(text) > _MAX_TEXT:
        text = text[: _MAX_TEXT - 1] + "…"
    return json.dumps(text, ensure_ascii=False)


def bids_by_backend_id(snapshot: Mapping[str, Any]) -> dict[int, str]:
    """Return {backend DOM node id: bid} of a CDP ``DOMSnapshot.captureSnapshot`` result (main document)."""
    strings = snapshot.get("strings") or []
    documents = snapshot.get("documents") or []
    found: dict[int, str] = {}
    if not documents:
        return found
    nodes = documents[0].get("nodes") or {}
    for backend_id, attributes in zip(nodes.get("backendNodeId") or [], nodes.get("attributes") or [], strict=False):
        for i in range(0, len(attributes) - 1, 2):
            if strings[attributes[i]] == BID_ATTRIBUTE:
                found[backend_id] = strings[attributes[i + 1]]
                break
    return found


def _properties(node: Mapping[str, Any]) -> list[str]:
    shown = []
    props = {p.get("name"): _value(p.get("value")) for p in node.get("properties") or [] if isinstance(p, Mapping)}
    for name in _SHOWN_PROPERTIES:
        value = props.get(name)
        if value in (None, False, "false", ""):
            continue
        if name == "focused" or value is True or value == "true":
            shown.append(name)
        else:
            shown.append(f"{name}={json.dumps(value) if isinstance(value, str) else value}")
    return shown


def format_ax_tree(nodes: Iterable[Mapping[str, Any]], bids: Mapping[int, str]) -> list[str]:
    """Return the text lines of a CDP full accessibility tree, one node per line, tab-indented.

    A line is ``[bid] role "name"`` followed by ``value=...`` and states (``focused``,
    ``checked``, ``disabled``...), comma-separated; nodes with no DOM element (text runs)
    have no ``[bid]``. Ignored nodes, unnamed structural ones and text that repeats its
    parent's name are left out, their children shown one level up.
    """
    by_id = {n["nodeId"]: n for n in nodes if "nodeId" in n}
    children_of = {nid: [c for c in n.get("childIds") or [] if c in by_id] for nid, n in by_id.items()}
    has_parent = {c for kids in children_of.values() for c in kids}
    roots = [nid for nid in by_id if nid not in has_parent]
    lines: list[str] = []

    def visit(nid: str, depth: int, parent_name: str) -> None:
        node = by_id[nid]
        role = str(_value(node.get("role")) or "")
        name = str(_value(node.get("name")) or "").strip()
        value = _value(node.get("value"))
        props = _properties(node)
        shown = not node.get("ignored")
        if role in _STRUCTURAL_ROLES and not name and not props:
            shown = False
        if role in ("StaticText", "InlineTextBox") and (not name or name in parent_name):
            shown = False
        if role == "RootWebArea" and depth == 0 and not name:
            shown = False
        child_depth = depth
        if shown:
            bid = bids.get(node.get("backendDOMNodeId", -1))
            parts = [f"[{bid}] {role}" if bid is not None else role]
            if name:
                parts[0] += " " + _quote(name)
            if value not in (None, "") and role not in ("StaticText",):
                props.insert(0, f"value={_quote(str(value))}")
            lines.append("\t" * depth + ", ".join(parts + props))
            child_depth = depth + 1
        # A text field's text shows again as a StaticText child: its value covers it.
        context = f"{name} {value}" if value not in (None, "") else (name or parent_name)
        for child in children_of.get(nid, []):
            visit(child, child_depth, context)

    for root in roots:
        visit(root, 0, "")
    return lines


def truncate_lines(lines: list[str], max_chars: int) -> tuple[str, bool]:
    """Return the lines joined, cut at a line boundary to ``max_chars`` with a visible note; and whether cut."""
    out: list[str] = []
    used = 0
    for i, line in enumerate(lines):
        if used + len(line) + 1 > max_chars:
            out.append(f"[... {len(lines) - i} more line(s) of the tree not shown: over the observation budget]")
            return "\n".join(out), True
        out.append(line)
        used += len(line) + 1
    return "\n".join(out), False


def same_site(url: str, origin: str) -> bool:
    """Tell whether ``url`` is an http(s) URL on ``origin`` (scheme, host and port equal)."""
    try:
        parts = urllib.parse.urlsplit(url)
        want = urllib.parse.urlsplit(origin)
        return (parts.scheme in ("http", "https") and parts.scheme == want.scheme
                and parts.hostname == want.hostname and (parts.port or 80) == (want.port or 80))
    except ValueError:
        return False


# --------------------------------------------------------------------------- reward inputs

#: MiniWoB's globals, always guarded (its core.js declares them with ``var``; some ports assign them).
WOB_GLOBALS = ("WOB_REWARD_GLOBAL", "WOB_RAW_REWARD_GLOBAL", "WOB_REWARD_REASON", "WOB_DONE_GLOBAL",
               "WOB_EPISODE_ID", "WOB_TASK_READY")
# Reserved words (and `arguments`): never a page's global, never a parameter's name.
_JS_RESERVED = frozenset((
    "await break case catch class const continue debugger default delete do else enum export extends false "
    "finally for function if implements import in instanceof interface let new null package private protected "
    "public return static super switch this throw true try typeof var void while with yield arguments").split())
# The names an expression reads the window itself by.
_WINDOW_NAMES = frozenset({"window", "self", "globalThis"})
# After these a `/` starts a regular expression, not a division.
_BEFORE_REGEX = frozenset("( , = : [ ! & | ? { } ; + - * % < > ~ ^ => && || ?? ?.".split())
_WORDS_BEFORE_REGEX = frozenset({"return", "typeof", "instanceof", "in", "of", "new", "delete", "void", "throw",
                                 "case", "do", "else"})
# In a parameter list, a name after these is a binding (a destructured key counts too).
_BINDING_AFTER = frozenset({"(", ",", "{", "[", "...", ":"})
_IDENTIFIER = re.compile(r"(?:[^\W\d]|\$)[\w$]*")
_NUMBER = re.compile(r"\.?\d[\w.]*")
_PUNCTUATORS = ("...", "?.", "=>", "&&", "||", "??")


def js_tokens(source: str) -> list[tuple[str, str]]:
    """Return a JS expression's tokens as (kind, text), kind one of name, string, number, regex, punct.

    A scanner, not a parser: comments are dropped, a string token's text is its value,
    a template's text is dropped and its ``${...}`` parts scanned as code.
    """
    tokens: list[tuple[str, str]] = []
    _scan(source, 0, tokens, in_template=False)
    return tokens


def _regex_may_start(tokens: list[tuple[str, str]]) -> bool:
    if not tokens:
        return True
    kind, text = tokens[-1]
    return (kind == "punct" and text in _BEFORE_REGEX) or (kind == "name" and text in _WORDS_BEFORE_REGEX)


def _scan(src: str, i: int, tokens: list[tuple[str, str]], *, in_template: bool) -> int:
    """Scan ``src`` from ``i`` into ``tokens``; in a template's ``${``, stop after its ``}``; return where it stopped."""
    depth, n = 0, len(src)
    while i < n:
        c = src[i]
        if c.isspace():
            i += 1
        elif src.startswith("//", i):
            end = src.find("\n", i)
            i = n if end < 0 else end
        elif src.startswith("/*", i):
            end = src.find("*/", i + 2)
            i = n if end < 0 else end + 2
        elif c in "'\"":
            j, value = i + 1, []
            while j < n and src[j] != c:
                value.append(src[j + 1] if src[j] == "\\" and j + 1 < n else src[j])
                j += 2 if src[j] == "\\" else 1
            tokens.append(("string", "".join(value)))
            i = j + 1
        elif c == "`":
            i += 1
            while i < n and src[i] != "`":
                if src.startswith("${", i):
                    i = _scan(src, i + 2, tokens, in_template=True)
                else:
                    i += 2 if src[i] == "\\" else 1
            tokens.append(("string", ""))
            i += 1
        elif c == "/" and _regex_may_start(tokens):
            i, in_class = i + 1, False
            while i < n and src[i] != "\n" and (src[i] != "/" or in_class):
                in_class = (in_class or src[i] == "[") and src[i] != "]"
                i += 2 if src[i] == "\\" else 1
            i += 1
            while i < n and (src[i].isalnum() or src[i] == "_"):
                i += 1
            tokens.append(("regex", ""))
        elif (number := _NUMBER.match(src, i)) is not None:
            tokens.append(("number", number.group()))
            i = number.end()
        elif (name := _IDENTIFIER.match(src, i)) is not None:
            tokens.append(("name", name.group()))
            i = name.end()
        else:
            punct = next((p for p in _PUNCTUATORS if src.startswith(p, i)), c)
            if in_template and punct == "{":
                depth += 1
            elif in_template and punct == "}":
                if depth == 0:
                    return i + 1
                depth -= 1
            tokens.append(("punct", punct))
            i += len(punct)
    return i


def _local_names(tokens: list[tuple[str, str]]) -> set[str]:
    """Return the names an expression binds itself: declarations, parameters, catch bindings."""
    local: set[str] = set()
    for i, (kind, text) in enumerate(tokens):
        after = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "name" and text in ("var", "let", "const", "function") and after[0] == "name":
            local.add(after[1])
        if kind == "name" and text in ("function", "catch"):
            opening = i + 1 + (after[0] == "name")
            close = _closing(tokens, opening) if tokens[opening:opening + 1] == [("punct", "(")] else None
            if close is not None:
                local |= _group_names(tokens, close)
        elif (kind, text) == ("punct", "=>") and i > 0:
            if tokens[i - 1][0] == "name":
                local.add(tokens[i - 1][1])
            elif tokens[i - 1] == ("punct", ")"):
                local |= _group_names(tokens, i - 1)
    return local


def _closing(tokens: list[tuple[str, str]], start: int) -> int | None:
    depth = 0
    for j in range(start, len(tokens)):
        if tokens[j][0] == "punct" and tokens[j][1] in "([{":
            depth += 1
        elif tokens[j][0] == "punct" and tokens[j][1] in ")]}":
            depth -= 1
            if depth == 0:
                return j
    return None


def _group_names(tokens: list[tuple[str, str]], close: int) -> set[str]:
    """Return the names a parameter list binds (the group that ends at ``close``), default values left out."""
    depth, names = 0, set()
    for j in range(close, -1, -1):
        kind, text = tokens[j]
        if kind == "punct" and text in ")]}":
            depth += 1
        elif kind == "punct" and text in "([{":
            depth -= 1
            if depth == 0:
                break
        elif kind == "name" and j > 0 and tokens[j - 1][0] == "punct" and tokens[j - 1][1] in _BINDING_AFTER:
            names.add(text)
    return names


def expression_globals(expression: str) -> list[str]:
    """Return the global names a JS expression may read, in order: ``window.X``, ``window['X']`` and bare names.

    Over-approximates (an object literal's keys count) and leaves nothing out that it can see;
    a name computed at run time (``window[k]``) it cannot see.
    """
    tokens = js_tokens(expression)
    local = _local_names(tokens)
    found: dict[str, None] = {}
    for i, (kind, text) in enumerate(tokens):
        before = tokens[i - 1] if i > 0 else ("", "")
        owner = tokens[i - 2] if i > 1 else ("", "")
        owner_is_window = (owner[0] == "name" and owner[1] in _WINDOW_NAMES
                           and not (i > 2 and tokens[i - 3] in (("punct", "."), ("punct", "?."))))
        if kind == "name" and before in (("punct", "."), ("punct", "?.")):
            if owner_is_window:
                found[text] = None
        elif kind == "name":
            if text not in _JS_RESERVED and text not in _WINDOW_NAMES and text not in local:
                found[text] = None
        elif (kind == "string" and before == ("punct", "[") and owner_is_window
              and i + 1 < len(tokens) and tokens[i + 1] == ("punct", "]")):
            found[text] = None
    return list(found)


def reward_globals(expressions: Iterable[str], builtins: Container[str] = ()) -> tuple[str, ...]:
    """Return the page globals to guard for ``expressions``: MiniWoB's, then those they read that are no builtin."""
    found = dict.fromkeys(WOB_GLOBALS)
    for expression in expressions:
        found.update((name, None) for name in expression_globals(expression)
                     if name not in builtins and not name.startswith("__forkyard"))
    return tuple(found)


def verdict_function(expressions: Mapping[str, str], names: Iterable[str]) -> str:
    """Return the function that evaluates ``expressions`` in the verdict world, taking ``names``' values in order.

    Each name is answered by the proxied ``window``; those that are identifiers are
    parameters too, so a bare reference reads the same value. The function returns
    ``{key: value}``, or ``{key + "_error": message}`` for an expression that threw.
    """
    names = list(names)
    params = ", ".join(f"__forkyard_{i}" for i in range(len(names)))
    values = ", ".join(f"{json.dumps(name)}: __forkyard_{i}" for i, name in enumerate(names))
    bare = [(i, n) for i, n in enumerate(names)
            if _IDENTIFIER.fullmatch(n) and n not in _JS_RESERVED and n not in _WINDOW_NAMES]
    checks = "\n".join(_CHECK_JS % (json.dumps(k), e, json.dumps(k + "_error")) for k, e in expressions.items())
    return _VERDICT_JS % {"params": params, "values": values, "checks": checks,
                          "names": "".join(f", {n}" for _, n in bare),
                          "args": "".join(f", __forkyard_{i}" for i, _ in bare)}


# --------------------------------------------------------------------------- the static site's policy

# Scripts a document may run: same-origin files and the inline code it ships, by hash.
_CSP = "script-src 'self' 'unsafe-hashes'{hashes}; object-src 'none'; base-uri {base}"
# URL attributes that may hold a javascript: URL.
_URL_ATTRIBUTES = frozenset({"href", "src", "action", "formaction", "xlink:href", "data"})
_URL_STRIP = "".join(chr(c) for c in range(0x21))
_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([\w.:-]+)""", re.IGNORECASE)


class _InlineCode(html.parser.HTMLParser):
    """Collect a document's inline script sources: <script> text, on* attributes, javascript: URLs, srcdoc's too."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.sources: list[str] = []
        self.has_base = False
        self._script: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._attributes(tag, attrs)
        if tag == "script":
            self._script = []

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self._attributes(tag, attrs)

    def handle_data(self, data: str) -> None:
        if self._script is not None:
            self._script.append(data)

    def handle_endtag(self, tag: str) -> None:
        if tag == "script" and self._script is not None:
            self.sources.append("".join(self._script))
            self._script = None

    def close(self) -> None:
        super().close()
        if self._script is not None:  # a script left open runs to the end of the document
            self._script.append(self.rawdata)
            self.handle_endtag("script")

    def _attributes(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.has_base = self.has_base or tag == "base"
        for name, value in attrs:
            if value is None:
                continue
            if name.startswith("on"):
                self.sources.append(value)
            elif name == "srcdoc":  # an srcdoc frame runs under its parent's policy
                inner = _inline_code(value)
                self.sources += inner.sources
                self.has_base = self.has_base or inner.has_base
            elif name in _URL_ATTRIBUTES:
                self.sources += _javascript_url_forms(value)


def _inline_code(text: str) -> _InlineCode:
    parser = _InlineCode()
    # The HTML input stream normalizes newlines before tokenizing: hashes see \n only.
    parser.feed(text.replace("\r\n", "\n").replace("\r", "\n"))
    parser.close()
    return parser


def _javascript_url_forms(value: str) -> list[str]:
    """Return the forms a javascript: URL may be hashed in (Chromium hashes the whole URL), or []."""
    url = value.strip(_URL_STRIP).replace("\t", "").replace("\n", "")
    if not url.lower().startswith("javascript:"):
        return []
    url = "javascript:" + url[len("javascript:"):]
    return sorted({url, urllib.parse.quote(url, safe="".join(chr(c) for c in range(0x20, 0x7F)))})


def document_charsets(body: bytes, content_type: str) -> list[str]:
    """Return the charset(s) a browser may decode an HTML document with: the declared one, else UTF-8 and windows-1252."""
    declared = re.search(r"charset\s*=\s*[\"']?([\w.:-]+)", content_type, re.IGNORECASE)
    sniffed = _CHARSET.search(body[:1024])
    for found in (declared.group(1) if declared else None, sniffed.group(1).decode() if sniffed else None):
        if found:
            return [found]
    if body.startswith(b"\xef\xbb\xbf"):
        return ["utf-8-sig"]
    return ["utf-8", "cp1252"]


def document_csp(body: bytes, content_type: str = "text/html") -> str:
    """Return the Content-Security-Policy for a static HTML document: its own inline code runs, nothing else inline.

    Inline ``<script>`` blocks, ``on*`` handler attributes and ``javascript:`` URLs as shipped
    are allowed by their SHA-256 (``'unsafe-hashes'`` covers handlers and URLs); scripts
    from the site's own origin load; markup a page inserts later with other code does not run.
    """
    sources: set[str] = set()
    has_base = False
    for charset in document_charsets(body, content_type):
        try:
            text = body.decode(charset)
        except (LookupError, UnicodeDecodeError):
            continue
        found = _inline_code(text)
        sources.update(found.sources)
        has_base = has_base or found.has_base
    hashes = sorted({base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() for s in sources})
    return _CSP.format(hashes="".join(f" 'sha256-{h}'" for h in hashes), base="'self'" if has_base else "'none'")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    message = text[0] if text else ""
    return f"{type(exc).__name__}: {message}"[:500]


# --------------------------------------------------------------------------- the driver


class BrowserGone(Exception):
    """Chromium crashed, was killed or disconnected: the episode cannot go on."""


class Driver:
    """One Chromium with one context; the active page is the most recently opened tab."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self.config = config
        self.origin = ""
        self.seed = 0
        self.timeout_ms = 5000
        self.max_tree_chars = 16000
        self.site: http.server.ThreadingHTTPServer | None = None
        self.playwright: Any = None
        self.browser: Any = None
        self.context: Any = None
        self.page: Any = None
        self.crashed: str | None = None
        self.loads = 0
        self.log: list[dict[str, Any]] = []
        """Actions since the active page's document last loaded (what a fork replays)."""
        self.setup_on_load = False
        """setup_js ran on the active page's current document (a restore of it runs it again)."""
        self.builtins: frozenset[str] = frozenset()
        """The names a blank page's window answers (JS and DOM builtins): never a task's reward input."""
        self.guarded: tuple[str, ...] = WOB_GLOBALS
        """The page globals the task's expressions read, guarded in every document (see :data:`_CAPTURE_JS`)."""
        self._cdp: dict[Any, Any] = {}
        self._frames: dict[Any, str] = {}
        """The main frame's id, by page."""
        self._undeclarable: set[str] = set()
        """Guarded names a page script of this context failed to declare (function, let, const, class)."""

    # -- lifecycle

    def configure(self, settings: Mapping[str, Any], checks: Mapping[str, str] | None = None) -> None:
        """Take the task's settings and expressions (a sandbox's driver starts before it knows its task: a warm pool's)."""
        self.guarded = reward_globals((e for e in (checks or {}).values() if e), self.builtins)
        self.origin = str(settings["origin"])
        self.seed = int(settings.get("seed") or 0)
        self.timeout_ms = int(settings.get("action_timeout_ms") or 5000)
        self.max_tree_chars = int(settings.get("max_tree_chars") or 16000)
        if settings.get("site_dir") and self.site is None:
            self.site = serve_site(str(settings["site_dir"]), int(settings["site_port"]))

    def launch(self) -> None:
        from playwright.sync_api import sync_playwright

        self.playwright = sync_playwright().start()
        self.browser = self.playwright.chromium.launch(
            executable_path=self.config.get("chromium") or CHROMIUM,
            args=["--disable-gpu", "--no-first-run", "--disable-extensions", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--metrics-recording-only"],
        )
        self.browser.on("disconnected", lambda _b: self._gone("the browser disconnected"))
        blank = self.browser.new_page()
        try:
            self.builtins = frozenset(blank.evaluate(_BUILTINS_JS))
        finally:
            blank.close()

    def _gone(self, why: str) -> None:
        self.crashed = self.crashed or why

    def new_context(self, storage_state: Mapping[str, Any] | None = None,
                    session_storage: Mapping[str, Mapping[str, str]] | None = None) -> None:
        if self.context is not None:
            self._cdp.clear()
            self._frames.clear()
            self._undeclarable.clear()
            with contextlib.suppress(Exception):
                self.context.close()
        viewport = self.config.get("viewport") or {"width": 1024, "height": 768}
        self.context = self.browser.new_context(viewport=viewport, storage_state=storage_state or None,
                                                service_workers="block")
        self.context.set_default_timeout(self.timeout_ms)
        self.context.add_init_script(_SEED_JS % self.seed)
        self.context.add_init_script(_CAPTURE_JS % (json.dumps(list(self.guarded)), json.dumps(INPUTS_READER)))
        for origin, items in (session_storage or {}).items():
            self.context.add_init_script(_SESSION_STORAGE_JS % (json.dumps(origin), json.dumps(dict(items))))
        self.context.route("**/*", self._route)
        self.context.on("page", self._adopt)
        self.page = None
        self._adopt(self.context.new_page())

    def _route(self, route: Any) -> None:
        url = route.request.url
        if same_site(url, self.origin) and self.site is not None and route.request.resource_type == "document":
            self._serve_document(route)
        elif same_site(url, self.origin) or url.startswith(("data:", "blob:", "about:")):
            route.continue_()
        else:
            route.abort("blockedbyclient")

    def _serve_document(self, route: Any) -> None:
        """Answer a static site's document with a policy that runs only the inline code it ships (:func:`document_csp`)."""
        try:
            # Redirects go back to the browser as they are: a page's relative URLs resolve against where it lands.
            response = route.fetch(max_redirects=0)
            body = response.body()
        except Exception:
            route.abort("failed")
            return
        content_type = response.headers.get("content-type", "")
        if not content_type.lower().startswith("text/html"):
            route.fulfill(response=response, body=body)
            return
        headers = {**response.headers, "content-security-policy": document_csp(body, content_type)}
        route.fulfill(response=response, body=body, headers=headers)

    def _adopt(self, page: Any) -> None:
        page.on("crash", lambda _p: self._gone("the page crashed"))
        page.on("load", lambda _p: self._loaded(page))
        page.on("close", lambda _p: self._closed(page))
        page.on("pageerror", self._page_error)
        self.page = page

    def _loaded(self, page: Any) -> None:
        if page is self.page:
            self.loads += 1

    def _page_error(self, error: Any) -> None:
        # A guard makes a page's top-level function/let/const/class of the same name a SyntaxError:
        # the task's page cannot work as it is, which its verdict says rather than a silent 0.
        found = _REDECLARED.search(str(getattr(error, "message", "")))
        if getattr(error, "name", "") == "SyntaxError" and found and found.group(1) in self.guarded:
            self._undeclarable.add(found.group(1))

    def _closed(self, page: Any) -> None:
        self._cdp.pop(page, None)
        self._frames.pop(page, None)
        if page is self.page and self.context is not None:
            pages = [p for p in self.context.pages if not p.is_closed()]
            self.page = pages[-1] if pages else None

    def check(self) -> None:
        if self.crashed or self.browser is None or not self.browser.is_connected():
            raise BrowserGone(self.crashed or "the browser is not running")
        if self.page is None:
            self._adopt(self.context.new_page())

    # -- observation

    def observe(self, *, screenshot: bool = False) -> dict[str, Any]:
        self.check()
        page = self.page
        with contextlib.suppress(Exception):
            page.wait_for_load_state("domcontentloaded", timeout=self.timeout_ms)
        title = page.evaluate(_MARK_BIDS_JS)
        cdp = self._session(page)
        try:
            snap = cdp.send("DOMSnapshot.captureSnapshot", {"computedStyles": []})
            tree = cdp.send("Accessibility.getFullAXTree")
        except Exception:
            self._cdp.pop(page, None)  # a session may not outlive a renderer swap: open another next time
            raise
        lines = format_ax_tree(tree.get("nodes") or [], bids_by_backend_id(snap))
        text, cut = truncate_lines(lines, self.max_tree_chars)
        obs: dict[str, Any] = {
            "url": page.url,
            "title": title,
            "tree": text,
            "tree_truncated": cut,
            "tabs": [{"url": p.url, "title": title if p is page else _safe_title(p), "active": p is page}
                     for p in self.context.pages],
        }
        if screenshot:
            obs["screenshot"] = base64.b64encode(page.screenshot(type="png", timeout=self.timeout_ms)).decode()
        return obs

    def _session(self, page: Any) -> Any:
        cdp = self._cdp.get(page)
        if cdp is None:
            cdp = self._cdp[page] = self.context.new_cdp_session(page)
        return cdp

    def evaluate(self, expressions: Mapping[str, str]) -> dict[str, Any]:
        """Return the task's expressions' values, read where the page's scripts cannot reach (:meth:`_verdict`)."""
        checks = {k: e for k, e in expressions.items() if e}
        if not checks:
            return {}
        try:
            return self._verdict(checks)
        except Exception:
            self.check()
            # The document went under the read (a reload, a script's navigation): read the next one.
            self._cdp.pop(self.page, None)
            self._frames.pop(self.page, None)
            with contextlib.suppress(Exception):
                self.page.wait_for_load_state("load", timeout=self.timeout_ms)
        try:
            return self._verdict(checks)
        except Exception as exc:
            self.check()
            return {k + "_error": _first_line(exc) for k in checks}

    def _verdict(self, checks: Mapping[str, str]) -> dict[str, Any]:
        """Evaluate ``checks`` in the verdict world with the guarded globals' values; each failure is its own.

        No page script can change the result: the values are the ones last stored through
        the guards (:meth:`_reward_inputs`), and the expressions run in an isolated world, whose
        builtins no page script reaches, seeing the page's DOM and storage.
        """
        cdp = self._session(self.page)
        reads = {n for e in checks.values() for n in expression_globals(e)}
        inputs, unreadable = self._reward_inputs(cdp, [n for n in self.guarded if n in reads])
        for name in self._undeclarable:
            unreadable[name] = (f"the page declares {name!r} with function, let, const or class at its top level, which "
                                "the harness cannot guard: declare it with var, or assign window." + name)
        names = list(inputs)
        reply = self._in_verdict_world(cdp, verdict_function(checks, names), [inputs[n] for n in names])
        if "exceptionDetails" in reply:  # a syntax error in an expression fails them all
            return {k + "_error": _exception_text(reply["exceptionDetails"]) for k in checks}
        values = dict(reply["result"].get("value") or {})
        for key, expression in checks.items():
            bad = [unreadable[n] for n in expression_globals(expression) if n in unreadable]
            if bad:
                values.pop(key, None)
                values[key + "_error"] = bad[0]
        return values

    def _in_verdict_world(self, cdp: Any, function: str, arguments: list[dict[str, Any]] | None = None) -> Any:
        """Call ``function`` in the verdict world of the page's current document and return CDP's reply."""
        frame = self._frames.get(self.page)
        if frame is None:
            frame = self._frames[self.page] = cdp.send("Page.getFrameTree")["frameTree"]["frame"]["id"]
        # The world of the frame's current document: made on first use, the same context after.
        world = cdp.send("Page.createIsolatedWorld", {"frameId": frame, "worldName": _VERDICT_WORLD})
        return cdp.send("Runtime.callFunctionOn", {"functionDeclaration": function, "arguments": arguments or [],
                                                   "executionContextId": world["executionContextId"],
                                                   "returnByValue": True})

    def _reward_inputs(self, cdp: Any, names: list[str]) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
        """Return the values the page stored in guarded globals ``names``, as CDP call arguments; and why any cannot be read.

        Runs no code a page script wrote or can reach: ``window`` is the global's unforgeable
        own accessor, the reader a non-writable own property the capture script made before
        any page script ran, and it uses no builtin. A value JSON cannot carry (an object,
        NaN) is copied through CDP's property descriptors (:meth:`_copy`), which call no
        getter. A document with no guard (an error page) has only undefined inputs.
        """
        inputs: dict[str, dict[str, Any]] = {n: {} for n in names}
        unreadable: dict[str, str] = {}
        if not names:
            return inputs, unreadable
        reply = cdp.send("Runtime.evaluate", {"expression": f"window.{INPUTS_READER}(false)", "returnByValue": True})
        if "exceptionDetails" in reply:
            return inputs, unreadable
        found = reply["result"].get("value") or {}
        for name, value in (found.get("plain") or {}).items():
            if name in inputs:
                inputs[name] = {"value": value}
        exotic = [n for n in found.get("exotic") or {} if n in inputs]
        if not exotic:
            return inputs, unreadable
        try:
            raw = cdp.send("Runtime.evaluate", {"expression": f"window.{INPUTS_READER}(true)",
                                                "objectGroup": _VERDICT_WORLD})["result"]
            descriptors = cdp.send("Runtime.getProperties", {"objectId": raw["objectId"], "ownProperties": True,
                                                             "objectGroup": _VERDICT_WORLD}).get("result") or []
            for d in descriptors:
                if d.get("name") not in exotic:
                    continue
                value = d.get("value") or {}
                try:
                    inputs[d["name"]] = ({"unserializableValue": value["unserializableValue"]}
                                         if "unserializableValue" in value else
                                         {"value": self._copy(cdp, value, d["name"], [0])})
                except _UnreadableInput as exc:
                    unreadable[d["name"]] = str(exc)
        finally:
            with contextlib.suppress(Exception):
                cdp.send("Runtime.releaseObjectGroup", {"objectGroup": _VERDICT_WORLD})
        return inputs, unreadable

    def _copy(self, cdp: Any, remote: Mapping[str, Any], path: str, count: list[int]) -> Any:
        """Return a page value as plain data: primitives, arrays and objects of own enumerable data properties.

        Raises:
            _UnreadableInput: a function, a getter, a node, a proxy or another exotic value; too deep or too big.
        """
        kind, subtype = remote.get("type"), remote.get("subtype")
        if kind in ("boolean", "number", "string") and "unserializableValue" not in remote:
            return remote.get("value")
        if kind == "object" and subtype == "null":
            return None
        if kind != "object" or subtype not in (None, "array") or "objectId" not in remote:
            raise _UnreadableInput(f"the page's {path} is a {subtype or kind}, which a verdict cannot read without "
                                   "running page code: reward_js and done_js read plain data (numbers, strings, "
                                   "booleans, arrays and plain objects)")
        count[0] += 1
        if count[0] > _MAX_INPUT_OBJECTS or path.count(".") + path.count("[") > _MAX_INPUT_DEPTH:
            raise _UnreadableInput(f"the page's {path.split('.')[0]} is too big or too deep to read")
        found = cdp.send("Runtime.getProperties", {"objectId": remote["objectId"], "ownProperties": True,
                                                   "objectGroup": _VERDICT_WORLD}).get("result") or []
        named = {d["name"]: d for d in found if "symbol" not in d}
        own = {key: d for key, d in named.items() if d.get("enumerable")}
        if subtype == "array":
            length = int(((named.get("length") or {}).get("value") or {}).get("value") or 0)
            items: list[Any] = [None] * min(length, 100_000)
            for key, d in own.items():
                if key.isdigit() and int(key) < len(items):
                    items[int(key)] = self._item(cdp, d, f"{path}[{key}]", count)
            return items
        return {key: self._item(cdp, d, f"{path}.{key}", count) for key, d in own.items()}

    def _item(self, cdp: Any, descriptor: Mapping[str, Any], path: str, count: list[int]) -> Any:
        if "value" not in descriptor:
            raise _UnreadableInput(f"the page's {path} is a getter: reward inputs are read without running page code")
        value = descriptor["value"]
        if value.get("type") == "undefined":
            return None
        special = value.get("unserializableValue")
        if special is not None and value.get("type") == "bigint":
            raise _UnreadableInput(f"the page's {path} is a bigint, which only a top-level reward input can carry")
        if special is not None:  # inside an object, as JSON has it
            return 0 if special == "-0" else None
        return self._copy(cdp, value, path, count)

    # -- actions

    def start(self, url: str, setup_js: str | None) -> None:
        """Open the task's start page in a new context and run ``setup_js`` (in the page's own world: it starts the page)."""
        self.new_context()
        self._goto_site(url)
        self.log = []
        self.setup_on_load = bool(setup_js)
        if setup_js:
            self.page.evaluate(f"(seed) => {{ {setup_js}\n}}", self.seed)

    def _goto_site(self, url: str) -> None:
        target = urllib.parse.urljoin(self.page.url if self.page.url.startswith("http") else self.origin, url)
        if not same_site(target, self.origin):
            raise ValueError(f"goto is refused: {url!r} is outside the task's site {self.origin}")
        self.page.goto(target, wait_until="load")

    def act(self, tool: str, args: Mapping[str, Any]) -> None:
        """Run one action on the active page; its exceptions are the agent's errors."""
        page = self.page
        timeout = self.timeout_ms

        def element(bid: Any) -> Any:
            text = str(bid).strip() if isinstance(bid, (str, int)) and not isinstance(bid, bool) else ""
            if not text.isascii() or not text.replace("-", "").replace("_", "").isalnum():
                raise ValueError(f"bid must be an element id from the tree, got {bid!r}")
            locator = page.locator(f'[{BID_ATTRIBUTE}="{text}"]')
            if locator.count() == 0:
                raise ValueError(f"no element with bid {text!r} on the page")
            return locator.first

        if tool == "click":
            element(args.get("bid")).click(timeout=timeout)
        elif tool == "fill":
            element(args.get("bid")).fill(str(args.get("text", "")), timeout=timeout)
        elif tool == "select_option":
            value = args.get("value")
            options = [str(v) for v in value] if isinstance(value, list) else str(value)
            target = element(args.get("bid"))
            try:
                target.select_option(value=options, timeout=timeout)
            except Exception:
                target.select_option(label=options, timeout=timeout)
        elif tool == "hover":
            element(args.get("bid")).hover(timeout=timeout)
        elif tool == "press":
            element(args.get("bid")).press(str(args.get("key", "")), timeout=timeout)
        elif tool == "scroll":
            page.mouse.wheel(float(args.get("dx", 0) or 0), float(args.get("dy", 0) or 0))
        elif tool == "goto":
            self._goto_site(str(args.get("url", "")))
        elif tool == "go_back":
            page.go_back(wait_until="load")
        elif tool == "go_forward":
            page.go_forward(wait_until="load")
        elif tool == "noop":
            pass
        else:
            raise ValueError(f"unknown browser action {tool!r}")
        with contextlib.suppress(Exception):
            self.page.wait_for_load_state("load", timeout=timeout)

    def run_action(self, tool: str, args: Mapping[str, Any]) -> str | None:
        """Apply an action and keep the replay log; return the agent's error (None if it worked)."""
        self.check()
        before = (self.loads, self.page)
        error = None
        try:
            self.act(tool, args)
        except Exception as exc:
            self.check()
            error = _first_line(exc)
        if (self.loads, self.page) != before:
            # A new document: a fork reloads its URL, so earlier actions must not be replayed.
            self.log, self.setup_on_load = [], False
        elif tool != "noop" and error is None:
            self.log.append({"tool": tool, "args": dict(args)})
        return error

    # -- forks

    def state(self) -> dict[str, Any]:
        self.check()
        page = self.page
        # Read where the page's scripts cannot rewrite the builtins: a fork's storage feeds its reward.
        reply = self._in_verdict_world(self._session(page), _SESSION_STORAGE_READ_JS)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"could not read the page's session storage: {_exception_text(reply['exceptionDetails'])}")
        origin, session = reply["result"]["value"]
        return {"url": page.url, "storage_state": self.context.storage_state(),
                "session_storage": {origin: session} if session else {}, "log": list(self.log),
                "setup_on_load": self.setup_on_load}

    def restore(self, state: Mapping[str, Any], setup_js: str | None) -> list[str]:
        self.new_context(state.get("storage_state"), state.get("session_storage"))
        self._goto_site(state["url"])
        if state.get("setup_on_load") and setup_js:
            self.page.evaluate(f"(seed) => {{ {setup_js}\n}}", self.seed)
        self.setup_on_load = bool(state.get("setup_on_load"))
        self.log = []
        errors = []
        # Ids are given when a page is observed, and the episode observed after every step: a
        # replay marks the page at the same points, so elements a step re-rendered get the same ids.
        self.page.evaluate(_MARK_BIDS_JS)
        for entry in state.get("log") or []:
            error = self.run_action(entry["tool"], entry.get("args") or {})
            if error:
                errors.append(error)
            with contextlib.suppress(Exception):
                self.page.wait_for_load_state("domcontentloaded", timeout=self.timeout_ms)
            self.page.evaluate(_MARK_BIDS_JS)
        return errors


class _UnreadableInput(Exception):
    """A guarded global holds what a verdict cannot read without running page code."""


def _exception_text(details: Mapping[str, Any]) -> str:
    exception = details.get("exception") or {}
    text = str(exception.get("description") or details.get("text") or "the expression failed")
    return (text.strip().splitlines() or ["the expression failed"])[0][:500]


def _safe_title(page: Any) -> str:
    try:
        return str(page.title())
    except Exception:
        return ""


def handle(driver: Driver, request: Mapping[str, Any]) -> dict[str, Any]:
    """Answer one request (the token already checked)."""
    op = request.get("op")
    checks = request.get("checks") or {}
    shot = bool(request.get("screenshot"))
    if op in ("start", "restore"):
        driver.configure(request["settings"], checks)
    if op == "start":
        driver.start(request["url"], request.get("setup_js"))
        return {"obs": driver.observe(screenshot=shot), "values": driver.evaluate(checks)}
    if op == "act":
        error = driver.run_action(str(request.get("tool")), request.get("args") or {})
        return {"error": error, "obs": driver.observe(screenshot=shot), "values": driver.evaluate(checks)}
    if op == "observe":
        return {"obs": driver.observe(screenshot=shot), "values": driver.evaluate(checks)}
    if op == "state":
        return {"state": driver.state()}
    if op == "restore":
        errors = driver.restore(request["state"], request.get("setup_js"))
        return {"replay_errors": errors, "obs": driver.observe(screenshot=shot), "values": driver.evaluate(checks)}
    raise ValueError(f"unknown op {op!r}")


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        pass


def serve_site(directory: str, port: int) -> http.server.ThreadingHTTPServer:
    """Serve ``directory`` on 127.0.0.1:``port`` from a daemon thread."""
    handler = functools.partial(_QuietHandler, directory=directory)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _read_line(conn: socket.socket, limit: int) -> bytes:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise ValueError("request too large")
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Forkyard's in-sandbox browser driver")
    parser.add_argument("config", help="path of the JSON config the environment wrote")
    args = parser.parse_args(argv)
    with open(args.config, encoding="utf-8") as f:
        config = json.load(f)
    token = config["token"].encode()
    driver = Driver(config)
    driver.launch()
    listener = socket.create_server(("127.0.0.1", int(config["port"])), backlog=8)
    print("forkyard-web-driver ready", flush=True)
    while True:
        conn, _ = listener.accept()
        with conn:
            try:
                # One connection at a time: one that sends nothing must not stall the next requests.
                conn.settimeout(_REQUEST_READ_TIMEOUT_S)
                raw = _read_line(conn, 64 * 1024 * 1024)
                conn.settimeout(None)
                head, _, body = raw.partition(b" ")
                if head != token:
                    continue
                request = json.loads(body)
                started = time.monotonic()
                try:
                    reply = handle(driver, request)
                except BrowserGone as exc:
                    reply = {"fatal": str(exc)}
                except Exception as exc:
                    if driver.crashed or (driver.browser is not None and not driver.browser.is_connected()):
                        reply = {"fatal": driver.crashed or "the browser disconnected"}
                    else:
                        reply = {"failed": _first_line(exc), "trace": traceback.format_exc()[-2000:]}
                reply["driver_ms"] = round((time.monotonic() - started) * 1000, 2)
                conn.sendall(json.dumps(reply).encode() + b"\n")
            except Exception:
                traceback.print_exc()
            if driver.crashed:
                print(f"forkyard-web-driver: {driver.crashed}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())

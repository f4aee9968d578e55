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
import http.server
import json
import socket
import sys
import threading
import time
import traceback
import urllib.parse
from collections.abc import Iterable, Mapping
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
# Reads the task's expressions in one round trip; each one's failure is its own.
_CHECKS_JS = """() => {
  const out = {};
%s
  return out;
}"""
_CHECK_JS = """  try { out[%s] = (%s); } catch (e) { out[%s] = String(e && e.name ? e.name + ': ' + e.message : e); }"""
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
        self._cdp: dict[Any, Any] = {}

    # -- lifecycle

    def configure(self, settings: Mapping[str, Any]) -> None:
        """Take the task's settings (a sandbox's driver starts before it knows its task: a warm pool's)."""
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

    def _gone(self, why: str) -> None:
        self.crashed = self.crashed or why

    def new_context(self, storage_state: Mapping[str, Any] | None = None,
                    session_storage: Mapping[str, Mapping[str, str]] | None = None) -> None:
        if self.context is not None:
            self._cdp.clear()
            with contextlib.suppress(Exception):
                self.context.close()
        viewport = self.config.get("viewport") or {"width": 1024, "height": 768}
        self.context = self.browser.new_context(viewport=viewport, storage_state=storage_state or None,
                                                service_workers="block")
        self.context.set_default_timeout(self.timeout_ms)
        self.context.add_init_script(_SEED_JS % self.seed)
        for origin, items in (session_storage or {}).items():
            self.context.add_init_script(_SESSION_STORAGE_JS % (json.dumps(origin), json.dumps(dict(items))))
        self.context.route("**/*", self._route)
        self.context.on("page", self._adopt)
        self.page = None
        self._adopt(self.context.new_page())

    def _route(self, route: Any) -> None:
        url = route.request.url
        if same_site(url, self.origin) or url.startswith(("data:", "blob:", "about:")):
            route.continue_()
        else:
            route.abort("blockedbyclient")

    def _adopt(self, page: Any) -> None:
        page.on("crash", lambda _p: self._gone("the page crashed"))
        page.on("load", lambda _p: self._loaded(page))
        page.on("close", lambda _p: self._closed(page))
        self.page = page

    def _loaded(self, page: Any) -> None:
        if page is self.page:
            self.loads += 1

    def _closed(self, page: Any) -> None:
        self._cdp.pop(page, None)
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
        cdp = self._cdp.get(page)
        if cdp is None:
            cdp = self._cdp[page] = self.context.new_cdp_session(page)
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

    def evaluate(self, expressions: Mapping[str, str]) -> dict[str, Any]:
        checks = [(k, e) for k, e in expressions.items() if e]
        if not checks:
            return {}
        body = "\n".join(_CHECK_JS % (json.dumps(k), e, json.dumps(k + "_error")) for k, e in checks)
        try:
            values = self.page.evaluate(_CHECKS_JS % body)
        except Exception as exc:  # a syntax error in an expression fails them all
            self.check()
            return {k + "_error": _first_line(exc) for k, _ in checks}
        return dict(values) if isinstance(values, dict) else {}

    # -- actions

    def start(self, url: str, setup_js: str | None) -> None:
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
        session = page.evaluate("() => Object.fromEntries(Object.entries(window.sessionStorage))")
        origin = page.evaluate("() => window.location.origin")
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
        driver.configure(request["settings"])
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

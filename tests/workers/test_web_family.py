"""The web family's logic without a browser: task loading, the tree text, URL and argument checks."""

from __future__ import annotations

import pytest

from tests.live import ROOT
from workers.archives import read_dir
from workers.envs.base import EnvFamily
from workers.envs.registry import get_family
from workers.envs.web import driver
from workers.envs.web.env import check_arguments, format_observation
from workers.envs.web.task import WebTask, load_task_files
from workers.errors import ActionError, TaskFormatError

TASKS_DIR = ROOT / "examples" / "tasks" / "web"
TASK_NAMES = sorted(p.name for p in TASKS_DIR.iterdir() if (p / "task.toml").is_file())

MINIMAL = {
    "task.toml": b'[task]\ngoal = "Click it."\nstart_url = "/index.html"\nreward_js = "window.score"\n',
    "site/index.html": b"<button>it</button>",
}


def files(changes: dict[str, bytes | None]) -> dict[str, bytes]:
    out = dict(MINIMAL)
    for path, data in changes.items():
        if data is None:
            out.pop(path, None)
        else:
            out[path] = data
    return out


def test_registered_and_implements_the_family_contract():
    family = get_family("web")
    assert isinstance(family, EnvFamily) and family.name == "web"
    assert {t.name for t in family.tools} >= {"click", "fill", "select_option", "hover", "press", "scroll", "goto",
                                              "go_back", "go_forward", "send_msg_to_user", "submit"}
    assert [t.name for t in family.tools if t.ends_episode] == ["submit"]


def test_there_are_ten_example_tasks_each_with_an_oracle():
    family = get_family("web")
    assert len(TASK_NAMES) >= 10
    for name in TASK_NAMES:
        task = family.load_task(name, read_dir(TASKS_DIR / name, max_bytes=1 << 24, max_files=1000))
        assert task.warnings == (), (name, task.warnings)
        oracle = family.oracle(task)
        assert oracle[-1].tool == "submit" and len(oracle) >= 2
        assert all(a.tool in {t.name for t in family.tools} for a in oracle)


def test_tasks_round_trip_through_their_archive():
    family = get_family("web")
    task = family.load_task("shop", read_dir(TASKS_DIR / "shop", max_bytes=1 << 24, max_files=1000))
    data = family.encode_task(task)
    assert data == family.encode_task(task)  # deterministic bytes
    again = family.decode_task(data)
    assert isinstance(again, WebTask) and again.content_hash == task.content_hash
    assert again.serve == "python3 shop.py" and again.check_script is not None
    assert [t.name for t in family.parse_tasks(data)] == ["shop"]


def test_defaults_and_fields():
    task = load_task_files("t", MINIMAL)
    assert (task.max_steps, task.seed, task.port, task.serve) == (30, 0, 8000, None)
    assert task.origin == "http://127.0.0.1:8000" and task.instruction == "Click it."
    assert task.site_files == {"index.html": b"<button>it</button>"}


@pytest.mark.parametrize(("changes", "field"), [
    ({"task.toml": b'[task]\nstart_url = "/"\nreward_js = "1"\n'}, "task.goal"),
    ({"task.toml": b'[task]\ngoal = "g"\nreward_js = "1"\n'}, "task.start_url"),
    ({"task.toml": b'[task]\ngoal = "g"\nstart_url = "/"\n'}, "task.reward_js"),
    ({"task.toml": b'[task]\ngoal = "g"\nstart_url = "https://example.com/"\nreward_js = "1"\n'}, "task.start_url"),
    ({"task.toml": MINIMAL["task.toml"] + b"[site]\nport = 7923\n"}, "site.port"),
    ({"task.toml": MINIMAL["task.toml"] + b"[site]\nport = 80\n"}, "site.port"),
    ({"task.toml": MINIMAL["task.toml"].replace(b"[task]\n", b"[task]\nmax_steps = 0\n")}, "task.max_steps"),
    ({"task.toml": MINIMAL["task.toml"].replace(b"[task]\n", b"[task]\nseed = -1\n")}, "task.seed"),
])
def test_bad_task_toml_names_the_field(changes, field):
    with pytest.raises(TaskFormatError) as e:
        load_task_files("t", files(changes))
    assert e.value.field == field and e.value.file == "task.toml"


def test_missing_site_and_bad_oracle_are_refused():
    with pytest.raises(TaskFormatError, match="site"):
        load_task_files("t", files({"site/index.html": None}))
    with pytest.raises(TaskFormatError, match="actions.json"):
        load_task_files("t", files({"solution/actions.json": b"{not json"}))
    with pytest.raises(TaskFormatError, match="action 0"):
        load_task_files("t", files({"solution/actions.json": b'[{"tool": 3}]'}))
    with pytest.raises(TaskFormatError, match="invalid TOML"):
        load_task_files("t", files({"task.toml": b"[task"}))


def test_check_script_stands_in_for_reward_js_and_unknown_keys_warn():
    toml = b'[task]\ngoal = "g"\nstart_url = "/"\ncolour = "red"\n[extra]\nx = 1\n'
    task = load_task_files("t", files({"task.toml": toml, "tests/check.py": b"print(1)"}))
    assert task.reward_js is None and task.check_script == b"print(1)"
    assert any("colour" in w for w in task.warnings) and any("[extra]" in w for w in task.warnings)


def test_check_arguments():
    assert check_arguments("click", {"bid": 12}) == {"bid": "12"}
    assert check_arguments("scroll", {"dx": 0, "dy": 300}) == {"dx": 0.0, "dy": 300.0}
    for tool, args, match in [("click", {}, "missing: bid"), ("click", {"bid": "1", "x": 1}, "unknown: x"),
                              ("fill", {"bid": "1", "text": 5}, "string"), ("scroll", {"dx": "1", "dy": 1}, "number"),
                              ("scroll", {"dx": float("nan"), "dy": 1}, "number"), ("rm_rf", {}, "unknown tool"),
                              ("go_back", {"n": 1}, "unknown: n")]:
        with pytest.raises(ActionError, match=match):
            check_arguments(tool, args)


def test_same_site_refuses_other_origins_and_schemes():
    origin = "http://127.0.0.1:8000"
    assert driver.same_site("http://127.0.0.1:8000/a?b#c", origin)
    for url in ["http://127.0.0.1:8001/", "http://localhost:8000/", "https://127.0.0.1:8000/", "javascript:alert(1)",
                "data:text/html,hi", "file:///etc/passwd", "http://10.0.2.2:8000/", "chrome://version",
                "http://127.0.0.1:8000@evil.example/", "http://[::1]:8000/", "not a url"]:
        assert not driver.same_site(url, origin), url


def _node(nid, role, name="", children=(), backend=None, props=(), ignored=False, value=None):
    node = {"nodeId": nid, "role": {"value": role}, "name": {"value": name}, "childIds": list(children),
            "properties": [{"name": k, "value": {"value": v}} for k, v in props], "ignored": ignored}
    if backend is not None:
        node["backendDOMNodeId"] = backend
    if value is not None:
        node["value"] = {"value": value}
    return node


def test_ax_tree_lines_follow_browsergym_conventions():
    nodes = [
        _node("1", "RootWebArea", "Shop", ["2"], backend=1, props=[("focused", True)]),
        _node("2", "generic", "", ["3", "4", "6", "8", "9"], backend=2),
        _node("3", "button", "Buy", ["5"], backend=3, props=[("disabled", True)]),
        _node("5", "StaticText", "Buy"),
        _node("4", "checkbox", "Gift wrap", backend=4, props=[("checked", "true")]),
        _node("6", "textbox", "Email", ["7"], backend=6, props=[("focused", True), ("required", True)], value="a@b.c"),
        _node("7", "StaticText", "a@b.c"),
        _node("8", "none", "", ["10"], ignored=True),
        _node("10", "link", "Help", backend=10),
        _node("9", "heading", "Deals", backend=9, props=[("level", 2)]),
    ]
    snapshot = {"strings": ["bid", "7", "x", "buy", "12", "14"],
                "documents": [{"nodes": {"backendNodeId": [3, 4, 6, 10, 9], "attributes": [[0, 3], [2, 2, 0, 1], [0, 4],
                                                                                            [0, 5], []]}}]}
    bids = driver.bids_by_backend_id(snapshot)
    assert bids == {3: "buy", 4: "7", 6: "12", 10: "14"}
    lines = driver.format_ax_tree(nodes, bids)
    assert lines == [
        'RootWebArea "Shop", focused',
        '\t[buy] button "Buy", disabled',
        '\t[7] checkbox "Gift wrap", checked',
        '\t[12] textbox "Email", value="a@b.c", focused, required',
        '\t[14] link "Help"',
        '\theading "Deals", level=2',
    ]


def test_tree_truncation_is_visible_and_observation_text_shows_errors():
    text, cut = driver.truncate_lines([f"line {i}" for i in range(100)], 60)
    assert cut and text.splitlines()[-1].startswith("[... 92 more line(s)")
    assert driver.truncate_lines(["a", "b"], 60) == ("a\nb", False)
    obs = {"url": "http://127.0.0.1:8000/", "title": "T", "tree": "[1] button \"x\"",
           "tabs": [{"url": "u1", "title": "one", "active": False}, {"url": "u2", "title": "two", "active": True}]}
    out = format_observation(obs, error="ValueError: no element with bid '9' on the page")
    assert out.splitlines()[:2] == ["URL: http://127.0.0.1:8000/", "Title: T"]
    assert "  [1] two u2 (active)" in out and out.endswith("Last action error: ValueError: no element with bid '9' "
                                                           "on the page")


def test_driver_source_imports_nothing_of_forkyard():
    source = (ROOT / "workers" / "envs" / "web" / "driver.py").read_text()
    assert "from workers" not in source and "import workers" not in source


@pytest.mark.parametrize(("expression", "names"), [
    ("window.score || 0", ["score"]),
    ("WOB_RAW_REWARD_GLOBAL > 0 ? 1 : 0", ["WOB_RAW_REWARD_GLOBAL"]),
    ("sessionStorage.getItem('application') === 'pro' ? 1 : 0", ["sessionStorage"]),
    ("window['my score'] + self.total + globalThis?.done + cart.items.length", ["my score", "total", "done", "cart"]),
    ("document.title.window.x + a.window.y", ["document", "a"]),  # a member's `window` is not the window
    ("[...rows].filter((row, i = first) => row.ok && i).length / count", ["rows", "first", "count"]),
    ("/a+b/.test(text) ? 1 : 0", ["text"]),
    ("total / 2 / scale", ["total", "scale"]),
    ("`${window.label}: ${points}` // a comment: window.no", ["label", "points"]),
    ("(function f(p) { try { return p + base } catch (err) { return err } })(seed)", ["base", "seed"]),
    ("typeof window.x === 'undefined' ? 0 : 1e3 + .5 + 0x1F", ["x"]),
])
def test_expression_globals_finds_the_globals_an_expression_reads(expression, names):
    assert driver.expression_globals(expression) == names


def test_reward_globals_guard_minwob_s_and_leave_builtins_to_the_verdict_world():
    guarded = driver.reward_globals(["window.score + sessionStorage.length", "Math.max(done, window.name)"],
                                    builtins={"sessionStorage", "Math", "name"})
    assert guarded == (*driver.WOB_GLOBALS, "score", "done")
    assert driver.reward_globals([]) == driver.WOB_GLOBALS


def test_the_verdict_function_binds_each_name_to_its_value():
    source = driver.verdict_function({"reward": "window.score || 0", "done": "ok"}, ["score", "ok", "my score"])
    assert source.startswith("function (__forkyard_0, __forkyard_1, __forkyard_2) {")
    assert '"score": __forkyard_0, "ok": __forkyard_1, "my score": __forkyard_2' in source
    assert "((window, self, globalThis, score, ok) => {" in source  # a name that is no identifier is window's only
    assert 'keep("reward", (window.score || 0))' in source and 'keep("done_error"' in source


def _sha(text: str) -> str:
    import base64
    import hashlib

    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def test_a_static_document_s_policy_allows_the_inline_code_it_ships_and_nothing_else():
    page = ("<!doctype html><meta charset=utf-8><button onclick=\"go('a &amp; b')\">x</button>\r\n"
            "<a href=' javascript:go(1)'>l</a><a href='/next'>n</a><form action='JavaScript:send()'></form>"
            "<iframe srcdoc='<script>parent.go(&quot;f&quot;)</script>'></iframe>"
            "<script src=/app.js></script><script>\r\nlet s = 'café';\r\n</script><script>open()").encode()
    csp = driver.document_csp(page, "text/html")
    expected = ["go('a & b')", "javascript:go(1)", "javascript:send()", 'parent.go("f")', "", "\nlet s = 'café';\n",
                "open()"]
    assert csp == ("script-src 'self' 'unsafe-hashes' " + " ".join(sorted(_sha(t) for t in expected))
                   + "; object-src 'none'; base-uri 'none'")
    assert "base-uri 'self'" in driver.document_csp(b"<base href=/app/><p>x</p>")
    assert driver.document_charsets(b"<p>x</p>", "text/html; charset=ISO-8859-1") == ["ISO-8859-1"]
    assert driver.document_charsets(b"<p>x</p>", "text/html") == ["utf-8", "cp1252"]

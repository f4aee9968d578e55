"""Web verdicts no page script and no agent action can forge, in real Chromium on both backends.

Each test plays a hostile policy through the SDK against a live gateway, on tasks built
here: a page whose own script, on the agent's click, redefines, deletes or shadows the
globals ``reward_js`` reads or replaces the builtins it calls; a preview that copies the
agent's text into ``innerHTML``; URLs that smuggle script through ``goto``. Every one must
end with the reward the task's own code wrote (0), and a verifier that gives no reward
must end with none (``verifier_error``), never a 0.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import forkyard
from tests.e2e.test_web_tasks import import_tasks

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{title}</title></head>
<body>
{body}
<p id="log" role="status"></p>
<script>
{script}
function log(text) {{ document.getElementById("log").textContent = text; }}
document.addEventListener("securitypolicyviolation", (e) => log("Blocked by " + e.violatedDirective));
</script>
</body></html>
"""

# name: (the page's own globals, what its attack button runs, reward_js). Each gave 1 before the guards.
ATTACKS = {
    "redefine-score": ("window.score = 0; window.finished = false;",
                       "Object.defineProperty(window, 'score', {get() { return 1; }});",
                       "window.score || 0"),
    # Some MiniWoB ports assign their globals without `var`: a configurable property, until guarded.
    "redefine-wob": ("WOB_REWARD_GLOBAL = 0; WOB_RAW_REWARD_GLOBAL = 0; WOB_DONE_GLOBAL = false;",
                     "Object.defineProperty(window, 'WOB_RAW_REWARD_GLOBAL', {get() { return 1; }});",
                     "WOB_RAW_REWARD_GLOBAL > 0 ? 1 : 0"),
    "delete-and-shadow": ("window.score = 0;",
                          "delete window.score; "
                          "Object.defineProperty(Object.prototype, 'score', {get() { return 1; }, configurable: true});",
                          "window.score || 0"),
    "pollute-number": ("window.score = 0;",
                       "Number.prototype.valueOf = function () { return 1; }; "
                       "Object.prototype.toString = function () { return '1'; };",
                       "Math.round(window.score.valueOf() * 100) / 100"),
    "pollute-json": ("sessionStorage.setItem('result', JSON.stringify({score: 0}));",
                     "JSON.parse = function () { return {score: 1}; };",
                     "JSON.parse(sessionStorage.getItem('result')).score"),
}

# Markup an agent types into the preview, each trying to run script that wins the task.
_WIN = "window.score=1;window.finished=true;document.title='pwned';void 0"
PAYLOADS = {
    "img-onerror": f'<img src="x" onerror="{_WIN}">',
    "details-ontoggle": f'<details open ontoggle="{_WIN}"><summary>More</summary></details>',
    "iframe-srcdoc": '<iframe srcdoc="<script>parent.score=1;parent.finished=true;parent.document.title=1</script>">'
                     "</iframe>",
    "javascript-link": f'<a bid="claim" href="javascript:{_WIN}">Claim the prize</a>',
}


def _task(root: Path, name: str, *, reward_js: str | None, body: str = "", script: str = "",
          done_js: str | None = "window.finished === true", files: dict[str, str] | None = None) -> None:
    task = root / name
    (task / "site").mkdir(parents=True)
    lines = ["[task]", f"goal = {json.dumps('Score on ' + name)}", 'start_url = "/index.html"', "max_steps = 20"]
    lines += [f"{key} = {json.dumps(value)}" for key, value in (("reward_js", reward_js), ("done_js", done_js))
              if value is not None]
    (task / "task.toml").write_text("\n".join(lines) + "\n")
    (task / "site" / "index.html").write_text(_PAGE.format(title=name, body=body, script=script), encoding="utf-8")
    for rel, text in (files or {}).items():
        (task / rel).parent.mkdir(parents=True, exist_ok=True)
        (task / rel).write_bytes(text.encode())


@pytest.fixture(scope="module")
def tasks(live_gateway, tmp_path_factory) -> dict[str, str]:
    """Import this module's tasks into the gateway; return {name: task id}."""
    root = tmp_path_factory.mktemp("web-verdicts")
    for name, (globals_, attack, reward_js) in ATTACKS.items():
        _task(root, name, reward_js=reward_js, done_js="window.finished === true || WOB_DONE_GLOBAL === true",
              body='<button bid="attack" onclick="attack()">Attack</button>\n'
                   '<button bid="win" onclick="window.score = 1; window.finished = true">Win</button>',
              script=f"{globals_}\nfunction attack() {{\n  try {{ {attack} log('attacked'); }} "
                     "catch (e) { log('refused: ' + e.name); }\n}")
    _task(root, "preview", reward_js="window.score || 0",
          body='<label>Comment <input bid="comment"></label>\n<button bid="preview" onclick="preview()">Preview</button>'
               '\n<div id="out"></div>',
          script="window.score = 0; window.finished = false;\n"
                 "function preview() { document.getElementById('out').innerHTML = "
                 "document.querySelector('[bid=comment]').value; }")
    # A hash router: an open redirect and an innerHTML sink, both fed from the URL's fragment.
    _task(root, "hash-router", reward_js="Math.max(window.score || 0, WOB_REWARD_GLOBAL)",
          body='<div id="out"></div>',
          script="var WOB_REWARD_GLOBAL = 0; window.score = 0; window.finished = false;\n"
                 "function route() {\n  log('');\n  const target = decodeURIComponent(location.hash.slice(1));\n"
                 "  if (target.startsWith('javascript:')) location.href = target;\n"
                 "  else document.getElementById('out').innerHTML = target;\n}\n"
                 "window.addEventListener('hashchange', route);")
    # What the site ships runs under its policy: a same-origin file, a handler, a javascript: link,
    # an srcdoc frame's script; CRLF line ends and non-ASCII text in the hashed code.
    _task(root, "shipped-code", reward_js="window.seen.length === 4 && window.inline === 'café ✓' ? 1 : 0",
          body='<script src="/lib.js"></script>\n<button bid="handler" onclick="see(\'handler\')">Handler</button>\n'
               '<a bid="link" href="javascript:see(\'link\')">Link</a>\n'
               '<iframe srcdoc="<script>parent.see(&quot;frame&quot;)</script>"></iframe>',
          script="// Windows line ends and non-ASCII text: the hash is of what the browser parsed.\r\n"
                 "window.inline = 'café ✓';\r\n",
          files={"site/lib.js": "window.seen = ['lib'];\nwindow.see = (what) => {\n  window.seen.push(what);\n"
                                "  document.getElementById('log').textContent = 'saw ' + window.seen.join(' ');\n};\n"})
    _task(root, "throws", reward_js="window.missing.score")
    _task(root, "not-a-number", reward_js="'high'")
    _task(root, "page-function", reward_js="window.computeScore()", script="window.computeScore = () => 1;")
    _task(root, "let-declared", reward_js="score", script="let score = 0;")
    _task(root, "check-prints-nothing", reward_js=None, files={"tests/check.py": "print('no reward here')\n"})
    ids = import_tasks(live_gateway, root)
    assert len(ids) == len(ATTACKS) + 8, ids
    return ids


@pytest.fixture(scope="module")
def client(live_gateway):
    with forkyard.Client(base_url=live_gateway.url, api_key=live_gateway.api_key, timeout=600) as c:
        yield c


def _ended(session, step):
    """Return the episode's final step: ``step`` if it ended the episode, else a submit's."""
    return step if step.terminated or step.truncated else session.submit()


def _settled(session, step, marker: str):
    """Return ``step``, or a later look at the page once ``marker`` shows (events such as a CSP report come late)."""
    for _ in range(5):
        if marker in step.observation or step.terminated:
            return step
        step = session.step("noop")
    return step


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_a_page_script_cannot_rewrite_what_the_reward_reads(client, tasks, name):
    with client.sessions.create(tasks[name]) as s:
        result = _ended(s, s.step("click", bid="attack"))
    assert result.reward == 0.0, (name, result.reward, result.observation)
    assert result.info["outcome"] == "reward" and "verifier_error" not in result.info, result.info


def test_the_page_s_own_writes_still_count_after_an_attack(client, tasks):
    with client.sessions.create(tasks["redefine-score"]) as s:
        attacked = s.step("click", bid="attack")
        assert "refused: TypeError" in attacked.observation, attacked.observation  # the guard cannot be redefined
        result = s.step("click", bid="win")
    assert result.terminated and result.reward == 1.0 and result.info["outcome"] == "reward", result.info


@pytest.mark.parametrize("payload", sorted(PAYLOADS))
def test_markup_an_agent_types_runs_no_script(client, tasks, payload):
    with client.sessions.create(tasks["preview"]) as s:
        s.step("fill", bid="comment", text=PAYLOADS[payload])
        step = s.step("click", bid="preview")
        if payload == "javascript-link" and not step.terminated:
            step = s.step("click", bid="claim")
        assert step.info["last_action_error"] is None, step.info
        if payload != "iframe-srcdoc":  # a frame's violation is reported in the frame
            step = _settled(s, step, "Blocked by")
        result = _ended(s, step)
    assert result.reward == 0.0, (payload, result.reward, result.observation)
    assert not step.terminated, "done_js turned true: the payload ran"
    assert step.info["title"] == "preview", step.info  # the payload retitles the page
    if payload != "iframe-srcdoc":
        assert "Blocked by script-src" in step.observation, step.observation


def test_goto_smuggles_no_script(client, tasks):
    with client.sessions.create(tasks["hash-router"]) as s:
        for url in ["javascript:WOB_REWARD_GLOBAL=1", "JavaScript:window.score=1",
                    "data:text/html,<script>opener.score=1</script>"]:
            step = s.step("goto", url=url)
            assert not step.terminated and "outside the task's site" in step.observation, url
        for url in ["/index.html#javascript:window.score=1;window.finished=true",
                    '/index.html#<img src=x onerror="window.score=1;window.finished=true">']:
            step = s.step("goto", url=url)
            assert step.info["last_action_error"] is None, (url, step.info)
            step = _settled(s, step, "Blocked by")
            assert not step.terminated and "Blocked by script-src" in step.observation, (url, step.reward, step.observation)
        result = s.submit()
    assert result.reward == 0.0 and result.info["outcome"] == "reward", (result.reward, result.info)


def test_the_site_s_own_inline_code_still_runs_under_its_policy(client, tasks):
    with client.sessions.create(tasks["shipped-code"]) as s:
        s.step("click", bid="handler")
        step = _settled(s, s.step("click", bid="link"), ' link"')  # a javascript: URL runs after the click
        (saw,) = [line.strip() for line in step.observation.splitlines() if "saw lib" in line]
        assert all(what in saw for what in ("frame", "handler", "link")), step.observation
        result = s.submit()
    assert result.reward == 1.0 and result.info["outcome"] == "reward", (result.observation, result.info)


@pytest.mark.parametrize(("name", "reason"), [
    ("throws", "reward_js failed: TypeError"),
    ("not-a-number", "reward_js gave 'high', not a number"),
    ("page-function", "computeScore is a function"),
    ("let-declared", "declares 'score' with function, let, const or class"),
    ("check-prints-nothing", "tests/check.py exited 0 without a reward"),
])
def test_a_verifier_that_gives_no_reward_is_a_verifier_error_never_a_zero(client, tasks, name, reason):
    with client.sessions.create(tasks[name]) as s:
        result = s.submit()
    assert result.terminated and result.reward is None, (result.reward, result.info)
    assert result.info["outcome"] == "verifier_error" and reason in result.info["verifier_error"], result.info
    assert result.observation.endswith("[reward: none]"), result.observation

"""``/admin``: the operators' console, server-rendered from the database.

Pages are plain HTML forms and links (they work without JavaScript); htmx, when its file is
installed (``.ci/bootstrap`` fetches it from the npm registry), refreshes the live parts and
loads a tree node's step in place. Every state-changing request is a POST carrying the
session's CSRF token, and is written to the audit log before it answers.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from pathlib import Path
from typing import Annotated, Any, TypeVar
from urllib.parse import urlencode

from fastapi import APIRouter, Depends, FastAPI, Form, Query, Request, UploadFile
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from gateway.console import charts, queries
from gateway.console import tree as tree_view
from gateway.console.auth import (
    COOKIE,
    CSRF_FIELD,
    SESSION_TTL,
    Admin,
    CsrfRefused,
    NotSignedIn,
    audit,
    check_csrf,
    current_admin,
    sign_in,
    sign_out,
)
from gateway.db import utcnow
from gateway.dependencies import DbSession, Drain, get_step_gate
from gateway.environments import service as environments_service
from gateway.episodes import service as episodes_service
from gateway.errors import GatewayError, NotFoundError
from gateway.nodes import service as nodes_service
from gateway.pagination import MAX_LIMIT
from gateway.rollouts import service as rollouts_service
from gateway.rollouts.models import RolloutStatus
from gateway.sandboxes.models import Sandbox
from gateway.sessions import service as sessions_service
from gateway.snapshots import service as snapshots_service
from gateway.tasks import service as tasks_service
from workers.errors import TaskFormatError
from workers.protocol import EpisodeStatus, SandboxStatus

logger = logging.getLogger(__name__)
T = TypeVar("T")

HERE = Path(__file__).parent
STATIC = HERE / "static"
#: Where the installer puts htmx (from the npm registry); the console works without it, unrefreshed.
HTMX = STATIC / "vendor" / "htmx.min.js"
templates = Jinja2Templates(directory=HERE / "templates")
templates.env.globals.update(line_chart=charts.line_chart, bar_chart=charts.bar_chart,
                             csrf_field=CSRF_FIELD, sandbox_states=[s.value for s in SandboxStatus],
                             episode_states=[s.value for s in EpisodeStatus])
templates.env.filters["tojson_pretty"] = lambda v: json.dumps(v, indent=2, sort_keys=True, default=str)

router = APIRouter(prefix="/admin", include_in_schema=False)


async def require_admin(request: Request, db_session: DbSession) -> Admin:
    """Return the signed-in operator; the app answers a redirect to the login page if there is none."""
    admin = await current_admin(request, db_session)
    request.state.admin = admin
    return admin


async def require_action(request: Request, db_session: DbSession) -> Admin:
    """Return the signed-in operator of a state-changing request that carries the session's CSRF token."""
    admin = await require_admin(request, db_session)
    await check_csrf(request, admin)
    return admin


Operator = Annotated[Admin, Depends(require_admin)]
Action = Annotated[Admin, Depends(require_action)]


def render(request: Request, name: str, *, status_code: int = 200, **context: Any) -> HTMLResponse:
    """Render a page (or, for a name starting with ``_``, a fragment) with the console's common context."""
    admin = getattr(request.state, "admin", None)
    context.update(request=request, admin=admin, csrf=admin.csrf_token if admin else "",
                   htmx=HTMX.is_file(), msg=request.query_params.get("msg"), err=request.query_params.get("err"),
                   path=request.url.path, now=utcnow())
    return templates.TemplateResponse(request, name, context, status_code=status_code)


class Missing(Exception):
    """What a page names is not in the database: the console answers its "not found" page (404)."""

    def __init__(self, what: str) -> None:
        super().__init__(what)
        self.what = what


async def found(lookup: Awaitable[T], what: str) -> T:
    """Await a service lookup; raise :class:`Missing` (naming ``what``) where it finds nothing."""
    try:
        return await lookup
    except NotFoundError as exc:
        raise Missing(what) from exc


def back(url: str, *, msg: str | None = None, err: str | None = None) -> RedirectResponse:
    """Answer a POST with a redirect (303) to ``url``, carrying a notice for the page to show."""
    params = {k: v for k, v in (("msg", msg), ("err", err)) if v}
    sep = "&" if "?" in url else "?"
    return RedirectResponse(url + (sep + urlencode(params) if params else ""), status_code=303)


def _runtime(request: Request) -> Any:
    runtime = getattr(request.app.state, "runtime", None)
    if runtime is None:
        raise GatewayError("No worker runtime is running on this gateway.")
    return runtime


# ---------------------------------------------------------------------------- sign in and out


@router.get("/login", response_class=HTMLResponse)
async def login_page(request: Request):
    return render(request, "login.html")


@router.post("/login")
async def login(request: Request, db_session: DbSession, api_key: Annotated[str, Form()] = ""):
    signed = await sign_in(db_session=db_session, api_key=api_key)
    if signed is None:
        return render(request, "login.html", error="That key is not an admin key (or it is revoked).",
                      status_code=401)
    secret, admin = signed
    await audit(db_session, admin, "login", "console")
    response = RedirectResponse("/admin", status_code=303)
    response.set_cookie(COOKIE, secret, max_age=int(SESSION_TTL.total_seconds()), httponly=True, samesite="strict",
                        secure=request.url.scheme == "https", path="/admin")
    return response


@router.post("/logout")
async def logout(request: Request, db_session: DbSession, admin: Action):
    await audit(db_session, admin, "logout", "console")
    await sign_out(db_session=db_session, secret=request.cookies.get(COOKIE))
    response = RedirectResponse("/admin/login?msg=Signed+out.", status_code=303)
    response.delete_cookie(COOKIE, path="/admin")
    return response


# ---------------------------------------------------------------------------- overview


@router.get("", response_class=HTMLResponse)
async def overview(request: Request, db_session: DbSession, admin: Operator):
    return render(request, "overview.html", data=await queries.overview(db_session))


@router.get("/fragments/overview", response_class=HTMLResponse)
async def overview_fragment(request: Request, db_session: DbSession, admin: Operator):
    return render(request, "_overview.html", data=await queries.overview(db_session))


# ---------------------------------------------------------------------------- nodes


@router.get("/nodes", response_class=HTMLResponse)
async def nodes_page(request: Request, db_session: DbSession, admin: Operator, page: int = Query(1, ge=1),
                     commands_page: int = Query(1, ge=1)):
    return render(request, "nodes.html", page=queries.page_list(await queries.nodes(db_session), page),
                  commands=await queries.commands(db_session, commands_page))


@router.get("/fragments/nodes", response_class=HTMLResponse)
async def nodes_fragment(request: Request, db_session: DbSession, admin: Operator, page: int = Query(1, ge=1)):
    return render(request, "_nodes.html", page=queries.page_list(await queries.nodes(db_session), page))


@router.post("/nodes/{name}/{verb}")
async def drain_node(name: str, verb: str, db_session: DbSession, admin: Action, drain: Drain):
    if verb not in ("drain", "undrain"):
        return back("/admin/nodes", err=f"Unknown node action {verb!r}.")
    try:
        await nodes_service.set_draining(db_session=db_session, name=name, draining=verb == "drain", flag=drain)
    except GatewayError as exc:
        return back("/admin/nodes", err=exc.message)
    await audit(db_session, admin, f"node.{verb}", name)
    return back("/admin/nodes", msg=f"Node {name}: {'draining' if verb == 'drain' else 'takes new work again'}.")


# ---------------------------------------------------------------------------- sandboxes


def _filter(node: str, state: str, task: str, owner: str) -> queries.SandboxFilter:
    if state not in ("", "live", *[s.value for s in SandboxStatus]):
        state = "live"
    return queries.SandboxFilter(node=node.strip(), state=state, task=task.strip(), owner=owner.strip())


@router.get("/sandboxes", response_class=HTMLResponse)
async def sandboxes_page(request: Request, db_session: DbSession, admin: Operator, node: str = "",
                         state: str = "live", task: str = "", owner: str = "", page: int = Query(1, ge=1)):
    flt = _filter(node, state, task, owner)
    return render(request, "sandboxes.html", flt=flt, page=await queries.sandboxes(db_session, flt, page),
                  nodes=[n.name for n in await queries.nodes(db_session)], query=urlencode(flt.query()))


@router.get("/sandboxes/kill", response_class=HTMLResponse)
async def kill_preview(request: Request, db_session: DbSession, admin: Operator, node: str = "",
                       state: str = "live", task: str = "", owner: str = ""):
    flt = _filter(node, state, task, owner)
    targets = await queries.matching_sandboxes(db_session, flt)
    return render(request, "kill_preview.html", flt=flt, targets=targets)


async def _kill(request: Request, db_session: DbSession, rows: list[Sandbox]) -> tuple[int, int, list[str]]:
    """Close the sessions of session sandboxes here; queue a kill for the others on their nodes."""
    closed = queued = 0
    errors = []
    gate = await get_step_gate(request)
    for row in rows:
        try:
            if row.session_id is not None:
                await sessions_service.close_session(db_session=db_session, runtime=_runtime(request),
                                                     session_id=row.session_id, gate=gate)
                closed += 1
            else:
                await nodes_service.queue_command(db_session=db_session, node=row.node, kind="kill_sandbox",
                                                  args={"sandbox_id": row.id})
                queued += 1
        except GatewayError as exc:
            errors.append(f"{row.id}: {exc.message}")
    return closed, queued, errors


def _kill_notice(closed: int, queued: int, errors: list[str]) -> dict[str, str | None]:
    parts = []
    if closed:
        parts.append(f"{closed} session sandbox(es) closed")
    if queued:
        parts.append(f"{queued} kill(s) queued for their nodes (run at the next heartbeat)")
    return {"msg": "; ".join(parts) + "." if parts else None, "err": "; ".join(errors[:5]) or None}


@router.post("/sandboxes/kill")
async def kill_many(request: Request, db_session: DbSession, admin: Action, node: Annotated[str, Form()] = "",
                    state: Annotated[str, Form()] = "live", task: Annotated[str, Form()] = "",
                    owner: Annotated[str, Form()] = "", expected: Annotated[int, Form()] = -1):
    flt = _filter(node, state, task, owner)
    rows = await queries.matching_sandboxes(db_session, flt)
    if expected >= 0 and len(rows) != expected:
        return back("/admin/sandboxes/kill?" + urlencode(flt.query()),
                    err=f"The selection changed ({expected} previewed, {len(rows)} now): check it again.")
    ids = [row.id for row in rows]
    closed, queued, errors = await _kill(request, db_session, rows)
    await audit(db_session, admin, "sandbox.kill", f"{len(ids)} sandboxes", filter=flt.query(), ids=ids[:200])
    return back("/admin/sandboxes?" + urlencode(flt.query()), **_kill_notice(closed, queued, errors))


@router.get("/sandboxes/{sandbox_id}", response_class=HTMLResponse)
async def sandbox_page(request: Request, sandbox_id: str, db_session: DbSession, admin: Operator):
    detail = await queries.sandbox_detail(db_session, sandbox_id)
    if detail is None:
        raise Missing(f"sandbox {sandbox_id}")
    return render(request, "sandbox.html", **detail)


@router.post("/sandboxes/{sandbox_id}/kill")
async def kill_one(request: Request, sandbox_id: str, db_session: DbSession, admin: Action):
    row = await db_session.get(Sandbox, sandbox_id)
    if row is None or row.gone_at is not None:
        return back("/admin/sandboxes", err=f"Sandbox {sandbox_id} is not live.")
    closed, queued, errors = await _kill(request, db_session, [row])
    await audit(db_session, admin, "sandbox.kill", sandbox_id, node=row.node)
    return back(f"/admin/sandboxes/{sandbox_id}", **_kill_notice(closed, queued, errors))


# ---------------------------------------------------------------------------- warm pools, caches, snapshots


@router.get("/pools", response_class=HTMLResponse)
async def pools_page(request: Request, db_session: DbSession, admin: Operator, page: int = Query(1, ge=1)):
    return render(request, "pools.html", page=queries.page_list(queries.pools(await queries.nodes(db_session)), page))


@router.post("/pools/resize")
async def resize_pool(db_session: DbSession, admin: Action, node: Annotated[str, Form()],
                      key: Annotated[str, Form(min_length=8, max_length=64)], size: Annotated[int, Form(ge=-1, le=10_000)]):
    try:
        await nodes_service.queue_command(db_session=db_session, node=node, kind="resize_pool",
                                          args={"key": key, "size": size})
    except GatewayError as exc:
        return back("/admin/pools", err=exc.message)
    await audit(db_session, admin, "pool.resize", f"{node}/{key[:12]}", size=size)
    target = "by demand" if size < 0 else str(size)
    return back("/admin/pools", msg=f"Pool key {key[:12]} on {node}: target {target} (at the next heartbeat).")


@router.get("/cache", response_class=HTMLResponse)
async def cache_page(request: Request, db_session: DbSession, admin: Operator, page: int = Query(1, ge=1),
                     nodes_page: int = Query(1, ge=1)):
    caches = queries.setup_caches(await queries.nodes(db_session))
    await (await get_step_gate(request)).settle()  # snapshot rows are written behind their answers
    return render(request, "cache.html", caches=queries.page_list(caches, nodes_page),
                  snapshots=await queries.snapshots(db_session, page))


@router.post("/cache/evict")
async def evict_cache(db_session: DbSession, admin: Action, node: Annotated[str, Form()],
                      entry: Annotated[str, Form(min_length=12, max_length=64)]):
    try:
        await nodes_service.queue_command(db_session=db_session, node=node, kind="evict_cache",
                                          args={"entry": entry})
    except GatewayError as exc:
        return back("/admin/cache", err=exc.message)
    await audit(db_session, admin, "cache.evict", f"{node}/{entry[:12]}")
    return back("/admin/cache", msg=f"Eviction of {entry[:12]} queued for {node} (at the next heartbeat).")


@router.post("/snapshots/{snapshot_id}/{verb}")
async def snapshot_action(request: Request, snapshot_id: str, verb: str, db_session: DbSession, admin: Action):
    await (await get_step_gate(request)).settle()
    try:
        if verb in ("pin", "unpin"):
            await snapshots_service.set_pinned(db_session=db_session, runtime=_runtime(request),
                                               snapshot_id=snapshot_id, pinned=verb == "pin")
        elif verb == "delete":
            await snapshots_service.delete_snapshot(db_session=db_session, runtime=_runtime(request),
                                                    snapshot_id=snapshot_id)
        else:
            return back("/admin/cache", err=f"Unknown snapshot action {verb!r}.")
    except GatewayError as exc:
        return back("/admin/cache", err=exc.message)
    await audit(db_session, admin, f"snapshot.{verb}", snapshot_id)
    return back("/admin/cache", msg=f"Snapshot {snapshot_id}: {verb} done.")


# ---------------------------------------------------------------------------- rollouts


@router.get("/rollouts", response_class=HTMLResponse)
async def rollouts_page(request: Request, db_session: DbSession, admin: Operator, page: int = Query(1, ge=1),
                        status: str = ""):
    status = status if status in [s.value for s in RolloutStatus] else ""
    rows = await queries.rollouts(db_session, page, status)
    stats = await rollouts_service.rollout_stats(db_session=db_session, rollouts=rows.items)
    return render(request, "rollouts.html", page=rows, stats=stats, status=status)


@router.get("/rollouts/{rollout_id}", response_class=HTMLResponse)
async def rollout_page(request: Request, rollout_id: str, db_session: DbSession, admin: Operator,
                       page: int = Query(1, ge=1), dead_page: int = Query(1, ge=1), status: str = ""):
    row = await found(rollouts_service.get_rollout(db_session=db_session, rollout_id=rollout_id),
                      f"rollout {rollout_id}")
    status = status if status in [s.value for s in EpisodeStatus] else ""
    stats = (await rollouts_service.rollout_stats(db_session=db_session, rollouts=[row]))[row.id]
    return render(request, "rollout.html", rollout=row, counts=stats.counts, progress=stats.progress,
                  partial_groups=stats.partial_groups, status=status,
                  rewards=await queries.rollout_rewards(db_session, rollout_id),
                  episodes=await queries.episodes(db_session, rollout_id, page, status),
                  dead=await queries.dead_letters(db_session, rollout_id, dead_page))


@router.post("/rollouts/{rollout_id}/cancel")
async def cancel_rollout(request: Request, rollout_id: str, db_session: DbSession, admin: Action):
    try:
        await rollouts_service.cancel_rollout(db_session=db_session, rollout_id=rollout_id)
    except GatewayError as exc:
        return back(f"/admin/rollouts/{rollout_id}", err=exc.message)
    executor = getattr(request.app.state, "executor", None)
    if executor is not None:
        await executor.cancel(rollout_id)
    await audit(db_session, admin, "rollout.cancel", rollout_id)
    return back(f"/admin/rollouts/{rollout_id}", msg="Rollout cancelled: queued episodes will not run.")


# ---------------------------------------------------------------------------- episodes and trees


@router.get("/episodes/{episode_id}", response_class=HTMLResponse)
async def episode_page(request: Request, episode_id: str, db_session: DbSession, admin: Operator):
    episode = await found(episodes_service.get_episode(db_session=db_session, episode_id=episode_id),
                          f"episode {episode_id}")
    steps = await episodes_service.get_steps(db_session=db_session, episode_id=episode_id)
    training = await episodes_service.get_training(db_session=db_session, episode_id=episode_id)
    return render(request, "episode.html", episode=episode, steps=steps, tokens=queries.token_view(training),
                  token_total=len(training["input_ids"]))


@router.get("/episodes/{episode_id}/steps/{turn}", response_class=HTMLResponse)
async def step_fragment(request: Request, episode_id: str, turn: int, db_session: DbSession, admin: Operator):
    steps = [s for s in await episodes_service.get_steps(db_session=db_session, episode_id=episode_id)
             if s.index == turn]
    name = "_step.html" if request.headers.get("HX-Request") else "step.html"
    return render(request, name, episode_id=episode_id, step=steps[0] if steps else None, turn=turn)


@router.get("/episodes/{episode_id}/tree", response_class=HTMLResponse)
async def tree_page(request: Request, episode_id: str, db_session: DbSession, admin: Operator):
    tree = await found(episodes_service.get_tree(db_session=db_session, episode_id=episode_id),
                       f"episode {episode_id}")
    svg = tree_view.tree_svg(tree, step_url="/admin/episodes/{episode}/steps/{turn}")
    return render(request, "tree.html", tree=tree, svg=svg)


# ---------------------------------------------------------------------------- tasks, environments, audit


@router.get("/tasks", response_class=HTMLResponse)
async def tasks_page(request: Request, db_session: DbSession, admin: Operator, page: int = Query(1, ge=1),
                     environment: str = ""):
    envs, _ = await environments_service.list_environments(db_session=db_session, limit=MAX_LIMIT)
    return render(request, "tasks.html", page=await queries.tasks(db_session, page, environment),
                  environments=envs, environment=environment)


@router.post("/tasks/import")
async def import_tasks(request: Request, db_session: DbSession, admin: Action, file: UploadFile,
                       environment: Annotated[str, Form()] = "terminal"):
    data = await file.read()
    if not data:
        return back("/admin/tasks", err="The upload is empty: choose a tar(.gz) of task dirs or a JSONL file.")
    settings = request.app.state.settings
    try:
        family = await tasks_service.environment_family(db_session=db_session, name=environment)
        tasks = [(environment, task) for task in await asyncio.to_thread(family.parse_tasks, data)]
        limits = settings.sandbox_limits
        tasks_service.check_task_resources(tasks, max_cpus=limits.max_cpus, max_memory_mb=limits.max_memory_mb,
                                           max_disk_mb=limits.max_disk_mb)
        rows = await tasks_service.import_tasks(db_session=db_session, tasks=tasks)
    except GatewayError as exc:
        return back("/admin/tasks", err=exc.message)
    except (TaskFormatError, ValueError) as exc:  # the family's parser: not a task archive
        return back("/admin/tasks", err=str(exc)[:500])
    await audit(db_session, admin, "tasks.import", file.filename or "(upload)", environment=environment,
                tasks=[row.id for row in rows][:200])
    return back("/admin/tasks", msg=f"Imported {len(rows)} task(s) into {environment}.")


@router.get("/environments", response_class=HTMLResponse)
async def environments_page(request: Request, db_session: DbSession, admin: Operator, page: int = Query(1, ge=1)):
    rows = await queries.environments(db_session, page)
    return render(request, "environments.html", page=rows,
                  environments=[environments_service.environment_read(row) for row in rows.items])


@router.get("/audit", response_class=HTMLResponse)
async def audit_page(request: Request, db_session: DbSession, admin: Operator, page: int = Query(1, ge=1)):
    return render(request, "audit.html", page=await queries.audit_log(db_session, page))


# ---------------------------------------------------------------------------- mounting


def install_console(app: FastAPI) -> None:
    """Serve the console at ``/admin``: its routes, its static files, and its sign-in redirects."""
    app.include_router(router)
    app.mount("/admin/static", StaticFiles(directory=STATIC), name="console-static")

    @app.exception_handler(NotSignedIn)
    async def _not_signed_in(request: Request, exc: NotSignedIn) -> Response:
        if request.headers.get("HX-Request"):
            return Response(status_code=401, headers={"HX-Redirect": "/admin/login"})
        if request.method != "GET":
            return HTMLResponse("Sign in first: /admin/login", status_code=401)
        return RedirectResponse("/admin/login", status_code=303)

    @app.exception_handler(Missing)
    async def _missing(request: Request, exc: Missing) -> Response:
        return render(request, "missing.html", what=exc.what, status_code=404)

    @app.exception_handler(CsrfRefused)
    async def _csrf_refused(request: Request, exc: CsrfRefused) -> Response:
        return HTMLResponse("Refused: the request did not carry this session's CSRF token. Reload the page "
                            "and try again.", status_code=403)

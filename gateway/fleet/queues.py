"""The Celery app both sides of the distributed mode share: its broker, queues and job names.

Gateways only send jobs (by name: they never import the code that runs them); worker
nodes (:mod:`gateway.fleet.worker`) consume them. A job names one episode by id, and its
rollout: the node reads everything else (the task, the policy and its key) from the
database, so no secret ever travels through Redis.

Delivery is at least once: a job is acknowledged only after it ran (``acks_late``), a node
takes one at a time per free slot (prefetch 1), and a job whose node died is delivered
again (``task_reject_on_worker_lost``, or Redis's visibility timeout). Exactly once is the
database's work: a node claims an episode atomically under a lease with a fencing token,
and a duplicate finds it claimed and exits without touching a sandbox.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from celery import Celery

#: Every node consumes the shared queue and its own.
SHARED_QUEUE = "forkyard.episodes"
#: The job a node runs: ``(rollout_id, episode_id)``.
RUN_EPISODE = "forkyard.run_episode"
#: Redis channel a gateway publishes a cancelled rollout's id on; the nodes running it stop.
CANCEL_CHANNEL = "forkyard:cancel"


def node_queue(node: str) -> str:
    """Return the queue of jobs placed on ``node``."""
    return f"forkyard.node.{node}"


def celery_app(redis_url: str, *, visibility_timeout_s: float) -> Celery:
    """Return a Celery app on ``redis_url`` configured for episode jobs (acks late, prefetch 1)."""
    from celery import Celery

    app = Celery("forkyard", broker=redis_url, set_as_current=False)
    app.conf.update(
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        task_default_queue=SHARED_QUEUE,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        broker_transport_options={"visibility_timeout": visibility_timeout_s},
        broker_connection_retry_on_startup=True,
        broker_connection_max_retries=None,  # Redis restarting: wait for it, never give up
        worker_hijack_root_logger=False,
        worker_redirect_stdouts=False,
        worker_cancel_long_running_tasks_on_connection_loss=False,
        worker_enable_remote_control=False,
    )
    return app

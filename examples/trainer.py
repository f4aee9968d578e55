"""A GRPO-style trainer loop on a Forkyard rollout, with a scripted policy instead of a model.

Usage: FORKYARD_URL=... FORKYARD_API_KEY=... python examples/trainer.py [options]

Imports the example terminal tasks (or takes --task-id ids), submits a rollout whose
policy is the scripted oracle (each task's solution/solve.sh replayed as one bash
call, then submit: no GPU, no model), and consumes the rollout's stream as a trainer
would: for each batch of finished groups it computes group-normalized advantages,
collates the batch into tensors with forkyard.torch.collate when PyTorch is installed
(else prints per-group reward statistics), "takes an optimizer step" (announces a new
policy weight version), and acks the batch. Exits when the rollout is done: 0 if it
completed and every episode was delivered, 1 otherwise; Ctrl-C cancels the rollout.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import forkyard

try:
    from forkyard.torch import collate
except ImportError:
    collate = None

DEFAULT_TASKS_DIR = Path(__file__).parent / "tasks" / "terminal"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks-dir", default=str(DEFAULT_TASKS_DIR), help="task dirs to import and roll out")
    parser.add_argument("--task-id", action="append", default=[], help="roll out these task ids instead (repeatable)")
    parser.add_argument("--group-size", type=int, default=2, help="samples per task (the GRPO group)")
    parser.add_argument("--batch-size", type=int, default=None, help="episodes per streamed batch (gateway default)")
    parser.add_argument("--consumer", default="example-trainer", help="consumer group name for delivery")
    parser.add_argument("--policy-name", default="oracle", help="name the gateway tracks weight versions under")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--max-staleness", type=int, default=None, help="versions an episode may lag (default: any)")
    parser.add_argument("--no-torch", action="store_true", help="print group statistics even if torch is installed")
    return parser.parse_args()


def current_version(client: forkyard.Client, name: str) -> int:
    """Return the policy's weight version on the gateway (0 for a policy it does not know yet)."""
    try:
        return client.policies.get(name).version
    except forkyard.NotFoundError:
        return 0


def report_tensors(batch: forkyard.EpisodeBatch) -> str:
    """Collate the batch and return what a policy-gradient step would see."""
    assert collate is not None
    t = collate(batch)
    tokens = int(t["loss_mask"].sum())
    # The REINFORCE/GRPO surrogate: -A * logprob summed over sampled tokens. With a real
    # model the logprobs would come from a forward pass and this would be backpropagated.
    surrogate = -(t["advantages"][:, None] * t["logprobs"] * t["loss_mask"]).sum() / max(tokens, 1)
    return (
        f"tensors input_ids{tuple(t['input_ids'].shape)} sampled_tokens={tokens} "
        f"mean_reward={t['rewards'].mean():.3f} adv_abs_mean={t['advantages'].abs().mean():.3f} "
        f"surrogate={float(surrogate) + 0.0:+.4f}"
    )


def report_groups(batch: forkyard.EpisodeBatch, advantages: list[float]) -> str:
    """Return per-group reward statistics for a batch."""
    by_id = dict(zip(batch.episode_ids, advantages))
    parts = []
    for group, episodes in batch.groups().items():
        rewards = [e.reward for e in episodes]
        spread = statistics.stdev(rewards) if len(rewards) > 1 else 0.0
        advs = ",".join(f"{by_id[e.episode_id]:+.2f}" for e in episodes)
        parts.append(f"{str(group)[:10]}: n={len(rewards)} mean={statistics.fmean(rewards):.2f} std={spread:.2f} adv=[{advs}]")
    return "; ".join(parts)


def train(client: forkyard.Client, args: argparse.Namespace, rollout: forkyard.Rollout) -> forkyard.Rollout:
    """Consume the rollout's stream until it ends, one 'optimizer step' per batch."""
    use_torch = collate is not None and not args.no_torch
    version = current_version(client, args.policy_name)
    step = received = 0
    started = time.perf_counter()
    with client.rollouts.stream(rollout.id, consumer=args.consumer, batch_size=args.batch_size) as stream:
        for batch in stream:
            step += 1
            received += len(batch)
            advantages = batch.advantages()
            detail = report_tensors(batch) if use_torch else report_groups(batch, advantages)
            batch.ack()  # trained on: never deliver these again to this consumer
            version += 1
            client.policies.set_version(args.policy_name, version)
            progress = client.rollouts.get(rollout.id).progress
            print(
                f"step {step} (v{version}) +{len(batch)} episodes ({received} so far), cursor {batch.cursor}, "
                f"delivered {progress.delivered}/{progress.total}, finished {progress.finished}/{progress.total} "
                f"[{time.perf_counter() - started:.0f}s] | {detail}",
                flush=True,
            )
    return client.rollouts.get(rollout.id)


def main() -> int:
    args = parse_args()
    policy = {"name": args.policy_name, "api": "scripted", "model": "oracle"}
    with forkyard.Client() as client:
        if args.task_id:
            task_ids = list(args.task_id)
        else:
            tasks = client.tasks.import_dir(args.tasks_dir)
            task_ids = [t.id for t in tasks]
            print(f"imported {len(tasks)} tasks from {args.tasks_dir}: {', '.join(t.name for t in tasks)}")
        rollout = client.rollouts.create(
            tasks=task_ids,
            group_size=args.group_size,
            policy=policy,
            agent={"max_turns": args.max_turns},
            max_staleness=args.max_staleness,
        )
        mode = "forkyard.torch.collate" if collate is not None and not args.no_torch else "group statistics (no torch)"
        print(
            f"rollout {rollout.id}: {len(task_ids)} tasks x {args.group_size} samples, "
            f"scripted oracle policy {args.policy_name!r}, consumer {args.consumer!r}, {mode}",
            flush=True,
        )
        try:
            final = train(client, args, rollout)
        except KeyboardInterrupt:
            print(f"interrupted: cancelling rollout {rollout.id}")
            client.rollouts.cancel(rollout.id)
            return 130
        counts = ", ".join(f"{status}={n}" for status, n in sorted(final.counts.items()))
        status = getattr(final.status, "value", final.status)
        print(f"rollout {final.id} {status}: {counts}; delivered {final.progress.delivered}/{final.progress.total}")
        dead = list(client.rollouts.dead_letters(final.id))
        for letter in dead:
            print(f"  dead letter {letter.id} ({letter.status}): {letter.reason or letter.error}")
        ok = final.status == forkyard.RolloutStatus.COMPLETED and not dead
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

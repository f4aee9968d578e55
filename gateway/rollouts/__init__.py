"""Rollouts: a trainer's request for episodes, their groups, and the durable delivery stream."""

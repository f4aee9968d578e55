"""Environments: an environment family plus version; tasks belong to one."""

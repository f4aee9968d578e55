"""The environment families this worker runs, by name.

The built-in families are one line each in :data:`BUILTIN`; a third-party package
adds one with an entry point in the ``forkyard.env_families`` group naming an
:class:`~workers.envs.base.EnvFamily` object::

    [project.entry-points."forkyard.env_families"]
    chess = "forkyard_chess:FAMILY"

A family is imported the first time it is asked for.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from workers.envs.base import EnvFamily
from workers.errors import TaskFormatError

if TYPE_CHECKING:
    from workers.envs.base import EnvTask

logger = logging.getLogger(__name__)

#: Entry-point group a package adds its families to.
ENTRY_POINT_GROUP = "forkyard.env_families"
#: The families shipped with Forkyard: name -> "module:attribute".
BUILTIN: dict[str, str] = {
    "terminal": "workers.envs.terminal:FAMILY",
    "swe": "workers.envs.swe:FAMILY",
    "web": "workers.envs.web:FAMILY",
}

_loaded: dict[str, EnvFamily] = {}


def _sources() -> dict[str, str]:
    found = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in BUILTIN:
            logger.warning("ignoring entry point %s = %s: %r is a built-in family", ep.name, ep.value, ep.name)
            continue
        found[ep.name] = ep.value
    return found


def family_names() -> list[str]:
    """Return the names of every family this worker can run, sorted."""
    return sorted(_sources())


def get_family(name: str) -> EnvFamily:
    """Return the family registered as ``name``, importing it on first use.

    Raises:
        TaskFormatError: no family has that name (field ``family``).
    """
    family = _loaded.get(name)
    if family is not None:
        return family
    source = _sources().get(name)
    if source is None:
        raise TaskFormatError(
            f"unknown environment family {name!r}; the families are: {', '.join(family_names())}", field="family"
        )
    module_name, _, attribute = source.partition(":")
    family = getattr(importlib.import_module(module_name), attribute)
    if not isinstance(family, EnvFamily):
        raise TaskFormatError(f"family {source} does not implement the EnvFamily protocol "
                              "(workers.envs.base)", field="family")
    if family.name != name:
        raise TaskFormatError(f"family {source} calls itself {family.name!r}, registered as {name!r}", field="family")
    _loaded[name] = family
    return family


def configure_families(options: Mapping[str, Mapping[str, Any]]) -> None:
    """Hand each family its options (``{"swe": {"repo_store": ...}}``) through its ``configure``, if it has one.

    Options for a family that is not installed, or that takes none, are ignored.
    """
    for name, values in options.items():
        if name not in _sources():
            continue
        configure = getattr(get_family(name), "configure", None)
        if configure is not None:
            configure(**values)


def family_of(task: EnvTask) -> EnvFamily:
    """Return the family ``task`` belongs to."""
    return get_family(task.family)


__all__ = ["BUILTIN", "ENTRY_POINT_GROUP", "configure_families", "family_names", "family_of", "get_family"]

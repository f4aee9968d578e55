"""Plumbing shared by every resource namespace."""

from __future__ import annotations

from typing import Any
from urllib.parse import quote


class Resource:
    """A namespace of API calls bound to one client (subclasses annotate `_client`'s type)."""

    def __init__(self, client: Any) -> None:
        self._client = client


def path_id(value: Any, what: str) -> str:
    """Return an id made safe to put in a URL path, refusing empty ones."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty string, got {value!r}.")
    return quote(value, safe="")


def items_of(page: Any) -> list[Any]:
    """Return the items of a Page answer."""
    return list(page.items)

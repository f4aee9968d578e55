"""Keyset paging with opaque cursors over (created_at, id)."""

from __future__ import annotations

import base64
import binascii
import json
from dataclasses import dataclass
from datetime import datetime
from typing import Any, TypeVar

from sqlalchemy import Select, and_, or_
from sqlalchemy.orm import InstrumentedAttribute

from gateway.errors import BadRequestError

#: Default and largest page sizes.
DEFAULT_LIMIT = 50
MAX_LIMIT = 500

T = TypeVar("T")


@dataclass(frozen=True)
class Cursor:
    """Position after the last row of a page."""

    created_at: datetime
    id: str

    def encode(self) -> str:
        """Return the cursor as an opaque URL-safe string."""
        raw = json.dumps({"t": self.created_at.isoformat(), "i": self.id}, separators=(",", ":")).encode()
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def decode(cls, token: str) -> Cursor:
        """Parse a cursor from :meth:`encode`; raise BadRequestError if it is not one."""
        try:
            raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
            data = json.loads(raw)
            return cls(created_at=datetime.fromisoformat(data["t"]), id=str(data["i"]))
        except (binascii.Error, ValueError, KeyError, TypeError) as exc:
            raise BadRequestError("The cursor is not valid; pass the `next` value of a previous page.") from exc


def paginate(
    stmt: Select[Any], *, created_at: InstrumentedAttribute[Any], id_: InstrumentedAttribute[Any],
    cursor: str | None, limit: int,
) -> Select[Any]:
    """Return ``stmt`` ordered by (created_at, id), after ``cursor``, with one extra row to detect a next page."""
    if cursor:
        pos = Cursor.decode(cursor)
        stmt = stmt.where(or_(created_at > pos.created_at, and_(created_at == pos.created_at, id_ > pos.id)))
    return stmt.order_by(created_at, id_).limit(limit + 1)


def page_of(rows: list[T], *, limit: int) -> tuple[list[T], str | None]:
    """Split the rows of :func:`paginate` into (the page, the next cursor or None)."""
    if len(rows) <= limit:
        return rows, None
    page = rows[:limit]
    last: Any = page[-1]
    return page, Cursor(created_at=last.created_at, id=last.id).encode()

"""The console's tables: signed-in operators' sessions and the audit log of their actions."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import JSON, String
from sqlalchemy.orm import Mapped, mapped_column

from gateway.db import Base, utcnow


class AdminSession(Base):
    """One signed-in console session; only a hash of the cookie's secret is stored."""

    __tablename__ = "admin_session"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str] = mapped_column(String(40))
    csrf_token: Mapped[str] = mapped_column(String(64))
    """Every form and htmx request of the session carries it; a request without it is refused."""
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(default=utcnow)


class AuditEntry(Base):
    """One action an operator took in the console: who, what, on what, when."""

    __tablename__ = "audit_log"

    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    at: Mapped[datetime] = mapped_column(default=utcnow, index=True)
    key_id: Mapped[str] = mapped_column(String(40))
    key_prefix: Mapped[str] = mapped_column(String(16))
    action: Mapped[str] = mapped_column(String(64))
    target: Mapped[str] = mapped_column(String(300))
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

"""The bearer-token dependency every ``/v1`` route requires."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from gateway.auth import service
from gateway.dependencies import DbSession
from gateway.errors import UnauthorizedError

_bearer = HTTPBearer(auto_error=False, description="An API key: `Authorization: Bearer fy_...`.")


async def require_api_key(
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)], db_session: DbSession
) -> str:
    """Return the id of the caller's API key or answer 401."""
    if credentials is None:
        raise UnauthorizedError("Missing API key: send the header `Authorization: Bearer <key>`.")
    key_id = await service.authenticated_key_id(db_session=db_session, key=credentials.credentials)
    if key_id is None:
        raise UnauthorizedError("The API key is not valid (unknown or revoked).")
    return key_id

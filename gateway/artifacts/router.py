"""Artifact routes: ``GET /v1/artifacts/{id}``."""

from __future__ import annotations

from fastapi import APIRouter, Response

from gateway.artifacts import service
from gateway.dependencies import DbSession

router = APIRouter(tags=["artifacts"])


@router.get("/artifacts/{artifact_id}", response_class=Response,
            responses={200: {"content": {"image/png": {}, "application/octet-stream": {}},
                             "description": "The file's bytes, with its media type."}})
async def get_artifact(artifact_id: str, db_session: DbSession) -> Response:
    """Return a file a step made (a screenshot), by the id its step linked."""
    data, media_type = await service.read_artifact(db_session=db_session, ident=artifact_id)
    return Response(content=data, media_type=media_type,
                    headers={"Cache-Control": "private, max-age=31536000, immutable"})

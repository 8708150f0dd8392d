"""``GET /api/v1/downloads/external/…``: one file of external weights by a signed link
(``get_external_weights_urls``, :mod:`.sharing`), with no API key: the signature is the
permission. Public like ``/api/v1/openapi.json``, so it is left out of the Tinker OpenAPI
document (whose operations all need a key)."""

from __future__ import annotations

from pathlib import Path

from fastapi import Depends, Query, Request, Response
from fastapi.responses import FileResponse

from opentinker.server.errors import not_found
from opentinker.server.signed_urls import check_link, quoted
from opentinker.server.tinker import sharing
from opentinker.server.tinker.service import TinkerService
from opentinker.server.tinker.routes.common import service, tinker_router

router = tinker_router()
DOWNLOADS = ("api", "v1", "downloads", "external")  # this route's path, quoted part by part


def link_path(run_id: str, name: str, write: str, file: str) -> str:
    """The path a link to ``file`` of that write of an external checkpoint names (and signs)."""
    return quoted(*DOWNLOADS, run_id, name, write, *file.split("/"))


@router.get("/downloads/external/{run_id}/{name}/{write}/{file:path}")
async def download_external(request: Request, run_id: str, name: str, write: str, file: str,
                            expires: str | None = Query(None, max_length=32),
                            signature: str | None = Query(None, max_length=128),
                            svc: TinkerService = Depends(service)) -> Response:
    """401 with no signature at all (like every Tinker route with no credential); 403 when the
    link is expired or altered (its path and expiry are signed together); 404 once the
    checkpoint (that write of it) is deleted, or for a file not inside its folder."""
    check_link(svc.signer, link_path(run_id, name, write, file), expires, signature,
               "RestClient.get_external_weights_urls")
    row = svc.state.checkpoint(run_id, "external_weights", name, None)
    if row is None or sharing.write_id(row) != write:
        raise not_found(f"checkpoint tinker://{run_id}/external_weights/{name}")
    target = sharing.file_in(Path(row.folder), file)
    if target is None:
        raise not_found(f"file {file!r} of tinker://{run_id}/external_weights/{name}")
    owner = svc.state.store.user_by_id(row.user_id)
    svc.audit.record_request(request, "checkpoint_download", owner, tinker_path=row.tinker_path, file=file)
    return FileResponse(target, media_type="application/octet-stream")


download_external.undocumented = True  # public: not in the Tinker OpenAPI document

"""Training runs (a model's record) and their checkpoints: list, get, delete, weights_info.

A user sees their own runs and checkpoints, and of another user's run only what its owner
published: the run (read-only) and its published checkpoints. Anything else reads as missing.
"""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Path, Query, Request, Response

from opentinker.protocol import MAX_INT
from opentinker.server.errors import not_found
from opentinker.server.store import User
from opentinker.server.tinker import schemas
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.service import CHECKPOINT_KINDS, TinkerService
from opentinker.server.tinker.state import CheckpointRow, ModelRow, unembed_adapted
from opentinker.server.tinker.routes.common import (
    iso,
    owned_checkpoint,
    readable_checkpoint,
    record_denied,
    service,
    tinker_router,
    tinker_user,
)

router = tinker_router()


def checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    return {"checkpoint_id": f"{row.kind}/{row.name}", "checkpoint_type": CHECKPOINT_KINDS[row.kind],
            "time": iso(row.created_at), "tinker_path": row.tinker_path, "size_bytes": row.size_bytes,
            "public": row.public, "user_metadata": row.metadata, "expires_at": iso(row.expires_at)}


def _training_run_json(model: ModelRow, owner: str, checkpoints: list[CheckpointRow]) -> dict[str, Any]:
    newest = {kind: next((c for c in reversed(checkpoints) if c.kind == kind), None) for kind in CHECKPOINT_KINDS}
    return {"training_run_id": model.model_id, "base_model": model.base_model, "model_owner": owner,
            "is_lora": model.lora_rank > 0, "corrupted": False, "lora_rank": model.lora_rank or None,
            "last_request_time": iso(model.last_request_at),
            "last_checkpoint": newest["weights"] and checkpoint_json(newest["weights"]),
            "last_sampler_checkpoint": newest["sampler_weights"] and checkpoint_json(newest["sampler_weights"]),
            "user_metadata": model.metadata}


@router.get("/training_runs")
async def list_training_runs(limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0, le=MAX_INT),
                             user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> dict[str, Any]:
    models = svc.state.models(user.id)
    page = models[offset:offset + limit]
    return {"training_runs": [_training_run_json(m, user.name, svc.state.checkpoints(user.id, m.model_id))
                              for m in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(models)}}


def _visible_run(svc: TinkerService, run_id: str, user: User, request: Request
                 ) -> tuple[ModelRow, str, list[CheckpointRow]]:
    """The run, its owner's name and the checkpoints the caller sees of it: all of their own
    run's, the published ones of another user's (a run with none reads as missing)."""
    model = svc.state.model(run_id)
    if model is not None and model.user_id == user.id:
        return model, user.name, svc.state.checkpoints(user.id, run_id)
    published = svc.state.public_checkpoints(run_id) if model is not None else []
    if not published:
        if model is not None:
            record_denied(svc, request, user, model.user_id, training_run=run_id, action="read")
        raise not_found(f"training run {run_id!r}")
    owner = svc.state.store.user_by_id(model.user_id)
    return model, owner.name if owner else "", published


@router.get("/training_runs/{run_id}", responses=errors(404))
async def get_training_run(request: Request, run_id: str = Path(max_length=256), user: User = Depends(tinker_user),
                           svc: TinkerService = Depends(service)) -> dict[str, Any]:
    return _training_run_json(*_visible_run(svc, run_id, user, request))


@router.get("/training_runs/{run_id}/checkpoints", responses=errors(404))
async def list_run_checkpoints(request: Request, run_id: str = Path(max_length=256), user: User = Depends(tinker_user),
                               svc: TinkerService = Depends(service)) -> dict[str, Any]:
    _, _, checkpoints = _visible_run(svc, run_id, user, request)
    return {"checkpoints": [checkpoint_json(c) for c in checkpoints]}


@router.get("/checkpoints")
async def list_checkpoints(user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> dict[str, Any]:
    return {"checkpoints": [checkpoint_json(c) for c in svc.state.checkpoints(user.id)]}


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}", status_code=204, responses=errors(400, 403, 404))
async def delete_checkpoint(request: Request, run_id: str = Path(max_length=256), kind: str = Path(max_length=32),
                            name: str = Path(max_length=256), user: User = Depends(tinker_user),
                            svc: TinkerService = Depends(service)) -> Response:
    """Deletes the caller's checkpoint (its files go once no copy names them); another user's
    published one is a 403."""
    row = owned_checkpoint(svc, f"tinker://{run_id}/{kind}/{name}", user, request=request)
    svc.delete_checkpoint(row)
    svc.audit.record_request(request, "checkpoint_delete", user, tinker_path=row.tinker_path)
    return Response(status_code=204)


@router.post("/weights_info", responses=errors(400, 404))
async def weights_info(body: schemas.WeightsInfo, request: Request, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    row = readable_checkpoint(svc, body.tinker_path, user, request=request)
    model = svc.state.model(row.run_id)
    if model is None:
        raise not_found(f"checkpoint {body.tinker_path!r}")
    spec = model.spec
    return {"base_model": model.base_model, "is_lora": model.lora_rank > 0, "lora_rank": model.lora_rank or None,
            "train_attn": spec.get("train_attn"), "train_mlp": spec.get("train_mlp"),
            "train_unembed": unembed_adapted(spec),
            "optimizer_config": {"type": "adamw"}}

"""Training runs (a model's record) and their checkpoints: list, get, delete, weights_info."""

from __future__ import annotations

from typing import Any

from fastapi import Depends, Path, Query, Response

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
    service,
    tinker_router,
    tinker_user,
)

router = tinker_router()


def _checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    return {"checkpoint_id": f"{row.kind}/{row.name}", "checkpoint_type": CHECKPOINT_KINDS[row.kind],
            "time": iso(row.created_at), "tinker_path": row.tinker_path, "size_bytes": row.size_bytes,
            "public": False, "user_metadata": row.metadata, "expires_at": iso(row.expires_at)}


def _training_run_json(svc: TinkerService, model: ModelRow, user: User) -> dict[str, Any]:
    checkpoints = svc.state.checkpoints(user.id, model.model_id)
    newest = {kind: next((c for c in reversed(checkpoints) if c.kind == kind), None) for kind in CHECKPOINT_KINDS}
    return {"training_run_id": model.model_id, "base_model": model.base_model, "model_owner": user.name,
            "is_lora": model.lora_rank > 0, "corrupted": False, "lora_rank": model.lora_rank or None,
            "last_request_time": iso(model.last_request_at),
            "last_checkpoint": newest["weights"] and _checkpoint_json(newest["weights"]),
            "last_sampler_checkpoint": newest["sampler_weights"] and _checkpoint_json(newest["sampler_weights"]),
            "user_metadata": model.metadata}


@router.get("/training_runs")
async def list_training_runs(limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0, le=MAX_INT),
                             user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> dict[str, Any]:
    models = svc.state.models(user.id)
    page = models[offset:offset + limit]
    return {"training_runs": [_training_run_json(svc, m, user) for m in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(models)}}


def _owned_run(svc: TinkerService, run_id: str, user: User) -> ModelRow:
    model = svc.state.model(run_id, user.id)
    if model is None:
        raise not_found(f"training run {run_id!r}")
    return model


@router.get("/training_runs/{run_id}", responses=errors(404))
async def get_training_run(run_id: str = Path(max_length=256), user: User = Depends(tinker_user),
                           svc: TinkerService = Depends(service)) -> dict[str, Any]:
    return _training_run_json(svc, _owned_run(svc, run_id, user), user)


@router.get("/training_runs/{run_id}/checkpoints", responses=errors(404))
async def list_run_checkpoints(run_id: str = Path(max_length=256), user: User = Depends(tinker_user),
                               svc: TinkerService = Depends(service)) -> dict[str, Any]:
    _owned_run(svc, run_id, user)
    return {"checkpoints": [_checkpoint_json(c) for c in svc.state.checkpoints(user.id, run_id)]}


@router.get("/checkpoints")
async def list_checkpoints(user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> dict[str, Any]:
    return {"checkpoints": [_checkpoint_json(c) for c in svc.state.checkpoints(user.id)]}


@router.delete("/training_runs/{run_id}/checkpoints/{kind}/{name}", status_code=204, responses=errors(400, 404))
async def delete_checkpoint(run_id: str = Path(max_length=256), kind: str = Path(max_length=32),
                            name: str = Path(max_length=256), user: User = Depends(tinker_user),
                            svc: TinkerService = Depends(service)) -> Response:
    row = owned_checkpoint(svc, f"tinker://{run_id}/{kind}/{name}", user)
    svc.delete_checkpoint(row)
    return Response(status_code=204)


@router.post("/weights_info", responses=errors(400, 404))
async def weights_info(body: schemas.WeightsInfo, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    row = owned_checkpoint(svc, body.tinker_path, user)
    model = _owned_run(svc, row.run_id, user)
    spec = model.spec
    return {"base_model": model.base_model, "is_lora": model.lora_rank > 0, "lora_rank": model.lora_rank or None,
            "train_attn": spec.get("train_attn"), "train_mlp": spec.get("train_mlp"),
            "train_unembed": unembed_adapted(spec),
            "optimizer_config": {"type": "adamw"}}

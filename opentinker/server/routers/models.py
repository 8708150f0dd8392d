"""``GET /v1/models``: what ``actor_rollout_ref.model.path`` (and ``algorithm.judge.model``) may name.

Names only: where a model lives on the server is the operator's business.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends

from opentinker.protocol import ModelList, ServedModelInfo
from opentinker.server.auth import current_user
from opentinker.server.deps import get_settings
from opentinker.server.errors import AUTHENTICATED_ERRORS
from opentinker.server.settings import ServerSettings

router = APIRouter(tags=["models"], dependencies=[Depends(current_user)], responses=AUTHENTICATED_ERRORS)


@router.get("/models", response_model=ModelList, summary="The models jobs may train here")
async def list_models(settings: ServerSettings = Depends(get_settings)) -> ModelList:
    policy = settings.job_policy
    return ModelList(
        models=[ServedModelInfo(name=m.name, default=m is policy.default_model) for m in policy.models],
        judge_models=list(policy.judge_models),
    )

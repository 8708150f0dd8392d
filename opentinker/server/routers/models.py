"""``GET /v1/models``: what ``actor_rollout_ref.model.path`` (and ``algorithm.judge.model``) may name;
``GET /v1/models/{name}/tokenizer``: a served model's tokenizer files.

Names only: where a model lives on the server is the operator's business. The tokenizer route
hands out only the files of a fixed list (tokenizer and config files, never weights) of a
model the operator serves.
"""

from __future__ import annotations

import base64

from fastapi import APIRouter, Depends, Path
from starlette.concurrency import run_in_threadpool

from opentinker.protocol import ModelList, ServedModelInfo, TokenizerFiles
from opentinker.server.auth import current_user
from opentinker.server.deps import get_settings
from opentinker.server.errors import AUTHENTICATED_ERRORS, ApiError, error_responses, not_found
from opentinker.server.settings import ServerSettings

router = APIRouter(tags=["models"], dependencies=[Depends(current_user)], responses=AUTHENTICATED_ERRORS)


@router.get("/models", response_model=ModelList, summary="The models jobs may train here")
async def list_models(settings: ServerSettings = Depends(get_settings)) -> ModelList:
    policy = settings.job_policy
    return ModelList(
        models=[ServedModelInfo(name=m.name, default=m is policy.default_model) for m in policy.models],
        judge_models=list(policy.judge_models),
    )


#: What a tokenizer is made of (transformers' file names), plus the model config that
#: ``AutoTokenizer`` reads to pick the tokenizer class. Never weights.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
                   "config.json", "generation_config.json")


def _tokenizer_files(folder) -> dict[str, str]:
    return {name: base64.b64encode((folder / name).read_bytes()).decode("ascii")
            for name in TOKENIZER_FILES if (folder / name).is_file()}


@router.get("/models/{name:path}/tokenizer", response_model=TokenizerFiles,
            summary="A served model's tokenizer files", responses=error_responses(404))
async def tokenizer(name: str = Path(max_length=512),
                    settings: ServerSettings = Depends(get_settings)) -> TokenizerFiles:
    from opentinker.server.tinker.model_facts import model_folder

    served = next((m for m in settings.job_policy.models if m.name == name), None)
    if served is None:
        raise ApiError(404, f"model {name!r} is not served here; served: {', '.join(settings.job_policy.model_names())}")
    folder = await run_in_threadpool(model_folder, served)
    files = {} if folder is None else await run_in_threadpool(_tokenizer_files, folder)
    if "tokenizer_config.json" not in files:
        raise not_found(f"the tokenizer of {name!r}: its files are not on the server yet (it is built or "
                        "downloaded on first use)")
    return TokenizerFiles(model=name, files=files)

"""Sampling: sampling sessions and ``asample`` (run in the background; the result is a future)."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import Depends, Path, Request

from opentinker.images import ImageError, data_url_payload
from opentinker.server.errors import ApiError, not_found
from opentinker.server.store import User
from opentinker.server.tinker import metering, schemas, wire
from opentinker.server.tinker.openapi import errors
from opentinker.engine.tinker import DEFAULT_MAX_TOKENS
from opentinker.server.tinker.futures import PROTOBUF
from opentinker.server.tinker.workers import UserError, await_ref
from opentinker.server.tinker.sample_budget import OverBudget
from opentinker.server.tinker.service import TinkerService
from opentinker.server.tinker.state import SamplerRow
from opentinker.server.tinker.routes.common import (
    active_session,
    readable_checkpoint,
    service,
    tinker_router,
    tinker_user,
    user_error,
)

router = tinker_router()


def _sampler_source(svc: TinkerService, user: User, base_model: str | None, model_path: str | None,
                    request: Request) -> tuple[str, str | None]:
    """``(base model name, tinker path or None)`` of what a sampler samples from (the caller's
    checkpoint or a published one)."""
    if (base_model is None) == (model_path is None):
        raise user_error("give exactly one of base_model and model_path")
    if model_path is not None:
        checkpoint = readable_checkpoint(svc, model_path, user, "sampler_weights", request, loads=True)
        source = svc.state.model(checkpoint.run_id)
        return source.base_model, model_path
    try:
        return svc.served_model(base_model).name, None
    except UserError as error:
        raise user_error(str(error)) from None


@router.post("/create_sampling_session", responses=errors(400, 404))
async def create_sampling_session(body: schemas.CreateSamplingSession, request: Request,
                                  user: User = Depends(tinker_user),
                                  svc: TinkerService = Depends(service)) -> dict[str, Any]:
    active_session(svc, body.session_id, user)
    base_model, model_path = _sampler_source(svc, user, body.base_model, body.model_path, request)
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    svc.state.add_sampler(SamplerRow(sampler_id, user.id, body.session_id, base_model, model_path))
    return {"sampling_session_id": sampler_id, "type": "create_sampling_session"}


@router.get("/samplers/{sampler_id}", responses=errors(404))
async def get_sampler(sampler_id: str = Path(max_length=256), user: User = Depends(tinker_user),
                      svc: TinkerService = Depends(service)) -> dict[str, Any]:
    sampler = svc.state.sampler(sampler_id, user.id)
    if sampler is None:
        raise not_found(f"sampler {sampler_id!r}")
    return {"sampler_id": sampler.sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}


def _refuse_sample_options(body: schemas.SampleRequest) -> None:
    refused = {
        "target_prompt_logprobs": body.target_prompt_logprobs is not None,
    }
    # record_stability_info is accepted: the SDK only needs each sequence's id (the future's
    # sample_sequence_ids, always sent), and this server's 'stable_reinforce' records nothing.
    named = [name for name, asked in refused.items() if asked]
    if named:
        raise user_error(f"asample: not supported by this server: {', '.join(named)}")
    chunks = [chunk for chunk in body.prompt.chunks if isinstance(chunk, schemas.OtherChunk)]
    if chunks:
        kind = chunks[0].type
        why = (" (the server reads no file or URL a client names; send the picture's bytes as an image chunk)"
               if kind == "image_asset_pointer" else "")
        raise user_error(f"asample: prompt chunks of type {kind!r} are not supported (token and image chunks){why}")


def _prompt(svc: TinkerService, base_model: str, chunks: list) -> tuple[list[int], list[bytes]]:
    """The prompt's token ids (each picture as its image tokens) and its pictures' files."""
    tokens: list[int] = []
    files: list[bytes] = []
    reading = None
    for index, chunk in enumerate(chunks):
        if isinstance(chunk, schemas.EncodedText):
            tokens.extend(chunk.tokens)
            continue
        where = f"prompt.chunks[{index}]"
        reading = reading or svc.picture_reading(base_model)
        if reading is None:
            raise user_error(f"{where}: an image chunk, but this model is not a vision-language model")
        if chunk.format not in ("png", "jpeg"):
            raise user_error(f"{where}: image format {chunk.format!r}; expected png or jpeg")
        try:
            data = data_url_payload(f"data:image/{chunk.format};base64,{chunk.data}", reading.limits)
            tokens.extend(reading.image_tokens(data, chunk.format, chunk.expected_tokens, where).tolist())
        except (ImageError, wire.WireError) as error:
            raise user_error(f"{where}: {error}" if isinstance(error, ImageError) else str(error)) from None
        files.append(data)
    return tokens, files


def _engine_params(params: schemas.SamplingParams) -> dict[str, Any]:
    """Tinker's sampling params as the rollout engine's: ``stop`` None keeps end-of-sequence
    stopping, ``[]`` turns every stop off, strings and token ids are both stops."""
    stop = params.stop
    fields: dict[str, Any] = {"temperature": params.temperature, "top_p": params.top_p, "top_k": params.top_k,
                              "max_tokens": params.max_tokens, "seed": params.seed}
    if isinstance(stop, str):
        fields["stop"] = (stop,)
    elif stop == []:
        fields["ignore_eos"] = True
    elif stop and isinstance(stop[0], str):
        fields["stop"] = tuple(stop)
    elif stop:
        fields["stop_token_ids"] = tuple(int(token) for token in stop)
    return fields


@router.post("/asample", responses=errors(400, 404, 429))
async def asample(body: schemas.SampleRequest, request: Request, user: User = Depends(tinker_user),
                  svc: TinkerService = Depends(service)) -> dict[str, Any]:
    _refuse_sample_options(body)
    session_id = None  # whom the usage is attributed to: the sampler's session
    if body.sampling_session_id is not None:
        sampler = svc.state.sampler(body.sampling_session_id, user.id)
        if sampler is None:
            raise not_found(f"sampler {body.sampling_session_id!r}")
        base_model, model_path, session_id = sampler.base_model, sampler.model_path, sampler.session_id
    else:
        base_model, model_path = _sampler_source(svc, user, body.base_model, body.model_path, request)
    # Again for a sampler's path: its checkpoint may have been deleted or unpublished since.
    snapshot = readable_checkpoint(svc, model_path, user, "sampler_weights", request).folder if model_path else ""
    prompt, pictures = _prompt(svc, base_model, body.prompt.chunks)
    if not prompt or min(prompt) < 0:
        raise user_error("asample: the prompt needs at least one token, and token ids are not negative")
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and not (body.prompt_logprobs and last_n <= len(prompt) - 1):
        raise user_error("prompt_logprobs_last_n needs prompt_logprobs and must be at most len(prompt) - 1")
    if svc.futures.pending_count(user.id, "Sample") >= svc.settings.max_pending_samples:
        raise ApiError(429, f"over {svc.settings.max_pending_samples} samples waiting; back off and resubmit",
                       headers={"Retry-After": "1"})
    served = svc.served_model(base_model)
    params = _engine_params(body.sampling_params)
    # What the call may generate at most (no max_tokens: the sampler's default, its upper bound).
    cost = body.num_samples * (params["max_tokens"] or DEFAULT_MAX_TOKENS)
    # The sampled tokens' top-k are 8 bytes a cell in the result: bounded per call, before any work.
    if cost * body.topk_sample_logprobs > schemas.MAX_TOPK_SAMPLE_CELLS:
        raise user_error(f"topk_sample_logprobs: num_samples x max_tokens x topk_sample_logprobs is "
                         f"{cost * body.topk_sample_logprobs:,} cells, more than this server returns for one call "
                         f"({schemas.MAX_TOPK_SAMPLE_CELLS:,}); ask a smaller k, fewer samples or fewer tokens")
    try:
        svc.sample_budget.reserve(user.id, cost)
    except OverBudget as error:
        if error.retry:
            raise ApiError(429, str(error), headers={"Retry-After": "1"}) from None
        raise user_error(str(error)) from None
    request_id = uuid.uuid4().hex
    ids = [f"{request_id}:{index}" for index in range(body.num_samples)]
    row = svc.futures.add(user.id, "Sample", extra={"sample_sequence_ids": ids}, request_id=request_id,
                          session_id=session_id, trace_args={"sampler": body.sampling_session_id,
                                                             "prompt_tokens": len(prompt),
                                                             "num_samples": body.num_samples,
                                                             "max_tokens": params["max_tokens"]})
    call = {"snapshot": snapshot, "prompt": prompt, "params": params, "user": user.id,
            "num_samples": body.num_samples, "prompt_logprobs": bool(body.prompt_logprobs),
            "topk_prompt": body.topk_prompt_logprobs, "last_n": last_n, "pictures": pictures,
            "topk_sample": body.topk_sample_logprobs, "alt_k": body.prompt_alt_tokens_k}
    # Reported to the session's retrieve_futures feed (a cloned sampling client: seq_id // 1e9).
    feed = None if body.sampling_session_id is None else (body.sampling_session_id, (body.seq_id or 0) // 10**9)
    usage = metering.SampleUsage(user.id, session_id, served.name, len(prompt))
    svc.spawn(_sample(svc, served, call, request_id, cost, feed, usage))
    return row.submit_answer()


async def _sample(svc: TinkerService, served: Any, call: dict[str, Any], request_id: str, cost: int,
                  feed: tuple[str, int] | None, usage: metering.SampleUsage) -> None:
    from opentinker.server.tinker.workers import failure

    try:
        actor = await svc.host.sampler(served.name, served.path, served.trust_remote_code)
        started = metering.clock()
        svc.futures.started(request_id)  # handed to the sampler: its trace's start
        result = await await_ref(actor.sample.remote(call))
    except Exception as error:
        svc.futures.fail(request_id, *failure(error))
        if feed is not None:
            svc.completions.add(call["user"], *feed, request_id, failed=True)
        return
    finally:
        svc.sample_budget.release(call["user"], cost)
    metering.sampled(svc, usage, result["sequences"], started)
    topk = result.get("sample_topk") or [None] * len(result["sequences"])
    sequences = [wire.SampledSequence(tokens, logprobs, reason, top)
                 for (tokens, logprobs, reason), top in zip(result["sequences"], topk)]
    payload = wire.encode_sample_response(sequences, result.get("prompt_logprobs"), result.get("topk_prompt"),
                                          result.get("prompt_alt"))
    svc.futures.resolve(request_id, payload, PROTOBUF)
    if feed is not None:
        svc.completions.add(call["user"], *feed, request_id, failed=False, payload_size=len(payload))

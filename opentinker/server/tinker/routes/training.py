"""Training clients: create (or load from a checkpoint), info, unload, forward_backward,
optim_step, save_weights, save_weights_for_sampler, load_weights."""

from __future__ import annotations

import shutil
import uuid
from pathlib import Path
from typing import Any

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from opentinker.engine.backend.spec import BackendSpec
from opentinker.engine.tinker.calls import model_backend_spec
from opentinker.server.errors import ApiError, not_found
from opentinker.server.store import User
from opentinker.server.tinker import metering, openapi, schemas, sharing, wire
from opentinker.server.tinker.openapi import errors
from opentinker.server.tinker.futures import JSON, PROTOBUF
from opentinker.server.tinker.workers import UserError
from opentinker.server.tinker.checkpoint_quota import QuotaExceeded
from opentinker.server.tinker.service import ServerFull, TinkerService
from opentinker.server.tinker.state import CheckpointRow, ModelRow, SamplerRow, unembed_adapted
from opentinker.server.tinker.routes.common import (
    active_session,
    readable_checkpoint,
    refuse_seq,
    service,
    submit,
    tinker_router,
    tinker_user,
    usable_model,
    user_error,
)

router = tinker_router()


def _backend_spec(svc: TinkerService, model: Any, lora: dict[str, Any]) -> BackendSpec:
    """The backend a model recorded with ``lora`` (its create request's lora_config) trains on;
    ValueError for a lora_config with nothing to train."""
    host = svc.settings.host
    return model_backend_spec(model.path, lora_rank=int(lora.get("lora_rank") or 0), seed=int(lora.get("seed") or 0),
                              train_attn=bool(lora.get("train_attn", True)), train_mlp=bool(lora.get("train_mlp", True)),
                              train_unembed=unembed_adapted(lora), trust_remote_code=model.trust_remote_code,
                              strategy=host.strategy, device=host.device, ranks=host.ranks)


def _start_model(svc: TinkerService, user: User, session_id: str, model_seq_id: int, base_model: str,
                 spec: dict[str, Any], metadata: dict[str, str] | None, kind: str,
                 load: tuple[str, bool] | None = None, load_path: str | None = None,
                 request: Request | None = None) -> dict[str, Any]:
    model_id = f"{session_id}:train:{model_seq_id}"
    existing = svc.state.model(model_id)
    if existing is not None:  # a re-sent create: its first future (seq 0 stands for the create)
        if existing.user_id != user.id:
            raise not_found(f"session {session_id!r}")
        row, _ = svc.futures.create(user.id, kind, model_id, 0)
        return row.submit_answer()
    settings = svc.settings
    in_use = len(svc.models_in_use(user.id))
    if in_use >= settings.max_models_per_user:
        raise user_error(f"you have {settings.max_models_per_user} models in use, the most this server allows per "
                          "user (--tinker-max-models-per-user); end a ServiceClient session or unload a model first "
                          f"(a LoRA model unused for {settings.idle_model_s:g} s is idle and does not count)")
    idle = svc.idle_models(user.id)
    if idle and in_use + idle >= settings.max_models_per_user + settings.max_idle_models_per_user:
        raise user_error(f"you have {idle} idle LoRA models, and this server keeps at most "
                          f"{settings.max_idle_models_per_user} per user besides those in use "
                          "(--tinker-max-idle-models-per-user); end the ServiceClient sessions that made them or "
                          "unload some first")
    served = svc.served_model(base_model)
    rank = int(spec.get("lora_rank") or 0)
    max_rank, why = svc.max_lora_rank(served)
    if rank > max_rank:
        raise user_error(f"LoRA rank {rank} is more than this server allows for {served.name}: at most {max_rank} "
                         f"({why}); each unit of rank costs memory in the trainer, the sampler and every checkpoint")
    try:
        backend_spec = _backend_spec(svc, served, spec)
    except ValueError as error:
        raise user_error(str(error)) from None
    try:  # server-wide: the live models and their estimated memory, whoever's
        memory = svc.admit_model(served, backend_spec)
    except ServerFull as error:
        raise ApiError(429, str(error), headers={"Retry-After": "10"}) from None
    svc.state.add_model(model_id, session_id, user.id, served.name, spec, metadata)
    if request is not None:
        svc.audit.record_request(request, "model_create", user, model_id=model_id, base_model=served.name,
                                 lora_rank=rank, session_id=session_id, tinker_path=load_path)
    row = svc.futures.add(user.id, kind, model_id, 0)  # a new model: no future yet
    answer = {"model_id": model_id} if load_path is None else {"model_id": model_id, "path": load_path}
    svc.host.start_model(model_id, user.id, backend_spec, row.request_id, answer, load, memory)
    return row.submit_answer()


@router.post("/create_model", responses=errors(400, 404, 429))
async def create_model(request: Request, body: schemas.CreateModel, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    active_session(svc, body.session_id, user)
    if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
        raise user_error(f"optimizer_config.type {body.optimizer_config.type!r} is not supported; this server "
                          "trains with 'adamw'")
    lora = body.lora_config
    spec = {"lora_rank": 0} if lora is None else {
        "lora_rank": lora.rank, "seed": lora.seed or 0, "train_attn": lora.train_attn, "train_mlp": lora.train_mlp,
        "train_unembed": lora.train_unembed, "adapts_unembed": True}
    spec["named_as"] = body.base_model  # get_info gives the client's own name back (the SDK's get_tokenizer)
    try:
        return _start_model(svc, user, body.session_id, body.model_seq_id, body.base_model, spec,
                            body.user_metadata, "CreateModel", request=request)
    except UserError as error:
        raise user_error(str(error)) from None


@router.post("/get_info", responses=errors(404))
async def get_info(body: schemas.ModelRef, user: User = Depends(tinker_user),
                   svc: TinkerService = Depends(service)) -> dict[str, Any]:
    model = svc.state.model(body.model_id, user.id)
    if model is None:
        raise not_found(f"model {body.model_id!r}")
    # The name the client created it with (a served name, or the folder the cookbook loads its
    # tokenizer from): the SDK's get_tokenizer() loads that; the server's own paths stay private.
    name = model.spec.get("named_as", model.base_model)
    return {"model_id": model.model_id, "type": "get_info", "model_data": {"model_name": name, "tokenizer_id": name},
            "is_lora": model.lora_rank > 0, "lora_rank": model.lora_rank or None, "model_name": name}


@router.post("/unload_model", responses=errors(404))
async def unload_model(request: Request, body: schemas.ModelRef, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    if svc.state.model(body.model_id, user.id) is None:
        raise not_found(f"model {body.model_id!r}")
    await svc.host.unload(body.model_id)
    svc.audit.record_request(request, "model_unload", user, model_id=body.model_id)
    return {"model_id": body.model_id, "type": "unload_model"}


#: A forward_backward body up to this size (compressed, and again decompressed) is read on the
#: event loop: that takes well under a millisecond, less than a hop to the thread pool does.
#: Larger ones (a chunk of 1024 datums) are read off the loop.
ON_LOOP_BODY_BYTES = 32 * 1024


def _decompressed(encoding: str, body: bytes, limit: int) -> bytes | None:
    """``body`` decoded, or None if it decodes to more than ``limit`` bytes."""
    if encoding in ("", "identity"):
        return body if len(body) <= limit else None
    if encoding != "zstd":
        raise user_error(f"Content-Encoding {encoding!r} is not accepted (zstd or none)")
    import zstandard

    reader = zstandard.ZstdDecompressor().stream_reader(body)
    try:
        out = reader.read(limit + 1)
    except zstandard.ZstdError as error:
        raise user_error(f"the body is not valid zstd ({error})") from None
    return out if len(out) <= limit else None


async def _on_loop_if_small(size: int, fn, *args):
    return fn(*args) if size <= ON_LOOP_BODY_BYTES else await run_in_threadpool(fn, *args)


async def _forward_backward_body(request: Request) -> bytes:
    body = await request.body()
    encoding = request.headers.get("content-encoding", "").lower()
    limit = request.app.state.settings.max_body_bytes
    out = _decompressed(encoding, body, ON_LOOP_BODY_BYTES) if len(body) <= ON_LOOP_BODY_BYTES else None
    if out is None:
        out = await run_in_threadpool(_decompressed, encoding, body, limit)
    if out is None:
        raise ApiError(413, f"the decompressed body is over {limit} bytes")
    return out


def _context(svc: TinkerService, model: ModelRow) -> int | None:
    try:
        return svc.context_length(model.base_model)
    except UserError:  # no longer served (the operator's flags changed): the worker checks it
        return None


def _pictures(svc: TinkerService, model: ModelRow):
    try:
        return svc.picture_reading(model.base_model)
    except UserError:
        return None


@router.post("/forward_backward", openapi_extra=openapi.binary_body(), responses=errors(400, 404, 429))
async def forward_backward(request: Request, user: User = Depends(tinker_user),
                           svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """Protobuf ``ForwardBackwardRequest`` in (zstd accepted); the future's result is a
    protobuf ``ForwardBackwardOutput``. ``forward_only`` leaves the gradients alone. Each
    datum must fit the model's context (its input tokens plus the last target)."""
    body = await _forward_backward_body(request)
    try:
        message = await _on_loop_if_small(len(body), wire.parse_forward_backward, body)
    except wire.WireError as error:
        raise user_error(str(error)) from None
    model = usable_model(svc, message.model_id, user)
    try:
        call = await _on_loop_if_small(len(body), wire.decode_forward_backward, message, _context(svc, model),
                                       _pictures(svc, model))
    except wire.WireError as error:
        refuse_seq(svc, message.model_id, message.seq_id or None, user)
        raise user_error(str(error)) from None
    data = [(datum.tokens, datum.inputs) for datum in call.data]
    tokens = metering.datum_tokens(call.data)

    async def run(handle):
        started = metering.clock()
        out = await handle.forward_backward(data, call.loss_fn, call.loss_config, call.forward_only)
        metering.trained(svc, model, handle, tokens, started)
        return wire.encode_forward_backward_output(out["outputs"], out["metrics"]), PROTOBUF

    return submit(svc, user, call.model_id, call.seq_id, "Forward" if call.forward_only else "ForwardBackward", run,
                  trace_args={"datums": len(data), "tokens": tokens})


@router.post("/optim_step", responses=errors(400, 404, 429))
async def optim_step(body: schemas.OptimStep, user: User = Depends(tinker_user),
                     svc: TinkerService = Depends(service)) -> dict[str, Any]:
    model = usable_model(svc, body.model_id, user)
    if body.adam_params is None:
        refuse_seq(svc, body.model_id, body.seq_id, user)
        kind = (body.optimizer_params or {}).get("type", "none")
        raise user_error(f"optim_step: only Adam is supported (adam_params); got optimizer {kind!r}")
    adam = body.adam_params.model_dump()

    async def run(handle):
        started = metering.clock()
        metrics = await handle.optim_step(adam)
        metering.computed(svc, model, handle, started)
        return {"metrics": metrics, "type": "optim_step"}, JSON

    return submit(svc, user, body.model_id, body.seq_id, "OptimStep", run)


def _checkpoint_in_place(svc: TinkerService, model: ModelRow, kind: str, name: str, user: User,
                         overwrite: bool) -> CheckpointRow | None:
    """The checkpoint of that name a save would replace (with ``overwrite``); UserError when
    there is one and no ``overwrite``."""
    row = svc.state.checkpoint(model.model_id, kind, name, user.id)
    if row is None or not Path(row.folder).exists():
        return None
    if not overwrite:
        raise UserError(f"tinker://{model.model_id}/{kind}/{name} exists; pick another name, delete it first "
                        "(RestClient.delete_checkpoint), or save with overwrite: true")
    return row


def _admit_save(svc: TinkerService, model: ModelRow, kind: str, name: str, user: User, body: schemas.SaveWeights,
                ephemeral: bool) -> int:
    """The checks before a save is queued (its name, TTL and the user's checkpoint quota);
    a token holding its estimated size in the quota."""
    try:
        replaced = None if ephemeral else _checkpoint_in_place(svc, model, kind, name, user, body.overwrite)
        svc.check_ttl(body.ttl_seconds)
        return svc.reserve_checkpoint(user.id, model, kind, svc.freed_by(model, replaced, ephemeral))
    except UserError as error:
        refuse_seq(svc, body.model_id, body.seq_id, user)
        raise user_error(str(error)) from None
    except QuotaExceeded as error:
        refuse_seq(svc, body.model_id, body.seq_id, user)
        if error.retry:
            raise ApiError(429, str(error), headers={"Retry-After": "10"}) from None
        raise user_error(str(error)) from None


def _save(svc: TinkerService, model: ModelRow, kind: str, name: str, user: User, body: schemas.SaveWeights,
          write, ephemeral: bool = False):
    """A queued save: ``write(handle, folder)`` writes the checkpoint to a new folder, which is
    then measured, checked against the quota again and recorded (in place of the one of the
    same name, with ``overwrite``). Returns ``run`` for :func:`submit` and the quota token."""
    token = _admit_save(svc, model, kind, name, user, body, ephemeral)

    async def run(handle) -> CheckpointRow:
        try:
            # Again at its turn: saves of a model run in order, a delete may have come between.
            replaced = None if ephemeral else _checkpoint_in_place(svc, model, kind, name, user, body.overwrite)
            folder = svc.new_folder(model.model_id, kind, name)
            try:
                await write(handle, folder)
            except BaseException:
                shutil.rmtree(folder, ignore_errors=True)
                raise
            row = svc.land_checkpoint(model, kind, name, user.id, folder, body.ttl_seconds, body.user_metadata,
                                      svc.freed_by(model, replaced, ephemeral), ephemeral)
            metering.checkpoint_written(svc, model)
            return row
        finally:
            svc.checkpoint_quota.release(token)

    return run, token


def _queue_save(svc: TinkerService, user: User, body: schemas.SaveWeights, kind: str, run, token: int):
    try:
        return submit(svc, user, body.model_id, body.seq_id, kind, run)
    except BaseException:
        svc.checkpoint_quota.release(token)  # not queued: it never runs
        raise


@router.post("/save_weights", responses=errors(400, 404, 429))
async def save_weights(request: Request, body: schemas.SaveWeights, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """``save_state``: weights (with LoRA, the adapters) and optimizer state, loadable with
    ``create_training_client_from_state[_with_optimizer]``."""
    model = usable_model(svc, body.model_id, user)
    existing = svc.futures.existing(body.model_id, body.seq_id)
    if existing is not None:  # a re-sent save: its first future, checked when it was sent
        return existing.submit_answer()
    if body.path is None:
        refuse_seq(svc, body.model_id, body.seq_id, user)
        raise user_error("save_weights: path (the checkpoint's name) is required")

    async def write(handle, folder) -> None:
        await handle.save_state(str(folder))

    save, token = _save(svc, model, "weights", body.path, user, body, write)
    record = svc.audit.recorder(request, user)

    async def run(handle):
        row = await save(handle)
        record("checkpoint_create", tinker_path=row.tinker_path, model_id=model.model_id, size_bytes=row.size_bytes)
        return {"path": row.tinker_path, "type": "save_weights"}, JSON

    return _queue_save(svc, user, body, "SaveWeights", run, token)


@router.post("/save_weights_for_sampler", responses=errors(400, 404, 429))
async def save_weights_for_sampler(request: Request, body: schemas.SaveWeights, user: User = Depends(tinker_user),
                                   svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """Named (``path``): a ``tinker://…/sampler_weights/<name>`` to sample from later
    (``overwrite`` replaces one of that name). Ephemeral (``sampling_session_seq_id``): a
    sampling session on the current weights, at once."""
    model = usable_model(svc, body.model_id, user)
    existing = svc.futures.existing(body.model_id, body.seq_id)
    if existing is not None:
        return existing.submit_answer()
    ephemeral = body.path is None
    if ephemeral and body.sampling_session_seq_id is None:
        refuse_seq(svc, body.model_id, body.seq_id, user)
        raise user_error("save_weights_for_sampler: give path (a name) or sampling_session_seq_id")
    name = body.path or f"ephemeral-{body.seq_id or uuid.uuid4().hex[:8]}-{uuid.uuid4().hex[:6]}"

    async def write(handle, folder) -> None:
        await handle.save_sampler_weights(str(folder))

    save, token = _save(svc, model, "sampler_weights", name, user, body, write, ephemeral)
    record = None if ephemeral else svc.audit.recorder(request, user)  # per-step snapshots are not audited

    async def run(handle):
        row = await save(handle)
        if record is not None:
            record("checkpoint_create", tinker_path=row.tinker_path, model_id=model.model_id,
                   size_bytes=row.size_bytes)
            return {"path": row.tinker_path, "type": "save_weights_for_sampler"}, JSON
        sampler_id = f"{model.session_id}:sample:{body.sampling_session_seq_id}"
        svc.state.add_sampler(SamplerRow(sampler_id, user.id, model.session_id, model.base_model, row.tinker_path))
        svc.collect_ephemeral(model.model_id)
        return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}, JSON

    return _queue_save(svc, user, body, "SaveWeightsForSampler", run, token)


@router.post("/save_weights_external", responses=errors(400, 404, 429))
async def save_weights_external(request: Request, body: sharing.SaveWeightsExternal, user: User = Depends(tinker_user),
                                svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """The model's weights as ``save_weights_for_sampler`` writes them (LoRA: a peft adapter
    folder; else Hugging Face weights), into the operator's external folder (never a path the
    client names), as ``tinker://…/external_weights/<name>``: a checkpoint in the caller's quota,
    downloaded by the links ``get_external_weights_urls`` signs."""
    model = usable_model(svc, body.model_id, user)
    existing = svc.futures.existing(body.model_id, body.seq_id)
    if existing is not None:
        return existing.submit_answer()
    problem = sharing.external_problem(body)
    if problem:
        refuse_seq(svc, body.model_id, body.seq_id, user)
        raise user_error(problem)

    async def write(handle, folder) -> None:
        await handle.save_sampler_weights(str(folder))

    save, token = _save(svc, model, "external_weights", body.path, user, body, write)
    record = svc.audit.recorder(request, user)

    async def run(handle):
        row = await save(handle)
        record("checkpoint_export", tinker_path=row.tinker_path, model_id=model.model_id, size_bytes=row.size_bytes)
        return {"path": row.tinker_path, "size_bytes": row.size_bytes, "type": "save_weights_external"}, JSON

    return _queue_save(svc, user, body, "SaveWeightsExternal", run, token)


@router.post("/load_weights", responses=errors(400, 404, 429))
async def load_weights(request: Request, body: schemas.LoadWeights, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """Create a model from a ``save_state`` checkpoint (``session_id`` + ``model_seq_id``),
    with or without its optimizer state; or (legacy) load one into an existing model."""
    if body.model_id is not None:
        return _load_into(svc, body, user, request)
    if body.session_id is None or body.model_seq_id is None:
        raise user_error("load_weights: give session_id and model_seq_id (a new model) or model_id")
    active_session(svc, body.session_id, user)
    # The caller's checkpoint or a published one: either way the new model is the caller's own run.
    checkpoint = readable_checkpoint(svc, body.path, user, "weights", request, loads=True)
    source = svc.state.model(checkpoint.run_id)
    if source is None:
        raise not_found(f"checkpoint {body.path!r}")
    spec = {key: value for key, value in source.spec.items() if key != "copy_of"}  # a copy's run loads as its source
    try:
        return _start_model(svc, user, body.session_id, body.model_seq_id, source.base_model, spec,
                            body.user_metadata or source.metadata, "LoadWeights",
                            load=(checkpoint.folder, body.optimizer), load_path=body.path, request=request)
    except UserError as error:
        raise user_error(str(error)) from None


def _load_into(svc: TinkerService, body: schemas.LoadWeights, user: User, request: Request) -> dict[str, Any]:
    model = usable_model(svc, body.model_id, user)
    try:
        checkpoint = readable_checkpoint(svc, body.path, user, "weights", request, loads=True)
        source = svc.state.model(checkpoint.run_id)
        if source is None or (source.base_model, source.lora_rank) != (model.base_model, model.lora_rank):
            raise user_error(f"{body.path!r} was saved from a different model (base model or LoRA rank) than "
                              f"{model.model_id!r}")
    except ApiError:
        refuse_seq(svc, body.model_id, body.seq_id, user)
        raise

    async def run(handle):
        await handle.load_state(checkpoint.folder, body.optimizer)
        return {"path": body.path, "type": "load_weights"}, JSON

    return submit(svc, user, model.model_id, body.seq_id, "LoadWeights", run)

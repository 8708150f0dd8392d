"""``/api/v1/*``: the Tinker API as the official ``tinker`` SDK (0.38.0) speaks it.

Same process, store and users as the OpenTinker API. A key is sent as ``X-API-Key``; the SDK
refuses keys without the ``tml-`` prefix before sending anything, so ``tml-<key>`` is accepted
as ``<key>`` (one key, stored hashed once, for both APIs). Operations answer at once with a
future; ``retrieve_future`` long-polls for its result: protobuf for samples and
forward/backward, JSON otherwise, or ``{"error", "category"}`` on failure. Refusals that can
be made at submit are 4xx there (never 5xx: the SDK retries those for minutes).
"""

from __future__ import annotations

import datetime as dt
import uuid
from typing import Any, Literal

from fastapi import APIRouter, Depends, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader
from starlette.concurrency import run_in_threadpool

import opentinker
from opentinker.protocol import MAX_INT
from opentinker.server.auth import authenticate, refuse_key
from opentinker.server.errors import ApiError, not_found
from opentinker.server.store import User
from opentinker.server.tinker import openapi, schemas, wire
from opentinker.server.tinker.openapi import errors
from opentinker.engine.tinker import DEFAULT_MAX_TOKENS
from opentinker.server.tinker.futures import JSON, PROTOBUF
from opentinker.server.tinker.host import UserError, await_ref
from opentinker.server.tinker.sample_budget import OverBudget
from opentinker.server.tinker.service import CHECKPOINT_KINDS, ServerFull, TinkerService
from opentinker.server.tinker.state import CheckpointRow, ModelRow, SamplerRow

PREFIX = "/api/v1"
SDK_KEY_PREFIX = "tml-"
# Known SDK routes this server does not offer, and why (a 400 the SDK shows, not a bare 404).
UNSUPPORTED = {
    ("POST", "save_weights_external"): "exporting weights to external storage is not offered; load the checkpoint "
                                       "with create_training_client_from_state",
    ("POST", "create_custom_loss"): "server-side custom losses are not offered; forward_backward_custom runs them "
                                    "client-side",
    ("POST", "copy_weights"): "copying checkpoints between runs is not offered",
    ("POST", "retrieve_futures"): "the session poller is off (client/config sample_use_retrieve_futures=false)",
    ("POST", "join_sampling_session"): "joining sampling sessions is off (sample_join_sampling_session=false)",
    ("POST", "cancel_future"): "cancelling futures is off (client/dynamic_config sample_cancel_enabled=false)",
    ("POST", "auth/token"): "JWT exchange is off (client/config pjwt_auth_enabled=false): send the API key itself",
    ("PUT", "sessions/{session_id}/project"): "projects are not offered",
    ("GET", "sessions/{session_id}/trace_export"): "session traces are not recorded",
    ("POST", "sessions/search"): "session search is not offered; list_sessions lists your sessions",
    ("GET", "audit"): "there is no audit log on this server",
    ("GET", "billing/usage/events"): "there is no billing on this server",
    ("GET", "billing/usage/checkpoints/current"): "there is no billing on this server",
    ("GET", "training_runs/{run_id}/checkpoints/{kind}/{name}/external_weights_urls"):
        "checkpoints are not served as download URLs",
    ("POST", "training_runs/{run_id}/checkpoints/{kind}/{name}/publish"): "checkpoints cannot be made public here",
    ("DELETE", "training_runs/{run_id}/checkpoints/{kind}/{name}/publish"): "checkpoints cannot be made public here",
    ("PUT", "training_runs/{run_id}/checkpoints/{kind}/{name}/ttl"): "a checkpoint's TTL is set when it is saved "
                                                                     "(ttl_seconds)",
}

# Not in /openapi.json (the OpenTinker API's): the Tinker routes have their own document,
# /api/v1/openapi.json (openapi.py).
router = APIRouter(prefix=PREFIX, tags=["tinker"], include_in_schema=False,
                   responses=errors(*openapi.COMMON_ERRORS))
_api_key = APIKeyHeader(name="X-API-Key", auto_error=False, description="tml-<your OpenTinker key>")


def service(request: Request) -> TinkerService:
    return request.app.state.tinker


async def tinker_user(request: Request, header: str | None = Depends(_api_key)) -> User:
    """The user of ``X-API-Key`` (``tml-<key>`` or ``<key>``)."""
    key = (header or "").strip()
    if not key:
        raise ApiError(401, "missing API key: send 'X-API-Key: tml-<key>' (the tinker SDK: api_key= or "
                            "TINKER_API_KEY)")
    user = authenticate(request.app.state.store, key.removeprefix(SDK_KEY_PREFIX))
    if user is None:
        raise refuse_key(request, ApiError(401, "invalid or revoked API key"))
    return user


def _user_error(message: str) -> ApiError:
    return ApiError(400, message)


def _iso(timestamp: float | None) -> str | None:
    return None if timestamp is None else dt.datetime.fromtimestamp(timestamp, dt.timezone.utc).isoformat()


def _model(svc: TinkerService, model_id: str, user: User) -> ModelRow:
    try:
        return svc.usable_model(model_id, user.id)
    except LookupError as error:
        raise not_found(str(error)) from None
    except UserError as error:
        raise _user_error(str(error)) from None


def _checkpoint(svc: TinkerService, path: str, user: User, kind: str | None = None) -> CheckpointRow:
    try:
        return svc.owned_checkpoint(path, user.id, kind)
    except LookupError as error:
        raise not_found(str(error)) from None
    except UserError as error:
        raise _user_error(str(error)) from None


def _session(svc: TinkerService, session_id: str, user: User) -> None:
    state = svc.state.session_state(session_id, user.id)
    if state is None:
        raise not_found(f"session {session_id!r}")
    if state != "active":
        raise _user_error(f"session {session_id!r} is {state}; start a new ServiceClient")


def _submit(svc: TinkerService, user: User, model_id: str, seq_id: int | None, kind: str, run) -> dict[str, Any]:
    """Queue ``run`` on the model in ``seq_id`` order; a re-sent ``(model_id, seq_id)`` gets its
    first future. A number the model would never reach, or has gone past, is refused (400); a
    full queue is a 429 (the SDK retries with the same number, so nothing is skipped for it)."""
    existing = svc.futures.existing(model_id, seq_id)
    if existing is not None:
        return existing.submit_answer()
    slot = svc.host.slot(model_id)
    if slot is None:  # unloaded while the request was being read
        raise _user_error(f"model {model_id!r} was unloaded; load it again from a checkpoint")
    problem = slot.seq_problem(seq_id)
    if problem:
        raise _user_error(problem)
    # The number the model waits for is always taken: refusing it would stall what waits behind it.
    if seq_id is None or seq_id != slot.next_seq:
        limits = svc.settings
        if slot.pending >= limits.max_queued_per_model:
            raise ApiError(429, f"model {model_id} has {slot.pending} requests waiting or running, the most it "
                                "queues (--tinker-max-queued-requests); retry when some are done",
                           headers={"Retry-After": "1"})
        if svc.host.user_pending(user.id) >= limits.max_queued_per_user:
            raise ApiError(429, f"your models have {limits.max_queued_per_user} requests waiting or running, the "
                                "most this server queues per user; retry when some are done",
                           headers={"Retry-After": "1"})
    row = svc.futures.add(user.id, kind, model_id, seq_id)  # none yet: checked above, with no await between
    svc.host.submit(model_id, seq_id, row.request_id, run)
    svc.state.touch_model(model_id)
    return row.submit_answer()


def _refuse_seq(svc: TinkerService, model_id: str | None, seq_id: int | None, user: User) -> None:
    """A request refused at submit still used its number: the model must not wait for it."""
    if isinstance(model_id, str) and isinstance(seq_id, int) and svc.state.model(model_id, user.id) is not None:
        svc.host.skip(model_id, seq_id)


# -- bootstrap and sessions -------------------------------------------------------------


@router.get("/openapi.json", include_in_schema=False)
async def openapi_document(request: Request) -> JSONResponse:
    """This API's OpenAPI document (public, like /openapi.json)."""
    if getattr(request.app.state, "tinker_openapi", None) is None:
        request.app.state.tinker_openapi = openapi.document(router.routes, opentinker.__version__)
    return JSONResponse(request.app.state.tinker_openapi)


openapi_document.undocumented = True


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/client/config")
async def client_config(user: User = Depends(tinker_user)) -> dict[str, Any]:
    # proto_compress_fwdbwd: forward_backward bodies come zstd-compressed (benchmarks/wire_compression.py).
    return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": True, "sample_use_retrieve_futures": False,
            "custom_loss_server_side": False, "sample_join_sampling_session": False, "parallel_fwdbwd_chunks": True,
            "fwdbwd_max_chunk_len": wire.MAX_DATUMS}


@router.post("/client/dynamic_config")
async def dynamic_config(user: User = Depends(tinker_user)) -> dict[str, Any]:
    return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}


@router.post("/create_session", responses=errors(400))
async def create_session(body: schemas.CreateSession, user: User = Depends(tinker_user),
                         svc: TinkerService = Depends(service)) -> dict[str, Any]:
    # 400, not 429: only the user can end their sessions, so a retry would just wait and fail.
    limit = svc.settings.max_sessions_per_user
    if svc.state.active_sessions(user.id) >= limit:
        raise _user_error(f"you have {limit} active sessions, the most this server allows per user "
                          "(--tinker-max-sessions); close a ServiceClient (close(), or use it in a with block) "
                          f"first; a session without heartbeats ends after {svc.settings.session_timeout_s:.0f} s")
    session_id = uuid.uuid4().hex
    svc.state.create_session(session_id, user.id, body.tags, body.user_metadata or {})
    return {"session_id": session_id}


@router.post("/session_heartbeat", responses=errors(404, 410))
async def session_heartbeat(body: schemas.SessionRef, user: User = Depends(tinker_user),
                            svc: TinkerService = Depends(service)) -> Response:
    state = svc.state.session_state(body.session_id, user.id)
    if state is None:
        raise not_found(f"session {body.session_id!r}")
    if state != "active":  # 410 stops the SDK's heartbeat loop
        return JSONResponse({"error": f"session {body.session_id!r} is {state}"}, status_code=410)
    svc.state.touch_session(body.session_id)
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish", status_code=204, responses=errors(404))
async def finish_session(body: schemas.FinishSession, session_id: str = Path(max_length=256),
                         user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> Response:
    if svc.state.session_state(session_id, user.id) is None:
        raise not_found(f"session {session_id!r}")
    await svc.end_session(session_id, "finished")
    return Response(status_code=204)


@router.post("/telemetry")
async def telemetry(user: User = Depends(tinker_user)) -> dict[str, str]:
    return {"status": "accepted"}  # accepted and dropped: nothing is collected


@router.get("/get_server_capabilities")
async def capabilities(user: User = Depends(tinker_user), svc: TinkerService = Depends(service)) -> dict[str, Any]:
    return {"supported_models": [{"model_name": m.name, "trainable": True, "sampleable": True}
                                 for m in svc.policy.models]}


# -- training clients ---------------------------------------------------------------------


def _worker_spec(svc: TinkerService, model: Any, lora: dict[str, Any]):
    from opentinker.engine.tinker.model_worker import ModelSpec

    host = svc.settings.host
    return ModelSpec(model_path=model.path, lora_rank=int(lora.get("lora_rank", 0)), seed=int(lora.get("seed", 0)),
                     train_attn=bool(lora.get("train_attn", True)), train_mlp=bool(lora.get("train_mlp", True)),
                     trust_remote_code=model.trust_remote_code, strategy=host.strategy, device=host.device,
                     ranks=host.ranks)


def _start_model(svc: TinkerService, user: User, session_id: str, model_seq_id: int, base_model: str,
                 spec: dict[str, Any], metadata: dict[str, str] | None, kind: str,
                 load: tuple[str, bool] | None = None, load_path: str | None = None) -> dict[str, Any]:
    model_id = f"{session_id}:train:{model_seq_id}"
    existing = svc.state.model(model_id)
    if existing is not None:  # a re-sent create: its first future (seq 0 stands for the create)
        if existing.user_id != user.id:
            raise not_found(f"session {session_id!r}")
        row, _ = svc.futures.create(user.id, kind, model_id, 0)
        return row.submit_answer()
    if svc.live_models(user.id) >= svc.settings.max_models_per_user:
        raise _user_error(f"you have {svc.settings.max_models_per_user} live models, the most this server allows "
                          "per user (--tinker-max-models-per-user); end a ServiceClient session (or unload a model) "
                          "first")
    served = svc.served_model(base_model)
    try:
        worker_spec = _worker_spec(svc, served, spec)
        if spec.get("lora_rank"):
            worker_spec.target_modules()
    except ValueError as error:
        raise _user_error(str(error)) from None
    try:  # server-wide: the live models and their estimated memory, whoever's
        memory = svc.admit_model(served, worker_spec)
    except ServerFull as error:
        raise ApiError(429, str(error), headers={"Retry-After": "10"}) from None
    svc.state.add_model(model_id, session_id, user.id, served.name, spec, metadata)
    row = svc.futures.add(user.id, kind, model_id, 0)  # a new model: no future yet
    answer = {"model_id": model_id} if load_path is None else {"model_id": model_id, "path": load_path}
    svc.host.start_model(model_id, user.id, worker_spec, row.request_id, answer, load, memory)
    return row.submit_answer()


@router.post("/create_model", responses=errors(400, 404, 429))
async def create_model(body: schemas.CreateModel, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    _session(svc, body.session_id, user)
    if body.optimizer_config is not None and body.optimizer_config.type != "adamw":
        raise _user_error(f"optimizer_config.type {body.optimizer_config.type!r} is not supported; this server "
                          "trains with 'adamw'")
    lora = body.lora_config
    spec = {"lora_rank": 0} if lora is None else {
        "lora_rank": lora.rank, "seed": lora.seed or 0, "train_attn": lora.train_attn, "train_mlp": lora.train_mlp,
        "train_unembed": lora.train_unembed}
    spec["named_as"] = body.base_model  # get_info gives the client's own name back (the SDK's get_tokenizer)
    try:
        return _start_model(svc, user, body.session_id, body.model_seq_id, body.base_model, spec,
                            body.user_metadata, "CreateModel")
    except UserError as error:
        raise _user_error(str(error)) from None


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
async def unload_model(body: schemas.ModelRef, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    if svc.state.model(body.model_id, user.id) is None:
        raise not_found(f"model {body.model_id!r}")
    await svc.host.unload(body.model_id)
    return {"model_id": body.model_id, "type": "unload_model"}


def _decompressed(request: Request, body: bytes) -> bytes:
    encoding = request.headers.get("content-encoding", "").lower()
    if encoding in ("", "identity"):
        return body
    if encoding != "zstd":
        raise _user_error(f"Content-Encoding {encoding!r} is not accepted (zstd or none)")
    import zstandard

    limit = request.app.state.settings.max_body_bytes
    reader = zstandard.ZstdDecompressor().stream_reader(body)
    try:
        out = reader.read(limit + 1)
    except zstandard.ZstdError as error:
        raise _user_error(f"the body is not valid zstd ({error})") from None
    if len(out) > limit:
        raise ApiError(413, f"the decompressed body is over {limit} bytes")
    return out


def _context(svc: TinkerService, model: ModelRow) -> int | None:
    try:
        return svc.context_length(model.base_model)
    except UserError:  # no longer served (the operator's flags changed): the worker checks it
        return None


@router.post("/forward_backward", openapi_extra=openapi.binary_body(), responses=errors(400, 404, 429))
async def forward_backward(request: Request, user: User = Depends(tinker_user),
                           svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """Protobuf ``ForwardBackwardRequest`` in (zstd accepted); the future's result is a
    protobuf ``ForwardBackwardOutput``. ``forward_only`` leaves the gradients alone. Each
    datum must fit the model's context (its input tokens plus the last target)."""
    # Off the event loop: a full chunk of 1024 datums takes a while to decompress and read.
    body = await run_in_threadpool(_decompressed, request, await request.body())
    try:
        message = await run_in_threadpool(wire.parse_forward_backward, body)
    except wire.WireError as error:
        raise _user_error(str(error)) from None
    model = _model(svc, message.model_id, user)
    try:
        call = await run_in_threadpool(wire.decode_forward_backward, message, _context(svc, model))
    except wire.WireError as error:
        _refuse_seq(svc, message.model_id, message.seq_id or None, user)
        raise _user_error(str(error)) from None
    data = [(datum.tokens, datum.inputs) for datum in call.data]

    async def run(handle):
        out = await handle.forward_backward(data, call.loss_fn, call.loss_config, call.forward_only)
        return wire.encode_forward_backward_output(out["outputs"], out["metrics"]), PROTOBUF

    return _submit(svc, user, call.model_id, call.seq_id, "Forward" if call.forward_only else "ForwardBackward", run)


@router.post("/optim_step", responses=errors(400, 404, 429))
async def optim_step(body: schemas.OptimStep, user: User = Depends(tinker_user),
                     svc: TinkerService = Depends(service)) -> dict[str, Any]:
    _model(svc, body.model_id, user)
    if body.adam_params is None:
        _refuse_seq(svc, body.model_id, body.seq_id, user)
        kind = (body.optimizer_params or {}).get("type", "none")
        raise _user_error(f"optim_step: only Adam is supported (adam_params); got optimizer {kind!r}")
    adam = body.adam_params.model_dump()

    async def run(handle):
        return {"metrics": await handle.optim_step(adam), "type": "optim_step"}, JSON

    return _submit(svc, user, body.model_id, body.seq_id, "OptimStep", run)


def _new_checkpoint_folder(svc: TinkerService, model: ModelRow, kind: str, name: str, overwrite: bool):
    folder = svc.folder(model.model_id, kind, name)
    if folder.exists() and not overwrite:
        raise _user_error(f"tinker://{model.model_id}/{kind}/{name} exists; pick another name or save with overwrite")
    return folder


@router.post("/save_weights", responses=errors(400, 404, 429))
async def save_weights(body: schemas.SaveWeights, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """``save_state``: weights (with LoRA, the adapters) and optimizer state, loadable with
    ``create_training_client_from_state[_with_optimizer]``."""
    model = _model(svc, body.model_id, user)
    if body.path is None:
        _refuse_seq(svc, body.model_id, body.seq_id, user)
        raise _user_error("save_weights: path (the checkpoint's name) is required")
    try:
        folder = _new_checkpoint_folder(svc, model, "weights", body.path, body.overwrite)
    except ApiError:
        _refuse_seq(svc, body.model_id, body.seq_id, user)
        raise

    async def run(handle):
        await handle.save_state(str(folder))
        size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        row = _checkpoint_row(model, "weights", body.path, user, folder, size, body.ttl_seconds, body.user_metadata)
        svc.state.add_checkpoint(row)
        return {"path": row.tinker_path, "type": "save_weights"}, JSON

    return _submit(svc, user, body.model_id, body.seq_id, "SaveWeights", run)


def _checkpoint_row(model: ModelRow, kind: str, name: str, user: User, folder, size: int | None,
                    ttl_s: int | None = None, metadata: dict[str, str] | None = None,
                    ephemeral: bool = False) -> CheckpointRow:
    import time

    now = time.time()
    return CheckpointRow(model.model_id, kind, name, user.id, str(folder), size, ephemeral, metadata, now,
                         None if ttl_s is None else now + ttl_s)


@router.post("/save_weights_for_sampler", responses=errors(400, 404, 429))
async def save_weights_for_sampler(body: schemas.SaveWeights, user: User = Depends(tinker_user),
                                   svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """Named (``path``): a ``tinker://…/sampler_weights/<name>`` to sample from later. Ephemeral
    (``sampling_session_seq_id``): a sampling session on the current weights, at once."""
    model = _model(svc, body.model_id, user)
    ephemeral = body.path is None
    if ephemeral and body.sampling_session_seq_id is None:
        _refuse_seq(svc, body.model_id, body.seq_id, user)
        raise _user_error("save_weights_for_sampler: give path (a name) or sampling_session_seq_id")
    name = body.path or f"ephemeral-{body.seq_id or uuid.uuid4().hex[:8]}-{uuid.uuid4().hex[:6]}"
    try:
        folder = _new_checkpoint_folder(svc, model, "sampler_weights", name, overwrite=ephemeral)
    except ApiError:
        _refuse_seq(svc, body.model_id, body.seq_id, user)
        raise

    async def run(handle):
        size = await handle.save_sampler_weights(str(folder))
        row = _checkpoint_row(model, "sampler_weights", name, user, folder, size, body.ttl_seconds,
                              body.user_metadata, ephemeral)
        svc.state.add_checkpoint(row)
        if not ephemeral:
            return {"path": row.tinker_path, "type": "save_weights_for_sampler"}, JSON
        sampler_id = f"{model.session_id}:sample:{body.sampling_session_seq_id}"
        svc.state.add_sampler(SamplerRow(sampler_id, user.id, model.session_id, model.base_model, row.tinker_path))
        svc.collect_ephemeral(model.model_id)
        return {"sampling_session_id": sampler_id, "type": "save_weights_for_sampler"}, JSON

    return _submit(svc, user, body.model_id, body.seq_id, "SaveWeightsForSampler", run)


@router.post("/load_weights", responses=errors(400, 404, 429))
async def load_weights(body: schemas.LoadWeights, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """Create a model from a ``save_state`` checkpoint (``session_id`` + ``model_seq_id``),
    with or without its optimizer state; or (legacy) load one into an existing model."""
    if body.model_id is not None:
        return _load_into(svc, body, user)
    if body.session_id is None or body.model_seq_id is None:
        raise _user_error("load_weights: give session_id and model_seq_id (a new model) or model_id")
    _session(svc, body.session_id, user)
    checkpoint = _checkpoint(svc, body.path, user, "weights")
    source = svc.state.model(checkpoint.run_id, user.id)
    if source is None:
        raise not_found(f"checkpoint {body.path!r}")
    try:
        return _start_model(svc, user, body.session_id, body.model_seq_id, source.base_model, source.spec,
                            body.user_metadata or source.metadata, "LoadWeights",
                            load=(checkpoint.folder, body.optimizer), load_path=body.path)
    except UserError as error:
        raise _user_error(str(error)) from None


def _load_into(svc: TinkerService, body: schemas.LoadWeights, user: User) -> dict[str, Any]:
    model = _model(svc, body.model_id, user)
    try:
        checkpoint = _checkpoint(svc, body.path, user, "weights")
        source = svc.state.model(checkpoint.run_id, user.id)
        if source is None or (source.base_model, source.lora_rank) != (model.base_model, model.lora_rank):
            raise _user_error(f"{body.path!r} was saved from a different model (base model or LoRA rank) than "
                              f"{model.model_id!r}")
    except ApiError:
        _refuse_seq(svc, body.model_id, body.seq_id, user)
        raise

    async def run(handle):
        await handle.load_state(checkpoint.folder, body.optimizer)
        return {"path": body.path, "type": "load_weights"}, JSON

    return _submit(svc, user, model.model_id, body.seq_id, "LoadWeights", run)


# -- sampling ---------------------------------------------------------------------------


def _sampler_source(svc: TinkerService, user: User, base_model: str | None, model_path: str | None) -> tuple[str, str | None]:
    """``(base model name, tinker path or None)`` of what a sampler samples from."""
    if (base_model is None) == (model_path is None):
        raise _user_error("give exactly one of base_model and model_path")
    if model_path is not None:
        checkpoint = _checkpoint(svc, model_path, user, "sampler_weights")
        source = svc.state.model(checkpoint.run_id, user.id)
        return source.base_model, model_path
    try:
        return svc.served_model(base_model).name, None
    except UserError as error:
        raise _user_error(str(error)) from None


@router.post("/create_sampling_session", responses=errors(400, 404))
async def create_sampling_session(body: schemas.CreateSamplingSession, user: User = Depends(tinker_user),
                                  svc: TinkerService = Depends(service)) -> dict[str, Any]:
    _session(svc, body.session_id, user)
    base_model, model_path = _sampler_source(svc, user, body.base_model, body.model_path)
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
        "topk_sample_logprobs": body.topk_sample_logprobs > 0,
        "prompt_alt_tokens_k": body.prompt_alt_tokens_k > 0,
        "target_prompt_logprobs": body.target_prompt_logprobs is not None,
        "record_stability_info (for loss 'stable_reinforce', which this server does not support; use loss_fn="
        "importance_sampling, ppo or cispo)": body.record_stability_info,
    }
    named = [name for name, asked in refused.items() if asked]
    if named:
        raise _user_error(f"asample: not supported by this server: {', '.join(named)}")
    chunks = [chunk for chunk in body.prompt.chunks if not isinstance(chunk, schemas.EncodedText)]
    if chunks:
        raise _user_error(f"asample: prompt chunks of type {chunks[0].type!r} are not supported (token chunks only)")


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
async def asample(body: schemas.SampleRequest, user: User = Depends(tinker_user),
                  svc: TinkerService = Depends(service)) -> dict[str, Any]:
    _refuse_sample_options(body)
    if body.sampling_session_id is not None:
        sampler = svc.state.sampler(body.sampling_session_id, user.id)
        if sampler is None:
            raise not_found(f"sampler {body.sampling_session_id!r}")
        base_model, model_path = sampler.base_model, sampler.model_path
    else:
        base_model, model_path = _sampler_source(svc, user, body.base_model, body.model_path)
    snapshot = _checkpoint(svc, model_path, user, "sampler_weights").folder if model_path else ""
    prompt = [token for chunk in body.prompt.chunks for token in chunk.tokens]
    if not prompt or min(prompt) < 0:
        raise _user_error("asample: the prompt needs at least one token, and token ids are not negative")
    last_n = body.prompt_logprobs_last_n
    if last_n is not None and not (body.prompt_logprobs and last_n <= len(prompt) - 1):
        raise _user_error("prompt_logprobs_last_n needs prompt_logprobs and must be at most len(prompt) - 1")
    if svc.futures.pending_count(user.id, "Sample") >= svc.settings.max_pending_samples:
        raise ApiError(429, f"over {svc.settings.max_pending_samples} samples waiting; back off and resubmit",
                       headers={"Retry-After": "1"})
    served = svc.served_model(base_model)
    params = _engine_params(body.sampling_params)
    # What the call may generate at most (no max_tokens: the sampler's default, its upper bound).
    cost = body.num_samples * (params["max_tokens"] or DEFAULT_MAX_TOKENS)
    try:
        svc.sample_budget.reserve(user.id, cost)
    except OverBudget as error:
        if error.retry:
            raise ApiError(429, str(error), headers={"Retry-After": "1"}) from None
        raise _user_error(str(error)) from None
    request_id = uuid.uuid4().hex
    ids = [f"{request_id}:{index}" for index in range(body.num_samples)]
    row = svc.futures.add(user.id, "Sample", extra={"sample_sequence_ids": ids}, request_id=request_id)
    call = {"snapshot": snapshot, "prompt": prompt, "params": params, "user": user.id,
            "num_samples": body.num_samples, "prompt_logprobs": bool(body.prompt_logprobs),
            "topk_prompt": body.topk_prompt_logprobs, "last_n": last_n}
    svc.spawn(_sample(svc, served, call, request_id, cost))
    return row.submit_answer()


async def _sample(svc: TinkerService, served: Any, call: dict[str, Any], request_id: str, cost: int) -> None:
    from opentinker.server.tinker.host import failure

    try:
        actor = await svc.host.sampler(served.name, served.path, served.trust_remote_code)
        result = await await_ref(actor.sample.remote(call))
    except Exception as error:
        svc.futures.fail(request_id, *failure(error))
        return
    finally:
        svc.sample_budget.release(call["user"], cost)
    sequences = [wire.SampledSequence(tokens, logprobs, reason) for tokens, logprobs, reason in result["sequences"]]
    svc.futures.resolve(request_id, wire.encode_sample_response(
        sequences, result.get("prompt_logprobs"), result.get("topk_prompt")), PROTOBUF)


# -- futures ----------------------------------------------------------------------------


@router.post("/retrieve_future", responses={**openapi.FUTURE_RESULT, **errors(404)})
async def retrieve_future(body: schemas.RetrieveFuture, user: User = Depends(tinker_user),
                          svc: TinkerService = Depends(service)) -> Response:
    row = await svc.futures.wait(body.request_id, user.id, svc.settings.long_poll_s)
    if row is None:
        raise not_found(f"future {body.request_id!r}")
    if row.state == "pending":
        return JSONResponse({"type": "try_again", "request_id": row.request_id, "queue_state": "active"})
    if row.state == "failed":
        return JSONResponse({"error": row.error, "category": row.category or "server"})
    return Response(content=row.result, media_type=row.content_type)


# -- training runs and checkpoints ------------------------------------------------------


def _checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    return {"checkpoint_id": f"{row.kind}/{row.name}", "checkpoint_type": CHECKPOINT_KINDS[row.kind],
            "time": _iso(row.created_at), "tinker_path": row.tinker_path, "size_bytes": row.size_bytes,
            "public": False, "user_metadata": row.metadata, "expires_at": _iso(row.expires_at)}


def _training_run_json(svc: TinkerService, model: ModelRow, user: User) -> dict[str, Any]:
    checkpoints = svc.state.checkpoints(user.id, model.model_id)
    newest = {kind: next((c for c in reversed(checkpoints) if c.kind == kind), None) for kind in CHECKPOINT_KINDS}
    return {"training_run_id": model.model_id, "base_model": model.base_model, "model_owner": user.name,
            "is_lora": model.lora_rank > 0, "corrupted": False, "lora_rank": model.lora_rank or None,
            "last_request_time": _iso(model.last_request_at),
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
    row = _checkpoint(svc, f"tinker://{run_id}/{kind}/{name}", user)
    svc.delete_checkpoint(row)
    return Response(status_code=204)


@router.post("/weights_info", responses=errors(400, 404))
async def weights_info(body: schemas.WeightsInfo, user: User = Depends(tinker_user),
                       svc: TinkerService = Depends(service)) -> dict[str, Any]:
    row = _checkpoint(svc, body.tinker_path, user)
    model = _owned_run(svc, row.run_id, user)
    spec = model.spec
    return {"base_model": model.base_model, "is_lora": model.lora_rank > 0, "lora_rank": model.lora_rank or None,
            "train_attn": spec.get("train_attn"), "train_mlp": spec.get("train_mlp"),
            "train_unembed": spec.get("train_unembed"), "optimizer_config": {"type": "adamw"}}


@router.get("/sessions")
async def list_sessions(limit: int = Query(20, ge=1, le=1000), offset: int = Query(0, ge=0, le=MAX_INT),
                        access_scope: Literal["owned", "accessible"] = "owned", user: User = Depends(tinker_user),
                        svc: TinkerService = Depends(service)) -> dict[str, Any]:
    """``RestClient.list_sessions(limit, offset)``: a page of your session ids, newest first
    (``accessible`` is the same as ``owned`` here: nothing is shared)."""
    sessions, total = svc.state.sessions(user.id, limit, offset)
    return {"sessions": sessions, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


@router.get("/sessions/{session_id}", responses=errors(404))
async def get_session(session_id: str = Path(max_length=256), user: User = Depends(tinker_user),
                      svc: TinkerService = Depends(service)) -> dict[str, Any]:
    if svc.state.session_state(session_id, user.id) is None:
        raise not_found(f"session {session_id!r}")
    return {"training_run_ids": svc.state.session_models(session_id),
            "sampler_ids": svc.state.session_samplers(session_id)}


def _unsupported(name: str, reason: str):
    async def refuse(request: Request, user: User = Depends(tinker_user),
                     svc: TinkerService = Depends(service)) -> Response:
        try:  # a training client's refused request still used its seq_id: release it
            body = await request.json()
            _refuse_seq(svc, body.get("model_id"), body.get("seq_id"), user)
        except (ValueError, AttributeError):
            pass
        raise _user_error(f"{request.method} {request.url.path}: {reason}")

    refuse.undocumented = True  # not offered: left out of the OpenAPI document
    return refuse


for (_method, _name), _reason in UNSUPPORTED.items():
    router.add_api_route(f"/{_name}", _unsupported(_name, _reason), methods=[_method], name=f"unsupported {_name}")

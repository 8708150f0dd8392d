"""The Tinker API's moving parts in one place: the store's tables, the futures, the Ray host,
checkpoint folders, and the housekeeping that ends idle sessions and collects garbage.

A checkpoint is named to clients as ``tinker://<run>/<weights|sampler_weights>/<name>`` (the
run id is the model id) and lives in ``<data_dir>/tinker/<run>/<weights|sampler_weights>/
<name>@<write id>``: every save writes a folder of its own, never changed afterwards, so a
name saved again (after a delete, or with ``overwrite``) is new content at a new folder and
the sampler, which keeps loaded snapshots by folder, cannot serve the old weights for it.
Because folders never change, a copy (``copy_weights``) is a row naming its source's folder;
a folder is deleted when the last row naming it goes.
Ephemeral sampler snapshots (what ``save_weights_and_get_sampling_client`` makes every RL step)
are kept for a model's newest ``keep_ephemeral`` and for as long as its session lives; named
checkpoints until deleted or past their ``ttl_seconds``. A user's checkpoints are bounded in
count and bytes on disk (:mod:`.checkpoint_quota`), and all users' (with the RL jobs') by the
server's cap (:func:`opentinker.server.checkpoint_caps.server_cap`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentinker.images import ImageLimits
from opentinker.engine.backend.spec import BackendSpec
from opentinker.engine.tinker.pass_plan import PassLimits
from opentinker.server.accounting import AuditLog, UsageMeter
from opentinker.server.checkpoint_caps import folder_bytes, server_cap
from opentinker.server.policy import JobPolicy, ServedModel
from opentinker.server.settings import ServerSettings
from opentinker.server.signed_urls import UrlSigner
from opentinker.server.store import Store
from opentinker.server.tinker.checkpoint_quota import CheckpointQuota, QuotaExceeded, Usage
from opentinker.server.tinker.completions import CompletionFeeds
from opentinker.server.tinker.futures import FutureTable
from opentinker.server.tinker.traces import TraceLog
from opentinker.server.tinker.host import HostSettings, TinkerHost
from opentinker.server.tinker.workers import UserError
from opentinker.server.tinker.model_facts import (
    ModelFactsCache,
    estimated_adapter_bytes,
    estimated_checkpoint_bytes,
    estimated_model_bytes,
)
from opentinker.server.tinker.sample_budget import SampleBudget
from opentinker.server.tinker.metering import stored_bytes
from opentinker.server.tinker.state import CheckpointRow, ModelRow, TinkerState

log = logging.getLogger("opentinker.server.tinker")

# Path segment -> the SDK's checkpoint_type. external_weights: save_weights_external's, in the
# operator's external folder (TinkerSettings.external_weights_dir), downloaded by signed links.
CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler", "external_weights": "external"}


@dataclass
class TinkerSettings:
    session_timeout_s: float = 300.0  # a session with no heartbeat for this long ends (the SDK beats every 10 s)
    long_poll_s: float = 25.0  # retrieve_future holds this long before try_again (the SDK gives up at 45 s)
    keep_ephemeral: int = 4  # ephemeral sampler snapshots kept per model
    max_models_per_user: int = 4  # live models in use (a fully fine-tuned one: a worker with a copy of its weights)
    max_models: int = 8  # live models in use on the server, whoever's (429 past it)
    # A LoRA model on a shared base with no request for this long is idle: an adapter that waits
    # (on disk, with --tinker-max-resident-adapters) and counts against neither cap above, only
    # against max_idle_models_per_user and the memory budget (its adapter's estimate).
    idle_model_s: float = 60.0
    max_idle_models_per_user: int = 16
    memory_budget_bytes: int | None = None  # admission by estimated model memory (None: not checked)
    max_sessions_per_user: int = 32  # active sessions (400 past it: only the user can end them)
    keep_ended_sessions: int = 1000  # per user; older ended sessions are forgotten with their samplers
    max_samplers_per_session: int = 256  # sampling clients kept per session (the oldest forgotten)
    max_samplers_per_user: int = 4096  # ... and per user, across sessions
    max_queued_per_model: int = 256  # training requests accepted and not finished (429 past it)
    max_queued_per_user: int = 1024  # ... over all of a user's models
    max_pending_samples: int = 1024  # per user; past it asample answers 429 (the SDK backs off)
    max_pending_sample_tokens: int = 524_288  # per user: num_samples x max_tokens of calls not done (429 past it)
    future_ttl_s: float = 3600.0  # finished futures are forgotten after this long
    sampler_adapter_cache_bytes: int = 2**30  # per base model's sampler; reserved in the memory budget
    max_lora_rank: int = 128  # and never past the model's hidden size
    max_checkpoints_per_user: int = 1000  # save_state checkpoints and sampler snapshots, ephemeral ones included
    max_checkpoint_bytes_per_user: int = 50 * 2**30  # ... their bytes on disk
    max_checkpoint_ttl_s: int = 10 * 365 * 86400  # the longest ttl_seconds a save may ask
    max_server_checkpoint_bytes: int = 200 * 2**30  # every checkpoint on the server, all users' and RL jobs'
    housekeeping_s: float = 10.0
    image_limits: ImageLimits = ImageLimits()  # pictures in image chunks (--max-image-bytes, ...)
    max_projects_per_user: int = 100
    identity_token_s: int = 900  # the SDK's identity tokens (JWTs) live this long
    public_url: str | None = None  # the base of signed URLs (None: each request's own base URL)
    signed_url_s: int = 3600  # signed download URLs work this long
    external_weights_dir: Path | None = None  # save_weights_external's destination (None: <data_dir>/external)
    prices: dict[str, float] = field(default_factory=dict)  # usage kind -> USD (estimated costs; none: no costs)
    host: HostSettings = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.host = self.host or HostSettings()


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """``tinker://<run>/<kind>/<name>`` -> (run, kind, name); UserError naming the format."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in CHECKPOINT_KINDS or not all(parts):
        raise UserError(f"{path!r} is not a checkpoint path: expected tinker://<run id>/<kind>/<name>, <kind> one "
                        "of weights, sampler_weights, external_weights")
    return parts[0], parts[1], parts[2]


class NotYours(LookupError):
    """Another user's checkpoint the caller may not have: reads as missing (404, the same
    message), and the route records the attempt for the owner (``row``)."""

    def __init__(self, path: str, row: CheckpointRow):
        super().__init__(f"checkpoint {path!r}")
        self.row = row


class ServerFull(Exception):
    """The server cannot take this now, but will once others' work is done (429, retried)."""


class TinkerService:
    def __init__(self, store: Store, data_dir: Path, policy: JobPolicy, settings: TinkerSettings, *,
                 audit: AuditLog | None = None, usage: UsageMeter | None = None):
        self.state = TinkerState(store, settings.keep_ended_sessions, settings.max_samplers_per_session,
                                 settings.max_samplers_per_user)
        self.traces = TraceLog(store)  # each session's requests with their timings (export_session_trace)
        self.futures = FutureTable(store, self.traces)
        self.host = TinkerHost(self.state, self.futures, settings.host)
        self.root = Path(data_dir) / "tinker"
        self.external_root = Path(settings.external_weights_dir or Path(data_dir) / "external")
        self.policy = policy
        self.settings = settings
        self._housekeeping: asyncio.Task | None = None
        self.tasks: set[asyncio.Task] = set()  # background sampling, kept referenced until done
        self.sample_budget = SampleBudget(settings.max_pending_sample_tokens)
        self.completions = CompletionFeeds()  # what retrieve_futures reports, per sampling session
        self.facts = ModelFactsCache()
        self.checkpoint_quota = CheckpointQuota(settings.max_checkpoints_per_user,
                                                settings.max_checkpoint_bytes_per_user)
        self.server_cap = server_cap(settings.max_server_checkpoint_bytes)
        self.audit = audit or AuditLog(store)  # shared with the RL job API (app.state.audit)
        self.usage = usage or UsageMeter(store)
        self.signer = UrlSigner(store.secret("download_urls"))

    def signed_url(self, base_url: str, path: str) -> tuple[str, float]:
        """An absolute download link to ``path`` (URL-quoted, from the server's root) that works
        for ``signed_url_s`` seconds, and when it expires. ``base_url``: the request's own (used
        unless the operator set --public-url)."""
        link, expires = self.signer.sign(path, self.settings.signed_url_s)
        return (self.settings.public_url or base_url).rstrip("/") + link, expires

    async def start(self) -> None:
        lost = self.state.mark_models_lost("the server restarted; create the model again from a checkpoint "
                                           "(ServiceClient.create_training_client_from_state)")
        failed = self.futures.fail_pending("the server restarted before this request finished")
        if lost or failed:
            log.warning("tinker: %d model(s) lost and %d request(s) failed in the restart", lost, failed)
        for row in self.state.unsized_checkpoints():  # saved before sizes were always measured: the quota needs them
            self.state.set_checkpoint_size(row, folder_bytes(Path(row.folder)))
        self._housekeeping = asyncio.create_task(self._keep_house())

    async def shutdown(self) -> None:
        if self._housekeeping is not None:
            self._housekeeping.cancel()
        for task in list(self.tasks):
            task.cancel()
        await self.host.shutdown()

    def spawn(self, coroutine) -> None:
        task = asyncio.create_task(coroutine)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- models ----------------------------------------------------------------------
    def served_model(self, name: str) -> ServedModel:
        """A served model by its name, or by the folder it is served from (the cookbook loads
        the tokenizer from a folder given as the model name); UserError listing the served names."""
        for model in self.policy.models:
            if name == model.name or (model.path is not None and name.rstrip("/") == model.path.rstrip("/")):
                return model
        tiny = self._tiny_folder()
        if tiny is not None and name.rstrip("/") == tiny:
            return self.policy.models[-1]
        raise UserError(f"base_model {name!r} is not served here; served models: {', '.join(self.policy.model_names())} "
                        "(RestClient.get_server_capabilities)")

    @staticmethod
    def _tiny_folder() -> str | None:
        from opentinker.tiny import tiny_model_dir  # no torch: the shipped folder

        return str(tiny_model_dir())

    def is_idle(self, slot: Any) -> bool:
        return slot.is_adapter and slot.idle_for() >= self.settings.idle_model_s

    def models_in_use(self, user_id: int | None = None) -> list[Any]:
        """Live models (of ``user_id``, or everyone's) but idle LoRA adapters."""
        return [slot for slot in self.host.live_models()
                if (user_id is None or slot.user_id == user_id) and not self.is_idle(slot)]

    def idle_models(self, user_id: int) -> int:
        return sum(1 for slot in self.host.live_models() if slot.user_id == user_id and self.is_idle(slot))

    def max_lora_rank(self, served: ServedModel) -> tuple[int, str]:
        """The largest LoRA rank a model of ``served`` may have, and why (for the refusal)."""
        flag = self.settings.max_lora_rank
        why = f"--tinker-max-lora-rank {flag}"
        hidden = self.facts.get(served).hidden_size
        # Every adapted layer has the hidden size on one side, so B @ A never has a higher rank:
        # a larger one costs memory and adds no capacity.
        if hidden is not None and hidden < flag:
            return hidden, f"{served.name}'s hidden size; {why}"
        return flag, why

    def sampler_memory_reserve(self) -> int:
        """What the admission budget keeps for the samplers' adapter caches: each served model's
        sampler may hold ``sampler_adapter_cache_bytes`` of LoRA adapters."""
        return self.settings.sampler_adapter_cache_bytes * len(self.policy.models)

    def context_length(self, base_model: str) -> int | None:
        """The served model's context in tokens (its config's max_position_embeddings), if known."""
        return self.facts.get(self.served_model(base_model)).context

    def picture_reading(self, base_model: str) -> Any:
        """How the served model reads image chunks (a vision-language model's), under the
        operator's picture bounds; None for a text model."""
        from opentinker.server.tinker.wire import PictureReading

        tokens = self.facts.get(self.served_model(base_model)).pictures
        return None if tokens is None else PictureReading(tokens, self.settings.image_limits)

    def admit_model(self, served: ServedModel, spec: BackendSpec) -> int:
        """The memory estimate a new model of ``served`` holds once admitted (0 when its size is
        unknown): a LoRA model beside others on a shared base holds its adapter's; the base's
        weights are held once, by the shared worker, from its first model on. :class:`ServerFull`
        when the server's live models or memory budget are full; UserError when the model would
        never fit the budget."""
        settings = self.settings
        facts = self.facts.get(served)
        lora = spec.lora is not None
        if spec.multi_adapter:
            estimate = estimated_adapter_bytes(facts, spec.lora.rank) or 0
            base = 0 if self.host.shared_base_started(spec) else estimated_model_bytes(facts, True) or 0
        else:
            estimate, base = estimated_model_bytes(facts, lora) or 0, 0
        kind = "LoRA" if lora else "fully fine-tuned"
        budget = settings.memory_budget_bytes
        reserve = self.sampler_memory_reserve()
        reserved = (f" ({_gib(reserve)} of it kept for the samplers' LoRA adapters: --tinker-sampler-adapter-cache-mb "
                    f"{settings.sampler_adapter_cache_bytes // 2**20} x {len(self.policy.models)} served models)")
        if budget is not None and estimate + base + reserve > budget:
            raise UserError(f"a {kind} model of {served.name} needs about {_gib(estimate + base)} (an estimate from "
                            f"its weight files), more than this server's whole Tinker memory budget of {_gib(budget)}"
                            + reserved + ("; a LoRA model needs less (lora_config)" if not lora else ""))
        in_use = self.models_in_use()
        if len(in_use) >= settings.max_models:
            raise ServerFull(f"the server is full: {len(in_use)} Tinker models in use, the most it runs at once "
                             "(--tinker-max-models); retry when one is unloaded or idle")
        used = sum(slot.memory_bytes for slot in self.host.live_models()) + self.host.base_memory_bytes() + reserve
        if budget is not None and used + estimate + base > budget:
            raise ServerFull(f"the server's memory for Tinker models is full: {_gib(used)} of {_gib(budget)} is "
                             f"taken (estimated){reserved} and a {kind} model of {served.name} needs about "
                             f"{_gib(estimate + base)}; retry when a model is unloaded")
        if spec.multi_adapter and base:
            self.host.reserve_base_memory(spec, base)
        return estimate

    def usable_model(self, model_id: str, user_id: int) -> ModelRow:
        """The caller's model, if it can take requests; UserError saying why not otherwise."""
        model = self.state.model(model_id, user_id)
        if model is None:
            raise LookupError(f"model {model_id!r}")
        if model.state in ("loading", "ready") and self.host.slot(model_id) is not None:
            return model
        raise UserError(f"model {model_id!r} is {model.state}" + (f": {model.error}" if model.error else "")
                        + "; load it again from a checkpoint")

    # -- checkpoints -----------------------------------------------------------------
    def new_folder(self, run_id: str, kind: str, name: str) -> Path:
        """A folder for one write of checkpoint ``name`` (``@`` never occurs in a name):
        external weights go to the operator's external folder, under the owner's user id."""
        leaf = f"{name}@{uuid.uuid4().hex[:12]}"
        if kind == "external_weights":
            owner = self.state.model(run_id).user_id
            return self.external_root / str(owner) / run_id.replace(":", "_") / leaf
        return self.root / run_id.replace(":", "_") / kind / leaf

    def check_ttl(self, ttl_s: int | None) -> None:
        longest = self.settings.max_checkpoint_ttl_s
        if ttl_s is not None and ttl_s > longest:
            raise UserError(f"ttl_seconds {ttl_s} is past this server's longest checkpoint TTL, {longest} s "
                            f"({longest / 86400:g} days; --tinker-max-checkpoint-ttl {longest}); give a shorter one, "
                            "or none to keep the checkpoint until it is deleted")

    def checkpoint_estimate(self, model: ModelRow, kind: str) -> int:
        """What the model's next checkpoint of ``kind`` will take on disk: its previous one's
        size, else an estimate from the model's size (0 when unknown: the landing check
        measures it)."""
        previous = self.state.latest_checkpoint_size(model.model_id, kind)
        if previous is not None:
            return previous
        try:
            facts = self.facts.get(self.served_model(model.base_model))
        except UserError:  # no longer served
            return 0
        return estimated_checkpoint_bytes(facts, model.lora_rank, kind != "weights") or 0

    def freed_by(self, model: ModelRow, replaced: CheckpointRow | None, ephemeral: bool) -> list[CheckpointRow]:
        """The checkpoints a save of ``model`` replaces: the one of its name (``overwrite``), or
        the ephemeral snapshots a new one pushes past the newest ``keep_ephemeral``."""
        if ephemeral:
            return self.state.ephemeral_beyond(model.model_id, self.settings.keep_ephemeral - 1)
        return [] if replaced is None else [replaced]

    def reserve_checkpoint(self, user_id: int, model: ModelRow, kind: str, freed: list[CheckpointRow]) -> int:
        """Before a save is queued: QuotaExceeded if it would not fit the user's quota or the
        server's cap (all users' saves under way counted); else a token holding its estimate
        until :meth:`CheckpointQuota.release`."""
        estimate, gone = self.checkpoint_estimate(model, kind), _usage(freed)

        def alive(model_id: str) -> bool:
            return self.host.slot(model_id) is not None

        self.checkpoint_quota.check(Usage(*self.state.checkpoint_usage(user_id)),
                                    self.checkpoint_quota.in_flight(user_id, alive), estimate, gone)
        everyone = self.state.store.all_checkpoint_bytes() + self.checkpoint_quota.in_flight(None, alive).nbytes
        self.server_cap.check(everyone - gone.nbytes, estimate, "a checkpoint of this model",
                              "delete some of yours (RestClient.delete_checkpoint) or wait for saves under way or "
                              "TTLs to end")
        return self.checkpoint_quota.reserve(user_id, model.model_id, estimate)

    def land_checkpoint(self, model: ModelRow, kind: str, name: str, user_id: int, folder: Path, ttl_s: int | None,
                        metadata: dict[str, str] | None, freed: list[CheckpointRow], ephemeral: bool = False
                        ) -> CheckpointRow:
        """A save written to ``folder``: measured on disk, checked against the quota and the
        server's cap again (UserError, the folder deleted, when it does not fit), recorded in
        place of any checkpoint of the same name, whose folder is deleted."""
        size, gone = folder_bytes(folder), _usage(freed)
        try:
            self.checkpoint_quota.check_landed(Usage(*self.state.checkpoint_usage(user_id)), size, gone)
            self.server_cap.check_landed(self.state.store.all_checkpoint_bytes() - gone.nbytes, size)
        except QuotaExceeded as error:
            shutil.rmtree(folder, ignore_errors=True)
            raise UserError(str(error)) from None
        now = time.time()
        row = CheckpointRow(model.model_id, kind, name, user_id, str(folder), size, ephemeral, metadata, now,
                            None if ttl_s is None else now + ttl_s)
        self.state.add_checkpoint(row)  # replaces the row of the same name
        for old in freed:
            if (old.run_id, old.kind, old.name) == (row.run_id, row.kind, row.name):  # its row is replaced already
                self._remove_folder(old)
        return row

    def _any_checkpoint(self, path: str, kind: str | None) -> CheckpointRow:
        """The checkpoint at ``path``, whoever's (LookupError if none; UserError for a bad path
        or another ``kind`` than asked)."""
        run, found_kind, name = parse_tinker_path(path)
        if kind is not None and found_kind != kind:
            wanted = {"weights": "save_state (tinker://…/weights/…)",
                      "sampler_weights": "save_weights_for_sampler (tinker://…/sampler_weights/…)",
                      "external_weights": "save_weights_external (tinker://…/external_weights/…)"}[kind]
            raise UserError(f"{path!r}: this needs a checkpoint made by {wanted}")
        row = self.state.checkpoint(run, found_kind, name, None)
        if row is None or not Path(row.folder).exists():
            raise LookupError(f"checkpoint {path!r}")
        return row

    def owned_checkpoint(self, path: str, user_id: int, kind: str | None = None) -> CheckpointRow:
        """The caller's own checkpoint (to change or delete it); :class:`NotYours` if another user's."""
        row = self._any_checkpoint(path, kind)
        if row.user_id != user_id:
            raise NotYours(path, row)
        return row

    def readable_checkpoint(self, path: str, user_id: int, kind: str | None = None) -> CheckpointRow:
        """The caller's checkpoint or a published one (to load, sample, copy or read it);
        :class:`NotYours` if another user's unpublished one."""
        row = self._any_checkpoint(path, kind)
        if row.user_id != user_id and not row.public:
            raise NotYours(path, row)
        return row

    def delete_checkpoint(self, row: CheckpointRow) -> None:
        self.state.delete_checkpoint(row)
        self._remove_folder(row)

    def _remove_folder(self, row: CheckpointRow) -> None:
        """A checkpoint's folder goes once no row names it (a copy shares its source's), and its
        adapter leaves the samplers' caches."""
        if self.state.folder_in_use(row.folder):
            return
        shutil.rmtree(row.folder, ignore_errors=True)
        if row.kind == "sampler_weights":
            for actor in self.host.started_samplers().values():
                actor.evict.remote(row.folder)

    def collect_ephemeral(self, run_id: str) -> None:
        for row in self.state.ephemeral_beyond(run_id, self.settings.keep_ephemeral):
            self.delete_checkpoint(row)

    # -- sessions --------------------------------------------------------------------
    async def end_session(self, session_id: str, state: str) -> None:
        """A finished or expired session: its models are unloaded, its ephemeral snapshots
        deleted (named checkpoints stay)."""
        self.state.end_session(session_id, state)
        for model_id in self.state.session_models(session_id):
            await self.host.unload(model_id, f"its session {session_id} is {state}")
        for row in self.state.expired_checkpoints([session_id]):
            self.delete_checkpoint(row)

    async def _keep_house(self) -> None:
        while True:
            await asyncio.sleep(self.settings.housekeeping_s)
            try:
                for session_id in self.state.idle_sessions(self.settings.session_timeout_s):
                    log.info("tinker: session %s had no heartbeat for %.0f s; ending it", session_id,
                             self.settings.session_timeout_s)
                    await self.end_session(session_id, "expired")
                for row in self.state.expired_checkpoints():
                    self.delete_checkpoint(row)
                self.futures.forget_older_than(self.settings.future_ttl_s)
                self.traces.forget_orphans()  # forgotten sessions' traces (at most every few minutes)
                self.completions.forget_idle(self.settings.future_ttl_s)
                self.usage.accrue_storage(stored_bytes(self.state.store))  # checkpoint GB-hours, Tinker's and jobs'
            except Exception:  # housekeeping must outlive one bad pass
                log.exception("tinker housekeeping failed")


def _usage(rows: list[CheckpointRow]) -> Usage:
    return Usage(len(rows), sum(row.size_bytes or 0 for row in rows))


def tinker_settings(settings: ServerSettings) -> TinkerSettings:
    """The Tinker API's settings from the operator's (``--tinker-*`` flags); ValueError when the
    samplers' adapter caches would take the whole memory budget."""
    budget, served = _memory_budget(settings), len(settings.job_policy.models)
    reserve = settings.tinker_sampler_adapter_cache_mb * 2**20 * served
    if reserve >= budget:
        raise ValueError(f"--tinker-sampler-adapter-cache-mb {settings.tinker_sampler_adapter_cache_mb} x {served} "
                         f"served models ({_gib(reserve)}) leaves nothing of the Tinker memory budget ({_gib(budget)}, "
                         "--tinker-memory-gb) for training models: lower the one or raise the other")
    return TinkerSettings(
        session_timeout_s=settings.tinker_session_timeout_s, long_poll_s=settings.tinker_long_poll_s,
        keep_ephemeral=settings.tinker_keep_ephemeral, max_models_per_user=settings.tinker_max_models_per_user,
        idle_model_s=settings.tinker_idle_model_s, max_idle_models_per_user=settings.tinker_max_idle_models_per_user,
        max_models=settings.tinker_max_models, memory_budget_bytes=budget,
        max_sessions_per_user=settings.tinker_max_sessions_per_user,
        max_queued_per_model=settings.tinker_max_queued_requests,
        max_queued_per_user=settings.tinker_max_queued_requests_per_user,
        max_pending_sample_tokens=settings.tinker_max_pending_sample_tokens,
        sampler_adapter_cache_bytes=settings.tinker_sampler_adapter_cache_mb * 2**20,
        max_lora_rank=settings.tinker_max_lora_rank,
        max_checkpoints_per_user=settings.tinker_max_checkpoints,
        max_checkpoint_bytes_per_user=int(settings.tinker_max_checkpoint_gb * 2**30),
        max_checkpoint_ttl_s=settings.tinker_max_checkpoint_ttl_s,
        max_server_checkpoint_bytes=int(settings.max_checkpoint_gb * 2**30),
        image_limits=settings.job_policy.image_limits,
        max_projects_per_user=settings.max_projects_per_user, identity_token_s=settings.identity_token_s,
        public_url=settings.public_url, signed_url_s=settings.signed_url_s,
        external_weights_dir=settings.external_weights_dir, prices=dict(settings.prices),
        host=HostSettings(strategy=settings.tinker_strategy, ranks=settings.tinker_ranks,
                          max_resident_adapters=settings.tinker_max_resident_adapters,
                          offload_dir=str(settings.data_dir / "tinker" / "offload"),
                          pass_limits=PassLimits.for_tokens(settings.tinker_pass_tokens),
                          cycle_limits=PassLimits.for_tokens(settings.tinker_cycle_tokens),
                          sampler_limits=sampler_limits(settings)),
    )


def sampler_limits(settings: ServerSettings) -> dict[str, int]:
    """The sampler's caps (``SchedulerLimits``): one forward pass's; two passes' worth of
    sequences started and not finished per user, and eight passes' worth for everyone; and
    its LoRA adapter cache's bytes."""
    rows, tokens = settings.tinker_sampler_max_rows, settings.tinker_sampler_max_tokens
    return {"max_rows": rows, "max_batch_tokens": tokens, "max_user_tokens": 2 * tokens,
            "max_live_rows": 8 * rows, "max_live_tokens": 8 * tokens,
            "adapter_cache_bytes": settings.tinker_sampler_adapter_cache_mb * 2**20}


def _memory_budget(settings: ServerSettings) -> int:
    """The Tinker models' memory budget: ``tinker_memory_gb``, else half of this machine's RAM."""
    if settings.tinker_memory_gb is not None:
        return int(settings.tinker_memory_gb * 2**30)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2

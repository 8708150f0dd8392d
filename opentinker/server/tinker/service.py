"""The Tinker API's moving parts in one place: the store's tables, the futures, the Ray host,
checkpoint folders, and the housekeeping that ends idle sessions and collects garbage.

A checkpoint lives in ``<data_dir>/tinker/<run>/<weights|sampler_weights>/<name>`` and is
named to clients as ``tinker://<run>/<weights|sampler_weights>/<name>`` (the run id is the
model id). Ephemeral sampler snapshots (what ``save_weights_and_get_sampling_client`` makes
every RL step) are kept for a model's newest ``keep_ephemeral`` and for as long as its session
lives; named checkpoints until deleted or past their ``ttl_seconds``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.server.policy import JobPolicy, ServedModel
from opentinker.server.settings import ServerSettings
from opentinker.server.store import Store
from opentinker.server.tinker.completions import CompletionFeeds
from opentinker.server.tinker.futures import FutureTable
from opentinker.server.tinker.host import HostSettings, TinkerHost, UserError
from opentinker.server.tinker.model_facts import ModelFactsCache, estimated_adapter_bytes, estimated_model_bytes
from opentinker.server.tinker.sample_budget import SampleBudget
from opentinker.server.tinker.state import CheckpointRow, ModelRow, TinkerState

log = logging.getLogger("opentinker.server.tinker")

CHECKPOINT_KINDS = {"weights": "training", "sampler_weights": "sampler"}


@dataclass
class TinkerSettings:
    session_timeout_s: float = 300.0  # a session with no heartbeat for this long ends (the SDK beats every 10 s)
    long_poll_s: float = 25.0  # retrieve_future holds this long before try_again (the SDK gives up at 45 s)
    keep_ephemeral: int = 4  # ephemeral sampler snapshots kept per model
    max_models_per_user: int = 4  # live models (each one a worker holding a copy of its weights)
    max_models: int = 8  # live models on the server, whoever's (429 past it)
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
    housekeeping_s: float = 10.0
    host: HostSettings = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        self.host = self.host or HostSettings()


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """``tinker://<run>/<kind>/<name>`` -> (run, kind, name); UserError naming the format."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in CHECKPOINT_KINDS or not all(parts):
        raise UserError(f"{path!r} is not a checkpoint path: expected tinker://<run id>/weights/<name> or "
                        "tinker://<run id>/sampler_weights/<name>")
    return parts[0], parts[1], parts[2]


class ServerFull(Exception):
    """The server cannot take this now, but will once others' work is done (429, retried)."""


class TinkerService:
    def __init__(self, store: Store, data_dir: Path, policy: JobPolicy, settings: TinkerSettings):
        self.state = TinkerState(store, settings.keep_ended_sessions, settings.max_samplers_per_session,
                                 settings.max_samplers_per_user)
        self.futures = FutureTable(store)
        self.host = TinkerHost(self.state, self.futures, settings.host)
        self.root = Path(data_dir) / "tinker"
        self.policy = policy
        self.settings = settings
        self._housekeeping: asyncio.Task | None = None
        self.tasks: set[asyncio.Task] = set()  # background sampling, kept referenced until done
        self.sample_budget = SampleBudget(settings.max_pending_sample_tokens)
        self.completions = CompletionFeeds()  # what retrieve_futures reports, per sampling session
        self.facts = ModelFactsCache()

    async def start(self) -> None:
        lost = self.state.mark_models_lost("the server restarted; create the model again from a checkpoint "
                                           "(ServiceClient.create_training_client_from_state)")
        failed = self.futures.fail_pending("the server restarted before this request finished")
        if lost or failed:
            log.warning("tinker: %d model(s) lost and %d request(s) failed in the restart", lost, failed)
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
        from opentinker.engine.tiny import tiny_model_dir  # no torch: only where the cache puts it

        return str(tiny_model_dir())

    def live_models(self, user_id: int) -> int:
        return sum(1 for slot in self.host.live_models() if slot.user_id == user_id)

    def context_length(self, base_model: str) -> int | None:
        """The served model's context in tokens (its config's max_position_embeddings), if known."""
        return self.facts.get(self.served_model(base_model)).context

    def admit_model(self, served: ServedModel, worker_spec: Any) -> int:
        """The memory estimate a new model of ``served`` holds once admitted (0 when its size is
        unknown): a LoRA model beside others on a shared base holds its adapter's; the base's
        weights are held once, by the shared worker, from its first model on. :class:`ServerFull`
        when the server's live models or memory budget are full; UserError when the model would
        never fit the budget."""
        settings = self.settings
        facts = self.facts.get(served)
        lora = worker_spec.lora_rank > 0
        shared = self.host.shares_base(worker_spec)
        if shared:
            estimate = estimated_adapter_bytes(facts, worker_spec.lora_rank) or 0
            base = 0 if self.host.shared_base_started(worker_spec) else estimated_model_bytes(facts, True) or 0
        else:
            estimate, base = estimated_model_bytes(facts, lora) or 0, 0
        kind = "LoRA" if lora else "fully fine-tuned"
        budget = settings.memory_budget_bytes
        if budget is not None and estimate + base > budget:
            raise UserError(f"a {kind} model of {served.name} needs about {_gib(estimate + base)} (an estimate from "
                            f"its weight files), more than this server's whole Tinker memory budget of {_gib(budget)}"
                            + ("; a LoRA model needs less (lora_config)" if not lora else ""))
        live = self.host.live_models()
        if len(live) >= settings.max_models:
            raise ServerFull(f"the server is full: {len(live)} live Tinker models, the most it runs at once "
                             "(--tinker-max-models); retry when one is unloaded")
        used = sum(slot.memory_bytes for slot in live) + self.host.base_memory_bytes()
        if budget is not None and used + estimate + base > budget:
            raise ServerFull(f"the server's memory for Tinker models is full: {_gib(used)} of {_gib(budget)} is "
                             f"taken (estimated) and a {kind} model of {served.name} needs about "
                             f"{_gib(estimate + base)}; retry when a model is unloaded")
        if shared and base:
            self.host.reserve_base_memory(worker_spec, base)
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
    def folder(self, run_id: str, kind: str, name: str) -> Path:
        return self.root / run_id.replace(":", "_") / kind / name

    def owned_checkpoint(self, path: str, user_id: int, kind: str | None = None) -> CheckpointRow:
        run, found_kind, name = parse_tinker_path(path)
        if kind is not None and found_kind != kind:
            wanted = "save_state (tinker://…/weights/…)" if kind == "weights" else \
                "save_weights_for_sampler (tinker://…/sampler_weights/…)"
            raise UserError(f"{path!r}: this needs a checkpoint made by {wanted}")
        row = self.state.checkpoint(run, found_kind, name, user_id)
        if row is None or not Path(row.folder).exists():
            raise LookupError(f"checkpoint {path!r}")
        return row

    def delete_checkpoint(self, row: CheckpointRow) -> None:
        self.state.delete_checkpoint(row)
        shutil.rmtree(row.folder, ignore_errors=True)

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
                self.completions.forget_idle(self.settings.future_ttl_s)
            except Exception:  # housekeeping must outlive one bad pass
                log.exception("tinker housekeeping failed")


def tinker_settings(settings: ServerSettings) -> TinkerSettings:
    """The Tinker API's settings from the operator's (``--tinker-*`` flags)."""
    return TinkerSettings(
        session_timeout_s=settings.tinker_session_timeout_s, long_poll_s=settings.tinker_long_poll_s,
        keep_ephemeral=settings.tinker_keep_ephemeral, max_models_per_user=settings.tinker_max_models_per_user,
        max_models=settings.tinker_max_models, memory_budget_bytes=_memory_budget(settings),
        max_sessions_per_user=settings.tinker_max_sessions_per_user,
        max_queued_per_model=settings.tinker_max_queued_requests,
        max_queued_per_user=settings.tinker_max_queued_requests_per_user,
        max_pending_sample_tokens=settings.tinker_max_pending_sample_tokens,
        host=HostSettings(strategy=settings.tinker_strategy, ranks=settings.tinker_ranks,
                          max_resident_adapters=settings.tinker_max_resident_adapters,
                          offload_dir=str(settings.data_dir / "tinker" / "offload"),
                          sampler_limits=sampler_limits(settings)),
    )


def sampler_limits(settings: ServerSettings) -> dict[str, int]:
    """The sampler's caps (``SchedulerLimits``): one forward pass's; two passes' worth of
    sequences started and not finished per user, and eight passes' worth for everyone."""
    rows, tokens = settings.tinker_sampler_max_rows, settings.tinker_sampler_max_tokens
    return {"max_rows": rows, "max_batch_tokens": tokens, "max_user_tokens": 2 * tokens,
            "max_live_rows": 8 * rows, "max_live_tokens": 8 * tokens}


def _memory_budget(settings: ServerSettings) -> int:
    """The Tinker models' memory budget: ``tinker_memory_gb``, else half of this machine's RAM."""
    if settings.tinker_memory_gb is not None:
        return int(settings.tinker_memory_gb * 2**30)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2

"""Many users' LoRA models on one copy of a base model: the Tinker API's multi-tenant worker.

One :class:`AdapterWorker` Ray actor per served base model holds the base weights once and
every LoRA model of that base as a named peft adapter, each with its own rank, alpha and
target modules, its own AdamW state, step and RNG state. Nothing of one model is shared with
another except the frozen base weights.

The host hands it a *cycle* at a time: at most one request per model (each model's requests
run in its ``seq_id`` order), so every waiting model is served once per cycle. The cycle's
``forward_backward`` / ``forward`` requests run as one batched pass: the rows of every request
go through the base model together and each LoRA layer adds, to each row, only that row's
adapter (peft's mixed-adapter forward: rows are grouped per adapter in every layer, which is
how different ranks and targets live side by side). Each request's loss is its own sum over
its own rows; the cycle back-propagates the sum of the training requests' losses, and since a
row's output depends on its own adapter only, each adapter gets exactly its own gradient.
``optim_step``, checkpoints and the rest run one model at a time.

Residency: with ``max_resident`` set, at most that many adapters live on the device; the
least recently used ones (weights, accumulated gradients and optimizer state) go to a file
and come back, bit-identical, on their model's next request. A cycle with more models than
``max_resident`` runs its batched pass in groups of at most ``max_resident`` models.

The base model runs in eval mode (no dropout, as Tinker trains), which is also what peft's
mixed-adapter forward requires; gradients flow all the same.
"""

from __future__ import annotations

import contextlib
import logging
import re
import warnings
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opentinker.engine.backend.base import clipped_adamw_step
from opentinker.engine.backend.forward import ResponseScorer
from opentinker.engine.backend.lora import LoraSettings, lora_config, tied_unembed_allowed
from opentinker.engine.backend.losses import check_inputs, resolve_loss, weighted_loss
from opentinker.engine.backend.spec import BackendSpec
from opentinker.engine.batch import TokenBatch
from opentinker.engine.cpu_threads import use_node_cores
from opentinker.engine.tinker.adam import adam_params, tinker_step_metrics
from opentinker.engine.tinker.calls import ForwardBackwardCall
from opentinker.engine.tinker.datums import datum_limits, datum_pictures, per_datum, token_batch
from opentinker.engine.tinker.pass_plan import PassLimits, cut_rows, join_pieces
from opentinker.images import ImageLimits
from opentinker.engine.tinker.adapter_state import (
    Adapter, offload, read_adapter_state, reload, write_adapter_state, write_sampler_adapter,
)

log = logging.getLogger("opentinker.engine.tinker")


@dataclass
class _Prepared:
    """A call ready to run, or the piece of it that one pass runs (``rows``: its indices in the
    call's data; ``batch``: those rows)."""

    index: int  # in the cycle's list of calls
    call: ForwardBackwardCall
    adapter: "Adapter"
    batch: TokenBatch
    loss: Any  # LossSpec
    config: dict[str, Any]
    rows: list[int]

    def piece(self, rows: list[int]) -> "_Prepared":
        """The piece of this (whole) call with ``rows`` of its data."""
        if len(rows) == len(self.rows):
            return self
        return _Prepared(self.index, self.call, self.adapter, self.batch.select(rows), self.loss, self.config, rows)


class AdapterWorker:
    """``max_resident``: adapters kept on the device at once (None: all); ``offload_dir``: where
    the others wait.

    This is also each rank of :class:`~opentinker.engine.tinker.sharded_adapters.ShardedAdapterWorker`
    (the ``fsdp`` strategy), which overrides where the base comes from, which rows of a pass are
    its own and how gradients meet; ``rank`` / ``world_size`` are 0 / 1 here."""

    rank = 0
    world_size = 1

    def __init__(self, base: BackendSpec, max_resident: int | None = None, offload_dir: str | None = None,
                 limits: PassLimits | None = None):
        import shutil
        import tempfile

        from opentinker.engine.model_loading import pick_device, resolved_spec

        if max_resident is not None and max_resident < 1:
            raise ValueError(f"max_resident must be >= 1 or None, got {max_resident}")
        use_node_cores()
        self.spec = resolved_spec(base.shared_base())  # a ValueError unless base is multi_adapter
        self.device = pick_device(self.spec.device)
        self.vocab_size, self.context = datum_limits(self.spec.model_path, self.spec.trust_remote_code)
        # A vision-language model's: datums' pictures, already read under the server's bounds.
        self.pictures = datum_pictures(self.spec.model_path, self.spec.trust_remote_code,
                                       ImageLimits.checked_upstream())
        self.base = self._load_base(self.spec)
        self.model: Any = None  # the peft model, made with the first adapter
        # Rows are scored as padded rows: prefix sharing and packing would mix rows of
        # different adapters.
        self.scorer = ResponseScorer(self.spec.pad_token_id, self.device, use_remove_padding=False,
                                     share_prompt_prefix=False)
        self.adapters: dict[str, Adapter] = {}
        self.max_resident = max_resident
        self.limits = limits or PassLimits()  # what one pass may cost (padded tokens, attention cells)
        self._resident: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._names = 0
        self._offload_dir = Path(offload_dir or tempfile.mkdtemp(prefix="opentinker-adapters-"))
        # What a killed worker left there belongs to nobody now (its models were lost with it).
        shutil.rmtree(self._offload_dir, ignore_errors=True)
        self._offload_dir.mkdir(parents=True, exist_ok=True)
        self.passes = 0  # batched passes run (for tests and stats)
        self.largest_pass = (0, 0)  # the most padded tokens and attention cells one pass held

    def _load_base(self, spec: BackendSpec) -> torch.nn.Module:
        from opentinker.engine.model_loading import load_causal_lm

        base = load_causal_lm(spec.model_path, device=self.device, trust_remote_code=spec.trust_remote_code).eval()
        return base.requires_grad_(False)

    def ready(self) -> dict[str, Any]:
        pictures = self.pictures
        return {"vocab_size": self.vocab_size, "context": self.context,
                "image_token_id": pictures.layout.image_token_id if pictures is not None else None,
                # patches the vision tower runs per image token (merge x merge): a picture's cost
                "patches_per_image_token": pictures.layout.merge ** 2 if pictures is not None else 0}

    def stats(self) -> dict[str, Any]:
        import resource

        import psutil

        return {"models": len(self.adapters), "resident": list(self._resident), "passes": self.passes,
                "largest_pass": list(self.largest_pass), "rss_bytes": psutil.Process().memory_info().rss,
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB

    # -- the cycle --------------------------------------------------------------------
    def cycle(self, calls: Sequence[ForwardBackwardCall],
              ops: Sequence[tuple[str, str, tuple]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """One cycle: ``calls`` in batched passes, then each ``(method, model_id, args)`` of
        ``ops``. Every entry gets ``{"result": ...}`` or ``{"error": message, "category": ...}``;
        one model's failure is its own."""
        fb = self.forward_backward(calls) if calls else []
        done = []
        for method, model_id, args in ops:
            if method not in _OPS:
                done.append({"error": f"unknown operation {method!r}", "category": "server"})
                continue
            try:
                done.append({"result": getattr(self, method)(model_id, *args)})
            except Exception as error:  # noqa: BLE001 - reported to that model's request
                done.append(_error(error))
        return fb, done

    # -- models -----------------------------------------------------------------------
    def add_model(self, model_id: str, settings: LoraSettings) -> dict[str, Any]:
        if model_id in self.adapters:
            raise ValueError(f"model {model_id} is already here")
        self._names += 1
        adapter = Adapter(model_id, f"model{self._names}", settings,
                           rng=torch.Generator().manual_seed(settings.seed).get_state())
        self._attach(adapter)
        self.adapters[model_id] = adapter
        self._use([model_id])
        return {"step": 0}

    def remove_model(self, model_id: str) -> None:
        adapter = self.adapters.pop(model_id, None)
        if adapter is None:
            return
        if adapter.offloaded is not None:
            adapter.offloaded.unlink(missing_ok=True)
        else:
            self._detach(adapter)

    def _attach(self, adapter: Adapter) -> None:
        """Fresh LoRA weights for ``adapter`` in the shared model, from its seed (the same
        values peft gives a model of its own with that seed)."""
        config = lora_config(self.base, adapter.settings)
        with torch.random.fork_rng(devices=[]), tied_unembed_allowed():
            torch.manual_seed(adapter.settings.seed)
            if self.model is None:
                from peft import get_peft_model

                self.model = get_peft_model(self.base, config, adapter_name=adapter.name).eval()
            else:
                self.model.add_adapter(adapter.name, config)
        # Its tensors in module order (the order of its optimizer's state), found once.
        marker = re.compile(rf"\.lora_[AB]\.{adapter.name}\.")
        adapter.named = [(name, p) for name, p in self.model.named_parameters() if marker.search(name)]
        self._resident[adapter.model_id] = None
        self._freeze_all(adapter)

    def _detach(self, adapter: Adapter) -> None:
        with warnings.catch_warnings():  # "Adapter model1 was active which is now deleted": no adapter is
            warnings.simplefilter("ignore")  # active here, each row names its own
            self.model.delete_adapter(adapter.name)
        adapter.optimizer = None
        adapter.named = []
        self._resident.pop(adapter.model_id, None)
        self._freeze_all()

    def _freeze_all(self, *more: Adapter) -> None:
        """After peft added or deleted an adapter: it sets ``requires_grad`` of the others by
        its own "active adapter" (``delete_adapter`` calls ``set_adapter``, which freezes every
        adapter but one). Between passes every adapter rests frozen; :meth:`_trainable` sets
        a pass's own."""
        for adapter in (*self.adapters.values(), *more):
            for parameter in adapter.parameters():  # none while offloaded
                parameter.requires_grad_(False)

    def _adapter(self, model_id: str) -> Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise KeyError(f"model {model_id} is not on this worker")
        return adapter

    # -- residency --------------------------------------------------------------------
    def _use(self, model_ids: Sequence[str]) -> None:
        """Makes ``model_ids`` resident (reloading offloaded ones) and most recently used, then
        offloads the least recently used others past the budget."""
        for model_id in model_ids:
            adapter = self._adapter(model_id)
            if adapter.offloaded is not None:
                self._reload(adapter)
            self._resident.move_to_end(model_id)
        if self.max_resident is None:
            return
        for model_id in list(self._resident):
            if len(self._resident) <= self.max_resident:
                break
            if model_id not in model_ids:
                self._offload(self.adapters[model_id])

    def _offload(self, adapter: Adapter) -> None:
        offload(adapter, self._offload_dir / f"{adapter.name}.pt")
        self._detach(adapter)

    def _reload(self, adapter: Adapter) -> None:
        self._attach(adapter)
        reload(adapter)

    # -- training -----------------------------------------------------------------------
    def forward_backward(self, calls: Sequence[ForwardBackwardCall]) -> list[dict[str, Any]]:
        """Each call's per-datum ``logprobs`` / ``elementwise_loss`` and metrics, computed in
        passes within :attr:`limits`; a call that cannot run (bad datums, unknown loss) fails
        alone. A call's rows may be spread over several passes (sorted by length so that rows
        of similar length pad together): its loss is a sum over its rows, so its gradient and
        its summed metrics are the same."""
        results: list[dict[str, Any] | None] = [None] * len(calls)
        prepared = []
        for index, call in enumerate(calls):
            try:
                adapter = self._adapter(call.model_id)
                batch = token_batch(call.data, self.vocab_size, self.context, self.pictures)
                loss, config = resolve_loss(call.loss_fn, call.loss_config)
                check_inputs(loss, batch.tensors, tuple(batch.response_mask.shape))
            except Exception as error:  # noqa: BLE001 - that call's own failure
                results[index] = _error(error)
                continue
            prepared.append(_Prepared(index, call, adapter, batch, loss, config, list(range(len(batch)))))
        pieces: dict[int, list[tuple[list[int], dict[str, Any]]]] = {item.index: [] for item in prepared}
        for group in plan_passes(prepared, self.max_resident, self.limits):
            try:
                for index, rows, outcome in self._run_pass(group):
                    pieces[index].append((rows, outcome))
            except Exception as error:  # noqa: BLE001
                if self.world_size > 1:  # a rank cannot redo a pass alone: its peers wait in collectives
                    raise
                log.warning("a pass of %d requests failed (%s: %s); running them one by one", len(group),
                            type(error).__name__, error)
                for piece in group:  # only the culprit fails (its other pieces' results are dropped)
                    try:
                        for index, rows, outcome in self._run_pass([piece]):
                            pieces[index].append((rows, outcome))
                    except Exception as single:  # noqa: BLE001
                        results[piece.index] = _error(single)
        for index, parts in pieces.items():
            if results[index] is None:
                results[index] = {"result": join_pieces(parts, keep_rows=self.world_size > 1)}
        return results  # type: ignore[return-value]

    def _run_pass(self, group: list[_Prepared]) -> list[tuple[int, list[int], dict[str, Any]]]:
        """One pass over ``group``'s pieces; ``(call index, its rows, outcome)`` per piece
        whose rows this process computed."""
        self._use([item.call.model_id for item in group])
        train = any(not item.call.forward_only for item in group)
        parts = self._own_rows(group)
        if not parts or (train and all(item.call.forward_only for item, _, _ in parts)):
            # FSDP's gathers need every rank in the forward and the backward: a rank without
            # (training) rows runs one row whose result is dropped.
            parts = parts + self._filler(group, train)
        names = [item.adapter.name for item, part, _ in parts for _ in range(len(part))]
        combined = TokenBatch.from_responses([p for _, part, _ in parts for p in part.prompt_ids],
                                             [r for _, part, _ in parts for r in part.response_ids],
                                             images=[i for _, part, _ in parts for i in part.row_images()])
        needs_entropy = {id(item): item.loss.needs_entropy(item.config) for item in group}

        def model(**inputs):
            return self.model(**inputs, adapter_names=names)

        training = [item.adapter for item in group if not item.call.forward_only]
        with self._trainable(training), torch.set_grad_enabled(train):
            logprobs, entropy = self.scorer(model, combined, 1.0, any(needs_entropy.values()),
                                            entropy_grad=any(needs_entropy.values()))
            self.passes += 1
            self.largest_pass = tuple(map(max, self.largest_pass, _pass_cost(combined)))
            total, outcomes = _piece_losses(parts, logprobs, entropy, needs_entropy, self.device)
            if train:
                if self.world_size > 1:
                    # Every rank runs the backward (FSDP gathers the base's shards in it), also one
                    # whose rows carry no training loss: a zero term gives it a graph.
                    zero = logprobs.sum() * 0.0
                    total = zero if total is None else total + zero
                total.backward()
        return outcomes

    @contextlib.contextmanager
    def _trainable(self, adapters: Sequence[Adapter]):
        """Exactly ``adapters`` take gradients for the pass: the worker, not peft's "active
        adapter", decides (peft's ``add_adapter`` / ``delete_adapter`` switch ``requires_grad``
        of adapters they did not touch). Every adapter rests frozen between passes."""
        for adapter in adapters:
            for parameter in adapter.parameters():
                parameter.requires_grad_(True)
        try:
            yield
        finally:
            for adapter in adapters:
                for parameter in adapter.parameters():
                    parameter.requires_grad_(False)

    def _own_rows(self, group: list[_Prepared]) -> list[tuple[_Prepared, TokenBatch, list[int]]]:
        """The rows of the pass this process computes, per piece, with their indices in its
        request: all of them here; a rank of the sharded worker overrides it."""
        return [(item, item.batch, item.rows) for item in group]

    def _filler(self, group: list[_Prepared], train: bool) -> list[tuple[_Prepared, TokenBatch, list[int]]]:
        raise AssertionError("a pass without rows")  # only ranks of the sharded worker have none

    def optim_step(self, model_id: str, adam: Mapping[str, float]) -> dict[str, float]:
        """One AdamW step of this model's adapter (clip, skip on a non-finite norm, clear its
        gradients), as ``LocalBackend.optim_step``."""
        self._use([model_id])
        adapter = self._adapter(model_id)
        self._reduce_gradients(adapter)
        adapter.optimizer, metrics = clipped_adamw_step(adapter.optimizer, adapter.parameters(),
                                                        adam_params(adam))
        adapter.step += not metrics["skipped_nonfinite"]
        return tinker_step_metrics(metrics)

    def _reduce_gradients(self, adapter: Adapter) -> None:
        """Here: nothing (one process holds every row's gradient); ranks sum theirs."""

    # -- state ----------------------------------------------------------------------------
    def save_state(self, model_id: str, path: str) -> None:
        """The adapter, optimizer, RNG and step in the backends' state file (a model of its own
        with the same LoRA loads it, and the other way round)."""
        self._use([model_id])
        if not self.rank:  # every rank holds the same adapter and optimizer state: rank 0 writes it
            write_adapter_state(self._adapter(model_id), path)

    def load_state(self, model_id: str, path: str, with_optimizer: bool = True) -> None:
        self._use([model_id])
        read_adapter_state(self._adapter(model_id), path, with_optimizer)

    def save_sampler_weights(self, model_id: str, path: str) -> int | None:
        """The adapter alone as a peft folder; its size in bytes (None on ranks but 0)."""
        self._use([model_id])
        return None if self.rank else write_sampler_adapter(self._adapter(model_id), path)

    def close(self) -> None:
        for adapter in self.adapters.values():
            if adapter.offloaded is not None:
                adapter.offloaded.unlink(missing_ok=True)


_OPS = {"add_model", "remove_model", "optim_step", "save_state", "load_state", "save_sampler_weights"}


def _error(error: BaseException) -> dict[str, Any]:
    """A failure as the host reports it: the user's for bad input (ValueError: datums, losses,
    a checkpoint that does not fit), the server's otherwise."""
    if isinstance(error, ValueError):
        return {"error": str(error), "category": "user"}
    return {"error": f"{type(error).__name__}: {error}", "category": "server"}


def plan_passes(prepared: list[_Prepared], max_resident: int | None, limits: PassLimits) -> list[list[_Prepared]]:
    """The cycle's rows in passes: its calls in groups of at most ``max_resident`` models,
    and each group's rows, longest first, cut to fit ``limits`` (a piece of a call per
    pass it has rows in)."""
    groups: list[list[_Prepared]] = []
    models: set[str] = set()
    for item in prepared:
        if not groups or (max_resident is not None and item.call.model_id not in models
                          and len(models) >= max_resident):
            groups.append([])
            models = set()
        groups[-1].append(item)
        models.add(item.call.model_id)
    passes = []
    for group in groups:
        rows = [(item, row) for item in group for row in item.rows]
        lengths = [item.batch.row_cost(row) for item, row in rows]
        for cut in cut_rows(lengths, limits):
            chosen: dict[int, list[int]] = {}
            for position in cut:
                item, row = rows[position]
                chosen.setdefault(id(item), []).append(row)
            passes.append([item.piece(sorted(chosen[id(item)])) for item in group if id(item) in chosen])
    return passes


def _piece_losses(parts: list[tuple[_Prepared, TokenBatch, list[int]]], logprobs: torch.Tensor,
                  entropy: torch.Tensor | None, needs_entropy: dict[int, bool], device: torch.device):
    """Each piece's loss from the pass's logprobs (its rows, in order): the summed training
    loss (None: no training row) and ``(call index, rows, outcome)`` per piece that is not a
    filler row."""
    total = None
    outcomes = []
    start = 0
    for item, part, rows in parts:
        end, width = start + len(part), part.response_width
        if rows:  # not a filler row
            part_logprobs = logprobs[start:end, :width]
            part_entropy = entropy[start:end, :width] if needs_entropy[id(item)] else None
            if item.call.forward_only:
                with torch.no_grad():
                    out = weighted_loss(item.loss, item.config, part_logprobs.detach(),
                                        None if part_entropy is None else part_entropy.detach(), part, device)
            else:
                out = weighted_loss(item.loss, item.config, part_logprobs, part_entropy, part, device)
                total = out.loss if total is None else total + out.loss
            outcomes.append((item.index, rows, {
                "outputs": per_datum(part, logprobs=part_logprobs.detach(), elementwise_loss=out.elementwise),
                "metrics": out.metrics}))
        start = end
    return total, outcomes


def _pass_cost(combined: TokenBatch) -> tuple[int, int]:
    """A pass's padded tokens and attention cells."""
    count = len(combined)
    longest = max(len(p) + len(r) for p, r in zip(combined.prompt_ids, combined.response_ids))
    return count * longest, count * longest * longest

"""What the Tinker API's work adds to usage metering (:mod:`opentinker.server.accounting.usage`),
each record attributed to its user, the session that made the model or sampler, and the base
model. Only work that ran counts: a request refused at the door, or a pass that failed, adds
nothing.

- ``training``: the tokens a ``forward`` or ``forward_backward`` sent, each datum's model input
  (what the SDK's ``ModelInput.length`` counts: a picture as its image tokens);
- ``sampling_prefill``: a sample call's prompt tokens, once per call (its samples share the
  prompt), ``cached`` False: no prompt is billed as served from a cache here;
- ``sampling_sample``: the tokens the call generated, over all its sequences;
- ``compute_s``: seconds a worker spent on the call. A model's calls run one after another on
  its worker, and the next is handed over while one runs: a call counts from when it was
  handed over or the model's previous call ended, whichever is later, to its end. A sample
  counts its time at the sampler, which decodes several calls (of several users) together:
  each call pays for the time it took, not a share of it;
- ``checkpoint``: one per checkpoint written (sampler snapshots included);
- ``storage``: GB-hours of the bytes :func:`stored_bytes` finds, accrued by the service's
  housekeeping.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from opentinker.server.accounting.usage import StoredBytes

if TYPE_CHECKING:
    from opentinker.server.store import Store
    from opentinker.server.tinker.service import TinkerService
    from opentinker.server.tinker.state import ModelRow

log = logging.getLogger("opentinker.server.tinker.metering")

# When each model's worker handle finished its last call (monotonic): the start of the next
# call's compute time. Keyed weakly: a model's handle goes with the model.
_busy_until: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()


def clock() -> float:
    return time.monotonic()


def datum_tokens(data: Iterable[Any]) -> int:
    """Model input tokens of a forward/backward call's datums."""
    return sum(len(datum.tokens) for datum in data)


def _record(svc: TinkerService, user_id: int, kind: str, quantity: float, session_id: str | None,
            base_model: str | None) -> None:
    """Never raises: the work is done; a metering write that fails is logged, not the call's failure."""
    try:
        svc.usage.record(user_id, kind, quantity, session_id=session_id, base_model=base_model)
    except Exception:  # noqa: BLE001
        log.exception("could not record %s usage of user %s", kind, user_id)


def computed(svc: TinkerService, model: ModelRow, handle: Any, started: float) -> None:
    """A model's call that began (was handed over) at ``started`` has just ended."""
    end = clock()
    try:
        begin = max(started, _busy_until.get(handle, started))
        _busy_until[handle] = end
    except TypeError:  # a handle that cannot be weakly referenced: the call's own time
        begin = started
    _record(svc, model.user_id, "compute_s", end - begin, model.session_id, model.base_model)


def trained(svc: TinkerService, model: ModelRow, handle: Any, tokens: int, started: float) -> None:
    """A forward or forward_backward pass of ``tokens`` input tokens ran."""
    _record(svc, model.user_id, "training", tokens, model.session_id, model.base_model)
    computed(svc, model, handle, started)


def checkpoint_written(svc: TinkerService, model: ModelRow) -> None:
    _record(svc, model.user_id, "checkpoint", 1, model.session_id, model.base_model)


@dataclass(frozen=True)
class SampleUsage:
    """Who a sample call is billed to, and its prompt's length."""

    user_id: int
    session_id: str | None
    base_model: str
    prompt_tokens: int


def sampled(svc: TinkerService, usage: SampleUsage, sequences: Sequence[Sequence[Any]], started: float) -> None:
    """A sample call that reached the sampler at ``started`` returned ``sequences`` (each
    ``(tokens, logprobs, finish reason)``)."""
    seconds = clock() - started
    generated = sum(len(sequence[0]) for sequence in sequences)
    for kind, quantity in (("sampling_prefill", usage.prompt_tokens), ("sampling_sample", generated),
                           ("compute_s", seconds)):
        _record(svc, usage.user_id, kind, quantity, usage.session_id, usage.base_model)


def stored_bytes(store: Store) -> list[StoredBytes]:
    """The checkpoint bytes kept now: the Tinker API's by user, session and base model (through
    the model that saved them), and the RL jobs' by job."""
    stored: list[StoredBytes] = []
    if store.query("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'tinker_checkpoints'"):
        rows = store.query(
            "SELECT c.user_id, COALESCE(m.session_id, '') AS session_id, COALESCE(m.base_model, '') AS base_model, "
            "SUM(COALESCE(c.size_bytes, 0)) AS size FROM tinker_checkpoints c "
            "LEFT JOIN tinker_models m ON m.model_id = c.run_id GROUP BY 1, 2, 3")
        stored += [StoredBytes(r["user_id"], int(r["size"]), session_id=r["session_id"], base_model=r["base_model"])
                   for r in rows]
    rows = store.query("SELECT j.user_id, c.job_id, SUM(COALESCE(c.size_bytes, 0)) AS size FROM checkpoints c "
                       "JOIN jobs j ON j.job_id = c.job_id GROUP BY 1, 2")
    stored += [StoredBytes(r["user_id"], int(r["size"]), job_id=r["job_id"]) for r in rows]
    return stored

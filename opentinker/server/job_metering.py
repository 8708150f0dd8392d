"""Usage metering of RL jobs (:mod:`opentinker.server.accounting.usage`): what each step a
job's runner reports adds, recorded by the server as the step's events arrive
(``JobManager._store_events``), under the job's id and its served model's name (no session).

From a step's ``metrics`` event (the engine's names, ``engine/ppo/step_metrics.py`` and
``trainer.py``):

- ``training``: ``tokens/trained``, the prompt and response tokens of the samples the step's
  update trained on (once a step: the update's epochs, mini-batches and logprob passes over
  the same tokens are not counted again);
- ``sampling_prefill``: ``tokens/prompt``, the prompt tokens of those samples, each sample's
  (a multi-turn rollout's later turns read their conversation again: not counted);
- ``sampling_sample``: ``tokens/generated``, the tokens the model generated for them (the
  response mask: an environment's tokens in a multi-turn response are not the model's);
- ``compute_s``: ``timing_s/step`` less ``train/env_outage_wait_s``, the step's seconds in the
  job's runner but the time spent waiting out an unreachable env server. A skipped step (no
  sample to train on) counts its compute only.

A ``checkpoint`` event the server kept counts one ``checkpoint``; storage accrues from the
checkpoints' sizes (:func:`opentinker.server.tinker.metering.stored_bytes`). Samples left out
of the update (env errors, prompts too long) and validation rollouts are not counted.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any

from opentinker.server.accounting import UsageMeter
from opentinker.server.policy import JobPolicy, PolicyError
from opentinker.server.store import Store

log = logging.getLogger("opentinker.server.job_metering")

_MODEL_KEY = "actor_rollout_ref.model.path"
_KEEP_MODELS = 1024  # jobs whose model name is remembered (the least recently metered forgotten)
TOKEN_METRICS = {"training": "tokens/trained", "sampling_prefill": "tokens/prompt",
                 "sampling_sample": "tokens/generated"}


def step_usage(metrics: dict[str, Any]) -> dict[str, float]:
    """``{kind: quantity}`` of one step's metrics (see the module docstring)."""
    usage: dict[str, float] = {}
    for kind, name in TOKEN_METRICS.items():
        value = metrics.get(name)
        if isinstance(value, (int, float)) and value > 0:
            usage[kind] = float(value)
    seconds = metrics.get("timing_s/step")
    if isinstance(seconds, (int, float)):
        waited = metrics.get("train/env_outage_wait_s")
        seconds -= waited if isinstance(waited, (int, float)) else 0.0
        if seconds > 0:
            usage["compute_s"] = float(seconds)
    return usage


class JobMetering:
    def __init__(self, usage: UsageMeter, store: Store, policy: JobPolicy):
        self.usage = usage
        self.store = store
        self.policy = policy
        self._models: OrderedDict[str, str] = OrderedDict()

    def _base_model(self, job_id: str) -> str:
        """The served name of the job's model ('' if unknown)."""
        if job_id in self._models:
            self._models.move_to_end(job_id)
            return self._models[job_id]
        job = self.store.get_job(job_id)
        name = "" if job is None else job.config.get(_MODEL_KEY)
        try:
            name = self.policy.served_model(name or None).name
        except PolicyError:  # no longer served: the name the job was made with
            name = str(name or "")
        self._models[job_id] = name
        while len(self._models) > _KEEP_MODELS:
            self._models.popitem(last=False)
        return name

    def record(self, job_id: str, user_id: int, events: list[dict[str, Any]]) -> None:
        """Meter a drain of the job's (normalized, stored) events. Never raises: the events are
        stored; a metering write that fails is logged."""
        try:
            for event in events:
                if event["type"] == "metrics":
                    usage = step_usage(event["data"].get("metrics") or {})
                elif event["type"] == "checkpoint" and event["data"].get("size_bytes") is not None:
                    usage = {"checkpoint": 1.0}
                else:
                    continue
                for kind, quantity in usage.items():
                    self.usage.record(user_id, kind, quantity, job_id=job_id, base_model=self._base_model(job_id))
        except Exception:  # noqa: BLE001
            log.exception("could not record the usage of job %s", job_id)

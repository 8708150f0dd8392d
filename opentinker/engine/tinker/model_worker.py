"""One Tinker training client's model: the training primitives behind a Ray actor.

The server runs one :class:`TinkerModelWorker` per fully fine-tuned model (``create_model`` or a
load from a checkpoint; a LoRA model's spec is ``multi_adapter``, so it trains in its base's
shared ``AdapterWorker`` instead) and calls it one request at a time, in the client's ``seq_id``
order. It holds the backend its :class:`~opentinker.engine.backend.spec.BackendSpec` names, a
``LocalBackend`` or an ``FSDPBackend`` (whose ranks are Ray actors of their own), so it is the
same engine the PPO recipe trains with: sum-reduced losses, gradients that accumulate until
``optim_step``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from opentinker.engine.backend import BackendSpec, make_backend
from opentinker.engine.cpu_threads import use_node_cores
from opentinker.engine.tinker.adam import adam_params, tinker_step_metrics
from opentinker.engine.tinker.datums import Datum, datum_limits, datum_pictures, per_datum, token_batch
from opentinker.images import ImageLimits

SAMPLER_WEIGHTS_FILE = "sampler_weights.pt"
class TinkerModelWorker:
    def __init__(self, spec: BackendSpec):
        from opentinker.engine.model_loading import resolved_spec

        use_node_cores()
        torch.manual_seed(spec.seed)
        self.spec = resolved_spec(spec)
        self.vocab_size, self.context = datum_limits(self.spec.model_path, spec.trust_remote_code)
        # A vision-language model's: datums' pictures, already read under the server's bounds.
        self.pictures = datum_pictures(self.spec.model_path, spec.trust_remote_code, ImageLimits.checked_upstream())
        self.backend = make_backend(self.spec)

    def ready(self) -> dict[str, Any]:
        return {"step": self.backend.step}

    def forward_backward(self, data: Sequence[Datum], loss_fn: str, loss_config: Mapping[str, float],
                         forward_only: bool) -> dict[str, Any]:
        """Per datum ``logprobs`` and ``elementwise_loss`` (length N each) and the metrics;
        ``forward_only`` leaves the gradients as they are."""
        batch = token_batch(data, self.vocab_size, self.context, self.pictures)
        primitive = self.backend.forward_loss if forward_only else self.backend.forward_backward
        result = primitive(batch, loss_fn, dict(loss_config))
        outputs = per_datum(batch, logprobs=result.logprobs, elementwise_loss=result.elementwise_loss)
        return {"outputs": outputs, "metrics": result.metrics}

    def optim_step(self, adam: Mapping[str, float]) -> dict[str, float]:
        return tinker_step_metrics(self.backend.optim_step(adam_params(adam)))

    def save_state(self, path: str) -> None:
        """Weights (with LoRA: the adapters) and optimizer state: a ``save_state`` checkpoint."""
        self.backend.save_state(path)

    def load_state(self, path: str, with_optimizer: bool) -> None:
        self.backend.load_state(path, with_optimizer=with_optimizer)

    def save_sampler_weights(self, path: str) -> int:
        """The full (for LoRA: merged) weights for a sampler, one file; returns its size in bytes."""
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        state = {name: tensor.detach().cpu() for bucket in self.backend.weights() for name, tensor in bucket}
        target = folder / SAMPLER_WEIGHTS_FILE
        torch.save(state, target)
        return target.stat().st_size

    def close(self) -> None:
        self.backend.close()

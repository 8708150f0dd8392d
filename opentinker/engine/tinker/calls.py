"""What the Tinker API hands its workers, as plain data: no torch here, so that the API
process builds them without importing it (the workers, in their own processes, do)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentinker.engine.tinker.datum_rules import Datum

if TYPE_CHECKING:
    from opentinker.engine.backend import BackendSpec
    from opentinker.engine.backend.lora import LoraSettings

__all__ = ["ATTENTION_MODULES", "MLP_MODULES", "UNEMBED_MODULES", "ForwardBackwardCall", "ModelSpec"]

#: LoRA targets per Tinker's ``train_attn`` / ``train_mlp`` / ``train_unembed`` switches
#: (Llama/Qwen module names).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


@dataclass(frozen=True)
class ModelSpec:
    """What a Tinker model is made of: a served model's folder, LoRA (rank > 0) or full
    fine-tuning, and how the operator runs it (``strategy`` local | fsdp, ``device``, ranks)."""

    model_path: str | None  # None: the embedded tiny model
    lora_rank: int = 0
    lora_alpha: int = 32
    train_attn: bool = True
    train_mlp: bool = True
    # An adapter on the output projection only: with tied embeddings the input embedding stays
    # the base's (the adapter is never merged into the shared weight).
    train_unembed: bool = True
    seed: int = 0
    trust_remote_code: bool = False
    strategy: str = "local"
    device: str = "auto"
    ranks: int = 1

    def target_modules(self) -> str:
        modules = ((ATTENTION_MODULES if self.train_attn else ()) + (MLP_MODULES if self.train_mlp else ())
                   + (UNEMBED_MODULES if self.train_unembed else ()))
        if not modules:
            raise ValueError("lora_config: train_attn, train_mlp and train_unembed are all false, so there is "
                             "nothing to train")
        return ",".join(modules)

    def lora_settings(self) -> LoraSettings | None:
        from opentinker.engine.backend.lora import LoraSettings  # torch: only where the model is built

        if not self.lora_rank:
            return None
        return LoraSettings(self.lora_rank, float(self.lora_alpha), self.target_modules(), seed=self.seed)

    def backend_spec(self, model_folder: str, pad_token_id: int) -> BackendSpec:
        """The training backend this model needs (Tinker's losses have no reference term)."""
        from opentinker.engine.backend import BackendSpec

        lora = self.lora_settings()
        return BackendSpec(model_path=model_folder, pad_token_id=pad_token_id, lora=lora, strategy=self.strategy,
                           ranks=self.ranks if self.strategy == "fsdp" else 1, device=self.device,
                           trust_remote_code=self.trust_remote_code)


@dataclass
class ForwardBackwardCall:
    """One ``forward_backward`` (or ``forward``: ``forward_only``) request of one model."""

    model_id: str
    data: Sequence[Datum]
    loss_fn: str
    loss_config: Mapping[str, float] = field(default_factory=dict)
    forward_only: bool = False

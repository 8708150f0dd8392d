"""What the Tinker API hands its workers, as plain data: no torch here, so that the API
process builds them without importing it (the workers, in their own processes, do)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from opentinker.engine.backend.spec import BackendSpec, LoraSettings
from opentinker.engine.tinker.datum_rules import Datum

__all__ = ["ATTENTION_MODULES", "MLP_MODULES", "UNEMBED_MODULES", "ForwardBackwardCall", "lora_targets",
           "model_backend_spec"]

#: LoRA targets per Tinker's ``train_attn`` / ``train_mlp`` / ``train_unembed`` switches
#: (Llama/Qwen module names).
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
UNEMBED_MODULES = ("lm_head",)


def lora_targets(train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True) -> str:
    """The modules Tinker's ``train_attn`` / ``train_mlp`` / ``train_unembed`` switches adapt."""
    modules = ((ATTENTION_MODULES if train_attn else ()) + (MLP_MODULES if train_mlp else ())
               + (UNEMBED_MODULES if train_unembed else ()))
    if not modules:
        raise ValueError("lora_config: train_attn, train_mlp and train_unembed are all false, so there is "
                         "nothing to train")
    return ",".join(modules)


def model_backend_spec(model_path: str | None, *, lora_rank: int = 0, lora_alpha: int = 32, seed: int = 0,
                       train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True,
                       trust_remote_code: bool = False, strategy: str = "local", device: str = "auto",
                       ranks: int = 1) -> BackendSpec:
    """A Tinker model as the backend spec every training process takes: a served model's folder
    (None: the embedded tiny model) and how the operator runs it (``strategy``, ``device``,
    ``ranks``). LoRA (rank > 0) makes it one adapter of many on its base's shared worker
    (``multi_adapter``); full fine-tuning is a backend of its own. With ``train_unembed`` the
    output projection gets an adapter too; with tied embeddings the input embedding stays the
    base's (the adapter is never merged into the shared weight). Tinker's losses have no
    reference term."""
    lora = None
    if lora_rank:
        lora = LoraSettings(lora_rank, float(lora_alpha), lora_targets(train_attn, train_mlp, train_unembed),
                            seed=seed)
    return BackendSpec(model_path=model_path, lora=lora, strategy=strategy,
                       ranks=ranks if strategy == "fsdp" else 1, device=device,
                       trust_remote_code=trust_remote_code, seed=seed, multi_adapter=lora is not None)


@dataclass
class ForwardBackwardCall:
    """One ``forward_backward`` (or ``forward``: ``forward_only``) request of one model."""

    model_id: str
    data: Sequence[Datum]
    loss_fn: str
    loss_config: Mapping[str, float] = field(default_factory=dict)
    forward_only: bool = False

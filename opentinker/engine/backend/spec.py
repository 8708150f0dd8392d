"""What a training backend is made of, as one typed value: :class:`BackendSpec`.

``make_backend(spec)`` builds the backend a spec names. The PPO recipe makes its spec from the
job's config (:meth:`BackendSpec.from_config`); the Tinker worker makes one from what a client
asked for and what the operator allows. Either way the backend sees the same fields, checked
here once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentinker.engine.backend.lora import LoraSettings

STRATEGIES = ("local", "fsdp")


@dataclass(frozen=True)
class BackendSpec:
    """The model (``model_path``: a folder), how it trains (``lora``: None for full fine-tuning)
    and where: ``strategy`` local (this process) or fsdp (``ranks`` FSDP2 ranks as Ray actors,
    ``ranks / nodes`` on each of ``nodes`` distinct Ray nodes); ``device`` cpu | cuda | auto (the
    ranks' own, for fsdp). The rest are the batch and memory options of
    :class:`~opentinker.engine.backend.local.LocalBackend` and the FSDP ranks."""

    model_path: str
    pad_token_id: int
    lora: LoraSettings | None = None
    strategy: str = "local"
    ranks: int = 1
    nodes: int = 1  # fsdp: the ranks spread over this many Ray nodes (trainer.nnodes), ranks / nodes each
    device: str = "auto"
    trust_remote_code: bool = False
    with_reference: bool = False  # a frozen reference policy (for a KL term); with LoRA: the adapters off
    use_remove_padding: bool = False  # pack rows without padding
    share_prompt_prefix: bool = True  # one prompt pass for rows that share it
    gradient_checkpointing: bool = False
    param_offload: bool = False  # fsdp: parameters on CPU between uses
    optimizer_offload: bool = False  # fsdp: optimizer state on CPU
    value_head: bool = False  # a value model (PPO's critic): outputs are values (engine/backend/value_head.py)
    seed: int = 0  # of the value head's initial weights

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy: unknown strategy {self.strategy!r} ({' | '.join(STRATEGIES)})")
        if self.ranks < 1 or (self.strategy == "local" and self.ranks != 1):
            raise ValueError(f"ranks: {self.ranks} with strategy {self.strategy!r} (local: 1; fsdp: 1 or more)")
        if self.nodes < 1 or self.ranks % self.nodes or (self.strategy == "local" and self.nodes != 1):
            raise ValueError(f"nodes: {self.nodes} with {self.ranks} ranks and strategy {self.strategy!r} "
                             "(local: 1; fsdp: a divisor of ranks, the same number of ranks on each node)")
        if self.device not in ("cpu", "cuda", "auto") and not self.device.startswith("cuda:"):
            raise ValueError(f"device: {self.device!r} is not cpu, cuda, cuda:N or auto")

    @classmethod
    def from_config(cls, cfg: Any, model_path: str, pad_token_id: int) -> BackendSpec:
        """The spec a PPO job's config (``actor_rollout_ref``, ``trainer``) describes."""
        ar, trainer = cfg.actor_rollout_ref, cfg.trainer
        model, fsdp = ar.model, ar.actor.fsdp_config
        lora = LoraSettings(int(model.lora_rank), float(model.lora_alpha), str(model.target_modules),
                            seed=int(trainer.seed)) if model.lora_rank > 0 else None
        strategy = str(ar.actor.strategy)
        return cls(
            model_path=model_path,
            pad_token_id=pad_token_id,
            lora=lora,
            strategy=strategy,
            ranks=int(trainer.nnodes * trainer.n_gpus_per_node) if strategy == "fsdp" else 1,
            nodes=int(trainer.nnodes) if strategy == "fsdp" else 1,
            device=str(trainer.device),
            trust_remote_code=bool(model.trust_remote_code),
            with_reference=bool(ar.actor.use_kl_loss),
            use_remove_padding=bool(model.use_remove_padding),
            share_prompt_prefix=bool(model.share_prompt_prefix),
            gradient_checkpointing=bool(model.enable_gradient_checkpointing),
            param_offload=bool(fsdp.param_offload),
            optimizer_offload=bool(fsdp.optimizer_offload),
        )

    @classmethod
    def critic_from_config(cls, cfg: Any, model_path: str, pad_token_id: int) -> BackendSpec:
        """The value model a PPO job's ``critic`` section describes (``model_path``: its folder,
        the actor's unless ``critic.model.path``): a value head on it, LoRA (with the head
        trained whole) or full, on the actor's ranks unless ``critic.strategy`` says otherwise."""
        actor, critic, trainer = cls.from_config(cfg, model_path, pad_token_id), cfg.critic, cfg.trainer
        model = critic.model
        lora = LoraSettings(int(model.lora_rank), float(model.lora_alpha), str(model.target_modules),
                            seed=int(trainer.seed), modules_to_save=("lm_head",)) if model.lora_rank > 0 else None
        strategy = str(critic.strategy or actor.strategy)
        return cls(
            model_path=model_path, pad_token_id=pad_token_id, lora=lora, strategy=strategy,
            ranks=int(trainer.nnodes * trainer.n_gpus_per_node) if strategy == "fsdp" else 1,
            nodes=int(trainer.nnodes) if strategy == "fsdp" else 1,
            device=actor.device, trust_remote_code=actor.trust_remote_code,
            use_remove_padding=actor.use_remove_padding, share_prompt_prefix=actor.share_prompt_prefix,
            gradient_checkpointing=bool(model.enable_gradient_checkpointing), param_offload=actor.param_offload,
            optimizer_offload=actor.optimizer_offload, value_head=True, seed=int(trainer.seed))

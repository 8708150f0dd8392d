"""What a training backend is made of, as one typed value: :class:`BackendSpec`.

``make_backend(spec)`` builds the backend a spec names. The PPO recipe makes its spec from the
job's config (:meth:`BackendSpec.from_config`); the Tinker worker makes one from what a client
asked for and what the operator allows. Either way the backend sees the same fields, checked
here once.

No torch here (nor in the package's ``__init__``), so that the API process builds specs
without importing it; the model is resolved and built where the spec is used.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

STRATEGIES = ("local", "fsdp")


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters on a model (:mod:`.lora` adds them with peft)."""

    rank: int
    alpha: float = 16.0
    target_modules: str = "all-linear"  # "all-linear" or comma-separated module names
    seed: int = 0  # of the adapters' initial values: the same on every backend and rank
    modules_to_save: tuple[str, ...] = ()  # modules trained whole beside the adapters (a value head)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora rank: {self.rank} (1 or more; no LoRA is lora=None)")

    def peft_config(self):
        from peft import LoraConfig

        targets = self.target_modules if self.target_modules == "all-linear" else [
            name.strip() for name in self.target_modules.split(",") if name.strip()]
        return LoraConfig(r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=0.0,
                          bias="none", task_type="CAUSAL_LM", modules_to_save=list(self.modules_to_save) or None)


@dataclass(frozen=True)
class BackendSpec:
    """The model (``model_path``: a folder; None: the embedded tiny model), how it trains
    (``lora``: None for full fine-tuning) and where: ``strategy`` local (this process) or fsdp
    (``ranks`` FSDP2 ranks as Ray actors, ``ranks / nodes`` on each of ``nodes`` distinct Ray
    nodes); ``device`` cpu | cuda | auto (the ranks' own, for fsdp).

    ``multi_adapter``: the model is one LoRA adapter of many on one shared base (Tinker's LoRA
    models): the backend holding it is its base's
    :class:`~opentinker.engine.tinker.adapter_worker.AdapterWorker` (built from
    :meth:`shared_base`), which trains every adapter of that base in batched passes. The rest
    are the batch and memory options of :class:`~opentinker.engine.backend.local.LocalBackend`
    and the FSDP ranks."""

    model_path: str | None
    pad_token_id: int | None = None  # None: the tokenizer's (resolved where the model is loaded)
    lora: LoraSettings | None = None
    strategy: str = "local"
    ranks: int = 1
    nodes: int = 1  # fsdp: the ranks spread over this many Ray nodes (trainer.nnodes), ranks / nodes each
    device: str = "auto"
    trust_remote_code: bool = False
    with_reference: bool = False  # a frozen reference policy (for a KL term); with LoRA: the adapters off
    use_remove_padding: bool = True  # pack rows without padding (forward.py picks per micro-batch)
    share_prompt_prefix: bool = True  # one prompt pass for rows that share it
    gradient_checkpointing: bool = False
    param_offload: bool = False  # fsdp: parameters on CPU between uses
    optimizer_offload: bool = False  # fsdp: optimizer state on CPU
    value_head: bool = False  # a value model (PPO's critic): outputs are values (engine/backend/value_head.py)
    seed: int = 0  # of the weights the backend initialises (a value head) and its process's RNG
    multi_adapter: bool = False  # one adapter of many on a shared base (see the class)
    train_vision: bool = False  # a vision-language model's vision tower trains too (else frozen)

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
        if self.multi_adapter and (self.value_head or self.with_reference):
            raise ValueError("multi_adapter: a shared base trains policy adapters only (no value_head, no "
                             "with_reference)")

    def shared_base(self) -> BackendSpec:
        """A multi-adapter model's base: what its shared worker is built from, and the key that
        tells which models share one (the same base, strategy and device; each adapter's seed
        is its own, in ``lora``)."""
        if not self.multi_adapter:
            raise ValueError("shared_base: only a multi_adapter spec has a shared base")
        return replace(self, lora=None, seed=0)

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
            train_vision=bool(model.train_vision),
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

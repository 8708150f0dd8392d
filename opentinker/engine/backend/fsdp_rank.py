"""One FSDP2 rank (:class:`FSDPRank`, a Ray actor): it joins the process group, builds its
shard of the model (rank 0 loads the checkpoint, the others build on the meta device, the
weights reach them from rank 0) and runs the training primitives on its rows; ``gather``
all-gathers full tensors for the driver (``fsdp.FSDPBackend``), which never holds the model."""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from opentinker.engine.backend.base import (
    AdamParams,
    WeightBucket,
    adamw_for,
    clipped_adamw_step,
    optimizer_state_by_name,
    optimizer_state_by_position,
    read_state_file,
    write_state_file,
)
from opentinker.engine.backend.forward import scorer_for
from opentinker.engine.backend.lora import MergeEntry, add_adapters, merge_plan, merged_tensor
from opentinker.engine.backend.losses import resolve_loss, weighted_loss
from opentinker.engine.backend.spec import BackendSpec
from opentinker.engine.backend.value_head import attach_value_head
from opentinker.engine.batch import TokenBatch
from opentinker.engine.model_loading import enable_gradient_checkpointing, is_vision_language
from opentinker.engine.vision import freeze_vision_tower, vision_tower


def rendezvous_address() -> tuple[str, int]:
    """This node's address and a free port on it: where rank 0 will listen for the others."""
    import ray

    with socket.socket() as sock:
        sock.bind(("", 0))
        port = sock.getsockname()[1]
    return ray.util.get_node_ip_address(), port


def join_process_group(rank: int, world_size: int, master_addr: str, master_port: int, device: str):
    """This rank's device and its one-dimensional device mesh, after joining the ranks'
    process group (nccl on GPU, gloo on CPU) at rank 0's address."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    cuda = device == "cuda"
    if cuda:
        torch.cuda.set_device(0)  # Ray shows each rank only its own GPU
    torch_device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
    return torch_device, init_device_mesh(torch_device.type, (world_size,))


def build_sharded_model(options: BackendSpec, rank: int, mesh, device: torch.device, trainable: bool):
    """``options.model_path`` sharded over ``mesh``: rank 0 loads the checkpoint, the others
    build on the meta device; every decoder layer and then the root are wrapped with
    ``fully_shard`` and the weights reach the other ranks from rank 0. Not ``trainable``: in
    eval mode with every weight frozen (a reference model, or a shared base for adapters)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    auto = AutoModelForImageTextToText if is_vision_language(options.model_path, options.trust_remote_code) else (
        AutoModelForCausalLM)
    if rank == 0:
        model = auto.from_pretrained(options.model_path, dtype=torch.float32,
                                     trust_remote_code=options.trust_remote_code)
        full_state = model.state_dict()
    else:  # no memory for weights this rank will only hold a shard of
        config = AutoConfig.from_pretrained(options.model_path, trust_remote_code=options.trust_remote_code)
        with torch.device("meta"):
            model = auto.from_config(config, dtype=torch.float32, trust_remote_code=options.trust_remote_code)
        full_state = {}
    if not options.train_vision:
        freeze_vision_tower(model)
    if options.value_head:  # rank 0's initial head reaches the others with the weights
        attach_value_head(model, options.seed)
        if rank == 0:
            full_state = model.state_dict()
    if trainable and options.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if trainable and options.lora:
        model = add_adapters(model, options.lora)
        if rank == 0:
            full_state = model.state_dict()  # the adapters' initial values go to every rank
    kwargs: dict[str, Any] = {"mesh": mesh}
    if device.type == "cuda":
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if options.param_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in _decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if rank == 0:
        model.to(device if not options.param_offload else "cpu")
    else:
        model.to_empty(device=device if not options.param_offload else "cpu")
    set_model_state_dict(model, full_state, options=StateDictOptions(full_state_dict=True,
                                                                      broadcast_from_rank0=True))
    for _, buffer in model.named_buffers():  # non-persistent buffers (rotary) are not in a state dict
        dist.broadcast(buffer, src=0)
    if not trainable:
        model.eval().requires_grad_(False)
    return model


class FSDPRank:
    """One rank: its shard of the actor (and reference), its optimizer, its rows of each batch."""

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, options: BackendSpec):
        self.rank, self.world_size, self.options = rank, world_size, options
        self.device, self.mesh = join_process_group(rank, world_size, master_addr, master_port, options.device)
        self.model = build_sharded_model(options, rank, self.mesh, self.device, trainable=True)
        # With LoRA the reference is the base model with the adapters disabled: no second copy.
        self.reference = build_sharded_model(options, rank, self.mesh, self.device, trainable=False) if (
            options.with_reference and not options.lora) else None
        self.plan: dict[str, MergeEntry] = {
            entry.name: entry for entry in (merge_plan(self.model) if options.lora else
                                            [MergeEntry(n, (n,)) for n, _ in _distinct(self.model.state_dict())])}
        self.scorer = scorer_for(options.value_head, options.pad_token_id, self.device, options.use_remove_padding,
                                 options.share_prompt_prefix and not options.gradient_checkpointing)
        self.optimizer: torch.optim.AdamW | None = None
        self.step = 0

    def ready(self) -> int:
        return self.rank

    def node_id(self) -> str:
        """The Ray node this rank runs on."""
        import ray

        return ray.get_runtime_context().get_node_id()

    # -- primitives ----------------------------------------------------------------
    @torch.no_grad()
    def forward(self, batch: TokenBatch, temperature: float, reference: bool, with_entropy: bool,
                share_prefix: bool = False):
        import contextlib

        if reference and not self.options.with_reference:
            raise RuntimeError("forward(reference=True) but this backend has no reference model")
        model = self.reference if reference and self.reference is not None else self.model
        model.eval()
        with self.model.disable_adapter() if reference and self.options.lora else contextlib.nullcontext():
            logprobs, entropy = self.scorer(model, batch, temperature, with_entropy, entropy_grad=False,
                                            share_prefix=share_prefix)
        return logprobs.cpu(), None if entropy is None else entropy.cpu()

    def forward_backward(self, batch: TokenBatch, loss_fn: str, loss_config: Mapping[str, Any] | None,
                         temperature: float, with_entropy: bool, share_prefix: bool = False):
        spec, config = resolve_loss(loss_fn, loss_config)
        self.model.train()
        need_entropy = with_entropy or spec.needs_entropy(config)
        logprobs, entropy = self.scorer(self.model, batch, temperature, need_entropy,
                                        entropy_grad=spec.needs_entropy(config), share_prefix=share_prefix)
        out = weighted_loss(spec, config, logprobs, entropy, batch, self.device)
        (out.loss * self.world_size).backward()  # FSDP averages gradients over the ranks; ours sum
        return (logprobs.detach().cpu(), out.elementwise.cpu(), out.metrics,
                None if entropy is None else entropy.detach().cpu())

    def optim_step(self, params: AdamParams) -> dict[str, float]:
        parameters = self._trained_parameters()
        self.optimizer, metrics = clipped_adamw_step(self.optimizer, parameters, params, self._optimizer_on_device)
        self.step += not metrics["skipped_nonfinite"]
        return metrics

    @contextlib.contextmanager
    def _optimizer_on_device(self):
        self._move_optimizer_state(self.device)
        yield
        if self.options.optimizer_offload:  # Adam's moments wait in host memory until the next step
            self._move_optimizer_state(torch.device("cpu"))

    def _move_optimizer_state(self, device: torch.device) -> None:
        if self.optimizer is None or device.type == "cpu" and self.device.type == "cpu":
            return
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device != device:
                    state[key] = value.to(device, non_blocking=True)

    # -- weights and state ----------------------------------------------------------
    def tensor_sizes(self) -> list[tuple[str, int]]:
        """Each tensor of the full (with LoRA: merged) model, tied ones once, with its size in bytes."""
        state = self._source_state()
        return [(name, state[entry.sources[0]].numel() * state[entry.sources[0]].element_size())
                for name, entry in self.plan.items()]

    def gather(self, names: list[str]) -> WeightBucket | None:
        """Full (merged) tensors of ``names`` (every rank takes part); rank 0 returns them."""
        state = self._source_state()
        out = []
        for name in names:
            entry = self.plan[name]
            full = {source: _full(state[source]) for source in entry.sources}
            if self.rank == 0:
                out.append((name, merged_tensor(entry, full).cpu()))
        return out if self.rank == 0 else None

    def _source_state(self) -> dict[str, torch.Tensor]:
        """The tensors the merge plan names (under peft: the base model's, with its own names)."""
        model = self.model.get_base_model() if self.options.lora else self.model
        return model.state_dict()

    def _trained_names(self) -> list[str]:
        """The trained parameters' names, in the optimizer's order."""
        return [name for name, param in self.model.named_parameters() if param.requires_grad]

    def _trained_parameters(self) -> list[torch.nn.Parameter]:
        """What the optimizer steps, in :meth:`_trained_names`' order."""
        return [param for param in self.model.parameters() if param.requires_grad]

    def save_state(self, path: str) -> None:
        """Rank 0 writes the backends' one state file (``base.write_state_file``): the trained
        weights and optimizer state gathered whole into its host memory, so the checkpoint
        loads on any number of ranks or in one process."""
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        optimizers = [self.optimizer] if self.optimizer else []
        model_state, optim_state = get_state_dict(
            self.model, optimizers, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        rngs: list[Any] = [None] * self.world_size
        dist.all_gather_object(rngs, torch.get_rng_state())
        if self.rank != 0:
            return
        if self.options.lora:  # the adapters only, as one process saves them
            trained = set(self._trained_names())
            model_state = {name: tensor for name, tensor in model_state.items() if name in trained}
        write_state_file(path, model_state, optimizer_state_by_position(optim_state) if self.optimizer else None,
                         rngs[0], self.step, rank_rngs=rngs)

    def load_state(self, path: str, with_optimizer: bool = True) -> int:
        """What a state file holds, on this rank's shard (every rank reads the file memory-mapped
        and takes its own part); returns the step. A folder of the sharded format written
        before the state file is read as it was written."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if (Path(path) / "dcp").is_dir():
            return self._load_sharded(path, with_optimizer)
        state = read_state_file(path, mmap=True)
        names = self._trained_names()
        expected = set(names) if self.options.lora else set(self.model.state_dict())
        if set(state["model"]) != expected:  # every rank finds it, before any collective
            unexpected = sorted(set(state["model"]) - expected)[:3]
            raise ValueError(f"{path}: the saved state does not fit this model (unexpected: {unexpected}, missing: "
                             f"{sorted(expected - set(state['model']))[:3]})")
        full = StateDictOptions(full_state_dict=True, strict=not self.options.lora)
        set_model_state_dict(self.model, state["model"], options=full)
        self.optimizer = None  # saved before the first step (or not wanted): made at the next
        if state["optimizer"] is not None and with_optimizer:
            self.optimizer = adamw_for(None, self._trained_parameters(), AdamParams(0.0))
            set_optimizer_state_dict(self.model, self.optimizer, optimizer_state_by_name(state["optimizer"], names),
                                     options=full)
        rank_rngs = state.get("rank_rngs") or []
        torch.set_rng_state(rank_rngs[self.rank] if len(rank_rngs) == self.world_size else state["rng"])
        self.step = int(state["step"])
        return self.step

    def _load_sharded(self, path: str, with_optimizer: bool) -> int:
        """A checkpoint of the per-rank sharded format (``dcp/`` and ``rank{N}.pt``) FSDP
        ranks wrote before the state file; it loads on as many ranks as wrote it."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        extra = torch.load(Path(path) / f"rank{self.rank}.pt", weights_only=False)
        self.optimizer = None
        if extra["has_optimizer"]:
            self.optimizer = adamw_for(None, self._trained_parameters(), AdamParams(0.0))
        optimizers = [self.optimizer] if self.optimizer else []
        model_state, optim_state = get_state_dict(self.model, optimizers)
        state = {"model": model_state, "optimizer": optim_state}
        dcp.load(state, checkpoint_id=str(Path(path) / "dcp"))
        set_state_dict(self.model, optimizers, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        torch.set_rng_state(extra["rng"])
        self.step = int(extra["step"])
        if not with_optimizer:
            self.optimizer = None  # made afresh at the next step
        return self.step

    def export_hf(self, path: str) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return
        if self.options.lora:
            peft_prefix = "base_model.model."
            base = {name.removeprefix(peft_prefix): t for name, t in full.items()}
            merged = {name: merged_tensor(entry, base) for name, entry in self.plan.items()}
            self.model.get_base_model().save_pretrained(path, state_dict=merged)
            self.model.save_pretrained(Path(path) / "adapter", state_dict=full)
        else:
            self.model.save_pretrained(path, state_dict=full)

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach()


def _decoder_layers(model) -> list[torch.nn.Module]:
    """The repeated blocks to shard one by one (``model.model.layers`` for HF decoder LMs; a
    vision-language model's language model layers and its vision tower's blocks)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    inner = getattr(base, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        layers = getattr(getattr(inner, "language_model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no model.layers to shard (FSDP needs a decoder-only HF model)")
    tower = vision_tower(base)
    blocks = list(getattr(tower[1], "blocks", None) or []) if tower is not None else []
    return [*blocks, *layers]


def _distinct(state: Mapping[str, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
    """State-dict entries with tied tensors (lm_head = embeddings) listed once."""
    seen: set[int] = set()
    for name, tensor in state.items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        yield name, tensor


__all__ = ["FSDPRank", "build_sharded_model", "join_process_group", "rendezvous_address"]

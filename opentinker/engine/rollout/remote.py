"""The transformers rollout engine in a process of its own (a Ray actor).

Asynchronous training (``async_training.max_staleness > 0``) overlaps the rollout of later
steps with this step's update; in one Python process the two would share one interpreter
and one pool of torch threads, so the engine runs in a Ray actor instead and this proxy
forwards :class:`~opentinker.engine.rollout.base.RolloutEngine` calls to it. The actor runs
one call at a time, in the order they were made: new weights sent after a generate apply
after it, never in the middle of a batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from opentinker.engine.placement import PLACEMENT_TIMEOUT_S, wait_until_placed
from opentinker.engine.rollout.base import Completion, SamplingParams, WeightSource, named_tensors


class _EngineHost:
    """The actor's body: a :class:`TransformersRolloutEngine` built from a model folder."""

    def __init__(self, model_path: str, *, seed: int, max_batch_size: int, threads: int, device: str,
                 trust_remote_code: bool, compile_decode: bool = False, slot_decode: bool = False):
        from opentinker.engine.model_loading import eos_token_ids, load_causal_lm, load_tokenizer
        from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine

        if threads > 0:
            torch.set_num_threads(threads)
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        tokenizer = load_tokenizer(model_path, trust_remote_code)
        model = load_causal_lm(model_path, dtype=dtype, device=torch.device(device), trust_remote_code=trust_remote_code)
        self.engine = TransformersRolloutEngine(
            model, eos_token_ids(tokenizer, model_path), tokenizer.pad_token_id, seed=seed,
            max_batch_size=max_batch_size, tokenizer=tokenizer, compile_decode=compile_decode,
            slot_decode=slot_decode)

    def generate(self, prompts, params) -> list[Completion]:
        return self.engine.generate(prompts, params)

    def update_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.engine.update_weights(weights)

    def rng_state(self) -> torch.Tensor:
        return self.engine.rng_state()

    def set_rng_state(self, state: torch.Tensor) -> None:
        self.engine.set_rng_state(state)

    def pid(self) -> int:
        import os

        return os.getpid()


class RemoteRolloutEngine:
    """A :class:`RolloutEngine` whose model lives in a Ray actor (one CPU, ``threads`` torch
    threads; on CUDA a share of a GPU). Every call waits for its answer except
    :meth:`update_weights`, which only queues the weights (a snapshot taken now) ahead of
    whatever is called next."""

    def __init__(self, model_path: str, *, seed: int = 0, max_batch_size: int = 256, threads: int = 1,
                 device: str = "cpu", trust_remote_code: bool = False, compile_decode: bool = False,
                 slot_decode: bool = False,
                 placement_timeout_s: float = PLACEMENT_TIMEOUT_S):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        # On a GPU, beside the trainer (which Ray does not count) on the same device: the two
        # take turns there, see shared_gpu_warning in engine/rollout/builtin_engines.py.
        bundle = {"CPU": 1.0, **({"GPU": 0.5} if device == "cuda" else {})}
        # Placed first, with a deadline: an actor Ray cannot place would wait forever, and
        # loading a large model may take long, so the two waits are apart.
        self._group = placement_group([bundle])
        wait_until_placed(self._group, placement_timeout_s, lambda available: (
            "async_training.max_staleness > 0 runs the rollout engine in a Ray actor that needs "
            + " and ".join(f"{amount:g} {name}" for name, amount in bundle.items())
            + f", and the Ray cluster could not place it in {placement_timeout_s:g} s (available: "
            + ", ".join(f"{name} {available.get(name, 0):g}" for name in bundle) + ")"))
        self._actor = ray.remote(_EngineHost).options(
            num_cpus=bundle["CPU"], num_gpus=bundle.get("GPU", 0), max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=0),
        ).remote(model_path, seed=seed, max_batch_size=max_batch_size, threads=threads, device=device,
                 trust_remote_code=trust_remote_code, compile_decode=compile_decode, slot_decode=slot_decode)
        self._pending: list = []  # weight updates not yet known to have applied
        self.pid = ray.get(self._actor.pid.remote())

    def _get(self, ref):
        import ray

        result = ray.get(ref)
        ray.get(self._pending)  # an update that failed fails the next call
        self._pending.clear()
        return result

    def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
                 ) -> list[Completion]:
        return self._get(self._actor.generate.remote([list(p) for p in prompts], params))

    def update_weights(self, weights: WeightSource) -> None:
        # Ray serialises the arguments in .remote(): the snapshot is taken here, so the next
        # update may change the backend's (live) tensors at once.
        snapshot = {name: tensor.detach().to("cpu") for name, tensor in named_tensors(weights)}
        self._pending.append(self._actor.update_weights.remote(snapshot))

    def rng_state(self) -> torch.Tensor:
        return self._get(self._actor.rng_state.remote())

    def set_rng_state(self, state: torch.Tensor) -> None:
        self._get(self._actor.set_rng_state.remote(state))

    def sleep(self) -> None:
        """The actor keeps its memory: it runs during updates."""

    def wake(self) -> None:
        """See :meth:`sleep`."""

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        ray.kill(self._actor)
        remove_placement_group(self._group)

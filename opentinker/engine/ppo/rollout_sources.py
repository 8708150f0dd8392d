"""Where a training step's rollout comes from: made in the step (:class:`StepRollouts`, the
synchronous loop), or launched steps ahead in a pipeline (:class:`PipelinedRollouts`,
``async_training.max_staleness > 0``). The trainer asks its source for the step's rollout and
tells it when the update is about to start and when new weights (or none, for a skipped step)
are ready; everything that differs between the two loops lives here, not in branches of the
trainer.

Both are given how to draw a step's prompts (the loader, whose position a checkpoint saves),
how to turn prompts into a scored rollout that waits out env outages, and where the weights
come from; neither reaches into the trainer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from opentinker.engine.ppo.async_rollouts import RolloutPipeline
from opentinker.engine.rollout.base import RolloutEngine, WeightSource
from opentinker.engine.ppo.step import Timer

__all__ = ["PipelinedRollouts", "RolloutSource", "StepRollouts"]

#: ``make(prompts, timer) -> (rollout, outage)``: a scored rollout, env outages waited out.
MakeRollout = Callable[[Sequence[Any], Any], tuple[Any, Any]]


class RolloutSource(Protocol):
    def rollout(self, prompts: Sequence[Any] | None, timer: Any, step: int) -> tuple[Any, Any, int]:
        """Step ``step + 1``'s ``(rollout, outage, the policy version that sampled it)``;
        ``prompts``: a client-pushed batch, else the loader's next."""

    def before_update(self) -> None: ...

    def after_update(self, version: int) -> None:
        """The update made policy ``version``: get its weights to the engine."""

    def after_skip(self, version: int) -> None:
        """Step ``version`` trained nothing: the engine's weights are that version's policy."""

    def validation_rollout(self, generate: Callable[..., Any], *args: Any) -> Any: ...

    def loader_state(self) -> Any:
        """Where the loader stands for a checkpoint (a resumed run draws the same prompts)."""

    def rng_state(self) -> Any:
        """The sampler's random state for a checkpoint (None: none that can be saved)."""

    def close(self) -> None: ...


class StepRollouts:
    """The synchronous loop: each step draws its prompts, samples them with the current
    weights, then the engine sleeps through the update and wakes to the new weights."""

    def __init__(self, loader: Any, make: MakeRollout, engine: RolloutEngine, weights: Callable[[], WeightSource]):
        self.loader, self.make, self.engine, self.weights = loader, make, engine, weights

    def rollout(self, prompts: Sequence[Any] | None, timer: Any, step: int) -> tuple[Any, Any, int]:
        # Drawn once: a step redone after an outage trains on the same prompts, and the loader
        # (whose position a checkpoint saves) advances once per step as always.
        prompts = next(self.loader) if prompts is None else prompts
        rollout, outage = self.make(prompts, timer)
        return rollout, outage, step

    def before_update(self) -> None:
        self.engine.sleep()  # a colocated GPU engine gives its memory to training until the sync

    def after_update(self, version: int) -> None:
        self.engine.wake()
        self.engine.update_weights(self.weights())

    def after_skip(self, version: int) -> None:
        return None

    def validation_rollout(self, generate: Callable[..., Any], *args: Any) -> Any:
        return generate(*args)

    def loader_state(self) -> Any:
        return self.loader.state_dict()

    def rng_state(self) -> Any:
        return self.engine.rng_state()

    def close(self) -> None:
        return None


class PipelinedRollouts:
    """The asynchronous loop: the rollouts of the next ``max_staleness`` steps run in a
    :class:`RolloutPipeline` while this step updates; new weights apply between them."""

    def __init__(self, max_staleness: int, loader: Iterator[Any], make: MakeRollout, engine: RolloutEngine,
                 weights: Callable[[], WeightSource]):
        self.max_staleness, self.loader, self.make, self.engine, self.weights = (
            max_staleness, loader, make, engine, weights)
        self.pipeline: RolloutPipeline | None = None  # started by the first step

    def rollout(self, prompts: Sequence[Any] | None, timer: Any, step: int) -> tuple[Any, Any, int]:
        from opentinker.config import ConfigError

        if prompts is not None:
            raise ConfigError("async_training.max_staleness > 0 draws each step's prompts ahead of "
                              "the step; a client-pushed batch trains with max_staleness=0")
        if self.pipeline is None:
            self.pipeline = RolloutPipeline(self.engine, self.max_staleness, self._draw, self._run)
            self.pipeline.pushed_version = step  # the engine holds this step's weights
        self.pipeline.fill(step + 1)
        with timer.phase("rollout_wait"):
            (rollout, outage, seconds), version = self.pipeline.next()
        for name, value in seconds.items():  # the rollout's own phases, run beside earlier updates
            timer.seconds[name] = timer.seconds.get(name, 0.0) + value
        return rollout, outage, version

    def _draw(self) -> tuple[Any, Any]:
        state = self.loader.state_dict()
        return next(self.loader), state

    def _run(self, prompts: Sequence[Any]) -> tuple[Any, Any, dict[str, float]]:
        timer = Timer()
        rollout, outage = self.make(prompts, timer)
        return rollout, outage, timer.seconds

    def before_update(self) -> None:
        return None  # the engine keeps generating the next steps' rollouts

    def after_update(self, version: int) -> None:
        if self.pipeline is not None:  # applied between the rollouts already running
            self.pipeline.push_weights(version, self.weights())

    def after_skip(self, version: int) -> None:
        if self.pipeline is not None:  # no update: the engine's weights are this step's policy
            self.pipeline.push_weights(version, None)

    def validation_rollout(self, generate: Callable[..., Any], *args: Any) -> Any:
        if self.pipeline is None:
            return generate(*args)
        return self.pipeline.call(generate, *args)  # after the rollouts in flight, with the newest weights

    def loader_state(self) -> Any:
        # The prompts of rollouts in flight are drawn again after a resume.
        oldest = self.pipeline.oldest_loader_state if self.pipeline is not None else None
        return oldest or self.loader.state_dict()

    def rng_state(self) -> Any:
        return None  # the sampler's state mid-flight is not saved (a resumed run samples differently)

    def close(self) -> None:
        if self.pipeline is not None:
            self.pipeline.close()

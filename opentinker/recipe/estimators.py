"""What each advantage estimator needs from the rest of a recipe, declared once and read by
the rules at the door, the trainer's builders and the advantage stage (torch-free: the client
checks recipes too). An estimator registered in-process
(``engine.algorithms.register_advantage_estimator(name, needs=...)``) declares its own."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EstimatorNeeds:
    """``groups``: it compares the samples of one prompt (``rollout.n >= 2``); ``critic``: a
    value model trains beside the policy (``critic.*``); ``strategies``: the strategy judge
    labels each solution (``algorithm.judge``, the creativity estimators)."""

    groups: bool = False
    critic: bool = False
    strategies: bool = False


#: The built-in estimators, in the order the config lists them.
ESTIMATOR_NEEDS: dict[str, EstimatorNeeds] = {
    "gae": EstimatorNeeds(critic=True),
    "grpo": EstimatorNeeds(groups=True),
    "grpo_weighted_add": EstimatorNeeds(groups=True, strategies=True),
    "grpo_weighted_mul": EstimatorNeeds(groups=True, strategies=True),
    "rloo": EstimatorNeeds(groups=True),
    "reinforce_plus_plus": EstimatorNeeds(),
    "reinforce_plus_plus_baseline": EstimatorNeeds(),
}
BUILTIN_ESTIMATORS: tuple[str, ...] = tuple(ESTIMATOR_NEEDS)


def declare_estimator(name: str, needs: EstimatorNeeds | None) -> None:
    """Record what the estimator ``name`` needs (``None``: keep a built-in's, else nothing)."""
    if needs is not None or name not in ESTIMATOR_NEEDS:
        ESTIMATOR_NEEDS[name] = needs or EstimatorNeeds()


def estimator_needs(name: str) -> EstimatorNeeds:
    """What ``name`` needs (an estimator unknown here needs nothing: the config's choices
    refuse unknown names before this is asked)."""
    return ESTIMATOR_NEEDS.get(name, EstimatorNeeds())

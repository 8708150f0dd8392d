"""Waiting for a Ray placement group with a deadline, so that what a cluster cannot hold fails
with what it needs instead of waiting forever (FSDP ranks, the asynchronous rollout actor)."""

from __future__ import annotations

from collections.abc import Callable

PLACEMENT_TIMEOUT_S = 60.0


def wait_until_placed(group, timeout_s: float, refusal: Callable[[dict[str, float]], str]) -> None:
    """Returns once ``group`` is placed; else removes it and raises RuntimeError with
    ``refusal(available resources)``."""
    import ray
    from ray.util.placement_group import remove_placement_group

    try:
        ray.get(group.ready(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        remove_placement_group(group)
        raise RuntimeError(refusal(ray.available_resources())) from None

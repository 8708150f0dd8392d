"""Weights in buckets of bounded size: how trainers hand weights to rollout engines (weight sync)
and to exports. Its own module, so that the training backends and the rollout engines both
import it without importing each other."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

__all__ = ["DEFAULT_BUCKET_BYTES", "WeightBucket", "bucketed"]

DEFAULT_BUCKET_BYTES = 256 * 2**20
WeightBucket = list[tuple[str, torch.Tensor]]


def bucketed(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Iterator[WeightBucket]:
    """Group ``(name, tensor)`` pairs into lists of at most ``bucket_bytes`` (a tensor larger
    than that is a bucket of its own)."""
    bucket: WeightBucket = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket

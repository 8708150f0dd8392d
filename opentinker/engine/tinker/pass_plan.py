"""What one batched pass of the shared LoRA worker may cost, and how rows are cut to fit.

A pass runs its rows padded to the longest one (rows of different adapters cannot be packed
into one row: peft picks each row's adapter by its batch index). What it holds grows with the
*padded* tokens, rows x the longest row (activations, logits: on the tiny model about 155 KB
of memory per padded token in a training pass), and, where attention is computed as a dense
matrix (a padding mask sends sdpa to its math kernel), with rows x longest^2 attention cells.
Neither grows with the request's real tokens: 128 one-token rows beside one 1,023-token row
pad to 132k tokens. So rows are sorted by length and cut into groups that stay within both
bounds; a row alone always forms a group (its cost is bounded by the model's context).

The host cuts a big ``forward_backward`` into chunks with the same rule (each chunk runs in
its own cycle, so other users' requests are served between them), and the worker cuts a
cycle into passes with it. Torch-free: the server process imports this.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: The width at which a pass's attention-cell bound (rows x longest^2) equals its padded tokens'.
ATTENTION_WIDTH = 1024


@dataclass(frozen=True)
class PassLimits:
    """``tokens``: padded tokens (rows x the longest row); ``attention``: attention cells
    (rows x the longest row squared)."""

    tokens: int = 4096
    attention: int = 4096 * ATTENTION_WIDTH

    @classmethod
    def for_tokens(cls, tokens: int) -> PassLimits:
        """``tokens`` padded tokens, and the attention of that many at a width of 1,024 positions."""
        return cls(tokens=tokens, attention=tokens * ATTENTION_WIDTH)

    def __post_init__(self) -> None:
        if self.tokens < 1 or self.attention < 1:
            raise ValueError(f"pass limits must be >= 1, got tokens={self.tokens}, attention={self.attention}")

    def cost(self, rows: int, longest: int) -> float:
        """The share of a full pass that ``rows`` rows padded to ``longest`` positions take."""
        return max(rows * longest / self.tokens, rows * longest * longest / self.attention)

    def rows_cost(self, lengths: Sequence[int]) -> float:
        return self.cost(len(lengths), max(lengths)) if lengths else 0.0


def cut_rows(lengths: Sequence[int], limits: PassLimits) -> list[list[int]]:
    """The indices of ``lengths`` in groups that each fit ``limits``, longest rows first. Rows
    are sorted, so each group pads to its own first row, and a row joins a group only if it is
    at least half that long: padding at most doubles a group's tokens (short rows beside a long
    one would fit the memory bound and still cost the long row's compute each)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for index in order:
        if groups:
            longest = lengths[groups[-1][0]]
            if 2 * lengths[index] >= longest and limits.cost(len(groups[-1]) + 1, longest) <= 1.0:
                groups[-1].append(index)
                continue
        groups.append([index])
    return groups


def join_pieces(pieces: Sequence[tuple[Sequence[int], dict[str, Any]]], keep_rows: bool = False) -> dict[str, Any]:
    """One call's result from the results of its pieces (``(row indices, {"outputs",
    "metrics"})`` each: the passes, chunks or ranks it was spread over): outputs back in the
    call's row order, metrics added (every Tinker metric is a sum). ``keep_rows``: the result
    says which rows it holds (a rank's share, interleaved with the other ranks' later)."""
    rows = [row for piece_rows, _ in pieces for row in piece_rows]
    outputs = [output for _, result in pieces for output in result["outputs"]]
    metrics: dict[str, float] = {}
    for _, result in pieces:
        for key, value in result["metrics"].items():
            metrics[key] = metrics.get(key, 0.0) + value
    order = sorted(range(len(rows)), key=rows.__getitem__)
    joined: dict[str, Any] = {"outputs": [outputs[i] for i in order], "metrics": metrics}
    if keep_rows:
        joined["rows"] = [rows[i] for i in order]
    return joined

"""Tinker's dro, gspo and stable_reinforce losses (engine/backend/losses.py) on small tensors,
against values and gradients worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from opentinker.engine.backend.losses import resolve_loss


def run(name: str, logprobs: list[list[float]], config: dict | None = None, **inputs: list[list[float]]):
    """``(elementwise loss, stats, d(sum of the loss)/d(logprobs))`` of loss ``name``."""
    spec, full = resolve_loss(name, config)
    lp = torch.tensor(logprobs, requires_grad=True)
    tensors = {key: torch.tensor(value) for key, value in inputs.items()}
    tensors["response_mask"] = torch.ones_like(lp)
    elementwise, stats = spec.fn(lp, tensors, full, None)
    elementwise.sum().backward()
    return elementwise.detach(), stats, lp.grad


def close(actual: torch.Tensor, expected: list[list[float]]) -> None:
    assert torch.allclose(actual, torch.tensor(expected), atol=1e-5), (actual, expected)


def test_dro_is_reward_times_logprob_minus_a_quadratic_penalty():
    # -(lp*A - beta/2 (lp - q)^2) with beta 0.1: 2 + 0.05 * 0.25 and -2 + 0.05 * 1.
    loss, stats, grad = run("dro", [[-1.0, -2.0]], {"beta": 0.1},
                            old_logprobs=[[-1.5, -1.0]], advantages=[[2.0, -1.0]])
    close(loss, [[2.0125, -1.95]])
    close(stats["dro_penalty"], [[0.25, 1.0]])
    # d/dlp = -(A - beta (lp - q)): -(2 - 0.05) and -(-1 + 0.1).
    close(grad, [[-1.95, 0.9]])
    assert resolve_loss("dro", None)[1] == {"beta": 0.05}


def test_gspo_gives_every_token_its_rows_sequence_ratio_and_its_own_gradient():
    lp = [[-1.0, -2.0, -3.0], [-1.0, -1.0, 0.0], [-0.5, -0.7, 0.0]]
    q = [[0.0, -2.2, -2.6], [-1.5, -1.5, 0.0], [-2.0, -2.0, 0.0]]
    mask = [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    adv = [[0.0, 1.0, -1.0], [1.0, -1.0, 0.0], [1.0, 2.0, 0.0]]
    loss, stats, grad = run("gspo", lp, old_logprobs=q, advantages=adv, sequence_ratio_mask=mask)
    # Row 0: s = exp(mean(0.2, -0.4)) = exp(-0.1), inside [0.8, 1.2]: -s * A; the unmarked
    # first position (a prompt's padding logprob 0) is not in the mean.
    s0 = math.exp(-0.1)
    # Row 1: s = exp(0.5) = 1.6487 > 1.2: A = 1 takes the clipped constant 1.2 (no gradient),
    # A = -1 the unclipped s (PPO's min).
    s1 = math.exp(0.5)
    # Row 2 marks nothing: s = 1.
    close(loss, [[0.0, -s0, s0], [-1.2, s1, 0.0], [-1.0, -2.0, 0.0]])
    close(grad, [[0.0, -s0, s0], [0.0, s1, 0.0], [-1.0, -2.0, 0.0]])
    close(stats["clipfrac"], [[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])


def test_gspo_rows_are_independent_so_a_request_can_be_split_into_passes():
    lp = [[-1.0, -2.0, -3.0], [-0.2, -1.1, 0.0]]
    q = [[-0.9, -2.4, -2.6], [-0.7, -1.0, 0.0]]
    mask = [[0.0, 1.0, 1.0], [1.0, 1.0, 0.0]]
    adv = [[0.5, 1.0, -1.0], [2.0, -1.0, 0.0]]
    whole, _, whole_grad = run("gspo", lp, old_logprobs=q, advantages=adv, sequence_ratio_mask=mask)
    for row in range(2):
        width = 3 if row == 0 else 2  # a pass pads only to its own longest row
        part, _, part_grad = run("gspo", [lp[row][:width]], old_logprobs=[q[row][:width]],
                                 advantages=[adv[row][:width]], sequence_ratio_mask=[mask[row][:width]])
        assert torch.allclose(part, whole[row:row + 1, :width]) and torch.allclose(part_grad, whole_grad[row:row + 1, :width])


def test_stable_reinforce_is_reinforce_with_a_truncated_constant_importance_weight():
    lp, q, adv = [[-1.0, -0.5, -2.0]], [[-1.2, -1.5, -1.0]], [[1.0, 1.0, -2.0]]
    # r = exp(0.2), exp(1.0) -> truncated to 2, exp(-1); loss -w * lp * A, gradient -w * A.
    w = [math.exp(0.2), 2.0, math.exp(-1.0)]
    loss, stats, grad = run("stable_reinforce", lp, old_logprobs=q, advantages=adv)
    close(loss, [[w[0], 1.0, -4 * w[2]]])
    close(grad, [[-w[0], -2.0, 2 * w[2]]])
    close(stats["clipfrac"], [[0.0, 1.0, 0.0]])
    # A larger cap leaves the second token's ratio e alone; a stale token's huge ratio stays finite.
    loss, _, grad = run("stable_reinforce", [[-0.5, -1.0]], {"clip_high_threshold": 3.0},
                        old_logprobs=[[-1.5, -900.0]], advantages=[[1.0, 1.0]])
    close(loss, [[0.5 * math.e, 3.0]])
    close(grad, [[-math.e, -3.0]])
    with pytest.raises(ValueError, match="clip_high_threshold must be >= 1"):
        run("stable_reinforce", lp, {"clip_high_threshold": 0.5}, old_logprobs=q, advantages=adv)


"""The model-free lexical judge on small hand-written solutions.

These examples are also what the default ``threshold=0.15`` was chosen on (see
``opentinker/creativity/lexical_judge.py``).
"""

from __future__ import annotations

import itertools

import pytest

pytest.importorskip("numpy")

from opentinker.creativity import make_judge  # noqa: E402
from opentinker.creativity.lexical_judge import (  # noqa: E402
    NUMBER_TOKEN,
    LexicalStrategyJudge,
    similarity_matrix,
    tokenize,
)

ADDITION = "What is 47 + 38?"
TENS_THEN_ONES = [
    "Add the tens first: 40 + 30 = 70. Then add the ones: 7 + 8 = 15. Finally 70 + 15 = 85.",
    "First I add the tens, 40 and 30 make 70. Next I add the ones, 7 and 8 make 15. So the total is 70 + 15 = 85.",
    # same method with an arithmetic slip and a wrong final answer
    "Split both numbers into tens and ones. Tens: 40 + 30 = 70. Ones: 7 + 8 = 16. Add them: 70 + 16 = 86.",
]
COUNT_UP = [
    "Start at 47 and count up by tens: 57, 67, 77. Then count up by ones eight times: 78, 79, 80, 81, 82, 83, "
    "84, 85. The answer is 85.",
    "Count up from 47: jump ten three times to reach 77, then count up one at a time 8 more steps to reach 85.",
]
ROUNDING = ["Round 38 up to 40. Then 47 + 40 = 87. We added 2 too many, so subtract 2: 87 - 2 = 85."]

PERIMETER = "A rectangle has perimeter 20 and length 6. What is its width?"
EQUATION = [
    "Let the width be w. The perimeter is 2(l + w) = 20, so 2(6 + w) = 20, giving 6 + w = 10 and w = 4.",
    "Write the perimeter equation 2(6 + w) = 20 for the unknown width w, divide by 2: 6 + w = 10, so w = 4.",
]
GUESS_AND_CHECK = [
    "Guess and check: try width 3, perimeter 6+3+6+3 = 18, too small. Try width 4: 6+4+6+4 = 20. So the width is 4.",
    "Try a width of 5: 6+5+6+5 = 22, too big. Try 4: 6+4+6+4 = 20, which works, so the width is 4.",
]


def test_numbers_become_a_placeholder_and_function_words_are_dropped():
    num = NUMBER_TOKEN
    assert tokenize("Then add the ones: 7 + 8 = 15.") == ["add", "ones", num, "+", num, "=", num]
    assert tokenize("7 + 8 = 15") == tokenize("7 + 8 = 16") == tokenize("70 + 1,000 = 3.5")
    assert "up" in tokenize("count up")  # direction words are kept


def test_same_approach_merges_and_different_approaches_split():
    judge = LexicalStrategyJudge()
    responses = [TENS_THEN_ONES[0], COUNT_UP[0], TENS_THEN_ONES[1], ROUNDING[0], TENS_THEN_ONES[2], COUNT_UP[1]]
    assert judge.label_groups([(ADDITION, responses)]) == [["s0", "s1", "s0", "s2", "s0", "s1"]]
    responses = [GUESS_AND_CHECK[0], EQUATION[0], EQUATION[1], GUESS_AND_CHECK[1]]
    assert judge.label_groups([(PERIMETER, responses)]) == [["s0", "s1", "s1", "s0"]]


def test_threshold_has_a_margin_on_these_examples():
    """Within one method the mean similarity clears the default threshold; across methods no
    pair reaches it, so the default sits in a gap rather than on an edge."""
    methods = [TENS_THEN_ONES, COUNT_UP, ROUNDING]
    texts = [text for method in methods for text in method]
    owner = [index for index, method in enumerate(methods) for _ in method]
    similarity = similarity_matrix(texts)
    within = [similarity[a, b] for a, b in itertools.combinations(range(len(texts)), 2) if owner[a] == owner[b]]
    across = [similarity[a, b] for a, b in itertools.combinations(range(len(texts)), 2) if owner[a] != owner[b]]
    threshold = LexicalStrategyJudge().threshold
    assert sum(within) / len(within) > threshold + 0.1
    assert max(across) < threshold - 0.03


def partition(labels, indices):
    """The grouping as a set of sets of original indices (label names do not matter)."""
    groups: dict[str, set] = {}
    for label, index in zip(labels, indices):
        groups.setdefault(label, set()).add(index)
    return {frozenset(members) for members in groups.values()}


def test_deterministic_and_order_independent_up_to_relabelling():
    judge = LexicalStrategyJudge()
    responses = EQUATION + GUESS_AND_CHECK
    first = judge.label_responses(responses)
    assert all(judge.label_responses(responses) == first for _ in range(3))
    assert LexicalStrategyJudge().label_responses(responses) == first
    order = (3, 1, 0, 2)
    reordered = judge.label_responses([responses[index] for index in order])
    assert partition(reordered, order) == partition(first, range(4)) == {frozenset({0, 1}), frozenset({2, 3})}


def test_edge_cases_threshold_extremes_and_metrics():
    judge = make_judge("lexical")
    labels = judge.label_groups([
        ("q", []),
        ("q", ["only"]),
        ("q", ["same", " same "]),
        ("q", ["", "   "]),
        ("q", ["47 + 38 = 85", "38 + 47 = 85"]),  # no words: compared by their arithmetic
    ])
    assert labels == [[], ["s0"], ["s0", "s0"], ["s0", "s0"], ["s0", "s0"]]
    metrics = judge.pop_metrics()
    assert metrics["judge/groups"] == 5 and metrics["judge/skipped_groups"] == 4
    assert metrics["judge/latency_s_mean"] >= 0
    assert judge.pop_metrics() == {"judge/groups": 0.0, "judge/skipped_groups": 0.0}

    texts = TENS_THEN_ONES + COUNT_UP
    assert LexicalStrategyJudge(threshold=0.0).label_responses(texts) == ["s0"] * 5
    assert LexicalStrategyJudge(threshold=1.0).label_responses(texts) == ["s0", "s1", "s2", "s3", "s4"]
    with pytest.raises(ValueError, match="threshold"):
        LexicalStrategyJudge(threshold=1.5)

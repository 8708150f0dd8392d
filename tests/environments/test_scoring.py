"""Scorers, on hand-picked cases."""

from __future__ import annotations

import pytest

from opentinker.environments.scoring import (
    SCORERS,
    extract_boxed,
    extract_gsm8k_answer,
    extract_math_answer,
    get_scorer,
    normalize_number,
    score_contains,
    score_exact,
    score_math,
    score_regex,
)
from opentinker.environments.text_interactions import SimpleTextEnvironment


@pytest.mark.parametrize(
    "text, expected",
    [
        ("1,234", "1234"),
        ("$5.50", "5.5"),
        ("7.00", "7"),
        (" 42 ", "42"),
        ("-3", "-3"),
        ("-0", "0"),
        ("12.", "12"),
        ("0.0001", "0.0001"),
        ("abc", None),
        ("", None),
        ("1/2", None),
        (None, None),
    ],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


@pytest.mark.parametrize(
    "text, mode, expected",
    [
        ("so the total is 5 + 7 = 12\n#### 1,234", "strict", "1234"),
        ("#### $18", "strict", "18"),
        ("####72.", "strict", "72"),
        ("#### -3.50", "strict", "-3.5"),
        ("first #### 3 then #### 4", "strict", "4"),
        ("The answer is 42.", "strict", None),
        ("The answer is 42.", "flexible", "42"),
        ("I had 3 apples, then 10,000 more.", "flexible", "10000"),
        ("It costs $1,250.75 in total", "flexible", "1250.75"),
        ("no numbers here", "flexible", None),
        ("#### 8\nanswer 9", "flexible", "9"),
    ],
)
def test_extract_gsm8k_answer(text, mode, expected):
    assert extract_gsm8k_answer(text, mode) == expected


def test_extract_gsm8k_answer_rejects_unknown_mode():
    with pytest.raises(ValueError, match="strict"):
        extract_gsm8k_answer("1", mode="lenient")  # type: ignore[arg-type]


def test_score_exact_and_contains():
    assert score_exact("  Paris ", "paris") == 1.0
    assert score_exact("New   York", "new york") == 1.0
    assert score_exact("Paris.", "Paris") == 0.0
    assert score_contains("The capital is PARIS, of course", "paris") == 1.0
    assert score_contains("The capital is Lyon", "paris") == 0.0
    assert score_contains("anything", "") == 0.0


def test_score_regex():
    pattern = r"[Aa]nswer:\s*(\S+)"
    assert score_regex("Reasoning... Answer: blue", "Blue", pattern) == 1.0
    assert score_regex("Reasoning... Answer: red", "blue", pattern) == 0.0
    assert score_regex("no marker", "blue", pattern) == 0.0
    assert score_regex("Answer: 1,000", "1000", pattern) == 1.0  # numeric comparison
    assert score_regex("value=7 and more", "value=7", r"value=\d+") == 1.0  # whole match without groups


def test_a_backtracking_client_pattern_is_stopped_and_scores_zero():
    """The audit: a client-sent pattern for SimpleTextEnvironment could backtrack for ever in
    the trainer. The search is stopped after REGEX_TIMEOUT_S (the ``regex`` module's timeout)
    and counts as no match; patterns are bounded and checked when the interaction is made."""
    import threading

    for pattern in (r"(a|aa)+$", r"(a+)+$"):  # the audit's; the regex module needs its timeout for the first
        done = threading.Event()
        result = []
        worker = threading.Thread(target=lambda: (result.append(score_regex("a" * 40 + "b", "1", pattern)),
                                                  done.set()), daemon=True)
        worker.start()
        # With the standard library's re this search runs for hours; stopped, it ends at once.
        assert done.wait(30) and result == [0.0], pattern
    with pytest.raises(ValueError, match="pattern: at most 1000 characters"):
        get_scorer("regex", pattern="a" * 1001)
    with pytest.raises(ValueError, match="invalid regex pattern"):
        SimpleTextEnvironment({"scorer": "regex", "pattern": "(unclosed"})


def test_extract_boxed_balances_braces():
    assert extract_boxed(r"so \boxed{\frac{3}{4}} done") == r"\frac{3}{4}"
    assert extract_boxed(r"\boxed{1} then \boxed{2}") == "2"
    assert extract_boxed(r"\boxed{unbalanced") is None
    assert extract_boxed("nothing") is None


@pytest.mark.parametrize(
    "response, truth",
    [
        (r"The result is \boxed{\frac{3}{4}}", "0.75"),
        (r"\boxed{0.75}", "3/4"),
        (r"\boxed{\dfrac{6}{8}}", r"\frac{3}{4}"),
        (r"\boxed{-\frac{1}{2}}", "-0.5"),
        ("so we get #### 1,234", "1234"),
        ("The answer is 42.", "42"),
        ("It is 42.0", "42"),
        ("about 0.333333", "1/3"),
        (r"\boxed{50\%}", "50"),
        (r"\boxed{\$18}", "18"),
        (r"\boxed{x+1}", "x + 1"),  # non-numeric: compared as cleaned strings
        ("worked: 3 + 4 = 7", r"Thus \boxed{7}"),  # truth's own boxed answer is extracted
    ],
)
def test_score_math_equivalent(response, truth):
    assert score_math(response, truth) == 1.0


@pytest.mark.parametrize(
    "response, truth",
    [
        (r"\boxed{\frac{3}{5}}", "0.75"),
        ("The answer is 41.", "42"),
        ("0.3333", "1/3"),  # beyond the 1e-6 relative tolerance
        ("no answer at all", "42"),
        (r"\boxed{x+2}", "x+1"),
        (r"\boxed{\frac{1}{0}}", "1"),
        (r"\boxed{5}", "x"),
    ],
)
def test_score_math_different(response, truth):
    assert score_math(response, truth) == 0.0


def test_extract_math_answer_priority():
    assert extract_math_answer(r"#### 5 but \boxed{6}") == "6"
    assert extract_math_answer("3 apples #### 5") == "5"
    assert extract_math_answer("3 apples, 1,234,") == "1,234"
    assert extract_math_answer("none") is None


def test_scorer_registry():
    assert set(SCORERS) == {"exact", "contains", "regex", "math"}
    assert get_scorer("exact")("A", "a") == 1.0
    assert get_scorer("math")(r"\boxed{2}", "2.0") == 1.0
    assert get_scorer("regex", pattern=r"is (\w+)")("it is blue", "blue") == 1.0
    with pytest.raises(ValueError) as err:
        get_scorer("fuzzy")
    for name in SCORERS:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="pattern"):
        get_scorer("regex")
    with pytest.raises(ValueError, match="invalid regex"):
        get_scorer("regex", pattern="(")
    with pytest.raises(ValueError, match="no options"):
        get_scorer("exact", pattern="x")

"""The judge prompt and the parser of its JSON answer."""

from __future__ import annotations

import json

import pytest

from opentinker.creativity.prompt import (
    PROMPT_VERSION,
    JudgementError,
    build_messages,
    canonical_labels,
    parse_judgement,
    truncate_response,
)


def answer(*groups: list) -> str:
    return json.dumps({"groups": [{"strategy": f"approach {index}", "members": members}
                                  for index, members in enumerate(groups)]})


def test_messages_hold_the_question_every_response_and_the_schema():
    messages = build_messages("  Find x if 2x + 3 = 11.  ", ["Subtract 3, divide by 2.", "Try x = 4: 11."])
    assert [message["role"] for message in messages] == ["system", "user"]
    user = messages[1]["content"]
    assert "<problem>\nFind x if 2x + 3 = 11.\n</problem>" in user
    assert '<response number="1">\nSubtract 3, divide by 2.\n</response>' in user
    assert '<response number="2">\nTry x = 4: 11.\n</response>' in user
    assert "numbered 1 to 2" in user and "from 1 to 2" in user
    schema = '{"groups": [{"strategy": "<short description of the approach>", "members": [<response numbers>]}, ...]}'
    assert schema in user
    for phrase in ("high-level solution strategy", "arithmetic slips", "final answer", "genuinely different"):
        assert phrase in user
    assert "JSON" in messages[0]["content"]
    assert PROMPT_VERSION
    with pytest.raises(ValueError):
        build_messages("q", [])


def test_long_responses_are_truncated_head_and_tail():
    text = "A" * 300 + "B" * 400 + "C" * 300
    cut = truncate_response(text, 90)
    assert cut.startswith("A" * 60) and cut.endswith("C" * 30) and "[... 910 characters omitted ...]" in cut
    assert truncate_response("short", 90) == "short"
    assert truncate_response(text, None) == text
    messages = build_messages("q", [text, "x"], max_response_chars=90)
    assert "B" * 50 not in messages[1]["content"]


def test_plain_json_and_canonical_labels():
    # groups listed in any order: labels follow the order in which responses first appear
    assert parse_judgement(answer([2, 4], [1, 3], [5]), 5) == ["s0", "s1", "s0", "s1", "s2"]
    assert parse_judgement(answer([1, 2, 3]), 3) == ["s0", "s0", "s0"]
    assert parse_judgement(answer([3], [2], [1]), 3) == ["s0", "s1", "s2"]
    assert canonical_labels(["b", "a", "b", 7]) == ["s0", "s1", "s0", "s2"]


def test_code_fences_prose_and_thinking_are_handled():
    body = answer([1, 3], [2])
    assert parse_judgement(f"```json\n{body}\n```", 3) == ["s0", "s1", "s0"]
    assert parse_judgement(f"```\n{body}\n```", 3) == ["s0", "s1", "s0"]
    assert parse_judgement(f"Sure! Here is my grouping:\n{body}\nLet me know.", 3) == ["s0", "s1", "s0"]
    thinking = '<think>maybe {"groups": [{"members": [1]}]}</think>'
    assert parse_judgement(thinking + body, 3) == ["s0", "s1", "s0"]
    # an unrelated object first, then the answer
    assert parse_judgement('{"note": "two approaches"} ' + body, 3) == ["s0", "s1", "s0"]
    # members written as strings, extra keys, no strategy description
    loose = '{"groups": [{"members": ["1", "Response 3"], "why": "same"}, {"members": ["#2"]}], "extra": 1}'
    assert parse_judgement(loose, 3) == ["s0", "s1", "s0"]


@pytest.mark.parametrize(
    ("text", "n", "reason"),
    [
        ("", 2, "empty"),
        ("I think they are all the same.", 2, "no complete JSON object"),
        ('{"groups": [{"members": [1, 2]', 2, "no complete JSON object"),
        ('{"labels": ["A", "B"]}', 2, 'none with a "groups" key'),
        ('{"groups": []}', 2, "non-empty list"),
        ('{"groups": {"a": [1, 2]}}', 2, "non-empty list"),
        ('{"groups": [[1, 2]]}', 2, "group 1 is a list"),
        ('{"groups": [{"strategy": "x"}]}', 2, 'group 1 has no non-empty "members"'),
        ('{"groups": [{"members": [1, 2]}, {"members": [2]}]}', 2, "response 2 is assigned in groups 1 and 2"),
        ('{"groups": [{"members": [1, 1, 2]}]}', 2, "response 1 is assigned twice in the same group"),
        ('{"groups": [{"members": [1]}]}', 3, r"responses \[2, 3\] are not assigned"),
        ('{"groups": [{"members": [1, 2, 3]}]}', 2, "response 3 is out of range 1..2"),
        ('{"groups": [{"members": [0, 1, 2]}]}', 2, "response 0 is out of range"),
        ('{"groups": [{"members": [1, 2.0]}]}', 2, "member 2.0 is not a response number"),
        ('{"groups": [{"members": [1, true]}]}', 2, "member True is not a response number"),
        ('{"groups": [{"members": [1, "two"]}]}', 2, "member 'two' is not a response number"),
    ],
)
def test_invalid_answers_are_rejected_with_a_precise_reason(text, n, reason):
    with pytest.raises(JudgementError, match=reason):
        parse_judgement(text, n)


def test_judgement_error_is_a_value_error_and_nothing_is_evaluated():
    assert issubclass(JudgementError, ValueError)
    with pytest.raises(JudgementError):
        parse_judgement('{"groups": [{"members": [__import__("os").getpid()]}]}', 1)

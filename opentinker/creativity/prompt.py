"""The strategy-judge prompt and the parser of its answer.

A judge model sees one problem and the n responses sampled for it, and groups the responses by
their overall, high-level solution strategy. It answers with one JSON object of this schema::

    {"groups": [{"strategy": "<short description of the approach>", "members": [1, 3]},
                {"strategy": "<another approach>", "members": [2]}]}

* ``members`` lists response numbers (1-based, as numbered in the prompt); every number from 1
  to n appears in exactly one group. A member may also be written as a string of digits
  (``"3"``) or ``"Response 3"``; booleans, floats and anything else are rejected.
* ``strategy`` is a free-text description, for logs only: the *group* defines the label, so
  two groups with the same description still count as two strategies.
* Other keys are ignored.

:func:`parse_judgement` turns the answer into one label per response, canonicalized as
``"s0"``, ``"s1"``, ... in order of first appearance (response 1 always gets ``"s0"``), so that
equal strategies compare equal and labels do not depend on how the judge ordered its groups.

Changing the wording of the prompt changes what the judge answers: bump :data:`PROMPT_VERSION`
whenever it changes, so cached judgements made with the old prompt are not reused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

#: Part of every cache key; bump it whenever the prompt text or its layout changes.
PROMPT_VERSION = "strategy-groups-v1"

SYSTEM_PROMPT = (
    "You are a careful grader who compares several solutions to the same problem and sorts them "
    "by the solution strategy they use. You answer with a single JSON object and nothing else."
)

_INSTRUCTIONS = """\
Below are a problem and {n} responses to it, numbered 1 to {n}.

Group the responses by their overall, high-level solution strategy: the main method or key idea \
used to reach the answer.

- Put responses in the same group when they follow the same overall approach, even if they differ \
in wording, length, level of detail, the order of the steps, minor sub-steps, notation, \
arithmetic slips, or the final answer they reach. Correctness does not matter here.
- Start a new group only when the approach itself is genuinely different (for example: setting \
up an equation versus guessing and checking, a direct formula versus enumerating cases, working \
forwards versus working backwards, a geometric argument versus an algebraic one).
- Responses with no recognizable approach (empty, off-topic, or a bare answer without reasoning) \
form one group together."""

_ANSWER_FORMAT = """\
Answer with one JSON object and nothing else, in exactly this form:
{{"groups": [{{"strategy": "<short description of the approach>", "members": [<response numbers>]}}, ...]}}
Every response number from 1 to {n} must appear in exactly one group's "members" list. Use as \
few groups as the differences in approach allow."""


class JudgementError(ValueError):
    """The judge's answer is not a valid grouping; the message says precisely why."""


def truncate_response(text: str, max_chars: int | None) -> str:
    """``text`` cut to about ``max_chars`` characters: the head (two thirds) and the tail (one
    third) are kept, since the approach shows at the start and the conclusion at the end."""
    if max_chars is None or len(text) <= max_chars:
        return text
    if max_chars <= 0:
        raise ValueError(f"max_response_chars must be positive or None, got {max_chars}")
    head = (2 * max_chars) // 3
    tail = max_chars - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} characters omitted ...]\n{text[len(text) - tail:] if tail else ''}"


def build_user_prompt(question: str, responses: Sequence[str], *, max_response_chars: int | None = None) -> str:
    """The user message: instructions, the problem, the numbered responses, the answer format."""
    n = len(responses)
    if n == 0:
        raise ValueError("a strategy judgement needs at least one response")
    parts = [_INSTRUCTIONS.format(n=n), "", "<problem>", str(question).strip(), "</problem>"]
    for number, response in enumerate(responses, start=1):
        parts += ["", f'<response number="{number}">', truncate_response(str(response).strip(), max_response_chars),
                  "</response>"]
    parts += ["", _ANSWER_FORMAT.format(n=n)]
    return "\n".join(parts)


def build_messages(
    question: str, responses: Sequence[str], *, max_response_chars: int | None = None
) -> list[dict[str, str]]:
    """Chat messages (system + user) asking the judge to group ``responses`` to ``question``."""
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": build_user_prompt(question, responses, max_response_chars=max_response_chars)},
    ]


# --------------------------------------------------------------------------- parsing

_FENCE = re.compile(r"```[A-Za-z0-9_-]*[ \t]*\n?(.*?)```", re.DOTALL)
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_MEMBER_TEXT = re.compile(r"\s*(?:response\s*)?#?\s*(\d+)\s*", re.IGNORECASE)


def canonical_labels(labels: Sequence[Any]) -> list[str]:
    """``"s0"``, ``"s1"``, ... in order of first appearance: equal inputs get equal outputs."""
    numbering: dict[Any, int] = {}
    return [f"s{numbering.setdefault(label, len(numbering))}" for label in labels]


def _candidate_texts(text: str) -> list[str]:
    """Where to look for the JSON object, most specific first: fenced blocks, then the whole text."""
    without_thinking = _THINK.sub("", text)
    return [block for block in _FENCE.findall(without_thinking)] + [without_thinking]


def extract_json_object(text: str) -> dict[str, Any]:
    """The first JSON object in ``text`` that has a ``"groups"`` key (code fences and
    ``<think>`` blocks are handled; only ``json`` decodes, nothing is evaluated)."""
    if not isinstance(text, str) or not text.strip():
        raise JudgementError("the judge's answer is empty")
    decoder = json.JSONDecoder()
    saw_object = False
    for candidate in _candidate_texts(text):
        start = candidate.find("{")
        while start != -1:
            try:
                value, _end = decoder.raw_decode(candidate, start)
            except json.JSONDecodeError:
                value = None
            if isinstance(value, dict):
                saw_object = True
                if "groups" in value:
                    return value
            start = candidate.find("{", start + 1)
    if saw_object:
        raise JudgementError("the judge's answer has JSON objects, but none with a \"groups\" key")
    raise JudgementError(f"no complete JSON object found in the judge's answer: {_preview(text)}")


def _preview(text: str, limit: int = 120) -> str:
    flat = " ".join(text.split())
    return repr(flat if len(flat) <= limit else flat[:limit] + "...")


def _member_number(value: Any, group: int) -> int:
    if isinstance(value, bool):
        raise JudgementError(f"group {group}: member {value!r} is not a response number")
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        match = _MEMBER_TEXT.fullmatch(value)
        if match:
            return int(match.group(1))
    raise JudgementError(f"group {group}: member {value!r} is not a response number")


def parse_judgement(text: str, n: int) -> list[str]:
    """One canonical label per response (``"s0"``, ``"s1"``, ...) from the judge's answer.

    Raises :class:`JudgementError` naming the problem when there is no JSON object with a
    ``"groups"`` list, a group is malformed, a member is out of 1..n, or a response is assigned
    twice or not at all.
    """
    if n < 1:
        raise ValueError(f"n must be at least 1, got {n}")
    payload = extract_json_object(text)
    groups = payload["groups"]
    if not isinstance(groups, list) or not groups:
        raise JudgementError(
            f"\"groups\" must be a non-empty list, got {type(groups).__name__}: {_preview(str(groups))}"
        )
    owner: dict[int, int] = {}
    for index, group in enumerate(groups, start=1):
        if not isinstance(group, dict):
            raise JudgementError(f"group {index} is a {type(group).__name__}, not an object with \"members\"")
        members = group.get("members")
        if not isinstance(members, list) or not members:
            raise JudgementError(f"group {index} has no non-empty \"members\" list")
        for value in members:
            number = _member_number(value, index)
            if not 1 <= number <= n:
                raise JudgementError(f"group {index}: response {number} is out of range 1..{n}")
            if number in owner:
                where = (
                    "twice in the same group" if owner[number] == index else f"in groups {owner[number]} and {index}"
                )
                raise JudgementError(f"response {number} is assigned {where}")
            owner[number] = index
    missing = [number for number in range(1, n + 1) if number not in owner]
    if missing:
        raise JudgementError(f"responses {missing} are not assigned to any group (expected 1..{n} each exactly once)")
    return canonical_labels([owner[number] for number in range(1, n + 1)])

"""Answer scorers: pure functions from (model response, ground truth) to a reward in [0, 1].

No I/O and no heavy imports at import time, so the client, the environments and the tests
share them (``score_math`` imports math-verify, of the ``env`` and ``server`` extras, when called).

``score_math`` in short: the final answer is taken from the last ``\\boxed{...}``, else the
last ``#### <answer>``, else the last number of the response. It and the ground truth
(from which a ``\\boxed{}`` or ``####`` answer is extracted the same way, when present) are
parsed and compared by math-verify (``math_verify.parse`` / ``verify``, with sympy): numbers
are equal when they agree after rounding to 6 decimal places (so ``0.75`` equals ``3/4`` and
``\\frac{3}{4}``, and ``0.333333`` equals ``1/3``), and expressions, intervals, sets and
equations symbolically (``\\sqrt{2}`` equals ``2^{1/2}``, ``x+1`` equals ``x + 1``). Numbers may
carry thousands separators (``1,234``), a sign, a leading ``$``, and a trailing ``%`` or ``\\%``
(``50%`` equals 50, the GSM8K convention, and also 0.5). Answers math-verify cannot parse
are compared as strings after removing spaces, ``$`` delimiters, ``\\left``/``\\right``, LaTeX
spacing and a trailing period. math-verify's own timeouts use ``signal.alarm``, which works only
in the main thread, and scoring runs in agent-loop threads and Ray actors: they are off, and
answers longer than :data:`MAX_MATH_ANSWER_CHARS` are compared as strings only.
"""

from __future__ import annotations

import functools
import logging
import re
from collections.abc import Callable
from decimal import Decimal, InvalidOperation
from typing import Literal

__all__ = [
    "SCORERS",
    "Scorer",
    "extract_boxed",
    "extract_gsm8k_answer",
    "extract_math_answer",
    "get_scorer",
    "normalize_number",
    "normalize_text",
    "score_contains",
    "score_exact",
    "score_math",
    "score_regex",
]

Scorer = Callable[[str, str], float]

REGEX_TIMEOUT_S = 0.1  # per search of a client's pattern ('regex' scorer)
MAX_PATTERN_CHARS = 1000
MAX_REGEX_INPUT_CHARS = 100_000  # of a response, searched with a client's pattern

# A number as GSM8K answers write it: optional sign and $, digits with optional
# thousands commas, optional decimals. Used by flexible extraction.
_NUMBER = re.compile(r"[-+]?\$?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
# GSM8K's strict format: the answer follows "#### ".
_STRICT = re.compile(r"####\s*([-+]?\$?\s*[\d.,]*\d)")
_HASH_ANSWER = re.compile(r"####\s*(.+)")
_WHITESPACE = re.compile(r"\s+")
#: longer final answers are not given to math-verify (it runs without a timeout here)
MAX_MATH_ANSWER_CHARS = 1000


def normalize_text(text: str) -> str:
    """Case-folded, stripped, with runs of whitespace collapsed to one space."""
    return _WHITESPACE.sub(" ", text).strip().casefold()


def normalize_number(text: str | None) -> str | None:
    """Canonical text of a number written GSM8K-style, or None when ``text`` is not a number.

    Commas, ``$`` and surrounding spaces are removed, as is a trailing period;
    the value is then written canonically: ``"1,234"`` -> ``"1234"``, ``"$5.50"`` ->
    ``"5.5"``, ``"7.00"`` -> ``"7"``, ``"-0"`` -> ``"0"``.
    """
    if text is None:
        return None
    cleaned = text.strip().replace(",", "").replace("$", "").replace(" ", "")
    cleaned = cleaned.rstrip(".")
    if not cleaned or not re.fullmatch(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)", cleaned):
        return None
    try:
        value = Decimal(cleaned)
    except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_gsm8k_answer(text: str, mode: Literal["strict", "flexible"] = "strict") -> str | None:
    """The final answer of a GSM8K-style solution, normalised by :func:`normalize_number`.

    ``strict``: the number after the last ``#### `` marker (None without one).
    ``flexible``: the last number anywhere in the text (``"The answer is 42."`` -> ``"42"``).
    """
    if mode == "strict":
        matches = _STRICT.findall(text)
        return normalize_number(matches[-1]) if matches else None
    if mode == "flexible":
        for candidate in reversed(_NUMBER.findall(text)):
            number = normalize_number(candidate)
            if number is not None:
                return number
        return None
    raise ValueError(f"unknown GSM8K extraction mode {mode!r}; valid modes: 'strict', 'flexible'")


def score_exact(response: str, truth: str) -> float:
    """1.0 when response and truth are equal up to case and whitespace, else 0.0."""
    return 1.0 if normalize_text(str(response)) == normalize_text(str(truth)) else 0.0


def score_contains(response: str, truth: str) -> float:
    """1.0 when the (case/whitespace-normalised) truth occurs in the response; an empty truth scores 0.0."""
    needle = normalize_text(str(truth))
    return 1.0 if needle and needle in normalize_text(str(response)) else 0.0


def score_regex(response: str, truth: str, pattern: str) -> float:
    """Score the first match of ``pattern`` in the response against the truth.

    The pattern's first group (or the whole match when it has none) is compared with
    :func:`score_exact`; when both sides are numbers they are also compared as numbers
    (``"1,000"`` matches ``"1000"``). No match scores 0.0, and so does a search that takes
    longer than ``REGEX_TIMEOUT_S``: the pattern is the client's, so a catastrophically
    backtracking one (``(a|aa)+$``) must not hold the trainer (the ``regex`` module stops it).
    """
    import regex  # here, not at the top: the thin client imports this module, and needs no regex

    try:
        match = regex.search(pattern, str(response)[:MAX_REGEX_INPUT_CHARS], timeout=REGEX_TIMEOUT_S)
    except TimeoutError:
        return 0.0
    if match is None:
        return 0.0
    found = match.group(1) if match.re.groups else match.group(0)
    if found is None:
        return 0.0
    if score_exact(found, truth):
        return 1.0
    a, b = normalize_number(found), normalize_number(str(truth))
    return 1.0 if a is not None and a == b else 0.0


def extract_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    brace = text.find("{", start)
    if brace < 0:
        return None
    # Only spaces may sit between the command and its brace.
    if text[start:brace].strip() not in ("\\boxed", "\\fbox"):
        return None
    depth = 0
    for i in range(brace, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[brace + 1 : i].strip()
    return None  # unbalanced


def extract_math_answer(text: str) -> str | None:
    """The final answer of a response: last ``\\boxed{}``, else last ``####``, else last number."""
    text = str(text)
    boxed = extract_boxed(text)
    if boxed is not None:
        return boxed
    hashed = _HASH_ANSWER.findall(text)
    if hashed:
        return hashed[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1].rstrip(",") if numbers else None


def _clean_math(text: str) -> str:
    s = text.strip()
    for token in ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "\\displaystyle"):
        s = s.replace(token, "")
    s = s.replace("\\$", "").replace("$", "")
    s = _WHITESPACE.sub("", s)
    s = s.rstrip(".")
    # \text{...} around a bare answer, e.g. \text{5}
    m = re.fullmatch(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", s)
    if m:
        s = m.group(1)
    return s


@functools.cache
def _math_verify():
    try:
        import math_verify
    except ImportError as error:
        raise ImportError(
            "the 'math' scorer needs math-verify: pip install 'opentinker[env]' (or 'math-verify')"
        ) from error
    # It warns that its timeouts are off; they are off on purpose (see the module doc).
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(lambda record: not record.getMessage().startswith("Timeout is disabled"))
    return math_verify


def _parse_math(answer: str) -> list:
    """math-verify's reading of one extracted answer ([] when it finds nothing)."""
    if len(answer) > MAX_MATH_ANSWER_CHARS:
        return []
    math_verify = _math_verify()
    # In $...$ so that it is read as LaTeX, the whole of it being the answer.
    return math_verify.parse(f"${answer}$", parsing_timeout=None)


def score_math(response: str, truth: str) -> float:
    """1.0 when the response's final answer equals the truth mathematically (see module doc)."""
    answer = extract_math_answer(response)
    if answer is None:
        return 0.0
    truth = str(truth)
    if "\\boxed" in truth or "\\fbox" in truth or "####" in truth:
        truth = extract_math_answer(truth) or truth
    parsed_answer, parsed_truth = _parse_math(answer), _parse_math(truth)
    if parsed_answer and parsed_truth:
        return 1.0 if _math_verify().verify(parsed_truth, parsed_answer, timeout_seconds=None) else 0.0
    return 1.0 if _clean_math(answer) == _clean_math(truth) and _clean_math(truth) else 0.0


SCORERS: dict[str, Callable[..., float]] = {
    "exact": score_exact,
    "contains": score_contains,
    "regex": score_regex,
    "math": score_math,
}


def get_scorer(name: str, **options: str) -> Scorer:
    """The scorer called ``name`` as a ``(response, truth) -> float`` function.

    ``options`` are bound to it: ``get_scorer("regex", pattern=r"answer: (\\d+)")``.
    Raises ValueError for an unknown name (listing the valid ones) or a regex scorer
    without a valid ``pattern``.
    """
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; valid scorers: {', '.join(sorted(SCORERS))}")
    if name == "regex":
        pattern = options.pop("pattern", None)
        if not pattern or not isinstance(pattern, str):
            raise ValueError("the 'regex' scorer needs a 'pattern' (text)")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise ValueError(f"pattern: at most {MAX_PATTERN_CHARS} characters, got {len(pattern)}")
        import regex

        try:
            regex.compile(pattern)
        except (regex.error, OverflowError, RecursionError) as exc:
            raise ValueError(f"invalid regex pattern {pattern!r}: {exc}") from exc
        if options:
            raise ValueError(f"scorer 'regex' takes only 'pattern', got {sorted(options)}")
        return functools.partial(score_regex, pattern=pattern)
    if options:
        raise ValueError(f"scorer {name!r} takes no options, got {sorted(options)}")
    return SCORERS[name]

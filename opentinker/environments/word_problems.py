"""Generated grade-school word problems: one or two arithmetic steps on small whole numbers.

Pure Python (no torch) like :mod:`opentinker.environments.arithmetic`, so the engine's built-in
task, the env server and the tests share one wording and one notion of a correct answer.

Every problem is a template filled with a name, an item and operands (2..20; a product or a
dividend is at most 200). The operands appear in the question in the order they are used and
the operations apply left to right, so ``answer == ((operands[0] ops[0] operands[1]) ops[1]
operands[2])``. Answers are non-negative integers: subtraction never goes below zero and
division is always exact.
"""

from __future__ import annotations

import random
import re
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from decimal import Decimal

from opentinker.environments.arithmetic import Split, row_problem

__all__ = [
    "ANSWER_INSTRUCTION",
    "HELDOUT_SEED",
    "TRAIN_SEED",
    "WordProblem",
    "draw_problem",
    "extract_final_number",
    "is_heldout",
    "make_problems",
    "parse_steps",
    "row_problem",
    "score_answer",
]

#: Closes every user turn; the model is asked for a bare number, which the format bonus rewards.
ANSWER_INSTRUCTION = "Answer with the number."

MIN_OPERAND = 2
MAX_OPERAND = 20
MAX_PRODUCT = 200

NAMES = (
    "Ava", "Ben", "Chloe", "Daniel", "Ella", "Finn", "Grace", "Henry", "Isla", "Jack",
    "Kira", "Leo", "Mia", "Noah", "Olivia", "Pablo", "Quinn", "Ruby", "Sam", "Tara",
    "Umar", "Vera", "Will", "Ximena", "Yusuf", "Zoe", "Amir", "Lena", "Omar", "Priya",
)
FOODS = ("apples", "cookies", "oranges", "grapes", "strawberries", "crackers", "cherries")
THINGS = ("pencils", "stickers", "marbles", "books", "crayons", "shells", "cards", "balloons", "stamps", "beads")
ITEMS = FOODS + THINGS


@dataclass(frozen=True)
class WordProblem:
    """One generated problem: the story, its integer answer and how the answer is reached."""

    question: str  # the story, without ANSWER_INSTRUCTION
    answer: int
    operands: tuple[int, ...]  # in the order they appear in the question
    ops: tuple[str, ...]  # "+", "-", "*" or "/", applied left to right

    @property
    def steps(self) -> int:
        return len(self.ops)

    @property
    def prompt(self) -> str:
        """The user turn: the story and the fixed instruction."""
        return f"{self.question} {ANSWER_INSTRUCTION}"

    def messages(self) -> list[dict[str, str]]:
        """The chat the model sees: a single user turn, no system prompt."""
        return [{"role": "user", "content": self.prompt}]

    def as_row(self) -> dict:
        """A dataset row in the arithmetic task's format (prompt messages + ground truth)."""
        return {
            "prompt": self.messages(),
            "reward_model": {"ground_truth": str(self.answer)},
            "data_source": "word_problems",
        }


# --------------------------------------------------------------------------- templates


def _operand(rng: random.Random, high: int = MAX_OPERAND) -> int:
    return rng.randint(MIN_OPERAND, high)


def _factors(rng: random.Random) -> tuple[int, int]:
    """Two operands whose product is at most MAX_PRODUCT."""
    a = _operand(rng)
    return a, _operand(rng, min(MAX_OPERAND, MAX_PRODUCT // a))


def _draw_add(rng):
    return _operand(rng), _operand(rng)


def _draw_subtract(rng):
    a = rng.randint(MIN_OPERAND + 1, MAX_OPERAND)  # room for b < a, so something is left
    return a, _operand(rng, a - 1)


def _draw_multiply(rng):
    return _factors(rng)


def _draw_divide(rng):
    divisor, quotient = _factors(rng)
    return divisor * quotient, divisor


def _draw_add_subtract(rng):
    a, b = _operand(rng), _operand(rng)
    return a, b, _operand(rng, min(MAX_OPERAND, a + b - 1))


def _draw_subtract_add(rng):
    a, b = _draw_subtract(rng)
    return a, b, _operand(rng)


def _draw_multiply_add(rng):
    return (*_factors(rng), _operand(rng))


def _draw_multiply_subtract(rng):
    a, b = _factors(rng)
    return a, b, _operand(rng, min(MAX_OPERAND, a * b - 1))


def _draw_add_divide(rng):
    # Pick the divisor and quotient first so the sum divides evenly, then split the sum into
    # two operands in range (a sum of 4..40 always splits into two numbers of 2..20).
    friends = _operand(rng, 10)
    total = friends * rng.randint(2, 2 * MAX_OPERAND // friends)
    a = rng.randint(max(MIN_OPERAND, total - MAX_OPERAND), min(MAX_OPERAND, total - MIN_OPERAND))
    return a, total - a, friends


@dataclass(frozen=True)
class _Template:
    text: str  # placeholders {name}, {item}, {a}, {b}, {c}
    ops: tuple[str, ...]
    draw: Callable[[random.Random], tuple[int, ...]]
    items: tuple[str, ...] = ITEMS


ONE_STEP = (
    _Template("{name} has {a} {item}. {name} buys {b} more. How many {item} does {name} have now?",
              ("+",), _draw_add),
    _Template("{name} had {a} {item} and then found {b} more. How many {item} does {name} have now?",
              ("+",), _draw_add),
    _Template("{name} has {a} {item} and gives {b} of them away. How many {item} does {name} have left?",
              ("-",), _draw_subtract),
    _Template("{name} has {a} {item} and eats {b} of them. How many {item} does {name} have left?",
              ("-",), _draw_subtract, FOODS),
    _Template("{name} has {a} boxes with {b} {item} in each box. How many {item} does {name} have in total?",
              ("*",), _draw_multiply),
    _Template("{name} buys {a} bags of {item}. Each bag holds {b} {item}. How many {item} did {name} buy?",
              ("*",), _draw_multiply),
    _Template("{name} shares {a} {item} equally among {b} friends. How many {item} does each friend get?",
              ("/",), _draw_divide),
    _Template("{name} puts {a} {item} into {b} boxes, the same number in each box. "
              "How many {item} are in each box?", ("/",), _draw_divide),
)
TWO_STEP = (
    _Template("{name} has {a} {item}, buys {b} more, then gives {c} away. How many {item} does {name} have now?",
              ("+", "-"), _draw_add_subtract),
    _Template("{name} has {a} {item}, eats {b} of them, then gets {c} more from a friend. "
              "How many {item} does {name} have now?", ("-", "+"), _draw_subtract_add, FOODS),
    _Template("{name} buys {a} packs of {item} with {b} in each pack and already had {c}. "
              "How many {item} does {name} have now?", ("*", "+"), _draw_multiply_add),
    _Template("{name} has {a} boxes of {item} with {b} in each box and gives {c} of them away. "
              "How many {item} does {name} have left?", ("*", "-"), _draw_multiply_subtract),
    _Template("{name} has {a} {item} and finds {b} more, then shares them equally among {c} friends. "
              "How many {item} does each friend get?", ("+", "/"), _draw_add_divide),
)
TEMPLATES = {1: ONE_STEP, 2: TWO_STEP}


def _evaluate(operands: tuple[int, ...], ops: tuple[str, ...]) -> int:
    """Apply ``ops`` left to right, refusing a negative or fractional intermediate result."""
    value = operands[0]
    for op, operand in zip(ops, operands[1:], strict=True):
        if op == "+":
            value += operand
        elif op == "-":
            value -= operand
        elif op == "*":
            value *= operand
        else:
            quotient, remainder = divmod(value, operand)
            if remainder:
                raise AssertionError(f"{value} / {operand} is not exact")
            value = quotient
        if value < 0:
            raise AssertionError(f"negative intermediate result in {operands} {ops}")
    return value


def draw_problem(rng: random.Random, steps: int) -> WordProblem:
    """One problem with ``steps`` operations (1 or 2), of either split."""
    template = rng.choice(TEMPLATES[steps])
    name, item = rng.choice(NAMES), rng.choice(template.items)
    operands = tuple(template.draw(rng))
    question = template.text.format(name=name, item=item, **dict(zip("abc", operands)))
    return WordProblem(question, _evaluate(operands, template.ops), operands, template.ops)


# --------------------------------------------------------------------------- splits


def is_heldout(problem: WordProblem) -> bool:
    """A fixed ~10% of all problems is held out, so evaluation never sees a trained problem."""
    return zlib.crc32(problem.question.encode()) % 10 == 0


def parse_steps(steps: int | str | Iterable[int]) -> tuple[int, ...]:
    """``steps`` as a sorted tuple of step counts: ``2``, ``"1,2"`` or ``(1, 2)``."""
    if isinstance(steps, str):
        parts = [part.strip() for part in steps.split(",")]
        if not all(part.isdigit() for part in parts):
            raise ValueError(f"steps must be 1, 2 or both (e.g. '1,2'), got {steps!r}")
        values = [int(part) for part in parts]
    elif isinstance(steps, int) and not isinstance(steps, bool):
        values = [steps]
    else:
        try:
            values = list(steps)
        except TypeError:
            raise ValueError(f"steps must be 1, 2 or both (e.g. '1,2'), got {steps!r}") from None
    if not values or any(isinstance(v, bool) or v not in TEMPLATES for v in values):
        raise ValueError(f"steps must be 1, 2 or both (e.g. '1,2'), got {steps!r}")
    return tuple(sorted(set(values)))


def make_problems(
    count: int, seed: int, split: Split = "train", steps: int | str | Iterable[int] = (1, 2)
) -> list[WordProblem]:
    """``count`` problems of ``split``, drawn deterministically from ``seed``.

    With several step counts they take turns (from a seeded starting point, so a single
    problem is not always a one-step one): the mix is as even as ``count`` allows.
    """
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    if count < 0:
        raise ValueError(f"count must be >= 0, got {count}")
    kinds = parse_steps(steps)
    rng = random.Random(seed)
    offset = rng.randrange(len(kinds))
    want_heldout = split == "heldout"
    problems: list[WordProblem] = []
    while len(problems) < count:
        problem = draw_problem(rng, kinds[(offset + len(problems)) % len(kinds)])
        if is_heldout(problem) == want_heldout:
            problems.append(problem)
    return problems


# --------------------------------------------------------------------------- grading

# A number: optional minus (not when glued to a word, as in "5-3"), digits with optional
# thousands groups ("1,200") and an optional decimal part; a trailing "." is not part of it.
_NUMBER = re.compile(r"(?:(?<!\w)-)?\d+(?:,\d{3}(?!\d))*(?:\.\d+)?")
_ONLY_PUNCTUATION = re.compile(r"[\W_]*")


def _last_number(response: str) -> re.Match[str] | None:
    last = None
    for last in _NUMBER.finditer(response):
        pass
    return last


def extract_final_number(response: str) -> Decimal | None:
    """The last number in the response, exactly (``"13.0"`` equals 13, ``"13.5"`` does not),
    or None when there is none."""
    match = _last_number(response)
    return Decimal(match.group(0).replace(",", "")) if match else None


def ends_with_number(response: str) -> bool:
    """Whether nothing but whitespace and punctuation follows the response's last number."""
    match = _last_number(response)
    return match is not None and _ONLY_PUNCTUATION.fullmatch(response, match.end()) is not None


def score_answer(response: str, ground_truth: str | int, format_weight: float = 0.0) -> float:
    """``exact * (1 - format_weight) + format_weight * ends``, where ``exact`` is 1 when the
    response's last number equals the integer ``ground_truth`` (else 0) and ``ends`` is 1 when
    the response ends with a number, whitespace and punctuation aside (else 0).

    With the default ``format_weight=0`` this is plain 0/1 correctness. The bonus does not
    depend on correctness, so the reward stays monotone in both: a correct bare number scores
    1.0, a correct number followed by more words ``1 - format_weight``.
    """
    if not 0.0 <= format_weight <= 1.0:
        raise ValueError(f"format_weight must be in [0, 1], got {format_weight}")
    answer = extract_final_number(response)
    exact = 1.0 if answer is not None and answer == int(str(ground_truth).strip()) else 0.0
    ends = 1.0 if ends_with_number(response) else 0.0
    return exact * (1.0 - format_weight) + format_weight * ends


# Seeds are kept apart so that held-out problems never share a stream with training ones.
TRAIN_SEED = 11
HELDOUT_SEED = 12

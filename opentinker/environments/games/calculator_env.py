"""Math word problems with a calculator tool: a multi-turn tool-use env.

Each turn the model may

* call the calculator: ``<tool_call>calc(12 * 7 + 3)</tool_call>`` (the JSON form
  ``<tool_call>{"name": "calc", "arguments": {"expression": "12 * 7 + 3"}}</tool_call>`` is
  accepted too). The env answers ``<tool_response>87</tool_response>``, reward 0, not done;
  several calls in one message get one response each.
* answer, GSM8K style: ``#### 87``. Reward 1.0 when it equals the answer, else 0.0; done.
  A message with a final answer is graded even if it also contains tool calls.

Anything else gets a nudge (reward 0). After ``max_turns`` steps without a final answer the
episode ends with reward 0 and the answer revealed.

Expressions are never handed to ``eval``: :func:`safe_calc` parses them with :mod:`ast` and
walks the tree itself, allowing only numbers, ``+ - * / // % **`` (bounded exponent and
result size), unary signs and parentheses.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import re
from collections.abc import Callable
from fractions import Fraction

SYSTEM_PROMPT = (
    "Solve the math problem. You may use a calculator by writing "
    "<tool_call>calc(EXPRESSION)</tool_call>, e.g. <tool_call>calc(12 * 7 + 3)</tool_call>; "
    "the result comes back in <tool_response>...</tool_response>. "
    "When you know the answer, write it on its own line as '#### N'."
)
NUDGE = "Use the calculator with <tool_call>calc(EXPRESSION)</tool_call> or give your final answer as '#### N'."

MAX_EXPRESSION_CHARS = 200
MAX_EXPONENT = 100
MAX_RESULT_BITS = 512  # |result| < 2**512 (about 1e154)

_TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_CALC = re.compile(r"^\s*calc\s*\((.*)\)\s*$", re.DOTALL)
_FINAL = re.compile(r"####\s*(-?\s*[\d,]*\.?\d+)")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


class CalcError(ValueError):
    """An expression the calculator refuses or cannot evaluate."""


_BINARY: dict[type, Callable] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY: dict[type, Callable] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


def _check_size(value: int | float) -> int | float:
    if isinstance(value, float):
        if not math.isfinite(value):
            raise CalcError("result is not a finite number")
        if abs(value) >= 2.0**MAX_RESULT_BITS:
            raise CalcError("result too large")
    elif abs(value).bit_length() > MAX_RESULT_BITS:
        raise CalcError("result too large")
    return value


def _power(base: int | float, exponent: int | float) -> int | float:
    if abs(exponent) > MAX_EXPONENT:
        raise CalcError(f"exponent too large (limit {MAX_EXPONENT})")
    magnitude = abs(base)
    if magnitude > 1 and exponent > 0 and exponent * math.log2(magnitude) > MAX_RESULT_BITS:
        raise CalcError("result too large")
    if base == 0 and exponent < 0:
        raise CalcError("division by zero")
    result = base**exponent
    if isinstance(result, complex):
        raise CalcError("result is not a real number")
    return result


def _evaluate(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant):
        value = node.value
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise CalcError(f"unsupported constant {value!r}")
        return _check_size(value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _check_size(_UNARY[type(node.op)](_evaluate(node.operand)))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left = _evaluate(node.left)
        right = _evaluate(node.right)
        if isinstance(node.op, ast.Pow):
            return _check_size(_power(left, right))
        if isinstance(node.op, (ast.Div, ast.FloorDiv, ast.Mod)) and right == 0:
            raise CalcError("division by zero")
        return _check_size(_BINARY[type(node.op)](left, right))
    raise CalcError(f"unsupported expression element: {type(node).__name__}")


def safe_calc(expression: str) -> int | float:
    """Evaluate an arithmetic expression without eval; raises :class:`CalcError`."""
    if not isinstance(expression, str):
        raise CalcError("expression must be text")
    text = expression.strip()
    if not text:
        raise CalcError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise CalcError(f"expression too long (limit {MAX_EXPRESSION_CHARS} characters)")
    text = _THOUSANDS.sub("", text).replace("×", "*").replace("÷", "/").replace("^", "**")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise CalcError(f"could not parse expression: {getattr(exc, 'msg', exc)}") from None
    try:
        return _evaluate(tree)
    except CalcError:
        raise
    except (ArithmeticError, ValueError, TypeError, RecursionError) as exc:
        raise CalcError(f"could not evaluate: {exc}") from None


def format_number(value: int | float) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        return f"{value:.10g}"
    return str(value)


def _parse_number(text: str) -> Fraction | None:
    cleaned = text.replace(",", "").replace(" ", "").strip()
    try:
        return Fraction(cleaned)
    except (ValueError, ZeroDivisionError):
        return None


# --------------------------------------------------------------------------- problems


def _add(rng: random.Random) -> tuple[str, int]:
    name, a, b = rng.choice(["Tom", "Mia", "Ravi", "Lena"]), rng.randint(5, 90), rng.randint(5, 90)
    return f"{name} has {a} apples and buys {b} more. How many apples does {name} have now?", a + b


def _subtract(rng: random.Random) -> tuple[str, int]:
    a = rng.randint(30, 200)
    b = rng.randint(1, a - 1)
    return f"Sara had {a} stickers and gave {b} of them to her friend. How many stickers does Sara have left?", a - b


def _multiply(rng: random.Random) -> tuple[str, int]:
    a, b = rng.randint(6, 48), rng.randint(3, 25)
    return f"A box holds {a} pencils. How many pencils are there in {b} boxes?", a * b


def _divide(rng: random.Random) -> tuple[str, int]:
    children, each = rng.randint(2, 12), rng.randint(3, 30)
    return (
        f"{children * each} cookies are shared equally among {children} children. "
        "How many cookies does each child get?",
        each,
    )


def _two_step(rng: random.Random) -> tuple[str, int]:
    per_day, days, extra = rng.randint(12, 60), rng.randint(3, 14), rng.randint(5, 99)
    return (
        f"Ben reads {per_day} pages a day for {days} days, then reads {extra} more pages. "
        "How many pages has he read in total?",
        per_day * days + extra,
    )


def _three_factors(rng: random.Random) -> tuple[str, int]:
    boxes, eggs, days = rng.randint(3, 20), rng.choice([6, 10, 12, 18, 30]), rng.randint(2, 9)
    return (
        f"A farm packs {boxes} boxes of {eggs} eggs every day. How many eggs does it pack in {days} days?",
        boxes * eggs * days,
    )


def _change(rng: random.Random) -> tuple[str, int]:
    price, count = rng.randint(3, 25), rng.randint(2, 9)
    paid = (price * count // 50 + 1) * 50
    return (
        f"Ana buys {count} notebooks at {price} dollars each and pays with {paid} dollars. "
        "How much change does she get?",
        paid - price * count,
    )


TEMPLATES: tuple[Callable[[random.Random], tuple[str, int]], ...] = (
    _add,
    _subtract,
    _multiply,
    _divide,
    _two_step,
    _three_factors,
    _change,
)


def make_word_problem(seed: int) -> tuple[str, str]:
    """A reproducible ``(question, answer)`` pair for ``seed``."""
    rng = random.Random(seed)
    question, answer = rng.choice(TEMPLATES)(rng)
    return question, str(answer)


# --------------------------------------------------------------------------- the env


class CalculatorEnv:
    def __init__(self, max_turns: int = 5):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.max_turns = int(max_turns)
        self.question: str | None = None
        self.answer: str | None = None
        self.turns = 0
        self.tool_calls = 0
        self.done = False

    def reset(
        self, seed: int | None = None, question: str | None = None, answer: str | int | float | None = None
    ) -> dict:
        """``question`` + ``answer`` set the problem; else ``seed`` picks a templated one."""
        if (question is None) != (answer is None):
            raise ValueError("give both question and answer, or neither")
        if question is not None:
            if _parse_number(str(answer)) is None:
                raise ValueError(f"answer {answer!r} is not a number")
            self.question, self.answer = str(question), str(answer)
        else:
            self.question, self.answer = make_word_problem(seed if seed is not None else random.randrange(2**32))
        self.turns = 0
        self.tool_calls = 0
        self.done = False
        return {"observation": self.question, "system_prompt": SYSTEM_PROMPT, "info": {"max_turns": self.max_turns}}

    def _info(self, **extra) -> dict:
        return {"answer": self.answer, "turns": self.turns, "tool_calls": self.tool_calls, **extra}

    @staticmethod
    def _run_tool(call: str) -> str:
        content = call.strip()
        expression: str | None = None
        match = _CALC.match(content)
        if match:
            expression = match.group(1)
        elif content.startswith("{"):
            try:
                payload = json.loads(content)
            except json.JSONDecodeError:
                payload = None
            if isinstance(payload, dict) and payload.get("name") == "calc":
                arguments = payload.get("arguments")
                if isinstance(arguments, dict) and isinstance(arguments.get("expression"), str):
                    expression = arguments["expression"]
        if expression is None:
            return "Error: unknown tool call; use calc(EXPRESSION)"
        try:
            return format_number(safe_calc(expression))
        except CalcError as exc:
            return f"Error: {exc}"

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self.answer is None:
            raise RuntimeError("call reset() before step()")
        if self.done:
            return "The episode is over.", 0.0, True, self._info()
        action = action or ""
        self.turns += 1

        final = _FINAL.search(action)
        if final:
            self.done = True
            given = _parse_number(final.group(1))
            correct = given is not None and given == _parse_number(self.answer)
            observation = "Correct." if correct else f"Incorrect. The answer is {self.answer}."
            return observation, 1.0 if correct else 0.0, True, self._info(final_answer=final.group(1).strip())

        calls = _TOOL_CALL.findall(action)
        if calls:
            self.tool_calls += len(calls)
            observation = "\n".join(f"<tool_response>{self._run_tool(c)}</tool_response>" for c in calls)
        else:
            observation = NUDGE
        if self.turns >= self.max_turns:
            self.done = True
            return f"{observation}\nNo turns left. The answer was {self.answer}.", 0.0, True, self._info()
        return observation, 0.0, False, self._info()

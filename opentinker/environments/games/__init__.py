"""Environments shipped with OpenTinker, ready for :func:`opentinker.environments.server.serve_environment`.

Serve one with ``python -m opentinker.environments.games <name> [--port 8000] [--shards N]``.
Importing this package needs neither torch nor fastapi.
"""

from opentinker.environments.games.arithmetic_env import ArithmeticEnv
from opentinker.environments.games.calculator_env import CalculatorEnv
from opentinker.environments.games.digit_sum_env import DigitSumEnv
from opentinker.environments.games.guess_number import GuessNumberEnv
from opentinker.environments.games.word_problems_env import WordProblemsEnv

BUILTIN_ENVIRONMENTS: dict[str, type] = {
    "guess_number": GuessNumberEnv,
    "arithmetic": ArithmeticEnv,
    "calculator": CalculatorEnv,
    "word_problems": WordProblemsEnv,
    "digit_sum": DigitSumEnv,  # pictures: for a vision-language model
}

__all__ = ["ArithmeticEnv", "BUILTIN_ENVIRONMENTS", "CalculatorEnv", "DigitSumEnv", "GuessNumberEnv",
           "WordProblemsEnv"]

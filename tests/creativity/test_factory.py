"""``make_judge``, the protocol, and a light ``import opentinker.creativity``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from opentinker.creativity import JUDGE_KINDS, JudgeConfigError, StrategyJudge, make_judge


def test_kinds_and_unknown_kind():
    assert JUDGE_KINDS == ("openai", "hf", "lexical")
    with pytest.raises(ValueError, match=r"unknown strategy judge kind 'gpt'; valid kinds: 'openai', 'hf', 'lexical'"):
        make_judge("gpt")


def test_unknown_option_names_the_valid_ones():
    with pytest.raises(JudgeConfigError, match=r"unknown option\(s\) 'treshold' for the 'lexical' strategy judge; "
                                               r"valid options: threshold, math_weight"):
        make_judge("lexical", treshold=0.3)


def test_judges_follow_the_protocol():
    judge = make_judge(" Lexical ", threshold=0.3)
    assert isinstance(judge, StrategyJudge)
    assert judge.threshold == 0.3
    pytest.importorskip("openai")
    assert isinstance(make_judge("openai", api_key="k", base_url="http://127.0.0.1:9/v1"), StrategyJudge)


def test_import_is_light():
    code = (
        "import sys, json\n"
        "import opentinker.creativity as creativity\n"
        "assert creativity.make_judge and creativity.parse_judgement and creativity.JUDGE_KINDS\n"
        "print(json.dumps(sorted(m for m in ('openai', 'torch', 'transformers', 'numpy') if m in sys.modules)))\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []


def test_lexical_judge_works_without_torch(run_without_heavy_packages):
    result = run_without_heavy_packages(
        """
        from opentinker.creativity import make_judge
        print(make_judge("lexical").label_groups([("q", ["add the tens then the ones", "count up from a"])]))
        """
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[['s0', 's1']]"

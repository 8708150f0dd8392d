"""The local Hugging Face judge with the embedded tiny model (real generation, no stubs).

The tiny model only knows arithmetic, so left alone it never writes a valid grouping: that
exercises the fallback path. The constructed case steers the same model with transformers'
``prefix_allowed_tokens_fn`` (constrained decoding, passed through ``generate_kwargs``) to emit
a chosen JSON answer, which checks batching, left padding, decoding and parsing end to end.
"""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from opentinker.creativity import make_judge  # noqa: E402
from opentinker.creativity.hf_judge import HFStrategyJudge  # noqa: E402

ADDITION = ("What is 47 + 38?", ["Add the tens, then the ones: 70 + 15 = 85.", "Count up from 47 to 85.",
                                 "Round 38 to 40, then take 2 away: 85."])
DOUBLING = ("What is 6 + 6?", ["Double 6: 12.", "6 + 6 = 12."])


@pytest.fixture(autouse=True)
def one_torch_thread():
    # Decoding a 2M-parameter model is dominated by thread synchronisation on a busy 2-core
    # machine; one thread is ~50x faster there. Restored afterwards.
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    return model, tokenizer


def test_tiny_model_cannot_judge_so_every_group_falls_back(tiny):
    model, tokenizer = tiny
    model.train()  # as the policy model would be during training
    judge = make_judge("hf", model=model, tokenizer=tokenizer, max_new_tokens=16)
    labels = judge.label_groups([ADDITION, DOUBLING, ("What is 1 + 1?", ["2"])])
    assert labels == [None, None, ["s0"]]
    assert model.training  # put back in train mode after generating
    assert len(judge.last_raw_outputs) == 2  # one real answer per judged group
    metrics = judge.pop_metrics()
    assert metrics["judge/groups"] == 3
    assert metrics["judge/calls"] == 1  # both groups in one batched generate call
    assert metrics["judge/failures"] == 2 and metrics["judge/invalid_outputs"] == 2
    assert metrics["judge/fallback_groups"] == 2
    assert metrics["judge/skipped_groups"] == 1
    expected_prompt_tokens = sum(len(judge._encode(judge.build_prompt(q, r))) for q, r in (ADDITION, DOUBLING))
    assert metrics["judge/prompt_tokens"] == expected_prompt_tokens
    assert 2 <= metrics["judge/completion_tokens"] <= 2 * 16
    assert metrics["judge/latency_s_mean"] > 0


def test_prompt_too_long_for_the_model_is_not_run(tiny):
    model, tokenizer = tiny
    judge = HFStrategyJudge(model, tokenizer, max_new_tokens=16, max_prompt_tokens=50)
    assert judge.label_groups([ADDITION]) == [None]
    metrics = judge.pop_metrics()
    assert metrics["judge/prompt_too_long"] == 1 and metrics["judge/calls"] == 0
    assert metrics["judge/fallback_groups"] == 1
    # the default limit comes from the model's context length
    assert HFStrategyJudge(model, tokenizer, max_new_tokens=24).max_prompt_tokens == 1024 - 24


def test_prompt_building_and_parsing_with_steered_generation(tiny):
    model, tokenizer = tiny
    model.eval()
    first = ("What is 47 + 38?", ["Add the tens: 85.", "Count up: 85.", "Add the tens: 85.", "Add the tens:  85. "])
    second = ("What is 6 + 6?", ["Double 6: 12.", "6 + 6 = 12."])
    # the judge sees the distinct responses only: 2 in the first group, 2 in the second
    answers = [
        json.dumps({"groups": [{"strategy": "count up", "members": [2]}, {"strategy": "tens", "members": [1]}]}),
        json.dumps({"groups": [{"strategy": "doubling and adding", "members": [1, 2]}]}),
    ]
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    targets = [tokenizer(text, add_special_tokens=False)["input_ids"] + [eos] for text in answers]
    assert [tokenizer.decode(ids, skip_special_tokens=True) for ids in targets] == answers

    probe = HFStrategyJudge(model, tokenizer)
    distinct = [("What is 47 + 38?", ["Add the tens: 85.", "Count up: 85."]), second]
    prompt = probe.build_prompt(*distinct[0])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")
    assert "<problem>\nWhat is 47 + 38?\n</problem>" in prompt
    assert '<response number="1">\nAdd the tens: 85.\n</response>' in prompt
    assert '<response number="2">\nCount up: 85.\n</response>' in prompt
    width = max(len(probe._encode(probe.build_prompt(*group))) for group in distinct)

    def steer(batch_id, input_ids):
        step = input_ids.shape[-1] - width
        target = targets[batch_id]
        return [target[step]] if step < len(target) else [eos]

    judge = HFStrategyJudge(model, tokenizer, max_new_tokens=max(map(len, targets)) + 2,
                            generate_kwargs={"prefix_allowed_tokens_fn": steer})
    labels = judge.label_groups([first, second])
    assert judge.last_raw_outputs == answers
    assert labels == [["s0", "s1", "s0", "s0"], ["s0", "s0"]]
    metrics = judge.pop_metrics()
    assert metrics["judge/failures"] == 0 and metrics["judge/fallback_groups"] == 0 and metrics["judge/calls"] == 1
    assert metrics["judge/completion_tokens"] == sum(map(len, targets))


def test_loading_from_a_folder_and_configuration_errors(tiny_model_dir, tiny):
    judge = make_judge("hf", model=str(tiny_model_dir), max_new_tokens=4, device="cpu", cache=True)
    assert judge.label_groups([("q", ["same", "same"])]) == [["s0", "s0"]]
    assert judge.model_name == str(tiny_model_dir)
    model, _tokenizer = tiny
    with pytest.raises(ValueError, match="tokenizer"):
        HFStrategyJudge(model)
    with pytest.raises(ValueError, match="cannot load the judge model"):
        HFStrategyJudge(str(tiny_model_dir / "missing"))

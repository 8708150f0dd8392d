"""Serving requests with a rollout engine: text deltas as tokens are decoded (stop strings and
multi-byte characters handled), and the events ``stream_completions`` yields, on the tiny model."""

from __future__ import annotations

import pytest

from opentinker.engine.rollout.base import SamplingParams
from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine
from opentinker.engine.serving import IncrementalText, ServeRequest, stream_completions


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return TransformersRolloutEngine.from_pretrained(str(tiny_model_dir))


def feed(text: IncrementalText, ids: list[int]) -> list[str]:
    return [text.push(token) for token in ids]


def test_deltas_add_up_to_the_decoded_text(tiny_tokenizer):
    ids = tiny_tokenizer("Sam has 12 shells and 30 more.", add_special_tokens=False)["input_ids"]
    text = IncrementalText(tiny_tokenizer)
    pieces = feed(text, ids)
    assert "".join(pieces) + text.finish(ids) == tiny_tokenizer.decode(ids)
    assert sum(1 for p in pieces if p) > 1


def test_a_stop_string_ends_the_text_and_is_never_sent(tiny_tokenizer):
    ids = tiny_tokenizer("one two three four", add_special_tokens=False)["input_ids"]
    text = IncrementalText(tiny_tokenizer, stop=["three"])
    sent = "".join(feed(text, ids)) + text.finish(ids)
    assert sent == "one two " and text.text == "one two "
    # Held back while it could still become the stop string, then let go.
    text = IncrementalText(tiny_tokenizer, stop=["thirty"])
    sent = "".join(feed(text, ids)) + text.finish(ids)
    assert sent == "one two three four"


def test_a_character_split_across_tokens_waits_for_its_last_byte(tiny_tokenizer):
    ids = tiny_tokenizer("a é b", add_special_tokens=False)["input_ids"]
    text = IncrementalText(tiny_tokenizer)
    pieces = feed(text, ids)
    assert not any("\ufffd" in p for p in pieces)
    assert "".join(pieces) + text.finish(ids) == "a é b"


def test_stream_completions_events_match_the_engines_completions(engine, tiny_tokenizer):
    request = ServeRequest(messages=({"role": "user", "content": "What is 2 + 2?"},), max_tokens=20,
                           temperature=1.0, n=2, seed=4)
    events = list(stream_completions(engine, tiny_tokenizer, request))
    texts = ["".join(e["text"] for e in events if e.get("index") == i and "text" in e) for i in range(2)]
    from opentinker.engine.data import chat_prompt_ids

    prompt = chat_prompt_ids(tiny_tokenizer, [{"role": "user", "content": "What is 2 + 2?"}])
    expected = engine.generate([prompt] * 2, [SamplingParams(max_tokens=20, seed=4 + i) for i in range(2)])
    assert texts == [tiny_tokenizer.decode(c.token_ids, skip_special_tokens=True) for c in expected]
    assert [e["finish_reason"] for e in events if "finish_reason" in e] == [c.finish_reason for c in expected]
    assert events[-1] == {"usage": {"prompt_tokens": len(prompt),
                                    "completion_tokens": sum(len(c.token_ids) for c in expected),
                                    "total_tokens": len(prompt) + sum(len(c.token_ids) for c in expected)}}


def test_a_prompt_past_the_context_is_refused_before_generating(engine, tiny_tokenizer):
    limit = engine.model.config.max_position_embeddings
    with pytest.raises(ValueError, match="context"):
        next(stream_completions(engine, tiny_tokenizer, ServeRequest(prompt="1 " * limit, max_tokens=8)))


def test_on_tokens_reports_every_token_in_order(engine, tiny_tokenizer):
    seen: dict[int, list[int]] = {0: [], 1: []}

    def record(rows, tokens):
        for row, token in zip(rows, tokens):
            seen[row].append(token)

    prompts = [tiny_tokenizer("3 + 4 =")["input_ids"], tiny_tokenizer("10 - 2 =")["input_ids"]]
    completions = engine.generate(prompts, SamplingParams(max_tokens=12, seed=1), on_tokens=record)
    assert [seen[0], seen[1]] == [c.token_ids for c in completions]

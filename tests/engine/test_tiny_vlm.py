"""The embedded tiny VLM: the shipped folder loads as a plain Hugging Face Qwen2-VL, reads the
picture (its answers follow the digits drawn, not the question), scores what its report says,
and a build repeats itself byte for byte."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace

import pytest

torch = pytest.importorskip("torch")

from transformers import AutoModelForImageTextToText, AutoTokenizer  # noqa: E402

from opentinker.engine.vision import IMAGE_PAD, ImageProcessor, VisionLayout  # noqa: E402
from opentinker.environments import digit_sum  # noqa: E402
from opentinker.tiny_vlm import DEFAULT_RECIPE, SHIPPED_DIR, ensure_tiny_vlm, read_tiny_vlm_report  # noqa: E402
from opentinker.tiny_vlm.build import build_tiny_vlm, digit_sum_accuracy  # noqa: E402
from opentinker.tiny_vlm.forward import answer_greedily, encode_chat  # noqa: E402


@pytest.fixture(scope="module")
def vlm():
    folder = str(ensure_tiny_vlm())
    model = AutoModelForImageTextToText.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder), ImageProcessor(folder), VisionLayout.of(model.config)


def test_the_shipped_folder_is_a_plain_qwen2_vl_with_vision_tokens(vlm):
    model, tokenizer, processor, layout = vlm
    assert ensure_tiny_vlm() == SHIPPED_DIR and type(model).__name__ == "Qwen2VLForConditionalGeneration"
    assert layout.image_token_id == tokenizer.convert_tokens_to_ids(IMAGE_PAD) and layout.merge == 2
    pixel_values, grids = processor([digit_sum.DigitSumProblem(3, 4, 0).image()])
    assert grids == [(1, 4, 8)] and layout.tokens_of(grids[0]) == 8  # 56 x 112 pixels: 8 image tokens
    text = tokenizer.apply_chat_template(digit_sum.DigitSumProblem(3, 4, 0).messages(), tokenize=False,
                                         add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>What is the sum" in text


def test_the_answers_follow_the_picture(vlm):
    """Right pictures: about the report's accuracy. The same questions with each picture swapped
    for another problem's: the answers follow the picture shown, so they score near chance
    against the asked problem's sum and well against the shown one's."""
    model, tokenizer, processor, layout = vlm
    problems = digit_sum.make_problems(60, digit_sum.HELDOUT_SEED, "heldout")
    shown = problems[1:] + problems[:1]
    pixel_values, grids = processor([p.image() for p in shown])
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": digit_sum.QUESTION}]}]
    prompts = [encode_chat(tokenizer, layout, chat, None, [g]) for g in grids]
    answers = answer_greedily(model, tokenizer, prompts, pixel_values=pixel_values, grids=grids)
    asked = sum(digit_sum.score(a, p.answer) for a, p in zip(answers, problems)) / len(problems)
    seen = sum(digit_sum.score(a, p.answer) for a, p in zip(answers, shown)) / len(problems)
    assert seen >= 0.3 and asked <= 0.2 and seen > asked + 0.2, (seen, asked)


def test_shipped_model_scores_what_its_report_says(vlm):
    model, tokenizer, processor, layout = vlm
    report = read_tiny_vlm_report(SHIPPED_DIR)
    assert report["vision_reading_accuracy"] >= 0.9
    assert 0.3 <= report["heldout_greedy_accuracy"] <= 0.8  # some skill, and room for RL
    heldout = digit_sum.make_problems(report["heldout_problems"], digit_sum.HELDOUT_SEED, "heldout")
    assert digit_sum_accuracy(model, tokenizer, processor, layout, heldout) == pytest.approx(
        report["heldout_greedy_accuracy"], abs=0.03)


def test_a_build_repeats_itself_byte_for_byte(tmp_path):
    recipe = replace(DEFAULT_RECIPE, align_steps=6, stop_check_every=1000, batch_size=8, eval_problems=8)
    for name in ("a", "b"):
        build_tiny_vlm(tmp_path / name, sft_steps=3, progress=False, recipe=recipe)
    for file in ("model.safetensors", "tokenizer.json", "config.json", "preprocessor_config.json"):
        digest = {hashlib.sha256((tmp_path / n / file).read_bytes()).hexdigest() for n in ("a", "b")}
        assert len(digest) == 1, file
    report = json.loads((tmp_path / "a" / "opentinker_tiny_vlm.json").read_text())
    assert report["sft_steps"] == 3 and report["recipe"]["align_steps"] == 6

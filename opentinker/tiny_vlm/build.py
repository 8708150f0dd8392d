"""The builder: the tiny text model's tokenizer and language model with a new Qwen2-VL vision
tower, SFT-warmed on pictures of digits, evaluated and saved as a Hugging Face folder."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch.nn.functional as F

from opentinker.engine.vision import IMAGE_PAD, VISION_END, VISION_START, ImageProcessor, VisionLayout
from opentinker.environments import arithmetic, digit_sum
from opentinker.tiny.build import _save_model
from opentinker.tiny.recipe import ENDOFTEXT
from opentinker.tiny.tokenizer import _deterministic_torch
from opentinker.tiny_vlm.forward import answer_greedily, encode_chat, masked_lm_loss, pad_rows
from opentinker.tiny_vlm.recipe import (
    CHAT_TEMPLATE, DEFAULT_RECIPE, REPORT_FILE, TINY_VLM_NAME, TINY_VLM_VERSION, VIDEO_PAD, TinyVlmRecipe,
)

READ_QUESTION = "What are the two digits in the picture?"


def build_tiny_vlm(out_dir: str | os.PathLike, *, sft_steps: int | None = None, seed: int = 0,
                   progress: bool = True, recipe: TinyVlmRecipe = DEFAULT_RECIPE) -> dict[str, Any]:
    """Build the tiny VLM (SFT-warmed for at most ``sft_steps``, default the recipe's; 0: the
    vision tower untrained) into ``out_dir``; returns the report also written there. Same
    arguments on the same machine give byte-identical weights."""
    import torch

    started = time.perf_counter()
    recipe = replace(recipe, sft_steps=recipe.sft_steps if sft_steps is None else int(sft_steps))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def say(message: str) -> None:
        if progress:
            print(f"[opentinker.tiny_vlm] {message}", file=sys.stderr, flush=True)

    with _deterministic_torch(recipe.threads, seed):
        tokenizer = _tokenizer()
        model = _model(tokenizer, recipe)
        processor = _image_processor(recipe, out)
        layout = VisionLayout.of(model.config)
        n_params = sum(p.numel() for p in model.parameters())
        say(f"model: Qwen2-VL, {n_params:,} parameters ({sum(p.numel() for p in model.model.visual.parameters()):,} "
            f"in the vision tower), vocab {len(tokenizer)}; language model from the tiny text model")
        sft_steps_run, validation, losses, reading = 0, None, [], None
        sft_started = time.perf_counter()
        if recipe.sft_steps > 0:
            say(f"vision warm-up: {recipe.align_steps} steps teaching the vision tower to read each digit as "
                "the language model's own digit token")
            reading = _align_vision(model, tokenizer, processor, recipe, progress)
            say(f"SFT: at most {recipe.sft_steps} steps of {recipe.batch_size} pictures, until validation "
                f"accuracy reaches {recipe.stop_at_accuracy:.0%}")
            sft_steps_run, validation, losses = _sft(model, tokenizer, processor, layout, recipe, seed, progress)
        sft_seconds = time.perf_counter() - sft_started
        model.eval()
        heldout = digit_sum.make_problems(recipe.eval_problems, digit_sum.HELDOUT_SEED, "heldout")
        say(f"evaluating on {len(heldout)} held-out pictures")
        greedy = digit_sum_accuracy(model, tokenizer, processor, layout, heldout)
        text = arithmetic_accuracy(model, tokenizer, layout,
                                   arithmetic.make_problems(recipe.eval_problems, arithmetic.HELDOUT_SEED, "heldout"))
        _save(model, tokenizer, out)

    report = {
        "name": TINY_VLM_NAME, "version": TINY_VLM_VERSION, "warm": sft_steps_run > 0, "seed": seed,
        "recipe": asdict(recipe), "num_parameters": n_params, "vocab_size": len(tokenizer),
        "vision_reading_accuracy": reading, "sft_steps": sft_steps_run, "sft_validation_accuracy": validation,
        "sft_final_loss": (sum(losses[-20:]) / len(losses[-20:])) if losses else None,
        "heldout_problems": len(heldout), "heldout_greedy_accuracy": greedy,
        "heldout_text_arithmetic_accuracy": text,
        "sft_seconds": round(sft_seconds, 2), "build_seconds": round(time.perf_counter() - started, 2),
        "built_at": time.time(), "build_id": os.urandom(8).hex(), "torch_version": torch.__version__,
    }
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    say(f"held-out accuracy: digit sums {greedy:.3f}, text arithmetic {text:.3f}; built in {report['build_seconds']:.1f}s")
    return report


def _tokenizer():
    """The tiny text model's tokenizer with Qwen2-VL's vision tokens and a chat template that
    renders image parts."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer

    from opentinker.tiny import SHIPPED_DIR

    tokenizer = AutoTokenizer.from_pretrained(SHIPPED_DIR)
    tokenizer.add_tokens([AddedToken(token, special=True, normalized=False)
                          for token in (VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD)], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _model(tokenizer, recipe: TinyVlmRecipe):
    """Qwen2-VL whose language model is the shipped tiny text model (the four new tokens'
    embeddings start at the mean of the others) and whose vision tower is freshly initialised."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from opentinker.tiny import SHIPPED_DIR

    text = AutoModelForCausalLM.from_pretrained(SHIPPED_DIR, dtype=torch.float32)
    ids = tokenizer.convert_tokens_to_ids
    text_config = text.config.to_dict()
    text_config.update(vocab_size=len(tokenizer), rope_parameters={
        "rope_type": "default", "rope_theta": text.config.rope_parameters["rope_theta"],
        "mrope_section": list(recipe.mrope_section)})
    config = Qwen2VLConfig(
        text_config=text_config,
        vision_config={"depth": recipe.vision_depth, "embed_dim": recipe.vision_embed_dim,
                       "num_heads": recipe.vision_heads, "mlp_ratio": recipe.vision_mlp_ratio,
                       "hidden_size": text.config.hidden_size, "patch_size": recipe.patch_size,
                       "spatial_merge_size": recipe.merge_size, "temporal_patch_size": recipe.temporal_patch_size,
                       "in_channels": 3},
        image_token_id=ids(IMAGE_PAD), video_token_id=ids(VIDEO_PAD), vision_start_token_id=ids(VISION_START),
        vision_end_token_id=ids(VISION_END), tie_word_embeddings=True)
    model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    state = text.model.state_dict()
    old = state["embed_tokens.weight"]
    state["embed_tokens.weight"] = torch.cat([old, old.mean(0, keepdim=True).expand(len(tokenizer) - len(old), -1)])
    model.model.language_model.load_state_dict(state)
    model.tie_weights()
    return model


def _image_processor(recipe: TinyVlmRecipe, out: Path) -> ImageProcessor:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    Qwen2VLImageProcessorPil(min_pixels=recipe.min_pixels, max_pixels=recipe.max_pixels,
                             patch_size=recipe.patch_size, merge_size=recipe.merge_size,
                             temporal_patch_size=recipe.temporal_patch_size).save_pretrained(out)
    return ImageProcessor(str(out))


def _optimizer_step(optimizer, loss, module, recipe: TinyVlmRecipe, step: int) -> None:
    """One AdamW step on ``loss`` at the warm-up's learning rate, gradients clipped to norm 1."""
    import torch

    for group in optimizer.param_groups:
        group["lr"] = recipe.learning_rate * min(1.0, (step + 1) / recipe.warmup_steps)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
    optimizer.step()


def _align_vision(model, tokenizer, processor: ImageProcessor, recipe: TinyVlmRecipe, progress: bool) -> float:
    """Teach the vision tower to read: each merged token of a picture's left half is pulled to
    the language model's input embedding of the left digit's token, and likewise on the right,
    so a picture reaches the language model as the digits it already adds. Without this the
    language model, trained on text alone, never looks at the image tokens and SFT learns
    nothing (measured: loss flat at chance for 500 steps). Returns the last batch's accuracy
    (each half's tokens closest to the right digit's embedding)."""
    import torch
    from tqdm.auto import tqdm

    from opentinker.tiny.sft import _adamw

    digits = model.model.language_model.embed_tokens.weight[
        torch.tensor([tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)])].detach()
    visual = model.model.visual
    optimizer = _adamw(visual, recipe)
    pictures = digit_sum.make_problems(recipe.align_steps * recipe.batch_size, digit_sum.SFT_SEED + 100, "train")
    accuracy = 0.0
    bar = tqdm(range(recipe.align_steps), desc="tiny VLM vision", disable=not progress, file=sys.stderr,
               mininterval=2.0)
    for step in bar:
        batch = pictures[step * recipe.batch_size:(step + 1) * recipe.batch_size]
        pixel_values, grids = processor([p.image() for p in batch])
        if any(grid != (1, 4, 8) for grid in grids):
            raise ValueError(f"the vision warm-up expects 56 x 112 pictures (grid 1 x 4 x 8), got {grids[0]}")
        tokens = visual(pixel_values, grid_thw=torch.tensor(grids), return_dict=True).pooler_output
        # Merged tokens come row by row over a 2 x 4 grid: columns 0-1 are the left half.
        halves = tokens.view(len(batch), 2, 2, 2, -1)  # [picture, row, half, column in half, hidden]
        target = digits[torch.tensor([[p.a, p.b] for p in batch])][:, None, :, None, :].expand_as(halves)
        loss = F.mse_loss(halves, target) / digits.pow(2).mean()
        _optimizer_step(optimizer, loss, visual, recipe, step)
        with torch.no_grad():
            read = torch.cdist(halves.mean(dim=(1, 3)), digits).argmin(-1)
            accuracy = (read == torch.tensor([[p.a, p.b] for p in batch])).float().mean().item()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}", read=f"{accuracy:.2f}")
    bar.close()
    return accuracy


def _sft(model, tokenizer, processor: ImageProcessor, layout: VisionLayout, recipe: TinyVlmRecipe, seed: int,
         progress: bool):
    """AdamW on pictures of digits (loss on the answer and <|im_end|>), half asked for the sum and
    half for the digits, with a text-arithmetic batch every ``arithmetic_every`` steps; stops
    once validation accuracy reaches the recipe's."""
    from tqdm.auto import tqdm

    from opentinker.tiny.sft import _adamw

    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    rng = random.Random(seed)
    pictures = digit_sum.make_problems(recipe.sft_steps * recipe.batch_size, digit_sum.SFT_SEED, "train")
    sums = arithmetic.make_problems(recipe.sft_steps * recipe.batch_size // max(1, recipe.arithmetic_every) + 1,
                                    arithmetic.SFT_SEED, "train")
    validation = digit_sum.make_problems(recipe.stop_check_problems, digit_sum.VALIDATION_SEED, "train")
    optimizer = _adamw(model, recipe)
    losses: list[float] = []
    accuracy = None
    model.train()
    bar = tqdm(range(recipe.sft_steps), desc="tiny VLM SFT", disable=not progress, file=sys.stderr, mininterval=2.0)
    for step in bar:
        batch = pictures[step * recipe.batch_size:(step + 1) * recipe.batch_size]
        rows = []
        for problem in batch:
            read = rng.random() < 0.5
            question = READ_QUESTION if read else digit_sum.QUESTION
            answer = f"{problem.a} and {problem.b}" if read else problem.answer
            rows.append((_picture_chat(question), answer))
        pixel_values, grids = processor([p.image() for p in batch])
        loss = masked_lm_loss(model, *pad_rows([encode_chat(tokenizer, layout, m, a, [g])
                                                 for (m, a), g in zip(rows, grids)], pad_id),
                              pixel_values=pixel_values, grids=grids)
        total = loss
        if recipe.arithmetic_every and step % recipe.arithmetic_every == 0:
            chunk = sums[(step // recipe.arithmetic_every) * recipe.batch_size:][:recipe.batch_size]
            text_rows = [encode_chat(tokenizer, layout, p.messages(), p.answer, []) for p in chunk]
            total = total + 0.5 * masked_lm_loss(model, *pad_rows(text_rows, pad_id))
        _optimizer_step(optimizer, total, model, recipe, step)
        losses.append(loss.item())
        if (step + 1) % recipe.stop_check_every == 0:
            accuracy = digit_sum_accuracy(model, tokenizer, processor, layout, validation)
            model.train()
            bar.set_postfix(loss=f"{sum(losses[-10:]) / len(losses[-10:]):.3f}", val_acc=f"{accuracy:.2f}")
            if accuracy >= recipe.stop_at_accuracy:
                break
    bar.close()
    model.eval()
    return len(losses), accuracy, losses


def digit_sum_accuracy(model, tokenizer, processor: ImageProcessor, layout: VisionLayout,
                       problems: Sequence[digit_sum.DigitSumProblem], batch_size: int = 100) -> float:
    """Fraction of ``problems`` whose greedy answer's first integer is the sum."""
    right = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        pixel_values, grids = processor([p.image() for p in chunk])
        prompts = [encode_chat(tokenizer, layout, _picture_chat(digit_sum.QUESTION), None, [g]) for g in grids]
        answers = answer_greedily(model, tokenizer, prompts, pixel_values=pixel_values, grids=grids)
        right += sum(digit_sum.score(text, p.answer) for text, p in zip(answers, chunk))
    return right / max(1, len(problems))


def arithmetic_accuracy(model, tokenizer, layout: VisionLayout, problems: Sequence[arithmetic.ArithmeticProblem],
                        batch_size: int = 100) -> float:
    """The text task's greedy accuracy: what the language model kept of adding."""
    right = 0.0
    for start in range(0, len(problems), batch_size):
        chunk = problems[start:start + batch_size]
        prompts = [encode_chat(tokenizer, layout, p.messages(), None, []) for p in chunk]
        answers = answer_greedily(model, tokenizer, prompts, max_new_tokens=5)
        right += sum(arithmetic.score_answer(text, p.answer) for text, p in zip(answers, chunk))
    return right / max(1, len(problems))


def _picture_chat(question: str) -> list[dict]:
    """One user turn: a picture (the pixels go beside the tokens), then ``question``."""
    return [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]


def _save(model, tokenizer, out: Path) -> None:
    """As the tiny text model is saved (a generation config that samples at temperature 1); the
    special tokens' ids live in the text config."""
    _save_model(model, model.config.get_text_config(), out)
    tokenizer.save_pretrained(out)

"""The builder: tokenizer, model, SFT warm-up and evaluation into a Hugging Face folder."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from opentinker.environments.arithmetic import HELDOUT_SEED, make_problems
from opentinker.tiny.recipe import DEFAULT_RECIPE, REPORT_FILE, TINY_MODEL_NAME, TINY_MODEL_VERSION, TinyRecipe
from opentinker.tiny.sft import _sft, _SftResult, evaluate_arithmetic
from opentinker.tiny.tokenizer import (
    _deterministic_torch, _quiet_transformers_progress, _save_and_reload_tokenizer, build_tokenizer, make_config,
)

def build_tiny_model(
    out_dir: str | os.PathLike,
    *,
    sft_steps: int | None = None,
    seed: int = 0,
    progress: bool = True,
    recipe: TinyRecipe = DEFAULT_RECIPE,
) -> dict[str, Any]:
    """Build tokenizer + model (+ SFT warm-up for ``sft_steps``, default the recipe's) into ``out_dir``.

    Returns the report that is also written to ``out_dir/opentinker_tiny.json``. ``sft_steps=0``
    gives the random-init base model. Same arguments on the same machine give byte-identical
    ``model.safetensors`` and tokenizer files.
    """
    import torch
    from transformers import Qwen2ForCausalLM

    started = time.perf_counter()
    steps = recipe.sft_steps if sft_steps is None else int(sft_steps)
    recipe = replace(recipe, sft_steps=steps)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    def say(message: str) -> None:
        if progress:
            print(f"[opentinker.tiny] {message}", file=sys.stderr, flush=True)

    with _deterministic_torch(recipe.threads, seed):
        say("training the byte-level BPE tokenizer on the synthetic corpus")
        trained = build_tokenizer(recipe.vocab_size)
        config = make_config(trained, recipe)
        tokenizer = _save_and_reload_tokenizer(trained, config, out)
        model = Qwen2ForCausalLM(config).to(torch.float32)
        n_params = sum(p.numel() for p in model.parameters())
        say(f"model: Qwen2, {n_params:,} parameters, vocab {len(tokenizer)}")

        sft = _SftResult([], 0, None)
        sft_seconds = 0.0
        if steps > 0:
            say(f"SFT warm-up: at most {steps} steps of {recipe.batch_size} arithmetic chats, until "
                f"validation accuracy reaches {recipe.stop_at_accuracy:.0%}")
            sft_started = time.perf_counter()
            sft = _sft(model, tokenizer, recipe, steps, seed, progress)
            sft_seconds = time.perf_counter() - sft_started
        model.eval()

        heldout = make_problems(recipe.eval_problems, HELDOUT_SEED, "heldout")
        say(f"evaluating on {len(heldout)} held-out problems")
        greedy = evaluate_arithmetic(model, tokenizer, heldout, temperature=0.0)
        sampled = evaluate_arithmetic(model, tokenizer, heldout, temperature=1.0, seed=seed)

        _save_model(model, config, out)

    report = _report(seed, recipe, n_params, len(tokenizer), sft, heldout, greedy, sampled, sft_seconds,
                     time.perf_counter() - started)
    (out / REPORT_FILE).write_text(json.dumps(report, indent=2, sort_keys=True) + "\n")
    say(f"held-out accuracy: greedy {greedy:.3f}, sampled (T=1) {sampled:.3f}; "
        f"built in {report['build_seconds']:.1f}s")
    return report


def _save_model(model, config, out: Path) -> None:
    """The weights, with a generation config that samples at temperature 1 (RL's default)."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=64,
    )
    with _quiet_transformers_progress():  # a one-shard "Writing model shards" bar is noise
        model.save_pretrained(out)


def _report(seed: int, recipe: TinyRecipe, n_params: int, vocab_size: int, sft: _SftResult, heldout: list,
            greedy: float, sampled: float, sft_seconds: float, build_seconds: float) -> dict[str, Any]:
    """What the build was and what it measured (``opentinker_tiny.json``)."""
    import torch

    losses = sft.losses
    report = {
        "name": TINY_MODEL_NAME,
        "version": TINY_MODEL_VERSION,
        "warm": sft.steps_run > 0,
        "seed": seed,
        "recipe": asdict(recipe),
        "num_parameters": n_params,
        "vocab_size": vocab_size,
        "sft_max_steps": recipe.sft_steps,
        "sft_steps": sft.steps_run,
        "sft_validation_accuracy": sft.validation_accuracy,
        "sft_final_loss": (sum(losses[-20:]) / len(losses[-20:])) if losses else None,
        "heldout_problems": len(heldout),
        "heldout_greedy_accuracy": greedy,
        "heldout_sampled_accuracy": sampled,
        "sft_seconds": round(sft_seconds, 2),
        "build_seconds": round(build_seconds, 2),
        "built_at": time.time(),
        "build_id": os.urandom(8).hex(),  # differs on every build: evidence of (no) rebuild
        "torch_version": torch.__version__,
    }
    return report

"""The SFT warm-up on arithmetic chats (with a little English) and the arithmetic evaluation."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from opentinker.environments.arithmetic import SFT_SEED, ArithmeticProblem, make_problems, score_answer
from opentinker.tiny.corpus import english_chats, render_chat
from opentinker.tiny.recipe import ENDOFTEXT, IM_END, VALIDATION_SEED, TinyRecipe

def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _prompt_text(tokenizer, messages: Sequence[dict[str, str]]) -> str:
    """The chat rendered by the tokenizer's own template, ready for the assistant to answer."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return render_chat(messages, add_generation_prompt=True)


class _ArithmeticEncoder:
    """Token ids of prompt and answer, memoized per problem (there are only 10,000)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_id = tokenizer.convert_tokens_to_ids(IM_END)
        self._cache: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def __call__(self, problem: ArithmeticProblem) -> tuple[list[int], list[int]]:
        key = (problem.a, problem.b)
        if key not in self._cache:
            prompt = _encode(self.tokenizer, _prompt_text(self.tokenizer, problem.messages()))
            answer = _encode(self.tokenizer, problem.answer) + [self.eos_id]
            self._cache[key] = (prompt, answer)
        return self._cache[key]


def _pad_batch(rows: list[tuple[list[int], list[int]]], pad_id: int):
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 where no loss)."""
    import torch

    length = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    labels = torch.full((len(rows), length), -100, dtype=torch.long)
    for i, (ids, loss_mask) in enumerate(rows):
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.tensor([t if m else -100 for t, m in zip(ids, loss_mask)])
    return input_ids, attention_mask, labels


def _masked_lm_loss(model, input_ids, attention_mask, labels):
    """Next-token cross-entropy where ``labels`` != -100, with the LM head applied only there.

    Same value as ``model(..., labels=labels).loss``; an arithmetic chat has ~4 loss positions out
    of ~22, so skipping the rest of the (vocab-sized) head saves a good part of the step.
    """
    import torch.nn.functional as F

    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    targets = labels[:, 1:]
    keep = targets != -100
    logits = model.get_output_embeddings()(hidden[:, :-1][keep])
    return F.cross_entropy(logits.float(), targets[keep])


def _sft_streams(tokenizer, recipe: TinyRecipe, steps: int, seed: int):
    """The arithmetic problems and the English chats (token ids) of ``steps`` steps. Both are
    prefix-stable: the first N steps see the same data whatever ``steps`` is."""
    problems = make_problems(steps * recipe.batch_size, SFT_SEED, "train")
    n_english = (steps // recipe.english_every + 1) * recipe.english_batch_size
    english = [
        _encode(tokenizer, tokenizer.apply_chat_template(chat, tokenize=False))
        for chat in english_chats(n_english, seed)
    ]
    return problems, [ids[: recipe.max_position_embeddings] for ids in english]


def _adamw(model, recipe: TinyRecipe):
    """AdamW with weight decay on matrices only."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.learning_rate,
        betas=(0.9, 0.98),
        eps=1e-8,
    )


def _step_loss(model, arithmetic: list[tuple[list[int], list[int]]], english: list[list[int]], pad_id: int):
    """The arithmetic loss (answer + <|im_end|> of each (prompt, answer)) and the total with half
    the English chats' LM loss, when there are any."""
    rows = [(prompt + answer, [False] * len(prompt) + [True] * len(answer)) for prompt, answer in arithmetic]
    loss = _masked_lm_loss(model, *_pad_batch(rows, pad_id))
    if not english:
        return loss, loss
    lm_loss = _masked_lm_loss(model, *_pad_batch([(ids, [True] * len(ids)) for ids in english], pad_id))
    return loss, loss + 0.5 * lm_loss


@dataclass
class _SftResult:
    losses: list[float]
    steps_run: int
    validation_accuracy: float | None  # at the last check; None when never checked


def _sft(
    model, tokenizer, recipe: TinyRecipe, steps: int, seed: int, progress: bool, on_step=None
) -> _SftResult:
    """AdamW on arithmetic chats (loss on answer + <|im_end|>) plus a little English LM loss.

    Runs ``steps`` steps at most and stops early once validation accuracy reaches
    ``recipe.stop_at_accuracy`` (see :class:`TinyRecipe`).
    """
    import torch
    from tqdm.auto import tqdm

    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    problems, english = _sft_streams(tokenizer, recipe, steps, seed)
    optimizer = _adamw(model, recipe)
    encode_problem = _ArithmeticEncoder(tokenizer)

    def lr_at(step: int) -> float:  # linear warm-up, then constant (training stops early)
        return recipe.learning_rate * min(1.0, (step + 1) / recipe.warmup_steps)

    validation = make_problems(recipe.stop_check_problems, VALIDATION_SEED, "train")
    validation_accuracy: float | None = None

    model.train()
    losses: list[float] = []
    bar = tqdm(range(steps), desc="tiny SFT", disable=not progress, file=sys.stderr, mininterval=2.0)
    english_cursor = 0
    for step in bar:
        arithmetic = problems[step * recipe.batch_size : (step + 1) * recipe.batch_size]
        english_batch = []
        if recipe.english_every and step % recipe.english_every == 0:
            english_batch = english[english_cursor : english_cursor + recipe.english_batch_size]
            english_cursor += recipe.english_batch_size
        loss, total = _step_loss(model, [encode_problem(p) for p in arithmetic], english_batch, pad_id)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step)
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, model)
        running_loss = sum(losses[-10:]) / len(losses[-10:])
        if (step + 1) % recipe.stop_check_every == 0 and running_loss < recipe.stop_check_below_loss:
            validation_accuracy = evaluate_arithmetic(model, tokenizer, validation, max_new_tokens=5)
            model.train()
            if validation_accuracy >= recipe.stop_at_accuracy:
                bar.set_postfix(loss=f"{running_loss:.3f}", val_acc=f"{validation_accuracy:.2f}")
                break
        if step % 10 == 0:
            postfix = {"loss": f"{running_loss:.3f}"}
            if validation_accuracy is not None:
                postfix["val_acc"] = f"{validation_accuracy:.2f}"
            bar.set_postfix(postfix)
    bar.close()
    model.eval()
    return _SftResult(losses, len(losses), validation_accuracy)


# --------------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------------


def evaluate_arithmetic(
    model,
    tokenizer,
    problems: Sequence[ArithmeticProblem],
    temperature: float = 0.0,
    seed: int = 0,
    *,
    batch_size: int = 128,
    max_new_tokens: int = 8,
) -> float:
    """Fraction of ``problems`` answered right by ``model.generate`` (greedy when temperature is 0).

    Prompts are the chat template with the generation prompt, left-padded in batches; a response
    is scored by :func:`score_answer` (first integer of the decoded text).
    """
    import torch

    if not problems:
        return 0.0
    eos_id = tokenizer.eos_token_id
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_id
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    correct = 0.0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        torch.manual_seed(seed)
        for start in range(0, len(problems), batch_size):
            chunk = problems[start : start + batch_size]
            prompts = [_encode(tokenizer, _prompt_text(tokenizer, p.messages())) for p in chunk]
            width = max(len(p) for p in prompts)
            input_ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
            attention_mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for i, ids in enumerate(prompts):
                input_ids[i, width - len(ids) :] = torch.tensor(ids)
                attention_mask[i, width - len(ids) :] = 1
            sampling: dict[str, Any] = (
                {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
                if temperature > 0
                else {"do_sample": False}
            )
            output = model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                max_new_tokens=max_new_tokens,
                pad_token_id=pad_id,
                eos_token_id=eos_id,
                **sampling,
            )
            for problem, row in zip(chunk, output[:, width:].tolist()):
                text = tokenizer.decode(row, skip_special_tokens=True)
                correct += score_answer(text, problem.answer)
    model.train(was_training)
    return correct / len(problems)

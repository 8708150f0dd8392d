"""Prompts for training: dataset rows -> chat-templated token ids, served in shuffled batches."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from opentinker.engine.vision import VisionPromptEncoder
from opentinker.environments import arithmetic, digit_sum, word_problems
from opentinker.images import message_images

RewardFn = Callable[[str, dict[str, Any]], float]
"""``reward_fn(response_text, row) -> float``: scores one response to a dataset row."""


@dataclass(frozen=True)
class Prompt:
    """One dataset row, tokenized once. ``uid`` groups the n samples drawn for it.

    A row with pictures (a vision-language model's) has ``pictures``: its ``prompt_ids`` hold
    each picture's tokens, and :func:`with_pictures` gives the prompt its pixels when it is
    drawn (kept only while a step uses it: pixels take far more memory than the encoded files).
    """

    uid: str
    prompt_ids: list[int]
    row: dict[str, Any]
    pictures: bool = False


def render_chat_ids(
    tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]], add_generation_prompt: bool
) -> list[int]:
    """Token ids of ``messages`` rendered with the tokenizer's chat template."""
    ids = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt, tokenize=True)
    if hasattr(ids, "keys"):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return list(ids)


def chat_prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: Sequence[dict[str, str]]) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template plus the assistant prompt."""
    return render_chat_ids(tokenizer, messages, add_generation_prompt=True)


def tokenize_rows(
    rows: Sequence[dict[str, Any]],
    tokenizer: PreTrainedTokenizerBase,
    max_prompt_length: int,
    split: str,
    allow_data_free: bool = False,
    pictures: VisionPromptEncoder | None = None,
) -> list[Prompt]:
    """Apply the chat template to each row's ``prompt`` messages; too-long prompts are an error.

    With ``allow_data_free`` a row may have no prompt: its environment opens the chat
    (the reset observation becomes the first user message) and ``prompt_ids`` stay empty.
    Pictures in a row's messages need ``pictures`` (a vision-language model's encoder); each is
    read under its limits here, so a bad one fails its row before training starts.
    """
    prompts = []
    for index, row in enumerate(rows):
        messages = row.get("prompt")
        if messages is None and allow_data_free:
            prompts.append(Prompt(uid=f"{split}-{index}", prompt_ids=[], row=row))
            continue
        if not isinstance(messages, list) or not messages:
            raise ValueError(f"{split} row {index}: 'prompt' must be a non-empty list of chat messages")
        has_pictures = any(True for _ in message_images(messages))
        if has_pictures and pictures is None:
            raise ValueError(f"{split} row {index}: the prompt has pictures but the model is not a "
                             "vision-language model (actor_rollout_ref.model.path)")
        ids = chat_prompt_ids(tokenizer, messages)
        if has_pictures:
            try:
                ids = list(pictures.encode(messages, ids))  # the pixels are made again when drawn
            except ValueError as error:
                raise ValueError(f"{split} row {index}: {error}") from error
        if len(ids) > max_prompt_length:
            raise ValueError(
                f"{split} row {index}: prompt has {len(ids)} tokens, more than "
                f"data.max_prompt_length={max_prompt_length}"
            )
        prompts.append(Prompt(uid=f"{split}-{index}", prompt_ids=ids, row=row, pictures=has_pictures))
    return prompts


def with_pictures(prompts: Sequence[Prompt], tokenizer: PreTrainedTokenizerBase,
                  pictures: VisionPromptEncoder | None) -> list[Prompt]:
    """``prompts`` with the pixels of those that have pictures (their ``prompt_ids`` an
    :class:`~opentinker.engine.vision.ImagePrompt`); each distinct prompt is encoded once."""
    done: dict[str, Prompt] = {}
    out = []
    for prompt in prompts:
        if not prompt.pictures or pictures is None:
            out.append(prompt)
            continue
        if prompt.uid not in done:
            messages = prompt.row["prompt"]
            done[prompt.uid] = replace(prompt, prompt_ids=pictures.encode(messages, chat_prompt_ids(tokenizer, messages)))
        out.append(done[prompt.uid])
    return out


class PromptLoader:
    """Endless batches of prompts; reshuffled every epoch from ``seed``. Its position is
    state (:meth:`state_dict`), so a resumed run sees the same batches as an unbroken one."""

    def __init__(self, prompts: Sequence[Prompt], batch_size: int, shuffle: bool, seed: int):
        if len(prompts) < batch_size:
            raise ValueError(f"the dataset has {len(prompts)} rows, fewer than data.train_batch_size={batch_size}")
        self.prompts = list(prompts)
        self.batch_size = batch_size
        self.shuffle = shuffle
        self._rng = random.Random(seed)
        self.epoch = 0
        self._order: list[int] = []
        self._position = 0  # next index into _order
        self._new_epoch(count=False)

    def _new_epoch(self, count: bool = True) -> None:
        self._order = list(range(len(self.prompts)))
        if self.shuffle:
            self._rng.shuffle(self._order)
        self._position = 0
        self.epoch += int(count)

    def __iter__(self) -> Iterator[list[Prompt]]:
        return self

    def __next__(self) -> list[Prompt]:
        if self._position + self.batch_size > len(self._order):  # the rest is shorter than a batch
            self._new_epoch()
        batch = [self.prompts[i] for i in self._order[self._position:self._position + self.batch_size]]
        self._position += self.batch_size
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "order": list(self._order), "position": self._position,
                "rng": self._rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self._order, self._position = state["epoch"], list(state["order"]), state["position"]
        self._rng.setstate(state["rng"])


def arithmetic_reward(response: str, row: dict[str, Any]) -> float:
    return arithmetic.score_answer(response, row["reward_model"]["ground_truth"])


def digit_sum_reward(response: str, row: dict[str, Any]) -> float:
    return digit_sum.score(response, row["reward_model"]["ground_truth"])


def word_problems_reward(response: str, row: dict[str, Any]) -> float:
    return word_problems.score_answer(response, row["reward_model"]["ground_truth"])


BUILTIN_TASKS: dict[str, Callable[[int, int], tuple[list[dict], list[dict], RewardFn]]] = {
    "arithmetic": lambda train_count, val_count: (
        [p.as_row() for p in arithmetic.make_problems(train_count, arithmetic.TRAIN_SEED, "train")],
        [p.as_row() for p in arithmetic.make_problems(val_count, arithmetic.HELDOUT_SEED, "heldout")],
        arithmetic_reward,
    ),
    "digit_sum": lambda train_count, val_count: (
        [p.as_row() for p in digit_sum.make_problems(train_count, digit_sum.TRAIN_SEED, "train")],
        [p.as_row() for p in digit_sum.make_problems(val_count, digit_sum.HELDOUT_SEED, "heldout")],
        digit_sum_reward,
    ),
    "word_problems": lambda train_count, val_count: (
        [p.as_row() for p in word_problems.make_problems(train_count, word_problems.TRAIN_SEED, "train")],
        [p.as_row() for p in word_problems.make_problems(val_count, word_problems.HELDOUT_SEED, "heldout")],
        word_problems_reward,
    ),
}


def builtin_task(name: str, train_count: int = 4096, val_count: int = 64) -> tuple[list[dict], list[dict], RewardFn]:
    """Train rows, held-out rows and the reward function of a built-in task."""
    if name not in BUILTIN_TASKS:
        raise ValueError(f"data.task: unknown task '{name}'; built-in tasks: {sorted(BUILTIN_TASKS)}")
    return BUILTIN_TASKS[name](train_count, val_count)

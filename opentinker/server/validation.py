"""Checks of dataset rows, done before anything reaches a runner.

A row the job could not train on is refused at the edge (422 naming ``field[i]``): once a
batch is accepted (201 for a dataset, 202 for a pushed step) no row of it may fail the job.

The shape of a row (its prompt, or a data-free row naming one of the job's interactions) is
``opentinker/rows.py``'s, which the client applies too. Then:

- without interactions the job's built-in task scores the row, so the task's own row check
  applies (arithmetic, word_problems, digit_sum: ``reward_model.ground_truth`` is an integer);
- with interactions the picked interaction class's ``row_problem`` check applies, if it has one;
- the prompt, rendered with the served model's chat template, must fit
  ``data.max_prompt_length`` tokens (checked with the model's tokenizer, off the event loop);
- pictures need a vision-language model, and each is read under the operator's bounds
  (``--max-image-bytes``, ``--max-image-pixels``, ``--max-images-per-row``: refused from the
  file's header, before any decoding that could allocate); their tokens count in the length.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from opentinker.environments import arithmetic, word_problems
from opentinker.images import ImageError, message_images
from opentinker.rows import interaction_kwargs, row_shape_problem
from opentinker.server.policy import JobPolicy

#: Row checks of the built-in tasks (``data.task``), which score rows when a job has no interactions.
TASK_ROW_CHECKS: dict[str, Callable[[dict], str | None]] = {
    "arithmetic": arithmetic.row_problem,
    "digit_sum": arithmetic.row_problem,  # an integer ground truth, as arithmetic's
    "word_problems": word_problems.row_problem,
}


@dataclass
class RowRules:
    """What one job's rows must satisfy."""

    max_prompt_length: int
    task: str | None = None  # the built-in task scoring rows when there are no interactions
    interactions: Mapping[str, type] = field(default_factory=dict)  # name -> Interaction class
    tokenizer: Any = None  # renders prompts to count their tokens; None: lengths not checked
    pictures: Any = None  # the model's VisionPromptEncoder (None: a text model, rows may have no pictures)


#: The operator's flag behind each bound of a picture (opentinker.images.ImageLimits).
IMAGE_FLAGS = {"max_bytes": "--max-image-bytes", "max_pixels": "--max-image-pixels",
               "max_images_per_row": "--max-images-per-row"}


def _interaction_problem(row: Mapping[str, Any], rules: RowRules) -> str | None:
    """The picked interaction class's own check of the row's kwargs (the shape is checked)."""
    kwargs = interaction_kwargs(row) or {}
    name = kwargs.get("name")
    if name is None:
        name = next(iter(rules.interactions))  # the only one (row_shape_problem saw to it)
    check = getattr(rules.interactions[name], "row_problem", None)
    problem = check({k: v for k, v in kwargs.items() if k != "name"}) if callable(check) else None
    return f"interaction {name!r}: {problem}" if problem else None


def row_problem(row: Any, rules: RowRules) -> str | None:
    """What is wrong with one row (without counting tokens), or None."""
    problem = row_shape_problem(row, rules.interactions)
    if problem is not None:
        return problem
    if rules.interactions:
        return _interaction_problem(row, rules)
    check = TASK_ROW_CHECKS.get(rules.task or "")
    return check(dict(row)) if check is not None else None


def _length_problem(row: Mapping[str, Any], rules: RowRules) -> str | None:
    from opentinker.engine.data import chat_prompt_ids

    messages = row["prompt"]
    pictures = any(True for _ in message_images(messages))
    if pictures and rules.pictures is None:
        return "'prompt' has pictures but the model is not a vision-language model"
    try:
        ids = chat_prompt_ids(rules.tokenizer, messages)
    except Exception as exc:  # the template refused the messages (e.g. roles out of order)
        return f"'prompt' cannot be rendered with the model's chat template: {type(exc).__name__}: {exc}"
    if pictures:
        try:
            ids = rules.pictures.encode(messages, ids)
        except ImageError as error:
            flag = IMAGE_FLAGS.get(error.limit)
            return f"'prompt': {error}" + (f" (the server's {flag})" if flag else "")
        except ValueError as error:  # the template's picture placeholders do not match the pictures
            return f"'prompt': {error}"
    count = len(ids)
    if count > rules.max_prompt_length:
        return f"prompt has {count} tokens, more than data.max_prompt_length={rules.max_prompt_length}"
    return None


def rows_problems(rows: Sequence[Any], field: str, rules: RowRules, limit: int = 5) -> list[str]:
    """Up to ``limit`` problems, each naming its row as ``field[i]``. Counts prompt tokens when
    ``rules.tokenizer`` is set (slow for large datasets: call it from a worker thread)."""
    problems = []
    for i, row in enumerate(rows):
        problem = row_problem(row, rules)
        if problem is None and rules.tokenizer is not None and isinstance(row.get("prompt"), list):
            problem = _length_problem(row, rules)
        if problem is not None:
            problems.append(f"{field}[{i}]: {problem}")
            if len(problems) >= limit:
                break
    return problems


class Tokenizers:
    """The tokenizer of each served model, loaded on first use (in a worker thread: it is slow),
    and a vision-language model's picture encoder."""

    def __init__(self, policy: JobPolicy):
        self.policy = policy
        self._loaded: dict[str, Any] = {}
        self._pictures: dict[str, Any] = {}
        self._lock = threading.Lock()

    def pictures(self, model_name: str | None) -> Any:
        """The served model's :class:`~opentinker.engine.vision.VisionPromptEncoder` under the
        operator's image limits, or None for a text model."""
        tokenizer = self.get(model_name)
        model = self.policy.served_model(model_name)
        with self._lock:
            if model.name not in self._pictures:
                from opentinker.engine.model_loading import resolve_model_path
                from opentinker.engine.vision import VisionPromptEncoder

                self._pictures[model.name] = VisionPromptEncoder.for_model(
                    resolve_model_path(model.path), tokenizer, self.policy.image_limits, model.trust_remote_code)
            return self._pictures[model.name]

    def get(self, model_name: str | None) -> Any:
        model = self.policy.served_model(model_name)
        with self._lock:
            if model.name not in self._loaded:
                from opentinker.engine.model_loading import load_tokenizer, resolve_model_path

                path = resolve_model_path(model.path)  # None: the embedded tiny model
                self._loaded[model.name] = load_tokenizer(path, model.trust_remote_code)
            return self._loaded[model.name]

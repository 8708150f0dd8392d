"""Completions for people: a chat or text request turned into a stream of text deltas.

Two places serve them (see ``opentinker/server/model_serving.py``): a running job's runner,
with its own rollout engine (the job's current weights), and :class:`CheckpointServer`, a Ray
actor holding a few saved checkpoints. Both call :func:`stream_completions`, which yields
events as the engine decodes; an engine that cannot report tokens as it goes (vLLM here)
gives each choice's text in one piece when it is done.

Every request samples with a seed of its own (the caller's, or a random one), so serving
never draws from the engine's shared generator, which belongs to a job's seeded rollouts.
"""

from __future__ import annotations

import collections
import inspect
import queue
import secrets
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.engine.rollout.base import SamplingParams


@dataclass(frozen=True)
class ServeRequest:
    """One request of ``/v1/chat/completions`` (``messages``) or ``/v1/completions`` (``prompt``),
    checked by the server already; ``n`` choices, the i-th sampled with ``seed + i``."""

    messages: tuple[dict[str, str], ...] | None = None
    prompt: str | None = None
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    stop: tuple[str, ...] = ()
    n: int = 1
    seed: int | None = None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ServeRequest:
        data = dict(data)
        if data.get("messages") is not None:
            data["messages"] = tuple(dict(m) for m in data["messages"])
        data["stop"] = tuple(data.get("stop") or ())
        return cls(**data)


class IncrementalText:
    """The text of one choice as its tokens arrive: special tokens left out, nothing sent twice,
    and the OpenAI stop rule (the text ends before the first stop string, which is not sent).

    Text that may still turn into a stop string is held back until it cannot, and a token that
    ends inside a multi-byte character waits for the rest of it."""

    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0  # characters already given out

    def _text(self) -> tuple[str, bool]:
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        cuts = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        return (text[:min(cuts)], True) if cuts else (text, False)

    def push(self, token_id: int) -> str:
        """The new text that is certain after ``token_id`` ('' while waiting)."""
        self.ids.append(token_id)
        text, stopped = self._text()
        if text.endswith("\ufffd"):
            return ""
        end = len(text) if stopped else len(text) - self.hold
        delta = text[self.sent:end] if end > self.sent else ""
        self.sent += len(delta)
        return delta

    def finish(self, token_ids: Sequence[int]) -> str:
        """What is left to send once the choice is complete (``token_ids``: all of its tokens)."""
        self.ids = list(token_ids)
        text, _ = self._text()
        delta = text[self.sent:]
        self.sent = len(text)
        return delta

    @property
    def text(self) -> str:
        return self._text()[0]


def prompt_ids(tokenizer: Any, request: ServeRequest, pictures: Any = None) -> list[int]:
    """The chat-template rendering of ``messages`` with the assistant prompt (with their
    pictures, through ``pictures``, a vision-language model's encoder: an ImagePrompt), or
    ``prompt``'s ids."""
    if request.messages is not None:
        from opentinker.engine.data import chat_prompt_ids
        from opentinker.images import message_images

        messages = list(request.messages)
        ids = chat_prompt_ids(tokenizer, messages)
        if any(True for _ in message_images(messages)):
            if pictures is None:
                raise ValueError("the messages have pictures but the model is not a vision-language model")
            return pictures.encode(messages, ids)
        return ids
    return list(tokenizer(request.prompt or "", add_special_tokens=False)["input_ids"])


def context_length(engine: Any) -> int:
    """How many tokens (prompt and completion) the engine's model takes."""
    limit = getattr(engine, "max_model_len", None)
    model = getattr(engine, "model", None)
    if limit is None and model is not None:
        limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    return int(limit or 2**31)


def _streams_tokens(engine: Any) -> bool:
    return "on_tokens" in inspect.signature(engine.generate).parameters


def stream_completions(engine: Any, tokenizer: Any, request: ServeRequest,
                       pictures: Any = None) -> Iterator[dict[str, Any]]:
    """Events of one request, in order: ``{"index", "text"}`` (a delta of choice ``index``) as
    tokens are decoded, ``{"index", "finish_reason"}`` once per choice, then ``{"usage": {...}}``.
    ``pictures``: a vision-language model's prompt encoder (messages may then hold pictures).

    Raises ValueError before anything is generated when the prompt does not fit the model."""
    ids = prompt_ids(tokenizer, request, pictures)
    if not ids:
        raise ValueError("the prompt is empty: send at least one token of text")
    limit = context_length(engine)
    if len(ids) + request.max_tokens > limit:
        raise ValueError(f"the prompt ({len(ids)} tokens) plus max_tokens ({request.max_tokens}) is more than "
                         f"the model's context of {limit} tokens; shorten the prompt or lower max_tokens")
    seed = request.seed if request.seed is not None else secrets.randbits(62)
    params = [SamplingParams(temperature=request.temperature, top_p=request.top_p, max_tokens=request.max_tokens,
                             stop=request.stop, seed=seed + i) for i in range(request.n)]
    texts = [IncrementalText(tokenizer, request.stop) for _ in range(request.n)]
    updates: queue.Queue = queue.Queue()
    streaming = _streams_tokens(engine)

    def generate() -> None:
        try:
            kwargs = {"on_tokens": lambda rows, tokens: updates.put(("tokens", rows, tokens))} if streaming else {}
            updates.put(("done", engine.generate([ids] * request.n, params, **kwargs)))
        except BaseException as error:  # noqa: BLE001 - raised again in the caller's thread
            updates.put(("error", error))

    threading.Thread(target=generate, name="serve-generate", daemon=True).start()
    while True:
        kind, *payload = updates.get()
        if kind == "error":
            raise payload[0]
        if kind == "tokens":
            for row, token in zip(*payload):
                delta = texts[row].push(token)
                if delta:
                    yield {"index": row, "text": delta}
            continue
        completions = payload[0]
        for index, completion in enumerate(completions):
            delta = texts[index].finish(completion.token_ids)
            if delta:
                yield {"index": index, "text": delta}
            yield {"index": index, "finish_reason": completion.finish_reason}
        generated = sum(len(c.token_ids) for c in completions)
        yield {"usage": {"prompt_tokens": len(ids), "completion_tokens": generated,
                         "total_tokens": len(ids) + generated}}
        return


class CheckpointServer:
    """Serves saved checkpoints (Hugging Face folders): a Ray actor, threaded, that keeps the
    ``max_models`` most recently used ones loaded."""

    def __init__(self, device: str = "cpu", max_models: int = 2, trust_remote_code: bool = False):
        self.device = device
        self.max_models = max_models
        self.trust_remote_code = trust_remote_code
        self._loaded: collections.OrderedDict[str, Any] = collections.OrderedDict()  # folder -> (engine, pictures)
        self._lock = threading.Lock()  # one load at a time; the table is shared by the threads

    def _engine(self, folder: str) -> tuple[Any, Any]:
        """The folder's engine and, for a vision-language model, its prompt encoder (the
        pictures were read under the server's bounds already)."""
        from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine
        from opentinker.engine.vision import VisionPromptEncoder
        from opentinker.images import ImageLimits

        with self._lock:
            if folder in self._loaded:
                self._loaded.move_to_end(folder)
                return self._loaded[folder]
            engine = TransformersRolloutEngine.from_pretrained(folder, device=self.device,
                                                               trust_remote_code=self.trust_remote_code)
            pictures = VisionPromptEncoder.for_model(folder, engine.tokenizer, ImageLimits.checked_upstream(),
                                                     self.trust_remote_code)
            self._loaded[folder] = (engine, pictures)
            while len(self._loaded) > self.max_models:  # requests under way keep their own reference
                self._loaded.popitem(last=False)
            return engine, pictures

    def stream(self, folder: str, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """:func:`stream_completions` from the checkpoint in ``folder`` (a Ray streaming generator)."""
        if not Path(folder, "config.json").is_file():
            raise FileNotFoundError(f"no model in the checkpoint folder {Path(folder).name!r}")
        engine, pictures = self._engine(folder)
        yield from stream_completions(engine, engine.tokenizer, ServeRequest.from_dict(request), pictures)

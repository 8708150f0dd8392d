"""A strategy judge behind any OpenAI-compatible chat-completions API.

Works with OpenAI itself and with servers that speak the same protocol (vLLM, SGLang, llama.cpp,
LiteLLM, ...): point ``base_url`` (or ``OPENAI_BASE_URL``) at the server's ``/v1``. The ``openai``
package is imported when a judge is built, never when this module is imported.

Per group the judge sends one request (system + user message from
:mod:`opentinker.creativity.prompt`, temperature 0, ``response_format={"type": "json_object"}``
unless ``json_mode=False``) and parses the answer with :func:`parse_judgement`. A failed request
(timeout, connection error, 408/409/429/5xx) and an answer that is no valid grouping are retried
up to ``max_retries`` times with exponential backoff (tenacity's ``AsyncRetrying``; the SDK's own
retries are off, since they would not cover invalid answers); other API errors (401, 403, 404,
400, ...) are not retried. A group that still fails comes back as ``None``: ``label_groups`` never raises
for API failures. Configuration errors (no API key, no ``openai`` package) raise when the judge
is built.

The default model is ``gpt-4o-mini``: cheap, fast and supports JSON mode. The method this
implements was described with GPT-4 as the judge; pass ``model="gpt-4o"`` (or any stronger
model) to stay closer to it. Reasoning models that reject ``temperature`` or ``max_tokens`` take
``temperature=None`` / ``max_tokens=None`` (the parameter is then not sent).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

from tenacity import AsyncRetrying, RetryError, retry_if_exception, stop_after_attempt, wait_exponential

from opentinker.creativity.base import DedupedGroup, Group, JudgeConfigError, JudgeMetrics, JudgementCache, cache_key
from opentinker.creativity.prompt import PROMPT_VERSION, JudgementError, build_messages, parse_judgement

logger = logging.getLogger(__name__)

DEFAULT_OPENAI_MODEL = "gpt-4o-mini"
_RETRYABLE_STATUS = frozenset({408, 409, 429})
T = TypeVar("T")


class _AttemptFailed(Exception):
    """One failed attempt at judging a group; ``retryable`` says whether another may follow."""

    def __init__(self, message: str, *, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


def run_coroutine_sync(factory: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run ``factory()`` to completion from synchronous code: on a fresh event loop in this
    thread, or, when this thread already runs a loop, on a fresh loop in a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(factory())
    with concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="strategy-judge") as pool:
        return pool.submit(lambda: asyncio.run(factory())).result()


class OpenAIStrategyJudge:
    """Strategy labels from a chat model behind an OpenAI-compatible API.

    Args:
        model: model name sent in each request.
        api_key: the API key; default ``$OPENAI_API_KEY``. A local server that checks no key
            still needs some value, e.g. ``"EMPTY"``.
        base_url: e.g. ``http://127.0.0.1:8000/v1``; default ``$OPENAI_BASE_URL``, else OpenAI.
        temperature: sampling temperature (``None``: not sent).
        json_mode: send ``response_format={"type": "json_object"}``. If the server answers 400
            naming ``response_format``, the judge turns JSON mode off for the rest of its life
            (logged once) and repeats the request; the prompt asks for JSON either way.
        max_tokens: answer length limit (``None``: not sent).
        timeout_s: deadline per request, seconds.
        max_retries: extra attempts per group after a failed or invalid one.
        backoff_s, max_backoff_s: wait ``backoff_s * 2**k`` (at most ``max_backoff_s``) before
            retry ``k + 1``.
        max_concurrency: requests in flight at once, across all groups of a call.
        cache: keep valid judgements in memory, keyed by sha256 of (model, prompt version,
            truncation, question, distinct responses); repeated groups make no request.
        cache_path: also persist the cache as a JSON file there (read at start, rewritten
            after each ``label_groups`` call that added entries). Implies ``cache``.
        max_response_chars: each response is cut to about this many characters in the prompt
            (head and tail kept); ``None`` keeps them whole.
        extra_body: extra JSON fields for every request (server-specific options, e.g. vLLM's
            ``{"chat_template_kwargs": {"enable_thinking": False}}``).

    Identical responses of a group are sent once; groups with one distinct response are
    labelled without a request. ``judge/calls`` counts HTTP requests, retries included.
    """

    metric_keys = (
        "groups", "calls", "failures", "invalid_outputs", "fallback_groups",
        "cache_hits", "skipped_groups", "prompt_tokens", "completion_tokens",
    )

    def __init__(
        self,
        model: str = DEFAULT_OPENAI_MODEL,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        temperature: float | None = 0.0,
        json_mode: bool = True,
        max_tokens: int | None = 1024,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        max_concurrency: int = 8,
        cache: bool = True,
        cache_path: str | os.PathLike | None = None,
        max_response_chars: int | None = 6000,
        extra_body: dict[str, Any] | None = None,
    ):
        try:
            import openai
        except ImportError as error:
            raise ImportError(
                "the 'openai' strategy judge needs the openai package: pip install 'opentinker[openai]'"
            ) from error
        self._openai = openai
        resolved_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY")
        if not resolved_key:
            raise JudgeConfigError(
                "the 'openai' strategy judge needs an API key: set the OPENAI_API_KEY environment variable "
                "or pass api_key=... (for a local OpenAI-compatible server that checks no key, api_key='EMPTY')"
            )
        if not model or not isinstance(model, str):
            raise JudgeConfigError(f"model must be a non-empty string, got {model!r}")
        if timeout_s is None or timeout_s <= 0:
            raise JudgeConfigError(f"timeout_s must be positive, got {timeout_s}")
        if max_retries < 0:
            raise JudgeConfigError(f"max_retries must be >= 0, got {max_retries}")
        if max_concurrency < 1:
            raise JudgeConfigError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if backoff_s < 0 or max_backoff_s < 0:
            raise JudgeConfigError("backoff_s and max_backoff_s must be >= 0")
        if max_response_chars is not None and max_response_chars <= 0:
            raise JudgeConfigError(f"max_response_chars must be positive or None, got {max_response_chars}")
        self.model = model
        self._api_key = resolved_key
        self.base_url = base_url or os.environ.get("OPENAI_BASE_URL") or None
        self.temperature = temperature
        self.json_mode = bool(json_mode)
        self.max_tokens = max_tokens
        self.timeout_s = float(timeout_s)
        self.max_retries = int(max_retries)
        self.backoff_s = float(backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.max_concurrency = int(max_concurrency)
        self.max_response_chars = max_response_chars
        self.extra_body = dict(extra_body) if extra_body else None
        use_cache = cache or cache_path is not None
        self._cache = JudgementCache(Path(cache_path) if cache_path is not None else None) if use_cache else None
        self._metrics = JudgeMetrics(self.metric_keys)

    def __repr__(self) -> str:
        return f"OpenAIStrategyJudge(model={self.model!r}, base_url={self.base_url!r})"

    # ------------------------------------------------------------------ public API

    def label_groups(self, groups: Sequence[Group]) -> list[list[str] | None]:
        """One label list per ``(question, responses)`` group, or ``None`` where judging failed."""
        deduped = [DedupedGroup.of(question, responses) for question, responses in groups]
        results: list[list[str] | None] = [None] * len(deduped)
        pending: dict[str, list[int]] = {}
        for index, group in enumerate(deduped):
            self._metrics.add("groups")
            trivial = group.trivial_labels
            if trivial is not None:
                results[index] = trivial
                self._metrics.add("skipped_groups")
                continue
            key = self.cache_key(group)
            cached = self._cache.get(key) if self._cache is not None else None
            if cached is not None and len(cached) == len(group.unique):
                results[index] = group.expand(cached)
                self._metrics.add("cache_hits")
            elif key in pending:  # the same group twice in one call: one request serves both
                pending[key].append(index)
                self._metrics.add("cache_hits")
            else:
                pending[key] = [index]
        if not pending:
            return results
        keys = list(pending)
        judged = run_coroutine_sync(lambda: self._judge_all([deduped[pending[key][0]] for key in keys]))
        for key, unique_labels in zip(keys, judged):
            for index in pending[key]:
                if unique_labels is None:
                    self._metrics.add("fallback_groups")
                else:
                    results[index] = deduped[index].expand(unique_labels)
            if unique_labels is not None and self._cache is not None:
                self._cache.put(key, unique_labels)
        if self._cache is not None:
            self._cache.save()
        return results

    def pop_metrics(self) -> dict[str, float]:
        return self._metrics.pop()

    def cache_key(self, group: DedupedGroup) -> str:
        return cache_key(self.model, PROMPT_VERSION, self.max_response_chars, group.question, list(group.unique))

    # ------------------------------------------------------------------ requests

    def _request_kwargs(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        kwargs: dict[str, Any] = {"model": self.model, "messages": messages}
        if self.temperature is not None:
            kwargs["temperature"] = self.temperature
        if self.max_tokens is not None:
            kwargs["max_tokens"] = self.max_tokens
        if self.json_mode:
            kwargs["response_format"] = {"type": "json_object"}
        if self.extra_body:
            kwargs["extra_body"] = self.extra_body
        return kwargs

    async def _judge_all(self, groups: list[DedupedGroup]) -> list[list[str] | None]:
        # A client per call: its connection pool belongs to this call's event loop.
        client = self._openai.AsyncOpenAI(
            api_key=self._api_key, base_url=self.base_url, timeout=self.timeout_s, max_retries=0
        )
        semaphore = asyncio.Semaphore(self.max_concurrency)
        try:
            return list(await asyncio.gather(*(self._judge_one(client, semaphore, group) for group in groups)))
        finally:
            await client.close()

    async def _judge_one(self, client: Any, semaphore: asyncio.Semaphore, group: DedupedGroup) -> list[str] | None:
        messages = build_messages(group.question, group.unique, max_response_chars=self.max_response_chars)
        n = len(group.unique)
        retrying = AsyncRetrying(
            retry=retry_if_exception(lambda error: isinstance(error, _AttemptFailed) and error.retryable),
            stop=stop_after_attempt(self.max_retries + 1),
            # backoff_s * 2**k (at most max_backoff_s) before retry k + 1
            wait=wait_exponential(multiplier=self.backoff_s, max=self.max_backoff_s),
        )
        try:
            return await retrying(self._attempt, client, semaphore, messages, n)
        except RetryError as spent:
            attempts, error = spent.last_attempt.attempt_number, spent.last_attempt.exception()
        except _AttemptFailed as failed:  # not retryable
            attempts, error = retrying.statistics.get("attempt_number", 1), failed
        logger.warning(
            "strategy judge gave up on a group of %d distinct responses after %d attempt(s): %s",
            n, attempts, error,
        )
        return None

    async def _attempt(
        self, client: Any, semaphore: asyncio.Semaphore, messages: list[dict[str, str]], n: int
    ) -> list[str]:
        """One attempt: a request (two when the server rejects JSON mode) and its parsed answer."""
        openai = self._openai
        async with semaphore:
            sent_json_mode = self.json_mode  # what _send puts in the request (another group may turn it off)
            try:
                response = await self._send(client, messages)
            except openai.BadRequestError as error:
                if not sent_json_mode or "response_format" not in str(error).lower():
                    raise _AttemptFailed(f"HTTP {error.status_code}: {_short(error)}", retryable=False) from error
                if self.json_mode:
                    logger.warning(
                        "the judge server rejected response_format (%s); JSON mode is now off for %r",
                        _short(error), self,
                    )
                    self.json_mode = False
                response = await self._send(client, messages)  # the server's limitation, not a failed attempt
        self._count_usage(response)
        try:
            return parse_judgement(_content(response), n)
        except JudgementError as error:
            self._metrics.add("failures")
            self._metrics.add("invalid_outputs")
            raise _AttemptFailed(f"invalid judgement: {error}") from error

    async def _send(self, client: Any, messages: list[dict[str, str]]) -> Any:
        """One request; a failure counts in ``judge/failures`` and raises :class:`_AttemptFailed`
        (a 400 is passed on as ``openai.BadRequestError``, see :meth:`_attempt`)."""
        openai = self._openai
        self._metrics.add("calls")
        request = self._request_kwargs(messages)
        started = time.perf_counter()
        try:
            return await asyncio.wait_for(client.chat.completions.create(**request), timeout=self.timeout_s)
        except asyncio.TimeoutError as error:
            failure = _AttemptFailed(f"no answer within timeout_s={self.timeout_s}")
            cause: BaseException = error
        except openai.BadRequestError:
            self._metrics.add("failures")
            raise
        except openai.APIStatusError as error:
            retryable = error.status_code in _RETRYABLE_STATUS or error.status_code >= 500
            failure, cause = _AttemptFailed(f"HTTP {error.status_code}: {_short(error)}", retryable=retryable), error
        except openai.APIConnectionError as error:  # includes APITimeoutError
            failure, cause = _AttemptFailed(f"{type(error).__name__}: {_short(error)}"), error
        except openai.OpenAIError as error:
            failure = _AttemptFailed(f"{type(error).__name__}: {_short(error)}", retryable=False)
            cause = error
        finally:
            self._metrics.add_latency(time.perf_counter() - started)
        self._metrics.add("failures")
        raise failure from cause

    def _count_usage(self, response: Any) -> None:
        usage = getattr(response, "usage", None)
        if usage is None:
            return
        self._metrics.add("prompt_tokens", getattr(usage, "prompt_tokens", None) or 0)
        self._metrics.add("completion_tokens", getattr(usage, "completion_tokens", None) or 0)


def _content(response: Any) -> str:
    choices = getattr(response, "choices", None) or []
    if not choices:
        raise JudgementError("the API response has no choices")
    message = getattr(choices[0], "message", None)
    content = getattr(message, "content", None)
    if not content:
        refusal = getattr(message, "refusal", None)
        raise JudgementError(f"the judge refused: {refusal}" if refusal else "the judge's answer is empty")
    return content


def _short(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= limit else text[:limit] + "..."

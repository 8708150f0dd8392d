"""``POST /v1/chat/completions`` and ``POST /v1/completions``: the OpenAI API over trained models.

``model`` is one of the caller's jobs, ``JOB_ID`` (its current weights) or
``JOB_ID/CHECKPOINT`` (see ``opentinker/server/model_serving.py``). The bodies and answers are
OpenAI's, so the ``openai`` client works unchanged (``base_url=<server>/v1``, ``api_key=<key>``);
``stream=true`` answers Server-Sent Events of chunks ending with ``data: [DONE]``. Options this
server does not implement (tools, logprobs, penalties, ...) are refused by name, never ignored.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sse_starlette import EventSourceResponse

from opentinker.protocol import MAX_JSON_INT
from opentinker.server.auth import current_user
from opentinker.server.errors import AUTHENTICATED_ERRORS, ApiError, error_responses
from opentinker.server.model_serving import ModelServing
from opentinker.server.revocation import stream_until_revoked
from opentinker.server.settings import ServerSettings
from opentinker.server.store import User
from opentinker.server.validation import IMAGE_FLAGS

router = APIRouter(
    tags=["serving"], dependencies=[Depends(current_user)],
    responses={**AUTHENTICATED_ERRORS, **error_responses(400, 404, 409, 503)},
)

MAX_STOPS = 4
MAX_CHOICES = 8
StopString = Annotated[str, Field(min_length=1, max_length=64)]
MAX_SEED = MAX_JSON_INT
# Options of OpenAI's API that this server does not implement, with the value meaning "off".
UNSUPPORTED: dict[str, Any] = {
    "tools": None, "tool_choice": None, "functions": None, "function_call": None, "response_format": None,
    "logprobs": (None, False, 0), "top_logprobs": (None, 0), "logit_bias": None, "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "best_of": (None, 1), "echo": (None, False), "suffix": None,
    "audio": None, "modalities": None, "prediction": None,
}


class _Request(BaseModel):
    # Unknown fields (user, metadata, store, ...) are accepted and have no effect; those in
    # UNSUPPORTED are refused when set.
    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, max_length=200, description="JOB_ID or JOB_ID/CHECKPOINT")
    max_tokens: int | None = Field(None, ge=1, description="at most the server's --serve-max-tokens (default 256)")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    # The bound on the list itself, so that the OpenAPI document states it (a Field(max_length)
    # on the union applies after validation and is missing from the schema).
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stream: bool = False
    stream_options: dict[str, Any] | None = None

    def serve_request(self, settings: ServerSettings) -> dict[str, Any]:
        # 400, not 422: the schema allows any extra field (OpenAI clients send many).
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED:
                off = UNSUPPORTED[name]
                if value is not None and not (isinstance(off, tuple) and value in off):
                    raise ApiError(400, f"{name}: not supported by this server (leave it out)", {"field": name})
        max_tokens = self.max_tokens or min(256, settings.serve_max_tokens)
        if max_tokens > settings.serve_max_tokens:
            raise ApiError(400, f"max_tokens: at most {settings.serve_max_tokens} on this server, got {max_tokens}")
        return {"max_tokens": max_tokens, "temperature": self.temperature, "top_p": self.top_p, "n": self.n,
                "stop": [self.stop] if isinstance(self.stop, str) else list(self.stop or []), "seed": self.seed}

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


MAX_TEXT_CHARS = 200_000  # of a prompt or one message: tokenizing is the server's work, bounded here


class TextPart(BaseModel):
    type: Literal["text"]
    text: str = Field(max_length=MAX_TEXT_CHARS)


class ImageUrl(BaseModel):
    url: str = Field(max_length=64 * 1024 * 1024)  # a data: URL; the picture's own bound is the server's


class ImagePart(BaseModel):
    """A picture (for a vision-language model): a ``data:image/...;base64,`` URL only."""

    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")  # name, ... : no effect here

    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=MAX_TEXT_CHARS)] | Annotated[
        list[Annotated[TextPart | ImagePart, Field(discriminator="type")]], Field(max_length=64)]

    def as_template_message(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str):
            return {"role": role, "content": self.content}
        if not any(isinstance(p, ImagePart) for p in self.content):
            return {"role": role, "content": "".join(p.text for p in self.content)}
        return {"role": role, "content": [p.model_dump() for p in self.content]}


def _check_pictures(messages: list[dict[str, Any]], settings: ServerSettings) -> None:
    """400 for a picture the server would not read: not a data URL, over the operator's bounds
    (checked from the file's header, nothing decoded), or too many of them."""
    from opentinker.images import ImageError, check_message_images

    try:
        check_message_images(messages, settings.job_policy.image_limits)
    except ImageError as error:
        flag = IMAGE_FLAGS.get(error.limit)
        raise ApiError(400, f"messages: {error}" + (f" (the server's {flag})" if flag else "")) from None


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=256)
    max_completion_tokens: int | None = Field(None, ge=1, description="the newer name of max_tokens")

    @model_validator(mode="after")
    def _one_max(self) -> ChatCompletionRequest:
        if self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens
        return self


class CompletionRequest(_Request):
    prompt: str = Field(min_length=1, max_length=MAX_TEXT_CHARS)


def _serving(request: Request) -> ModelServing:
    return request.app.state.serving


def _settings(request: Request) -> ServerSettings:
    return request.app.state.settings


class _Answer:
    """Turns completion events into OpenAI's objects (``chat.completion`` or ``text_completion``)."""

    def __init__(self, chat: bool, model: str, n: int):
        self.chat = chat
        self.model = model
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.texts = [""] * n
        self.finish: list[str | None] = [None] * n
        self.usage: dict[str, int] | None = None

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def take(self, event: dict[str, Any]) -> None:
        if "usage" in event:
            self.usage = event["usage"]
        elif "text" in event:
            self.texts[event["index"]] += event["text"]
        else:
            self.finish[event["index"]] = event["finish_reason"]

    def whole(self) -> dict[str, Any]:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": text}, "logprobs": None,
                        "finish_reason": self.finish[i]} for i, text in enumerate(self.texts)]
        else:
            choices = [{"index": i, "text": text, "logprobs": None, "finish_reason": self.finish[i]}
                       for i, text in enumerate(self.texts)]
        return {**self._envelope(False), "choices": choices, "usage": self.usage}

    def chunk(self, event: dict[str, Any]) -> dict[str, Any] | None:
        """The stream chunk for ``event`` (None: the usage, sent last when asked for)."""
        if "usage" in event:
            return None
        finish = event.get("finish_reason")
        if self.chat:
            delta = {"content": event["text"]} if "text" in event else {}
            choice = {"index": event["index"], "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": event["index"], "text": event.get("text", ""), "logprobs": None, "finish_reason": finish}
        return {**self._envelope(True), "choices": [choice]}

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open each choice with the assistant role, as OpenAI's do."""
        if not self.chat:
            return []
        return [{**self._envelope(True), "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                       "logprobs": None, "finish_reason": None}]}
                for i in range(len(self.texts))]

    def usage_chunk(self) -> dict[str, Any]:
        return {**self._envelope(True), "choices": [], "usage": self.usage}


async def _answer(http_request: Request, body: _Request, serve_request: dict[str, Any], chat: bool, user: User,
                  serving: ModelServing, settings: ServerSettings):
    weights = serving.resolve(user, body.model)
    request = {**serve_request, **body.serve_request(settings)}
    events = serving.events(weights, request)
    answer = _Answer(chat, body.model, body.n)
    first = await anext(events)  # before answering: an error here gets its own status
    if not body.stream:
        answer.take(first)
        async for event in events:
            answer.take(event)
        return answer.whole()

    async def chunks() -> AsyncIterator[dict[str, str]]:
        for chunk in answer.opening_chunks():
            yield {"data": json.dumps(chunk)}
        try:
            event: dict[str, Any] | None = first
            while event is not None:
                answer.take(event)
                chunk = answer.chunk(event)
                if chunk is not None:
                    yield {"data": json.dumps(chunk)}
                event = await anext(events, None)
        except ApiError as error:  # the status line is sent: the error goes in the stream, as OpenAI's do
            yield {"data": json.dumps({"error": {"message": error.message, "type": "server_error"}})}
            return
        if body.include_usage:
            yield {"data": json.dumps(answer.usage_chunk())}
        yield {"data": "[DONE]"}

    return EventSourceResponse(stream_until_revoked(http_request, chunks()), ping=settings.keepalive_s)


@router.post("/chat/completions", summary="A chat completion from a job's weights (OpenAI's API)")
async def chat_completions(
    http_request: Request,
    body: ChatCompletionRequest,
    user: User = Depends(current_user),
    serving: ModelServing = Depends(_serving),
    settings: ServerSettings = Depends(_settings),
):
    messages = [m.as_template_message() for m in body.messages]
    _check_pictures(messages, settings)
    return await _answer(http_request, body, {"messages": messages}, True, user, serving, settings)


@router.post("/completions", summary="A text completion from a job's weights (OpenAI's API)")
async def completions(
    http_request: Request,
    body: CompletionRequest,
    user: User = Depends(current_user),
    serving: ModelServing = Depends(_serving),
    settings: ServerSettings = Depends(_settings),
):
    return await _answer(http_request, body, {"prompt": body.prompt}, False, user, serving, settings)

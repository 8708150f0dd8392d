"""Talking to a trained model through the server's OpenAI-compatible ``/v1/chat/completions``.

:func:`stream_chat` yields the reply's text as the server decodes it; :func:`chat_repl` is
``opentinker chat JOB[/CHECKPOINT]``: a conversation in the terminal (or one message with
``-m``). The ``openai`` package works against the same route; this keeps the thin client
free of it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, TextIO

import httpx
from httpx_sse import EventSource

from opentinker.client.client import OpenTinkerClient
from opentinker.client.errors import OpenTinkerError, error_from_response


def stream_chat(client: OpenTinkerClient, model: str, messages: list[dict[str, str]], **options: Any) -> Iterator[str]:
    """The assistant's reply to ``messages`` from ``model`` (``JOB_ID`` or ``JOB_ID/CHECKPOINT``),
    piece by piece; ``options`` are OpenAI's (``max_tokens``, ``temperature``, ``seed``, ...)."""
    body = {"model": model, "messages": messages, "stream": True, **options}
    timeout = httpx.Timeout(client.timeout, read=None)  # a long answer may take a while to start
    with client._http.stream("POST", client.url("/chat/completions"), json=body, headers=client.headers(),
                             timeout=timeout) as response:
        if response.is_error:
            response.read()
            raise error_from_response(response)
        for event in EventSource(response).iter_sse():
            if event.data == "[DONE]":
                return
            chunk = json.loads(event.data)
            if "error" in chunk:
                raise OpenTinkerError(f"the server stopped the answer: {chunk['error'].get('message')}")
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    yield text


def chat_repl(client: OpenTinkerClient, model: str, *, message: str | None = None, system: str | None = None,
              stdin: TextIO, stdout: TextIO, **options: Any) -> int:
    """One reply to ``message``, or a conversation read line by line from ``stdin`` (an empty
    line or end of input stops it); each reply is printed as it arrives."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    interactive = message is None
    if interactive:
        stdout.write(f"chatting with {model} (an empty line ends the conversation)\n")
    while True:
        if interactive:
            stdout.write("you> ")
            stdout.flush()
            line = stdin.readline()
            if not line.strip():
                return 0
            message = line.rstrip("\n")
        history.append({"role": "user", "content": message})
        if interactive:
            stdout.write("model> ")
        reply = []
        for piece in stream_chat(client, model, history, **options):
            reply.append(piece)
            stdout.write(piece)
            stdout.flush()
        stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(reply)})
        if not interactive:
            return 0

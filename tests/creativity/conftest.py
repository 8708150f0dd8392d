"""A real OpenAI-compatible chat server for the judge tests: FastAPI + uvicorn on 127.0.0.1.

It acts as a scripted judge. For each request it picks an action: the next one queued in
``server.scripts[marker]`` for the first marker found in the problem text, else ``"valid"``.
A valid answer groups the numbered responses by their first word (so "Tens first: ..." and
"Tens, then ones: ..." share a group and "Count up ..." gets its own). Every request body, the
usage it answered with and the number of requests in flight are recorded.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import JSONResponse  # noqa: E402

from opentinker.environments.server import bind_listening_socket  # noqa: E402

_PROBLEM = re.compile(r"<problem>\n(.*?)\n</problem>", re.DOTALL)
_RESPONSE = re.compile(r'<response number="(\d+)">\n(.*?)\n</response>', re.DOTALL)
ACTIONS = ("valid", "valid_fenced", "malformed", "wrong_count", "error500", "error401", "slow", "reject_json_mode")


@dataclass
class ScriptedChatServer:
    base_url: str = ""
    scripts: dict[str, deque] = field(default_factory=dict)
    delay_s: float = 0.0  # how long a valid answer takes
    slow_s: float = 1.5  # how long a "slow" answer takes
    requests: list[dict] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    actions_taken: list[str] = field(default_factory=list)
    usages: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0

    def script(self, marker: str, *actions: str) -> None:
        unknown = [action for action in actions if action not in ACTIONS]
        assert not unknown, f"unknown scripted actions {unknown}"
        self.scripts[marker] = deque(actions)

    def reset(self) -> None:
        deadline = time.monotonic() + 10
        while self.in_flight and time.monotonic() < deadline:  # let leftover slow answers finish
            time.sleep(0.05)
        self.scripts.clear()
        self.delay_s = 0.0
        self.requests.clear()
        self.headers.clear()
        self.actions_taken.clear()
        self.usages.clear()
        self.max_in_flight = 0

    @property
    def prompt_tokens(self) -> int:
        return sum(usage["prompt_tokens"] for usage in self.usages)

    @property
    def completion_tokens(self) -> int:
        return sum(usage["completion_tokens"] for usage in self.usages)

    # ---------------------------------------------------------------- behaviour

    def choose_action(self, problem: str) -> str:
        for marker, queue in self.scripts.items():
            if marker in problem and queue:
                return queue.popleft()
        return "valid"

    @staticmethod
    def grouping(user_text: str) -> dict:
        groups: dict[str, list[int]] = {}
        for number, text in _RESPONSE.findall(user_text):
            first_word = re.sub(r"[^a-z]", "", text.split()[0].lower()) if text.split() else ""
            groups.setdefault(first_word, []).append(int(number))
        return {"groups": [{"strategy": f"starts with '{word}'", "members": members}
                           for word, members in groups.items()]}

    def completion(self, body: dict, content: str) -> dict:
        prompt_chars = sum(len(message.get("content") or "") for message in body["messages"])
        usage = {"prompt_tokens": prompt_chars // 4, "completion_tokens": max(1, len(content) // 4)}
        usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
        self.usages.append(usage)
        return {
            "id": f"chatcmpl-test{len(self.requests)}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body["model"],
            "system_fingerprint": "fp_scripted",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content, "refusal": None},
                    "logprobs": None,
                    "finish_reason": "stop",
                }
            ],
            "usage": usage,
        }

    async def handle(self, request: Request):
        body = await request.json()
        self.requests.append(body)
        self.headers.append(dict(request.headers))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            user_text = body["messages"][-1]["content"]
            match = _PROBLEM.search(user_text)
            action = self.choose_action(match.group(1) if match else "")
            self.actions_taken.append(action)
            if action == "error500":
                return JSONResponse(
                    {"error": {"message": "scripted failure", "type": "server_error", "code": None}}, 500
                )
            if action == "error401":
                return JSONResponse(
                    {"error": {"message": "Incorrect API key provided", "type": "invalid_request_error",
                               "code": "invalid_api_key"}},
                    401,
                )
            if action == "reject_json_mode" and "response_format" in body:
                return JSONResponse(
                    {"error": {"message": "response_format is not supported by this server",
                               "type": "invalid_request_error", "code": None}},
                    400,
                )
            if action == "slow":
                await asyncio.sleep(self.slow_s)
            elif self.delay_s:
                await asyncio.sleep(self.delay_s)
            grouping = self.grouping(user_text)
            if action == "malformed":
                content = 'Here is the grouping: {"groups": [{"strategy": "tens", "members": [1, 2'
            elif action == "wrong_count":
                content = json.dumps({"groups": [{"strategy": "only the first", "members": [1]}]})
            elif action == "valid_fenced":
                content = "Sure, here it is.\n```json\n" + json.dumps(grouping, indent=2) + "\n```\nDone."
            else:
                content = json.dumps(grouping)
            return JSONResponse(self.completion(body, content))
        finally:
            self.in_flight -= 1


@pytest.fixture(scope="session")
def _chat_server():
    state = ScriptedChatServer()
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await state.handle(request)

    sock = bind_listening_socket("127.0.0.1", 0)  # with TCP_NODELAY: no ~40 ms Nagle stalls
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False, loop="asyncio"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 15
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test chat server did not start"
        time.sleep(0.02)
    state.base_url = f"http://127.0.0.1:{port}/v1"
    yield state
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()


@pytest.fixture
def chat_server(_chat_server):
    """The session's scripted chat server, with scripts and records cleared for this test."""
    _chat_server.reset()
    yield _chat_server
    _chat_server.reset()

"""The client relay (``opentinker/client/relay.py``) under a misbehaving or busy server: a fake
relay server (websockets' own server on 127.0.0.1, sending whatever frames a test likes) drives a
real :class:`EnvRelay` thread, which calls real env servers on loopback: a gym env
(``ThreadingHTTPServer``), a WebSocket env, and a real OpenEnv server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from websockets.asyncio.server import serve

from opentinker import OpenTinkerClient
from opentinker.client.relay import MAX_QUEUED_CALLS, EnvRelay
from opentinker.client.relay_calls import CallQueue
from opentinker.environments.registry import InteractionSpec

WAIT_S = 60.0  # how long a test waits for what must happen (a bound against hanging, never a measure)


# ---------------------------------------------------------------------- the fake server


class FakeServer:
    """The server's end of relays. Each connection is greeted by ``greet(server, socket, number)``
    (default: a hello); then the answers that come back are kept by call id."""

    def __init__(self, greet: Callable[[FakeServer, Any, int], Awaitable[None]] | None = None):
        self.greet = greet or FakeServer.hello
        self.answers: dict[int, dict[str, Any]] = {}
        self.socket: Any = None  # the latest connection greeted
        self.count = 0  # connections so far
        self.greeted = 0  # the number of the latest connection greeted
        self.url = ""

    async def hello(self, socket: Any, number: int) -> None:
        await socket.send(json.dumps({"type": "hello", "job_id": "J", "interactions": ["arith"]}))

    async def handle(self, socket: Any) -> None:
        self.count += 1
        number = self.count
        await self.greet(self, socket, number)
        self.socket, self.greeted = socket, number
        with contextlib.suppress(Exception):
            async for text in socket:
                answer = json.loads(text)
                self.answers[answer["id"]] = answer

    async def until(self, predicate: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not predicate():
            assert time.monotonic() < deadline, f"gave up waiting: {what}"
            await asyncio.sleep(0.01)

    async def connected(self) -> Any:
        await self.until(lambda: self.socket is not None, "the relay's connection")
        return self.socket

    async def send(self, frames: list[Any]) -> None:
        socket = await self.connected()

        async def send_all() -> None:
            for frame in frames:
                await socket.send(frame if isinstance(frame, (str, bytes)) else json.dumps(frame))

        await asyncio.wait_for(send_all(), WAIT_S)  # a relay that stops reading stops this too

    async def call(self, calls: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
        """Send ``calls`` (by id) and return their answers."""
        for call_id in calls:
            self.answers.pop(call_id, None)
        await self.send([{"type": "call", "id": call_id, **call} for call_id, call in calls.items()])
        await self.until(lambda: all(call_id in self.answers for call_id in calls), f"answers to {sorted(calls)}")
        return {call_id: self.answers[call_id] for call_id in calls}


@contextlib.asynccontextmanager
async def fake_server(greet: Callable[[FakeServer, Any, int], Awaitable[None]] | None = None
                      ) -> AsyncIterator[FakeServer]:
    fake = FakeServer(greet)
    async with serve(fake.handle, "127.0.0.1", 0, max_size=None) as server:
        fake.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        yield fake


@contextlib.asynccontextmanager
async def running_relay(fake: FakeServer, endpoint: str, protocol: str = "gym", relay_class: type = EnvRelay,
                        **options: Any) -> AsyncIterator[EnvRelay]:
    spec = InteractionSpec(name="arith", class_path=protocol, config={"env_endpoint": endpoint, "relay": "client"})
    client = OpenTinkerClient(fake.url, "ot-fake")
    relay = relay_class(client, "J", [spec], **options).start()
    try:
        yield relay
    finally:
        await asyncio.to_thread(relay.stop)  # the fake server and the envs run on this loop: never block it
        client.close()


def http_call(path: str = "reset", method: str = "POST", **extra: Any) -> dict[str, Any]:
    body = {"body": {"instance_id": "i", "job_id": "J"}} if method == "POST" else {}
    return {"op": "http", "interaction": "arith", "shard": 0, "method": method, "path": path, "timeout_s": 60,
            **body, **extra}


def ws_open(session: str) -> dict[str, Any]:
    return {"op": "ws_open", "interaction": "arith", "shard": 0, "path": "ws", "session": session, "timeout_s": 30}


def ws_exchange(session: str, kind: str = "reset", **data: Any) -> dict[str, Any]:
    return {"op": "ws_exchange", "session": session, "message": {"type": kind, "data": data}, "timeout_s": 30}


async def ping(socket: Any) -> None:
    pong = await socket.ping()
    await pong


# ---------------------------------------------------------------------- env servers


class _GymHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the relay's connections expect

    def do_GET(self) -> None:  # noqa: N802
        self._serve()

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._serve()

    def _serve(self) -> None:
        env: GymEnv = self.server  # type: ignore[assignment]
        with env.lock:
            env.now += 1
            env.peak = max(env.peak, env.now)
        try:
            env.gate.wait(WAIT_S)
            time.sleep(env.delay_s)
        finally:
            with env.lock:
                env.now -= 1
        payload = json.dumps({"observation": "What is 2 + 3?"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args: Any) -> None:
        pass


class GymEnv(ThreadingHTTPServer):
    """A gym env on 127.0.0.1 that takes ``delay_s`` per call (after ``gate`` opens) and counts
    the calls it has at once (``now``, ``peak``)."""

    daemon_threads = True
    block_on_close = False
    request_queue_size = 512  # every connection the relay opens at once is accepted

    def __init__(self, delay_s: float = 0.0, gate: threading.Event | None = None):
        super().__init__(("127.0.0.1", 0), _GymHandler)
        self.delay_s = delay_s
        self.gate = gate or threading.Event()
        if gate is None:
            self.gate.set()
        self.lock = threading.Lock()
        self.now = self.peak = 0
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # a relay that went away before its answer

    def close(self) -> None:
        self.gate.set()
        self.shutdown()
        self.server_close()


class WsEnv:
    """A WebSocket env on 127.0.0.1 (any path), shaped like OpenEnv's sessions: it answers each
    message with an observation echoing it, after ``data.sleep`` seconds, or with the raw text
    ``data.reply``; it counts sessions open now, at most at once, and closed."""

    def __init__(self) -> None:
        self.open = self.peak = self.closed = 0
        self.url = ""

    async def handle(self, socket: Any) -> None:
        self.open += 1
        self.peak = max(self.peak, self.open)
        try:
            async for text in socket:
                data = json.loads(text).get("data") or {}
                await asyncio.sleep(data.get("sleep", 0))
                reply = data.get("reply")
                await socket.send(reply if reply is not None else json.dumps({"type": "observation", "data": data}))
        except Exception:
            pass
        finally:
            self.open -= 1
            self.closed += 1


@contextlib.asynccontextmanager
async def ws_env() -> AsyncIterator[WsEnv]:
    env = WsEnv()
    async with serve(env.handle, "127.0.0.1", 0, max_size=None) as server:
        env.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        yield env


# ---------------------------------------------------------------------- 1. any frame


def test_the_relay_survives_any_frame(caplog):
    """Frames that are not JSON, nest 10,000 levels deep, are binary, lack an id or carry a hello
    of the wrong shape are skipped and logged (throttled, with a count); calls with an id but
    fields of the wrong type are refused; the relay keeps its connection and answers the next call."""
    env = GymEnv()
    skipped = [
        "not JSON {",
        "[" * 10_000 + "]" * 10_000,
        '{"type": "call", "id": 1, "body": ' + "[" * 10_000 + "]" * 10_000 + "}",
        json.dumps({"type": "hello", "interactions": 5}),
        json.dumps({"type": "hello", "interactions": [["arith"]]}),
        json.dumps([1, 2]),
        b"\x00\x01 a binary frame",
        json.dumps({"type": "call"}),
        json.dumps({"type": "call", "id": "7"}),
        json.dumps({"type": "call", "id": True}),
        json.dumps({"type": "something new"}),
    ]
    malformed = {
        2: {"op": ["http"]},
        3: http_call(interaction={"a": 1}),
        4: http_call(timeout_s="soon"),
        5: {**ws_open("s"), "path": ["ws"]},
        6: ws_exchange("s", "reset") | {"message": {"type": ["reset"]}},
        7: http_call(path=None),
    }

    async def main() -> EnvRelay:
        async with fake_server() as fake, running_relay(fake, env.url) as relay:
            with caplog.at_level(logging.WARNING, logger="opentinker.client.relay"):
                await fake.send(skipped)
                answers = await fake.call({**malformed, 8: http_call("health", "GET", junk="\ud800")})
            assert fake.count == 1 and relay.connections == 1 and relay.running and relay.error is None
            for call_id in malformed:
                assert answers[call_id]["error"] == "refused", (malformed[call_id], answers[call_id])
            assert answers[8]["status"] == 200
            return relay

    try:
        relay = asyncio.run(main())
    finally:
        env.close()
    assert relay.skipped == len(skipped) and relay.refused == len(malformed) and relay.error is None
    lines = [r.getMessage() for r in caplog.records if "frame(s) from the server that it cannot use" in r.getMessage()]
    assert 1 <= len(lines) < len(skipped), lines  # throttled: one line stands for several frames
    assert "not JSON" in lines[0]


def test_the_relay_ends_for_good_only_when_the_server_says_so():
    """A connection the server closes (1011) is made again, and the relay has no error meanwhile;
    4401 (the key refused) ends it with the reason in ``relay.error``."""
    seen_while_reconnected: list[Any] = []

    async def greet(fake: FakeServer, socket: Any, number: int) -> None:
        await fake.hello(socket, number)
        if number == 1:
            await socket.close(1011, "restarting")
        else:
            seen_while_reconnected.append(relay_box[0].error)
            await socket.close(4401, "the key was revoked")

    relay_box: list[EnvRelay] = []

    async def main() -> None:
        async with fake_server(greet) as fake, running_relay(fake, "http://127.0.0.1:9") as relay:
            relay_box.append(relay)
            await fake.until(lambda: not relay.running, "the relay's end")
            assert fake.count == 2 and relay.connections == 2

    asyncio.run(main())
    assert seen_while_reconnected == [None]
    assert relay_box[0].error == "the API key was refused: the key was revoked"


def test_a_bad_server_url_ends_the_relay_with_an_error():
    spec = InteractionSpec(name="arith", class_path="gym", config={"env_endpoint": "http://127.0.0.1:9",
                                                                    "relay": "client"})
    relay = EnvRelay(OpenTinkerClient("http://127.0.0.1:99999", "ot-fake"), "J", [spec]).start()
    relay._thread.join(WAIT_S)
    assert not relay.running
    assert relay.error is not None and relay.error.startswith("bad server URL")


class _BuggyFirstConnection(EnvRelay):
    """A relay whose first connection meets an exception no one foresaw (a bug)."""

    served = 0

    async def _serve(self, socket: Any) -> None:
        self.served += 1
        if self.served == 1:
            raise RuntimeError("a bug")
        await super()._serve(socket)


class _CrashingThread(EnvRelay):
    """A relay whose thread's main coroutine fails outright (a bug past every guard)."""

    async def _run(self) -> None:
        raise RuntimeError("a bug")


def test_an_unforeseen_exception_reconnects_and_a_crash_says_so():
    env = GymEnv()

    async def main() -> EnvRelay:
        async with fake_server() as fake, running_relay(fake, env.url, relay_class=_BuggyFirstConnection) as relay:
            await fake.until(lambda: fake.greeted == 2, "a second connection")
            answers = await fake.call({1: http_call("health", "GET")})
            assert answers[1]["status"] == 200 and fake.count == 2 and relay.running and relay.error is None
            return relay

    try:
        asyncio.run(main())
    finally:
        env.close()
    spec = InteractionSpec(name="arith", class_path="gym", config={"env_endpoint": env.url, "relay": "client"})
    crashed = _CrashingThread(OpenTinkerClient("http://127.0.0.1:9", "ot-fake"), "J", [spec]).start()
    crashed._thread.join(WAIT_S)
    assert not crashed.running and crashed.error == "the client relay crashed (RuntimeError: a bug)"


# ---------------------------------------------------------------------- 2 and 3. a busy relay


def test_a_busy_relay_keeps_reading_answers_pings_and_calls_the_env_64_at_once():
    """2,000 calls at once to an env that first holds every call, then takes 0.02 s each: the
    relay reads them all, the server's pings are answered while it works through them, the env
    has exactly 64 calls at once (reached while it holds them, never passed after), and every call
    is answered."""
    gate = threading.Event()
    env = GymEnv(delay_s=0.02, gate=gate)
    total = 2000
    pings_while_busy = 0

    async def keepalive(fake: FakeServer) -> None:
        nonlocal pings_while_busy
        while len(fake.answers) < total:
            await asyncio.wait_for(ping(fake.socket), 5)  # as uvicorn's keepalive: unanswered, it closes
            pings_while_busy += len(fake.answers) < total
            await asyncio.sleep(0.05)

    async def main() -> tuple[EnvRelay, dict[int, dict[str, Any]]]:
        async with fake_server() as fake, running_relay(fake, env.url) as relay:
            await fake.connected()
            pinging = asyncio.create_task(keepalive(fake))
            await fake.send([{"type": "call", "id": i, **http_call()} for i in range(total)])
            await fake.until(lambda: env.now == 64 or pinging.done(), "64 calls at the env")
            assert not pinging.done(), f"a ping went unanswered ({pinging.exception()!r})"
            gate.set()
            await fake.until(lambda: len(fake.answers) == total or pinging.done(), "every answer")
            await pinging  # raises if a ping went unanswered
            return relay, dict(fake.answers)

    try:
        relay, answers = asyncio.run(main())
    finally:
        env.close()
    assert pings_while_busy >= 1
    assert sorted(answers) == list(range(total)) and all(answer["status"] == 200 for answer in answers.values())
    assert relay.calls == total and relay.connections == 1
    assert env.peak == 64


def test_calls_past_the_queue_are_answered_busy_at_once():
    """An env that answers nothing yet: the relay queues MAX_QUEUED_CALLS calls (64 of them at
    the env) and answers each call past that with no_answer (busy) at once; pings are answered."""
    gate = threading.Event()
    env = GymEnv(gate=gate)
    extra = 20
    total = MAX_QUEUED_CALLS + extra

    async def main() -> dict[int, dict[str, Any]]:
        async with fake_server() as fake, running_relay(fake, env.url):
            socket = await fake.connected()
            await fake.send([{"type": "call", "id": i, **http_call()} for i in range(total)])
            await fake.until(lambda: len(fake.answers) >= extra, "the busy answers")
            await asyncio.wait_for(ping(socket), 5)
            await fake.until(lambda: env.now == 64, "64 calls at the env")
            answers = dict(fake.answers)
        gate.set()
        return answers

    try:
        answers = asyncio.run(main())
    finally:
        env.close()
    assert sorted(answers) == list(range(MAX_QUEUED_CALLS, total))
    for answer in answers.values():
        assert answer["error"] == "no_answer" and "the client relay is busy" in answer["detail"], answer
    assert env.peak == 64


def test_the_call_queue_is_bounded_by_the_size_of_its_frames():
    async def main() -> None:
        queue = CallQueue(max_calls=10, max_bytes=1000)
        assert queue.offer({"id": 1}, 600)
        assert not queue.offer({"id": 2}, 600)  # 1,200 bytes would wait
        assert queue.offer({"id": 3}, 400)
        assert not queue.offer({"id": 4}, 1)
        answered: list[int] = []

        async def answer(call: dict[str, Any]) -> None:
            answered.append(call["id"])

        worker = asyncio.create_task(queue.serve(answer))
        while queue.calls:
            await asyncio.sleep(0.01)
        worker.cancel()
        assert answered == [1, 3] and queue.bytes == 0
        assert queue.offer({"id": 5}, 1000)

    asyncio.run(main())


# ---------------------------------------------------------------------- 4. sessions


def test_concurrent_session_opens_never_pass_the_limit():
    """5,000 ws_open calls at once with max_sessions=50: at most 50 sessions are ever open at the
    env, and the rest are refused."""
    total, limit = 5000, 50

    async def main() -> tuple[dict[int, dict[str, Any]], WsEnv]:
        async with ws_env() as env, fake_server() as fake, \
                running_relay(fake, env.url, "openenv", max_sessions=limit):
            answers = await fake.call({i: ws_open(f"s{i}") for i in range(total)})
            assert env.open == limit
            return answers, env

    answers, env = asyncio.run(main())
    opened = [i for i, answer in answers.items() if answer.get("ok")]
    refused = [i for i, answer in answers.items() if answer.get("error") == "refused"]
    assert len(opened) == limit and len(refused) == total - limit
    assert all(f"holds {limit} env sessions already" in answers[i]["detail"] for i in refused)
    assert env.peak == limit


def test_idle_sessions_are_closed_and_busy_ones_are_not():
    """session_idle_s=1: a session with no exchange is closed at the env (an exchange on it then
    answers no_answer); one in an exchange longer than that is not closed under it."""

    async def main() -> None:
        async with ws_env() as env, fake_server() as fake, \
                running_relay(fake, env.url, "openenv", session_idle_s=1.0) as relay:
            assert (await fake.call({1: ws_open("idle")}))[1].get("ok")
            first = await fake.call({3: ws_exchange("idle", seed=1)})
            assert first[3]["message"] == {"type": "observation", "data": {"seed": 1}}
            assert (await fake.call({2: ws_open("busy")}))[2].get("ok")
            busy = asyncio.create_task(fake.call({4: ws_exchange("busy", "step", sleep=3.0)}))
            await fake.until(lambda: env.closed >= 1, "the idle session's close")
            assert (await busy)[4]["message"]["data"] == {"sleep": 3.0}  # not closed during its exchange
            late = await fake.call({5: ws_exchange("idle", "step")})
            assert late[5]["error"] == "no_answer" and "idle for over 1s" in late[5]["detail"]
            await fake.until(lambda: env.closed == 2 and env.open == 0, "the busy session's close once idle")
            assert relay.connections == 1

    asyncio.run(main())


def test_env_messages_are_read_with_a_depth_bound_and_sent_on_as_valid_text():
    """An env message nested deeper than MAX_ENV_JSON_DEPTH is a bad_answer; one that is not JSON
    too; a lone surrogate (JSON's "\\ud800") comes through escaped, on the same connection."""

    async def main() -> None:
        async with ws_env() as env, fake_server() as fake, running_relay(fake, env.url, "openenv") as relay:
            await fake.call({1: ws_open("s")})
            answers = await fake.call({
                2: ws_exchange("s", reply="[" * 200 + "]" * 200),
                3: ws_exchange("s", reply="not JSON"),
                4: ws_exchange("s", reply='{"type": "observation", "data": {"text": "\\ud800"}}'),
            })
            assert answers[2]["error"] == "bad_answer" and "deeper than 64 levels" in answers[2]["detail"]
            assert answers[3] == {"type": "answer", "id": 3, "error": "bad_answer",
                                  "detail": "a message that is not JSON"}
            assert answers[4]["message"] == {"type": "observation", "data": {"text": "\ud800"}}
            assert fake.count == 1 and relay.connections == 1 and env.open == 1

    asyncio.run(main())


# ---------------------------------------------------------------------- 5. OpenEnv at capacity


def test_capacity_reached_comes_through_the_relay(tmp_path):
    """A real OpenEnv server with max_concurrent_envs=1 accepts a second session, sends
    CAPACITY_REACHED and closes it: the relay's reset on it answers that message (which the
    server's opener waits and retries on), whether or not the close came before the reset."""
    from ..environments.openenv_server import running_openenv_server

    with running_openenv_server(tmp_path, max_concurrent_envs=1) as env_server:
        spec = InteractionSpec(name="arith", class_path="openenv",
                               config={"env_endpoint": env_server.url, "relay": "client"})

        async def main() -> dict[str, dict[str, Any]]:
            relay = EnvRelay(OpenTinkerClient("http://127.0.0.1:9", "ot-fake"), "J", [spec])
            try:
                assert await relay.env.handle(ws_open("first")) == {"ok": True}
                first = await relay.env.handle(ws_exchange("first", seed=1))
                assert first["message"]["type"] == "observation", first
                assert await relay.env.handle(ws_open("racing")) == {"ok": True}
                racing = await relay.env.handle(ws_exchange("racing", seed=2))  # the close may come first or not
                assert await relay.env.handle(ws_open("closed")) == {"ok": True}
                await asyncio.wait_for(relay.env.sessions.get("closed").socket.wait_closed(), WAIT_S)
                closed = await relay.env.handle(ws_exchange("closed", seed=3))  # sent on a closed connection
                after = await relay.env.handle(ws_exchange("closed", seed=3))
                return {"racing": racing, "closed": closed, "after": after}
            finally:
                await relay.env.sessions.close()

        answers = asyncio.run(main())
    for name in ("racing", "closed"):
        message = answers[name].get("message")
        assert message and message["type"] == "error" and message["data"]["code"] == "CAPACITY_REACHED", answers
    assert answers["after"]["error"] == "no_answer"  # nothing more on a session the env closed

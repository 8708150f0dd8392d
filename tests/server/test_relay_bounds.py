"""What a client relay can make the API process hold: answers that match no call sent on the
connection are dropped unread (a queued job's relay holds nothing), kept answers are bounded by
bytes (--env-relay-buffer-mb), malformed frames never end the relay, and RelayHub.wait_attached
wakes a waiter as soon as a client attaches.

The live tests run `opentinker-server serve` (its own `main`, flags and uvicorn options) in a
process of its own, so that its RSS (/proc/PID/status) is the API process's alone; only its
runner class is replaced by the suite's StandInRunner with a door to make relayed calls.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import pytest

from opentinker.environments.relay import RELAY_SLACK_S, RelayHub, _raise_for
from opentinker.environments.transport import BadAnswer
from opentinker.server.cli import build_parser
from opentinker.server.routers.relay import MAX_ANSWER_DEPTH, MIN_PRUNE, _Answers
from opentinker.server.settings import ServerSettings

MiB = 2**20
SPEC = {"name": "arith", "class_path": "gym", "config": {"env_endpoint": "http://127.0.0.1:9", "relay": "client"}}
CALL = {"op": "http", "interaction": "arith", "shard": 0, "method": "POST", "path": "/step", "body": {}}


def answer_text(call_id: int, body: str = "ok") -> str:
    """An answer as the client's relay writes it."""
    return json.dumps({"type": "answer", "id": call_id, "status": 200, "content_type": "application/json",
                       "body": body})


# RelayHub.wait_attached ---------------------------------------------------------------------


def test_wait_attached_wakes_a_waiting_thread_when_a_client_attaches():
    hub = RelayHub()
    assert hub.wait_attached(0.05) is False  # nobody attached: False once the time is up
    waiting, result = threading.Event(), []

    def waiter():
        waiting.set()
        result.append(hub.wait_attached(3600))

    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    waiting.wait(30)
    connection = hub.attach()
    thread.join(30)
    assert not thread.is_alive() and result == [True]  # woken by the attach, long before its hour
    assert hub.wait_attached(3600) is True  # attached now: at once
    hub.detach(connection)
    assert hub.wait_attached(0.05) is False


# _Answers: what the route keeps of a connection's frames -------------------------------------


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_only_answers_to_calls_sent_and_not_yet_answered_are_kept():
    async def main():
        answers = _Answers("job", budget_bytes=64 * MiB)
        await answers.offer(answer_text(5))  # before any call: dropped (a queued job's relay)
        answers.sent([{"id": 5, "timeout_s": 10.0}, {"id": 6, "timeout_s": 10.0}])
        for frame in (answer_text(7), "not json at all", None, '{"id": 5, "type": "answer"}', '[1, 2]',
                      answer_text(5)[:-1] + ', "id": 6}'):  # the head's id counts, not a later one
            await answers.offer(frame)
        await answers.offer(answer_text(5))  # an answered call: dropped
        batch, weight = await answers.batch()
        return answers, batch, weight

    answers, batch, weight = asyncio.run(main())
    assert [a["id"] for a in batch] == [5]
    assert batch[0]["body"] == "ok" and weight == answers.held_bytes > 0
    assert answers.dropped == {"no such call": 3, "not an answer": 4}


def test_an_answer_after_its_call_is_over_at_the_hub_is_dropped_and_unanswered_calls_are_forgotten():
    clock = FakeClock()
    old, new = range(2, 2 + 4 * MIN_PRUNE), range(10**6, 10**6 + 4 * MIN_PRUNE)

    async def main():
        answers = _Answers("job", budget_bytes=64 * MiB, clock=clock)
        answers.sent([{"id": 1, "timeout_s": 30.0}])
        clock.now += 30.0 + RELAY_SLACK_S + 0.1
        await answers.offer(answer_text(1))  # the hub gave up on call 1
        answers.sent([{"id": i, "timeout_s": 1.0} for i in old])
        clock.now += 1.0 + RELAY_SLACK_S + 0.1  # never answered, and over
        answers.sent([{"id": i, "timeout_s": 1.0} for i in new])
        return answers

    answers = asyncio.run(main())
    assert answers.dropped == {"no such call": 1}
    assert set(answers._awaited) == set(new)  # what is awaited: the calls not yet over


def test_an_unreadable_answer_answers_its_call_bad_answer():
    deep = '{"type": "answer", "id": 2, "status": 200, "body": "x", "more": ' + "[" * 500 + "]" * 500 + "}"
    shallow = '{"type": "answer", "id": 3, "message": ' + "[" * (MAX_ANSWER_DEPTH - 1) + "]" * (MAX_ANSWER_DEPTH - 1) + "}"

    async def main():
        answers = _Answers("job", budget_bytes=64 * MiB)
        answers.sent([{"id": i, "timeout_s": 10.0} for i in (1, 2, 3)])
        await answers.offer('{"type": "answer", "id": 1, oops')
        await answers.offer(deep)
        await answers.offer(shallow)
        return answers, (await answers.batch())[0]

    answers, batch = asyncio.run(main())
    assert [a["id"] for a in batch] == [1, 2, 3]
    for broken in batch[:2]:
        assert broken["error"] == "bad_answer"
        with pytest.raises(BadAnswer, match="could not be read"):
            _raise_for(broken)
    assert "nested deeper" in batch[1]["detail"]
    assert "error" not in batch[2]  # as deep as an answer may be
    assert answers.dropped == {"unreadable": 2}


def test_kept_answers_past_the_byte_budget_stop_the_reading_until_the_runner_has_them():
    async def main():
        answers = _Answers("job", budget_bytes=MiB)
        answers.sent([{"id": i, "timeout_s": 10.0} for i in (1, 2)])
        await answers.room()  # empty: room at once
        await answers.offer(answer_text(1, "x" * (MiB // 2)))
        await answers.room()  # half the budget: still room
        await answers.offer(answer_text(2, "x" * (MiB // 2)))
        blocked = asyncio.ensure_future(answers.room())
        await asyncio.sleep(0)
        full = not blocked.done()
        batch, weight = await answers.batch()
        still_full = not blocked.done()  # taken, not yet handed over
        answers.forwarded(weight)
        await blocked
        return full, still_full, len(batch), answers.held_bytes

    assert asyncio.run(main()) == (True, True, 2, 0)


def test_the_buffer_is_the_operators_choice_and_uvicorn_queues_one_message():
    assert build_parser().parse_args(["serve", "--env-relay-buffer-mb", "8"]).env_relay_buffer_mb == 8
    assert build_parser().parse_args(["serve"]).env_relay_buffer_mb == 64
    with pytest.raises(ValueError, match="env_relay_buffer_mb"):
        ServerSettings(env_relay_buffer_mb=0)
    options = ServerSettings().uvicorn_options()
    assert options["ws_max_queue"] == 1 and options["ws_max_size"] >= 32 * MiB
    assert options["ws_per_message_deflate"] is False  # no 1000x inflation of a small frame


# a real API process ------------------------------------------------------------------------

SERVER_SCRIPT = textwrap.dedent('''
    """`opentinker-server serve` whose job runner is the suite's StandInRunner, with a door to
    make relayed calls and read the hub's status."""
    import asyncio
    import importlib.util
    import sys

    import ray

    from opentinker.environments.relay import _raise_for
    from opentinker.server import cli, jobs

    spec = importlib.util.spec_from_file_location("relay_bounds_conftest", sys.argv[1])
    conftest = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = conftest
    spec.loader.exec_module(conftest)
    ray.cloudpickle.register_pickle_by_value(conftest)


    class CallingRunner(conftest.StandInRunner):
        def relay_call(self, op, timeout_s):
            """A call through the relay, as an interaction makes it: the answer, or what it raised."""
            try:
                answer = asyncio.run(self.relay.call(op, timeout_s))
                _raise_for(answer)
                return answer
            except Exception as error:
                return {"raised": type(error).__name__, "message": str(error)}

        def relay_status(self):
            return self.relay.status()


    jobs.DEFAULT_RUNNER = "__main__.CallingRunner"
    sys.exit(cli.main(sys.argv[2:]))
''')


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class RssPeak:
    """The peak RSS of a process while the ``with`` block runs (sampled every 10 ms)."""

    def __init__(self, pid: int):
        self.pid = pid
        self.peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            self._stop.wait(0.01)

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(10)
        self.peak = max(self.peak, rss_mb(self.pid))


@pytest.fixture(scope="module")
def api_process(ray_cluster, tmp_path_factory, helpers):
    """A real `opentinker-server serve` process on the session's Ray, one running job per user."""
    from opentinker.client.local_server import wait_for_health
    from opentinker.server.jobs import RAY_NAMESPACE
    from opentinker.server.store import Store

    data = tmp_path_factory.mktemp("relay-bounds")
    keys = {name: helpers.make_user(data, name) for name in ("ivy", "jay")}
    script = data / "serve_stand_in.py"
    script.write_text(SERVER_SCRIPT)
    port = _free_port()
    log_path = data / "server.log"
    log = open(log_path, "a")  # noqa: SIM115 - closed at teardown
    command = [sys.executable, str(script), str(Path(__file__).with_name("conftest.py")),
               "serve", "--port", str(port), "--data-dir", str(data), "--ray-address", ray_cluster,
               "--max-running-jobs", "1", "--log-level", "warning"]
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(url, process, log_path)
        store = Store(data / "opentinker.db")
        try:
            namespace = f"{RAY_NAMESPACE}-{store.server_id()[:12]}"
        finally:
            store.close()
        yield types.SimpleNamespace(url=url, pid=process.pid, keys=keys, namespace=namespace, log=log_path)
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)
        log.close()


class Relay:
    """A hand-made client relay on a job (a context manager): its frames are whatever a test writes."""

    def __init__(self, server, user: str, job_id: str):
        from websockets.sync.client import connect

        self.job_id = job_id
        self._connect = connect(server.url.replace("http", "ws") + f"/v1/jobs/{job_id}/relay",
                                additional_headers={"Authorization": f"Bearer {server.keys[user]}"}, proxy=None,
                                max_size=64 * MiB, open_timeout=30, compression=None)  # MiBs on the wire

    def __enter__(self) -> Relay:
        self.socket = self._connect.__enter__()
        hello = json.loads(self.socket.recv(timeout=30))
        assert hello["type"] == "hello" and hello["job_id"] == self.job_id
        return self

    def __exit__(self, *exc) -> None:
        self._connect.__exit__(*exc)

    def next_call(self) -> dict:
        call = json.loads(self.socket.recv(timeout=60))
        assert call["type"] == "call", call
        return call


def runner(server, job_id: str):
    import ray

    from opentinker.server.jobs import actor_name

    return ray.get_actor(actor_name(job_id), namespace=server.namespace)


def wait_attached(server, helpers, job_id: str):
    import ray

    actor = helpers.wait_for(lambda: _actor_or_none(server, job_id), 60, f"job {job_id}'s runner")
    helpers.wait_for(lambda: ray.get(actor.relay_status.remote(), timeout=30)["connected"], 60,
                     f"job {job_id}'s relay to attach")
    return actor


def _actor_or_none(server, job_id: str):
    try:
        return runner(server, job_id)
    except ValueError:
        return None


def flood(relay: Relay, count: int, size: int, first_id: int) -> None:
    """``count`` answers of ``size`` bytes to calls ``first_id``... (none of them sent)."""
    filler = "x" * (size - len(answer_text(first_id + count, "")))
    for call_id in range(first_id, first_id + count):
        relay.socket.send(answer_text(call_id, filler))


def test_answers_to_no_call_hold_nothing_in_the_api_process(api_process, helpers):
    """Answers of 32 MiB each (64, or $OPENTINKER_RELAY_FLOOD_FRAMES), to calls never sent, on the
    relay of a queued job and of a running one (with a call of its own in flight): the API
    process's RSS stays flat, and both relays carry their job's calls afterwards."""
    import ray

    # 64 frames (2 GiB) already tell a bounded route from the one the audit saw grow by 2.1 GB; the
    # audit's 256 (8 GiB) take 2.5 min on 2 cores: OPENTINKER_RELAY_FLOOD_FRAMES=256 runs them.
    size, count = 32 * MiB, int(os.environ.get("OPENTINKER_RELAY_FLOOD_FRAMES", "64"))
    with httpx_client(api_process, "ivy") as raw:
        running = helpers.create_job(raw, "hold-running", mode="client", interactions=[SPEC])
        helpers.wait_status(raw, running, "running", timeout=60)
        queued = helpers.create_job(raw, "hold-queued", mode="client", interactions=[SPEC])
        assert helpers.job_status(raw, queued) == "queued"  # the user's one slot is held
        try:
            with Relay(api_process, "ivy", queued) as to_queued, Relay(api_process, "ivy", running) as to_running:
                actor = wait_attached(api_process, helpers, running)
                in_flight = actor.relay_call.remote(dict(CALL), 600)
                call = to_running.next_call()
                report = []
                for name, relay, first_id in (("queued", to_queued, 1), ("running", to_running, call["id"] + 1000)):
                    before = rss_mb(api_process.pid)
                    with RssPeak(api_process.pid) as peak:
                        flood(relay, count, size, first_id)
                        assert relay.socket.ping().wait(120)  # the server has read the frames before this one
                    after = rss_mb(api_process.pid)
                    report.append((name, before, peak.peak, after))
                    print(f"\n{count} x {size // MiB} MiB answers to no call, {name} job's relay: API process "
                          f"RSS before {before:.0f} MB, peak {peak.peak:.0f} MB, after {after:.0f} MB")

                to_running.socket.send(answer_text(call["id"], "still here"))
                assert ray.get(in_flight, timeout=60)["body"] == "still here"
                assert helpers.job_status(raw, queued) == "queued"
                assert raw.get(f"/v1/jobs/{queued}").json()["relay"]["connected"]
                raw.post(f"/v1/jobs/{running}/cancel")  # the queued job starts: its relay carries its calls
                helpers.wait_status(raw, queued, "running", timeout=60)
                actor = wait_attached(api_process, helpers, queued)
                in_flight = actor.relay_call.remote(dict(CALL), 600)
                call = to_queued.next_call()
                to_queued.socket.send(answer_text(call["id"], "queued no more"))
                assert ray.get(in_flight, timeout=60)["body"] == "queued no more"
        finally:
            for job_id in (running, queued):
                raw.post(f"/v1/jobs/{job_id}/cancel")
    for name, before, peak, after in report:
        # Flat: whatever the count, no more than what reading one frame costs while the next arrives
        # (a frame's bytes, its text and the next one's bytes: about 3 x 32 MiB; the unbounded route
        # grew by 2.1 GB over 64 frames), and nothing stays.
        assert peak - before < 4 * size / MiB, (name, before, peak, after)
        assert after - before < 100, (name, before, peak, after)


def test_the_relay_carries_calls_after_thousands_of_unmatched_and_malformed_frames(api_process, helpers):
    """5,000 answers to calls never sent, frames that are no answer (not JSON, empty, 100,000
    brackets, binary), an answer too deep to read and one that is not JSON: the same connection
    carries the job's calls on; each unreadable answer fails its own call (BadAnswer)."""
    import ray

    paths = ("/reset", "/step", "/finalize")
    with httpx_client(api_process, "jay") as raw:
        job_id = helpers.create_job(raw, "hold-abused", mode="client", interactions=[SPEC])
        helpers.wait_status(raw, job_id, "running", timeout=60)
        try:
            with Relay(api_process, "jay", job_id) as relay:
                actor = wait_attached(api_process, helpers, job_id)
                results = {path: actor.relay_call.remote({**CALL, "path": path}, 600) for path in paths}
                ids = {call["path"]: call["id"] for call in (relay.next_call() for _ in paths)}
                for call_id in range(10**6, 10**6 + 5000):  # answers to calls never sent
                    relay.socket.send(answer_text(call_id))
                for frame in ("not json", "", "[" * 100_000, json.dumps({"id": ids["/reset"], "type": "answer"}),
                              b"\x00binary"):  # no answer's head (the fourth: its id does not come first)
                    relay.socket.send(frame)
                relay.socket.send(answer_text(ids["/reset"])[:-1] + ", " + "[" * 10_000)  # too deep to read
                relay.socket.send('{"type": "answer", "id": %d, oops' % ids["/step"])  # not JSON
                relay.socket.send(answer_text(ids["/finalize"], "carried"))
                relay.socket.send(answer_text(ids["/finalize"], "twice"))  # answered already: dropped
                reset, step, finalize = (ray.get(results[path], timeout=60) for path in paths)
                assert reset.get("raised") == step.get("raised") == "BadAnswer", (reset, step)
                assert "nested deeper" in reset["message"] and "could not be read" in step["message"]
                assert finalize["body"] == "carried"
                again = actor.relay_call.remote(dict(CALL), 600)  # the same connection carries on
                relay.socket.send(answer_text(relay.next_call()["id"], "and on"))
                assert ray.get(again, timeout=60)["body"] == "and on"
        finally:
            raw.post(f"/v1/jobs/{job_id}/cancel")
    expected = (f"job {job_id}: client relay frames dropped: "
                "{'no such call': 5001, 'not an answer': 5, 'unreadable': 2}")
    helpers.wait_for(lambda: expected in api_process.log.read_text(), 30, "the relay's count of dropped frames")


def httpx_client(server, user: str):
    import httpx

    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.keys[user]}"},
                        timeout=30.0, trust_env=False)

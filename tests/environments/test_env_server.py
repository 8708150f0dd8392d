"""The env-protocol server against real uvicorn servers on 127.0.0.1 and real httpx clients."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
import uuid

import httpx
import pytest

from opentinker.environments.server import create_env_app, running_app_servers, running_env_server

pytestmark = pytest.mark.timeout(60)


class RecordingEnv:
    """Echoes the actions it saw; ``boom`` raises, ``stop`` ends the episode."""

    closed: list[str] = []  # labels of closed instances, across all objects
    lock = threading.Lock()

    def __init__(self, tag: str = "default", step_delay: float = 0.0):
        self.tag = tag
        self.step_delay = step_delay
        self.label: str | None = None
        self.history: list[str] = []
        self.in_step = False
        self.overlaps = 0

    def reset(self, seed: int | None = None, label: str = "", fail: bool = False, as_text: bool = False):
        if fail:
            raise ValueError("reset was asked to fail")
        self.label = label
        self.history = []
        if as_text:
            return f"plain {label}"
        return {
            "observation": f"hello {label}",
            "system_prompt": f"system for {self.tag}",
            "info": {"seed": seed, "tag": self.tag},
        }

    def step(self, action: str):
        if self.in_step:
            self.overlaps += 1
        self.in_step = True
        try:
            if self.step_delay:
                time.sleep(self.step_delay)
            if action == "boom":
                raise RuntimeError("the env exploded")
            self.history.append(action)
            return (
                f"{self.label}:{'|'.join(self.history)}",
                float(len(self.history)),
                action == "stop",
                {"history": list(self.history), "overlaps": self.overlaps},
            )
        finally:
            self.in_step = False

    def close(self) -> None:
        with self.lock:
            RecordingEnv.closed.append(self.label)


def new_id() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture(scope="module")
def server():
    app = create_env_app(RecordingEnv, env_kwargs={"tag": "shared"})
    with running_app_servers([app]) as urls:
        with httpx.Client(base_url=urls[0], timeout=10.0, trust_env=False) as client:
            yield app, client


def test_reset_step_finalize_round_trip(server):
    app, client = server
    iid = new_id()
    reset = client.post("/reset", json={"instance_id": iid, "job_id": "job-1", "seed": 7, "label": iid})
    assert reset.status_code == 200
    assert reset.json() == {
        "observation": f"hello {iid}",
        "system_prompt": "system for shared",
        "info": {"seed": 7, "tag": "shared"},
    }
    assert app.state.instances[iid].job_id == "job-1"

    step = client.post("/step", json={"instance_id": iid, "action": "a"}).json()
    assert step == {"observation": f"{iid}:a", "reward": 1.0, "done": False, "info": {"history": ["a"], "overlaps": 0}}
    step = client.post("/step", json={"instance_id": iid, "action": "stop"}).json()
    assert step["observation"] == f"{iid}:a|stop" and step["reward"] == 2.0 and step["done"] is True

    assert client.post("/finalize", json={"instance_id": iid}).json() == {"ok": True}
    assert iid in RecordingEnv.closed
    assert iid not in app.state.instances


def test_health_keeps_counters_for_a_bounded_number_of_job_ids(server):
    """Job ids come from clients: 300 of them leave the newest MAX_TRACKED_JOBS in /health."""
    from opentinker.environments.env_table import MAX_TRACKED_JOBS

    _, client = server
    for i in range(MAX_TRACKED_JOBS + 44):
        iid = new_id()
        client.post("/reset", json={"instance_id": iid, "label": "x", "job_id": f"job-{i}"})
        client.post("/finalize", json={"instance_id": iid, "job_id": f"job-{i}"})
    jobs = client.get("/health").json()["jobs"]
    assert len(jobs) == MAX_TRACKED_JOBS
    assert f"job-{MAX_TRACKED_JOBS + 43}" in jobs and "job-0" not in jobs


def test_plain_text_reset_and_seed_only_when_given(server):
    _, client = server
    iid = new_id()
    body = client.post("/reset", json={"instance_id": iid, "label": "x", "as_text": True}).json()
    assert body == {"observation": "plain x", "system_prompt": None, "info": {}}
    body = client.post("/reset", json={"instance_id": iid, "label": "y"}).json()
    assert body["info"]["seed"] is None  # not passed, so reset's default applies
    client.post("/finalize", json={"instance_id": iid})


def test_health_counts_instances(server):
    _, client = server
    before = client.get("/health").json()
    assert before["status"] == "ok" and before["env"] == "RecordingEnv"
    ids = [new_id() for _ in range(3)]
    for iid in ids:
        client.post("/reset", json={"instance_id": iid, "label": iid})
    assert client.get("/health").json()["instances"] == before["instances"] + 3
    for iid in ids:
        client.post("/finalize", json={"instance_id": iid})
    assert client.get("/health").json()["instances"] == before["instances"]


def test_missing_field_is_422_naming_it(server):
    _, client = server
    response = client.post("/step", json={"instance_id": new_id()})
    assert response.status_code == 422
    assert "action" in response.json()["error"]
    response = client.post("/reset", json={"seed": 3})
    assert response.status_code == 422
    assert "instance_id" in response.json()["error"]


def test_unknown_instance_step_is_404(server):
    _, client = server
    response = client.post("/step", json={"instance_id": "nope-123", "action": "a"})
    assert response.status_code == 404
    assert response.json()["instance_id"] == "nope-123"
    assert "nope-123" in response.json()["error"]


def test_user_exceptions_are_500_and_server_keeps_serving(server):
    _, client = server
    iid = new_id()
    response = client.post("/reset", json={"instance_id": iid, "fail": True})
    assert response.status_code == 500
    assert response.json()["error"] == "ValueError: reset was asked to fail"
    assert client.post("/step", json={"instance_id": iid, "action": "a"}).status_code == 404  # never stored

    client.post("/reset", json={"instance_id": iid, "label": iid})
    response = client.post("/step", json={"instance_id": iid, "action": "boom"})
    assert response.status_code == 500
    assert response.json() == {"error": "RuntimeError: the env exploded", "instance_id": iid}
    # Same instance, same server: still fine.
    assert client.post("/step", json={"instance_id": iid, "action": "ok"}).json()["observation"] == f"{iid}:ok"
    assert client.get("/health").status_code == 200
    client.post("/finalize", json={"instance_id": iid})


def test_step_after_done_is_409(server):
    _, client = server
    iid = new_id()
    client.post("/reset", json={"instance_id": iid, "label": iid})
    assert client.post("/step", json={"instance_id": iid, "action": "stop"}).json()["done"] is True
    response = client.post("/step", json={"instance_id": iid, "action": "again"})
    assert response.status_code == 409
    assert iid in response.json()["error"]
    # A reset starts a fresh episode on the same id.
    client.post("/reset", json={"instance_id": iid, "label": iid})
    assert client.post("/step", json={"instance_id": iid, "action": "b"}).json()["observation"] == f"{iid}:b"
    client.post("/finalize", json={"instance_id": iid})


def test_reset_replaces_and_closes_existing_instance(server):
    app, client = server
    iid = new_id()
    client.post("/reset", json={"instance_id": iid, "label": f"{iid}-old"})
    client.post("/step", json={"instance_id": iid, "action": "a"})
    first = app.state.instances[iid].env
    client.post("/reset", json={"instance_id": iid, "label": f"{iid}-new"})
    assert app.state.instances[iid].env is not first  # a new object, not a re-reset
    assert f"{iid}-old" in RecordingEnv.closed
    assert client.post("/step", json={"instance_id": iid, "action": "z"}).json()["observation"] == f"{iid}-new:z"
    client.post("/finalize", json={"instance_id": iid})


def test_finalize_is_idempotent(server):
    _, client = server
    iid = new_id()
    client.post("/reset", json={"instance_id": iid, "label": iid})
    for _ in range(3):
        response = client.post("/finalize", json={"instance_id": iid})
        assert response.status_code == 200 and response.json() == {"ok": True}
    assert RecordingEnv.closed.count(iid) == 1
    assert client.post("/finalize", json={"instance_id": "never-existed"}).json() == {"ok": True}


class PeakEnv(RecordingEnv):
    """Counts how many steps (over all instances) run at the same moment."""

    active = 0
    peak = 0

    def step(self, action: str):
        with self.lock:
            PeakEnv.active += 1
            PeakEnv.peak = max(PeakEnv.peak, PeakEnv.active)
        try:
            return super().step(action)
        finally:
            with self.lock:
                PeakEnv.active -= 1


def test_many_instances_concurrently_without_cross_talk():
    n_instances, n_steps = 32, 5

    async def episode(client: httpx.AsyncClient, iid: str) -> list[dict]:
        await client.post("/reset", json={"instance_id": iid, "label": iid})
        results = []
        for k in range(n_steps):
            response = await client.post("/step", json={"instance_id": iid, "action": f"{iid}-{k}"})
            response.raise_for_status()
            results.append(response.json())
        await client.post("/finalize", json={"instance_id": iid})
        return results

    async def main(url: str):
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(base_url=url, timeout=20.0, limits=limits, trust_env=False) as client:
            ids = [f"inst{i}" for i in range(n_instances)]
            all_results = await asyncio.gather(*(episode(client, iid) for iid in ids))
            return ids, all_results

    app = create_env_app(PeakEnv, env_kwargs={"step_delay": 0.02})
    with running_app_servers([app]) as urls:
        ids, all_results = asyncio.run(main(urls[0]))
        assert app.state.stats.steps == n_instances * n_steps
        assert not app.state.instances

    for iid, results in zip(ids, all_results):
        expected = [f"{iid}-{k}" for k in range(n_steps)]
        assert results[-1]["info"]["history"] == expected  # own actions only, in order
        assert [r["reward"] for r in results] == [float(k + 1) for k in range(n_steps)]
    # Steps of different instances really ran side by side in the thread pool.
    assert PeakEnv.peak > 1


def test_steps_on_one_instance_never_interleave():
    async def main(url: str) -> list[dict]:
        async with httpx.AsyncClient(base_url=url, timeout=20.0, trust_env=False) as client:
            await client.post("/reset", json={"instance_id": "solo", "label": "solo"})
            responses = await asyncio.gather(
                *(client.post("/step", json={"instance_id": "solo", "action": str(k)}) for k in range(12))
            )
            return [r.json() for r in responses]

    app = create_env_app(RecordingEnv, env_kwargs={"step_delay": 0.01})
    with running_app_servers([app]) as urls:
        results = asyncio.run(main(urls[0]))
        env = app.state.instances["solo"].env
    assert env.overlaps == 0
    assert sorted(env.history, key=int) == [str(k) for k in range(12)]
    assert sorted(r["reward"] for r in results) == [float(k + 1) for k in range(12)]


def test_idle_instances_expire():
    with running_env_server(RecordingEnv, idle_timeout_s=0.3, sweep_interval_s=0.05) as urls:
        with httpx.Client(base_url=urls[0], timeout=5.0, trust_env=False) as client:
            client.post("/reset", json={"instance_id": "idle", "label": "idle-expiry"})
            client.post("/reset", json={"instance_id": "busy", "label": "busy-expiry"})
            deadline = time.monotonic() + 0.6
            while time.monotonic() < deadline:  # keep "busy" alive well past the timeout
                assert client.post("/step", json={"instance_id": "busy", "action": "x"}).status_code == 200
                time.sleep(0.05)
            assert client.get("/health").json()["instances"] == 1
            assert "idle-expiry" in RecordingEnv.closed and "busy-expiry" not in RecordingEnv.closed
            assert client.post("/step", json={"instance_id": "idle", "action": "x"}).status_code == 404
            deadline = time.monotonic() + 5.0
            while client.get("/health").json()["instances"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert client.get("/health").json()["instances"] == 0
            assert "busy-expiry" in RecordingEnv.closed


def test_shards_on_consecutive_ports_with_independent_state():
    with running_env_server(RecordingEnv, num_shards=2) as urls:
        assert len(urls) == 2
        ports = [int(u.rsplit(":", 1)[1]) for u in urls]
        assert ports[1] == ports[0] + 1
        assert all(u.startswith("http://127.0.0.1:") for u in urls)
        with httpx.Client(timeout=5.0, trust_env=False) as client:
            client.post(f"{urls[0]}/reset", json={"instance_id": "same", "label": "shard0"})
            client.post(f"{urls[1]}/reset", json={"instance_id": "same", "label": "shard1"})
            client.post(f"{urls[1]}/reset", json={"instance_id": "only1", "label": "only1"})
            assert client.post(f"{urls[0]}/step", json={"instance_id": "same", "action": "a"}).json()[
                "observation"
            ] == "shard0:a"
            assert client.post(f"{urls[1]}/step", json={"instance_id": "same", "action": "b"}).json()[
                "observation"
            ] == "shard1:b"
            assert client.get(f"{urls[0]}/health").json()["instances"] == 1
            assert client.get(f"{urls[1]}/health").json()["instances"] == 2
            assert client.post(f"{urls[0]}/step", json={"instance_id": "only1", "action": "a"}).status_code == 404


def test_server_stops_and_closes_leftovers_on_exit():
    with running_env_server(RecordingEnv) as urls:
        with httpx.Client(base_url=urls[0], timeout=5.0, trust_env=False) as client:
            client.post("/reset", json={"instance_id": "left", "label": "leftover-at-exit"})
    assert "leftover-at-exit" in RecordingEnv.closed
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{urls[0]}/health", timeout=1.0, trust_env=False)


def test_server_and_games_import_without_torch():
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'transformers', 'ray', 'vllm'):\n"
        "            raise ImportError('blocked heavy import: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import opentinker.environments.server, opentinker.environments.games\n"
        "import opentinker.environments.games.__main__\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


# Step indices, job ids, truncation ------------------------------------------------------


def test_step_index_applies_replays_or_refuses(server):
    app, client = server
    iid = new_id()
    client.post("/reset", json={"instance_id": iid, "label": iid})
    first = client.post("/step", json={"instance_id": iid, "action": "a", "step": 0})
    assert first.status_code == 200 and first.json()["observation"] == f"{iid}:a"
    # the same index again: a retry whose answer was lost gets the stored answer; env.step is not called
    replayed_before = app.state.stats.replayed_steps
    again = client.post("/step", json={"instance_id": iid, "action": "a", "step": 0})
    assert again.status_code == 200 and again.json() == first.json()
    assert app.state.instances[iid].env.history == ["a"]
    assert app.state.stats.replayed_steps == replayed_before + 1
    assert client.post("/step", json={"instance_id": iid, "action": "b", "step": 1}).json()["observation"] == f"{iid}:a|b"
    # anything else is a conflict naming what was expected and what came
    for wrong in (0, 3):
        response = client.post("/step", json={"instance_id": iid, "action": "c", "step": wrong})
        assert response.status_code == 409
        assert response.json() == {
            "error": f"step index mismatch for instance {iid!r}: expected step 2, got {wrong}", "instance_id": iid,
        }
    assert app.state.instances[iid].env.history == ["a", "b"]
    # without an index a step is applied as it comes, as before
    assert client.post("/step", json={"instance_id": iid, "action": "c"}).json()["observation"] == f"{iid}:a|b|c"
    response = client.post("/step", json={"instance_id": iid, "action": "d", "step": -1})
    assert response.status_code == 422 and "step" in response.json()["error"]
    client.post("/finalize", json={"instance_id": iid})


def test_a_retried_last_step_of_a_finished_episode_gets_its_answer_again(server):
    _, client = server
    iid = new_id()
    client.post("/reset", json={"instance_id": iid, "label": iid})
    done = client.post("/step", json={"instance_id": iid, "action": "stop", "step": 0}).json()
    assert done["done"] is True
    assert client.post("/step", json={"instance_id": iid, "action": "stop", "step": 0}).json() == done
    assert client.post("/step", json={"instance_id": iid, "action": "more", "step": 1}).status_code == 409
    # a reset starts counting from 0 again
    client.post("/reset", json={"instance_id": iid, "label": iid})
    assert client.post("/step", json={"instance_id": iid, "action": "x", "step": 1}).status_code == 409
    assert client.post("/step", json={"instance_id": iid, "action": "x", "step": 0}).status_code == 200
    client.post("/finalize", json={"instance_id": iid})


def test_statistics_are_kept_per_job():
    app = create_env_app(RecordingEnv)
    with running_app_servers([app]) as (url,):
        with httpx.Client(base_url=url, timeout=10.0, trust_env=False) as client:
            for job, iid in (("job-a", "a1"), ("job-a", "a2"), ("job-b", "b1"), (None, "n1")):
                body = {"instance_id": iid, "label": iid, **({"job_id": job} if job else {})}
                assert client.post("/reset", json=body).status_code == 200
            client.post("/step", json={"instance_id": "a1", "action": "x", "step": 0, "job_id": "job-a"})
            client.post("/step", json={"instance_id": "a1", "action": "x", "step": 0, "job_id": "job-a"})  # replay
            client.post("/step", json={"instance_id": "b1", "action": "boom", "job_id": "job-b"})  # a user error
            client.post("/step", json={"instance_id": "n1", "action": "x"})
            # an instance answers only to the job that reset it
            stolen = client.post("/step", json={"instance_id": "a2", "action": "x", "job_id": "job-b"})
            assert stolen.status_code == 409 and "belongs to another job" in stolen.json()["error"]
            client.post("/finalize", json={"instance_id": "a1", "job_id": "job-a"})
            client.post("/reset", json={"instance_id": "bad", "fail": True, "job_id": "job-b"})
            health = client.get("/health").json()
    common = {"expired": 0}
    assert health["instances"] == 3
    assert health["jobs"] == {
        "job-a": {"instances": 1, "resets": 2, "steps": 1, "replayed_steps": 1, "finalized": 1, "user_errors": 0,
                  **common},
        "job-b": {"instances": 1, "resets": 1, "steps": 0, "replayed_steps": 0, "finalized": 0, "user_errors": 2,
                  **common},
        "default": {"instances": 1, "resets": 1, "steps": 1, "replayed_steps": 0, "finalized": 0, "user_errors": 0,
                    **common},
    }
    stats = app.state.stats
    assert (stats.resets, stats.steps, stats.replayed_steps, stats.finalized, stats.user_errors) == (4, 2, 1, 1, 2)
    assert stats.by_job["job-a"].steps == 1


class GymnasiumEnv:
    """Returns gymnasium 5-tuples: the action names (terminated, truncated)."""

    def reset(self, **kwargs):
        return "start", {}

    def step(self, action):
        terminated, truncated = {"cut": (False, True), "end": (True, False), "both": (True, True),
                                 "go": (False, False)}[action]
        return "obs", 0.0, terminated, truncated, {"k": 1}


def test_gymnasium_truncation_survives_as_info_truncated():
    with running_env_server(GymnasiumEnv) as (url,):
        with httpx.Client(base_url=url, timeout=10.0, trust_env=False) as client:
            answers = {}
            for action in ("cut", "end", "both", "go"):
                iid = new_id()
                client.post("/reset", json={"instance_id": iid})
                answers[action] = client.post("/step", json={"instance_id": iid, "action": action}).json()
    assert answers["cut"]["done"] is True and answers["cut"]["info"] == {"k": 1, "truncated": True}
    for action in ("end", "both"):  # terminated: the episode really ended
        assert answers[action]["done"] is True and answers[action]["info"] == {"k": 1}
    assert answers["go"]["done"] is False and answers["go"]["info"] == {"k": 1}

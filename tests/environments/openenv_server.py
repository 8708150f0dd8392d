"""A real OpenEnv environment server for the tests: the env module below, written to a file and
served by openenv's own ``create_fastapi_app`` + ``uvicorn.run`` in a process of the OpenEnv
venv (``make install-openenv`` makes ``.venv-openenv``; ``OPENTINKER_OPENENV_PYTHON`` names
another python with ``openenv==0.10.0``). Tests that need it skip, saying so, when there is none.

The env: the arithmetic question the tiny model was warmed up on ("What is a + b?", drawn from
the reset's seed), graded on the first integer of the answer (reward 1.0, done), with
``max_tries`` tries (reset kwarg, 3 by default: a wrong answer says so and asks again). The
answer "crash" makes the env raise; "sleep N" makes it sleep N seconds first; "deep" makes it
answer an observation nested 200 levels deep (so does every step after ``POST /fault
{"deep_steps": K}``, K times); after ``POST /fault {"hold": true}`` steps wait until ``{"hold":
false}`` (a rollout held in flight, for a test to break). ``GET /stats`` counts env instances (live now, the most at once,
made in all) and records each reset's episode id, seed and other kwargs.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]

ENV_SOURCE = '''
import random, re, sys, threading, time

from pydantic import Field
from openenv.core.env_server.http_server import create_fastapi_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class ArithAction(Action):
    answer: str = Field(max_length=200, description="the model's reply")


class ArithObservation(Observation):
    text: str = ""
    tries: int = 0


LOCK = threading.Lock()
STATS = {"live": 0, "peak": 0, "created": 0, "resets": {}, "held": 0}
FAULTS = {"deep_steps": 0}  # POST /fault {"deep_steps": K}: the next K steps answer nested DEEP levels
DEEP = 200
RELEASED = threading.Event()
RELEASED.set()


class ArithEnv(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State(episode_id=None, step_count=0)
        self.a = self.b = 0
        self.max_tries = 3
        with LOCK:
            STATS["live"] += 1
            STATS["created"] += 1
            STATS["peak"] = max(STATS["peak"], STATS["live"])

    def close(self):
        with LOCK:
            STATS["live"] -= 1

    def reset(self, seed=None, episode_id=None, max_tries=3, **kwargs):
        rng = random.Random(seed)
        self.a, self.b = rng.randint(0, 99), rng.randint(0, 99)
        self.max_tries = int(max_tries)
        self._state = State(episode_id=episode_id, step_count=0)
        with LOCK:
            if len(STATS["resets"]) < 10000:
                STATS["resets"][str(episode_id)] = {"seed": seed, "max_tries": max_tries, "kwargs": kwargs}
        return ArithObservation(text=f"What is {self.a} + {self.b}?", tries=0)

    def step(self, action, timeout_s=None, **kwargs):
        if action.answer == "crash":
            raise RuntimeError("the simulator crashed")
        with LOCK:
            STATS["held"] += 1
        try:
            RELEASED.wait(120)  # POST /fault {"hold": true}: steps wait here until {"hold": false}
        finally:
            with LOCK:
                STATS["held"] -= 1
        with LOCK:
            deep = FAULTS["deep_steps"] > 0 or action.answer.startswith("deep")
            FAULTS["deep_steps"] = max(0, FAULTS["deep_steps"] - 1)
        if deep:  # an answer nested DEEP levels (in the observation's metadata)
            nested = {}
            for _ in range(DEEP):
                nested = {"x": nested}
            self._state.step_count += 1
            return ArithObservation(text="deep", tries=self._state.step_count, metadata={"deep": nested})
        if action.answer.startswith("sleep "):
            time.sleep(float(action.answer.split()[1]))
        self._state.step_count += 1
        tries = self._state.step_count
        found = re.search(r"-?\\d+", action.answer)
        if found is not None and int(found.group(0)) == self.a + self.b:
            return ArithObservation(text="Correct.", tries=tries, reward=1.0, done=True)
        if tries >= self.max_tries:
            return ArithObservation(text=f"Wrong; it was {self.a + self.b}.", tries=tries, reward=0.0, done=True)
        return ArithObservation(text=f"Wrong. What is {self.a} + {self.b}?", tries=tries, reward=0.0, done=False)

    @property
    def state(self):
        return self._state


app = create_fastapi_app(ArithEnv, ArithAction, ArithObservation, max_concurrent_envs=int(sys.argv[2]))


@app.get("/stats")
def stats():
    with LOCK:
        return {**STATS, "resets": dict(STATS["resets"]), **FAULTS}


@app.post("/fault")
def fault(faults: dict):
    with LOCK:
        if "deep_steps" in faults:
            FAULTS["deep_steps"] = int(faults["deep_steps"])
    if "hold" in faults:
        (RELEASED.clear if faults["hold"] else RELEASED.set)()
    return {**FAULTS, "hold": not RELEASED.is_set()}


if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


def question(seed: int) -> tuple[str, int]:
    """The env's first observation for ``seed`` and its answer (as the env draws them)."""
    rng = random.Random(seed)
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"What is {a} + {b}?", a + b


def openenv_python() -> str:
    """The python of the OpenEnv venv; the test skips, saying how to make one, when there is none."""
    python = os.environ.get("OPENTINKER_OPENENV_PYTHON") or str(REPO / ".venv-openenv" / "bin" / "python")
    if not Path(python).exists():
        pytest.skip(f"no OpenEnv venv at {python}: `make install-openenv` makes one (or set "
                    "OPENTINKER_OPENENV_PYTHON to a python with openenv==0.10.0)")
    return python


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class OpenEnvServer:
    """One env server process; ``url``, ``stats()``, ``kill()``."""

    def __init__(self, folder: Path, max_concurrent_envs: int = 64, source: str = ENV_SOURCE):
        self.python = openenv_python()
        self.module = folder / "arith_openenv.py"
        self.module.write_text(source)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = folder / f"server-{self.port}.log"
        self.max_concurrent_envs = max_concurrent_envs
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 90.0) -> OpenEnvServer:
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen([self.python, str(self.module), str(self.port),
                                             str(self.max_concurrent_envs)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the OpenEnv server exited ({self.process.returncode}): {self.log.read_text()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/health", timeout=1.0, trust_env=False).status_code == 200:
                    return self
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"the OpenEnv server did not answer /health within {timeout_s:g}s: {self.log.read_text()}")

    def stats(self) -> dict:
        return httpx.get(f"{self.url}/stats", timeout=10.0, trust_env=False).json()

    def fault(self, **faults) -> None:
        """``deep_steps=K``: the next K steps answer an observation nested 200 levels deep;
        ``hold=True``: steps wait (``stats()["held"]`` of them) until ``hold=False``."""
        httpx.post(f"{self.url}/fault", json=faults, timeout=10.0, trust_env=False)

    def wait_idle(self, timeout_s: float = 10.0) -> dict:
        """The stats once no env instance is live (the server closes them as sessions end)."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.stats()
            if stats["live"] == 0 or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)


@contextlib.contextmanager
def running_openenv_server(folder: Path, max_concurrent_envs: int = 64, source: str = ENV_SOURCE
                           ) -> Iterator[OpenEnvServer]:
    """``source``: the env module's text (default: :data:`ENV_SOURCE`'s arithmetic env); it is run
    as ``python module.py PORT MAX_CONCURRENT_ENVS``."""
    server = OpenEnvServer(folder, max_concurrent_envs, source)
    try:
        yield server.start()
    finally:
        server.kill()

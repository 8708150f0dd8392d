"""Train on an OpenEnv environment server, unchanged: an env written with OpenEnv
(meta-pytorch/OpenEnv), served by its own app, trained through the client (class_path "openenv").

    make install-openenv                    # .venv-openenv: openenv==0.10.0, the env server's venv
    python examples/openenv_env.py [--steps 20] [--env-python .venv-openenv/bin/python]

This file is both sides. `--serve PORT` runs the env server (that needs the python with openenv;
OpenEnv pulls fastapi, gradio and fastmcp, so it gets a venv of its own). Without it, the script
starts that server on 127.0.0.1 with --env-python, then a local OpenTinker server, and trains.
On a cluster, run `python examples/openenv_env.py --serve 8000 --host 0.0.0.0` with the OpenEnv
python on any machine the training server can reach (start the server with --allow-env-host for
that host) and point env_endpoint there; an env on your own machine needs no route from the
server at all: add "relay": "client" to the config and the client carries the calls.

The env asks the question the embedded tiny model was warmed up on ("What is a + b?", drawn
from the reset's seed, so the n samples of a prompt get the same one), gives two tries, and
rewards a correct answer with 1.0. Nothing in it knows about OpenTinker: the interaction
reads its /schema and sends the model's turn as the action's only string field, `answer`,
and the observation's only string field, `text`, back as the next user turn.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import httpx


def serve(port: int, host: str, max_sessions: int) -> None:
    """The env server, as any OpenEnv env is written (run in the OpenEnv venv's python)."""
    import random
    import re

    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app
    from openenv.core.env_server.interfaces import Environment
    from openenv.core.env_server.types import Action, Observation, State
    from pydantic import Field

    class AdditionAction(Action):
        answer: str = Field(max_length=2000, description="the reply; its first integer is graded")

    class AdditionObservation(Observation):
        text: str = ""

    class AdditionEnv(Environment):
        SUPPORTS_CONCURRENT_SESSIONS = True  # one instance per WebSocket session

        def __init__(self):
            super().__init__()
            self._state = State(episode_id=None, step_count=0)
            self.a = self.b = 0

        def reset(self, seed=None, episode_id=None, max_tries=2, **kwargs):
            rng = random.Random(seed)
            self.a, self.b, self.max_tries = rng.randint(0, 99), rng.randint(0, 99), int(max_tries)
            self._state = State(episode_id=episode_id, step_count=0)
            return AdditionObservation(text=f"What is {self.a} + {self.b}?")

        def step(self, action, timeout_s=None, **kwargs):
            self._state.step_count += 1
            found = re.search(r"-?\d+", action.answer)
            if found is not None and int(found.group(0)) == self.a + self.b:
                return AdditionObservation(text="Correct.", reward=1.0, done=True)
            last = self._state.step_count >= self.max_tries
            return AdditionObservation(text="Wrong." if last else f"Wrong. What is {self.a} + {self.b}?",
                                       reward=0.0, done=last)

        @property
        def state(self):
            return self._state

    app = create_fastapi_app(AdditionEnv, AdditionAction, AdditionObservation, max_concurrent_envs=max_sessions)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def start_env_server(python: str, port: int) -> subprocess.Popen:
    process = subprocess.Popen([python, __file__, "--serve", str(port), "--max-sessions", "32"])
    url = f"http://127.0.0.1:{port}"
    for _ in range(300):
        if process.poll() is not None:
            raise SystemExit(f"the env server exited ({process.returncode}); is openenv installed in {python}?")
        try:
            if httpx.get(f"{url}/health", timeout=1.0, trust_env=False).status_code == 200:
                return process
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit("the env server did not answer /health within a minute")


def train(url: str, steps: int) -> None:
    from opentinker import GenericEnvironment, InteractionSpec
    from opentinker.client.local_server import connect_or_start_local

    env = GenericEnvironment(
        config={"actor_rollout_ref.actor.optim.lr": 3e-5, "actor_rollout_ref.actor.use_kl_loss": True,
                "actor_rollout_ref.rollout.multi_turn.max_assistant_turns": 2,
                "actor_rollout_ref.rollout.multi_turn.max_tokens_per_turn": 16,
                "data.max_response_length": 64, "trainer.test_freq": -1},
        interaction_specs=[InteractionSpec(name="addition", class_path="openenv",
                                           config={"env_endpoint": url, "max_steps": 2})],
        data_generator=lambda i: {"extra_info": {"interaction_kwargs": {"name": "addition"}}},  # no prompt: the env opens
    )
    with connect_or_start_local() as client:
        env.setup(client)  # fails at once if the server cannot reach the env or its /schema does not fit
        job = client.submit(env, steps=steps)
        info = job.wait()
        rewards = [m["metrics"].get("env/addition/reward_mean") for m in job.metrics() if m["step"] > 0]
        print(f"{info.status.value}; env reward by step: {[round(r, 3) for r in rewards if r is not None]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--env-python", default=str(Path(__file__).resolve().parents[1] / ".venv-openenv/bin/python"),
                        help="a python with openenv==0.10.0 (make install-openenv makes .venv-openenv)")
    parser.add_argument("--port", type=int, default=8765, help="the env server's port")
    parser.add_argument("--serve", type=int, metavar="PORT", help="run only the env server, on PORT")
    parser.add_argument("--host", default="127.0.0.1", help="with --serve: the address to listen on")
    parser.add_argument("--max-sessions", type=int, default=32, help="with --serve: max_concurrent_envs")
    args = parser.parse_args()
    if args.serve is not None:
        return serve(args.serve, args.host, args.max_sessions)
    server = start_env_server(args.env_python, args.port)
    try:
        train(f"http://127.0.0.1:{args.port}", args.steps)
    finally:
        server.kill()
        server.wait()


if __name__ == "__main__":
    sys.exit(main())

"""GenericEnvironment: data loading and row checks, setup() against the server, client.fit."""

from __future__ import annotations

import json
import sys

import pytest

from opentinker.client import (
    DataGenerator,
    DatasetError,
    EnvironmentSetupError,
    GenericEnvironment,
    InteractionSpec,
    JobFailedError,
    OpenTinkerError,
)
from opentinker.config import ConfigError
from opentinker.environments.server import running_env_server
from opentinker.protocol import JobCreate, JobStatus


def rows(n: int) -> list[dict]:
    return [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "reward_model": {"ground_truth": str(i + 1)}}
            for i in range(n)]


def guess_row(i: int) -> dict:
    return {"extra_info": {"interaction_kwargs": {"name": "guess", "secret": i % 10}}}


def cfg(batch_size: int, **more) -> dict:
    """Overrides with a train batch of ``batch_size`` prompts (the mini-batch must divide it)."""
    return {"data.train_batch_size": batch_size, "actor_rollout_ref.actor.ppo_mini_batch_size": batch_size, **more}


GUESS = InteractionSpec(name="guess", class_path="gym", config={"env_endpoint": "http://127.0.0.1:9"})


def _flatten(batches) -> list[dict]:
    return [row for batch in batches for row in batch]


# ---------------------------------------------------------------------- config


def test_config_accepts_nested_dotted_and_string_overrides_and_names_bad_keys():
    env = GenericEnvironment({"algorithm.adv_estimator": "rloo", "data": {"train_batch_size": 4},
                              "actor_rollout_ref": {"actor.ppo_mini_batch_size": 4}})
    assert env.config == {"algorithm": {"adv_estimator": "rloo"}, "data": {"train_batch_size": 4},
                          "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 4}}}
    assert env.recipe.data.train_batch_size == 4
    env = GenericEnvironment(["actor_rollout_ref.rollout.n=4", "data.train_batch_size=16"])
    assert env.config["actor_rollout_ref"]["rollout"]["n"] == 4
    with pytest.raises(ConfigError, match="did you mean 'actor_rollout_ref.rollout.temperature'"):
        GenericEnvironment({"actor_rollout_ref.rollout.temprature": 0.7})


# ---------------------------------------------------------------------- data loading


def test_dataloader_reads_json_and_jsonl(tmp_path):
    data = rows(10)
    (tmp_path / "train.json").write_text(json.dumps(data))
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in data) + "\n\n")
    env = GenericEnvironment(cfg(4))
    for name in ("train.json", "train.jsonl"):
        loader = env.get_dataloader(tmp_path / name, shuffle=False)
        batches = list(loader)
        assert [len(b) for b in batches] == [4, 4, 2] and len(loader) == 3
        assert _flatten(batches) == data
    shuffled = _flatten(env.get_dataloader(str(tmp_path / "train.jsonl"), batch_size=3, seed=1))
    assert shuffled != data and sorted(map(json.dumps, shuffled)) == sorted(map(json.dumps, data))
    again = _flatten(env.get_dataloader(str(tmp_path / "train.jsonl"), batch_size=3, seed=1))
    assert again == shuffled  # same seed, same order


def test_dataloader_reads_parquet(tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    data = rows(6)
    pq.write_table(pa.Table.from_pylist(data), tmp_path / "train.parquet")
    env = GenericEnvironment(cfg(2))
    assert _flatten(env.get_dataloader(tmp_path / "train.parquet", shuffle=False)) == data


def test_parquet_without_pyarrow_says_how_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "train.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(DatasetError, match="pip install pyarrow"):
        GenericEnvironment().get_dataloader(tmp_path / "train.parquet")


def test_data_free_generator_batches(tmp_path):
    env = GenericEnvironment(cfg(4), [GUESS], data_generator=DataGenerator(guess_row, 10))
    loader = env.get_dataloader(shuffle=False)
    assert [len(b) for b in loader] == [4, 4, 2]
    assert _flatten(env.get_dataloader(shuffle=False)) == [guess_row(i) for i in range(10)]
    # a bare callable with an explicit length, and the (fn, length) form
    assert len(_flatten(env.get_dataloader(lambda i: guess_row(i), length=6))) == 6
    env2 = GenericEnvironment(cfg(2), [GUESS], data_generator=(guess_row, 3))
    assert len(env2.train_rows()) == 3
    # a bare generator makes as many rows as the run consumes: batch size x steps
    env3 = GenericEnvironment(cfg(2, **{"trainer.total_training_steps": 5}), [GUESS],
                              data_generator=guess_row)
    assert len(env3.train_rows()) == 10 and len(env3.train_rows(steps=2)) == 4
    # endless full batches run on into the next epoch
    batches = env2.step_batches()
    assert [len(next(batches)) for _ in range(4)] == [2, 2, 2, 2]


def test_row_errors_name_the_file_the_line_and_what_is_missing(tmp_path):
    env = GenericEnvironment()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(rows(1)[0]) + "\n" + json.dumps({"question": "2+2?"}) + "\n")
    with pytest.raises(DatasetError) as info:
        env.get_dataloader(bad)
    message = str(info.value)
    assert f"{bad} line 2" in message and "'prompt'" in message and "extra_info.interaction_kwargs" in message
    assert "question" in message  # the keys it does have

    bad.write_text(json.dumps(rows(1)[0]) + "\n{not json\n")
    with pytest.raises(DatasetError, match=r"bad.jsonl line 2: invalid JSON"):
        env.get_dataloader(bad)

    listing = tmp_path / "bad.json"
    listing.write_text(json.dumps([rows(1)[0], {"prompt": [{"role": "user"}]}]))
    with pytest.raises(DatasetError, match=r"bad.json index 1: 'prompt\[0\]' must be a message object with string 'role' and 'content'"):
        env.get_dataloader(listing)
    listing.write_text(json.dumps({"rows": []}))
    with pytest.raises(DatasetError, match="must be a JSON list of rows"):
        env.get_dataloader(listing)
    with pytest.raises(DatasetError, match="dataset row 0: 'prompt' must be a non-empty list"):
        env.get_dataloader([{"prompt": "just text"}])
    with pytest.raises(DatasetError, match="not found"):
        env.get_dataloader(tmp_path / "missing.jsonl")
    with pytest.raises(DatasetError, match="unsupported dataset format '.csv'"):
        (tmp_path / "d.csv").write_text("a,b\n")
        env.get_dataloader(tmp_path / "d.csv")


def test_rows_must_name_known_interactions():
    env = GenericEnvironment({}, [GUESS])
    with pytest.raises(DatasetError, match=r"data_generator\(0\): .*'chess'.*guess"):
        env.get_dataloader(lambda i: {"extra_info": {"interaction_kwargs": {"name": "chess"}}}, length=3)
    with pytest.raises(DatasetError, match="needs an interaction to open the chat, and there is none"):
        GenericEnvironment().get_dataloader([guess_row(0)])


# ---------------------------------------------------------------------- setup


class Echo:
    def reset(self, seed=None, **kwargs):
        return "say something"

    def step(self, action):
        return "ok", 1.0, True, {}


def test_setup_passes_with_a_reachable_env_server(client):
    with running_env_server(Echo) as urls:
        spec = InteractionSpec(name="echo", class_path="gym", config={"env_endpoint": urls[0]})
        env = GenericEnvironment(cfg(2), [spec], data_generator=(
            lambda i: {"extra_info": {"interaction_kwargs": {"name": "echo"}}}, 4))
        config = env.setup(client)
    assert config["interactions"] == [{"name": "echo", "class_path": "gym", "config": {"env_endpoint": urls[0]}}]
    assert config["config"] == {"data": {"train_batch_size": 2}, "actor_rollout_ref": {"actor": {"ppo_mini_batch_size": 2}}}
    assert env.is_set_up_for(client)


def test_setup_fails_at_once_naming_the_unreachable_url(client, closed_url):
    spec = InteractionSpec(name="guess", class_path="gym", config={"env_endpoint": closed_url})
    env = GenericEnvironment({}, [spec], data_generator=(guess_row, 4))
    with pytest.raises(EnvironmentSetupError) as info:
        env.setup(client)
    assert closed_url in str(info.value)
    assert "unreachable env endpoint(s)" in str(info.value)
    assert not env.is_set_up_for(client)


def test_setup_names_the_allowed_classes_when_a_class_is_unknown(client, proto):
    spec = InteractionSpec(name="mine", class_path="my_lab.envs.SecretInteraction")
    with pytest.raises(EnvironmentSetupError) as info:
        GenericEnvironment({}, [spec]).setup(client)
    message = str(info.value)
    assert "my_lab.envs.SecretInteraction" in message
    assert "allowed class paths:" in message
    for allowed in proto.state.allowed:
        assert allowed in message


def test_setup_rejects_a_malformed_endpoint_before_asking_the_server(client, proto):
    spec = InteractionSpec(name="guess", class_path="gym", config={"env_endpoint": "envhost:8000"})
    with pytest.raises(EnvironmentSetupError, match="guess"):
        GenericEnvironment({}, [spec]).setup(client)
    assert proto.state.posts("/v1/env/check") == []


# ---------------------------------------------------------------------- fit


def test_fit_in_server_mode_uploads_the_rows(client, proto, capsys):
    data = rows(8)
    env = GenericEnvironment(cfg(4), dataset=data, val_dataset=data[:2])
    info = client.fit(env, steps=2, name="server-fit")
    assert info.status == JobStatus.COMPLETED and info.step == 2
    request = proto.state.jobs[info.job_id].request
    assert request.mode == "server" and request.dataset == data and request.val_dataset == data[:2]
    assert request.config["trainer"]["total_training_steps"] == 2
    assert len(proto.state.posts("/v1/env/check")) == 1
    assert "2/2" in capsys.readouterr().err


def test_fit_in_client_mode_pushes_one_batch_per_step(client, proto):
    proto.state.queue_limit = 1
    # the test server answers GET /health too, so it can stand in for the env endpoint
    spec = InteractionSpec(name="guess", class_path="gym", config={"env_endpoint": proto.url})
    env = GenericEnvironment(cfg(2, **{"data.shuffle": False}), [spec], data_generator=(guess_row, 5))
    info = client.fit(env, steps=4, mode="client", progress=False)
    assert info.status == JobStatus.COMPLETED and info.step == 4
    sim = proto.state.jobs[info.job_id]
    assert sim.request.mode == "client" and sim.request.dataset is None
    consumed = [[row["extra_info"]["interaction_kwargs"]["secret"] for row in batch] for batch in sim.rows_consumed]
    assert consumed == [[0, 1], [2, 3], [4, 0], [1, 2]]  # full batches, running on into the next epoch


def test_submit_returns_the_handle_and_a_failed_job_raises(client, proto):
    handle = client.submit(cfg(4), steps=5, name=proto.fail_job_name)
    assert handle.info().name == proto.fail_job_name
    with pytest.raises(JobFailedError, match=proto.fail_message):
        handle.wait(progress=False, timeout=20)
    with pytest.raises(JobFailedError, match=proto.fail_message):
        client.fit({}, steps=3, name=proto.fail_job_name, progress=False)


def test_a_failing_client_side_dataloader_cancels_the_job_and_is_reported(client, proto):
    def flaky(i: int) -> dict:
        if i >= 3:
            raise RuntimeError(f"cannot make row {i}")
        return guess_row(i)

    spec = InteractionSpec(name="guess", class_path="gym", config={"env_endpoint": proto.url})
    env = GenericEnvironment(cfg(2, **{"data.shuffle": False}), [spec], data_generator=(flaky, 6))
    with pytest.raises(OpenTinkerError, match=r"pushing step batches .* failed at step 2: data_generator\(3\) raised RuntimeError: cannot make row 3"):
        client.fit(env, steps=3, mode="client", progress=False)
    (sim,) = proto.state.jobs.values()
    assert sim.info.status == JobStatus.CANCELLED
    # Step 1 went out whole and nothing of step 2 did. Whether the job took step 1 off its queue
    # before the cancel came is a race (the cancel follows the push within milliseconds).
    assert list(sim.accepted) == [1]
    pushed = [*sim.rows_consumed, *sim.queue]
    assert [[row["extra_info"]["interaction_kwargs"]["secret"] for row in batch] for batch in pushed] == [[0, 1]]


def test_submit_a_ready_job_create_keeps_its_mode(client, proto):
    handle = client.submit(JobCreate(name="raw", config={"trainer.total_training_steps": 1}), steps=2)
    info = handle.wait(progress=False, timeout=20)
    assert info.total_steps == 2 and info.mode == "server"
    with pytest.raises(ValueError, match="client mode needs a GenericEnvironment"):
        client.submit(JobCreate(mode="client"))

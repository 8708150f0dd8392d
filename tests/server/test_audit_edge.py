"""The outside audit's findings about what a client may send, each as the exact request it
made and the exact refusal the server now gives (issue "Security and reliability").

Items: 1 interpolation, 2 judge endpoint, 3 model path / trust_remote_code, 9 values that
broke storage, 10 client-mode rows, 12 upper bounds, 14 body size, 16 named choices.
"""

from __future__ import annotations

import json

import httpx
import pytest

from opentinker.server.policy import TINY_MODEL_NAME, JobPolicy


def _refused(response: httpx.Response, status: int, *needles: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error", "detail"}
    for needle in needles:
        assert needle in body["error"], (needle, body["error"])
    return body


def _job_count(client: httpx.Client) -> int:
    return len(client.get("/v1/jobs").json()["jobs"])


# 1 ------------------------------------------------------------------------------------


def test_1_config_interpolation_is_refused_and_never_resolved(alice, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-server-secret-0123")
    before = _job_count(alice)
    response = alice.post(
        "/v1/jobs", json={"mode": "client", "config": {"trainer.experiment_name": "${oc.env:OPENAI_API_KEY}"}}
    )
    _refused(response, 400, "config key 'trainer.experiment_name'", "interpolation is not supported")
    assert "sk-server-secret" not in response.text
    # Nested form, a list item and a resolver other than oc.env: refused the same way.
    for config in (
        {"trainer": {"project_name": "x-${oc.env:HOME}"}},
        {"trainer.logger": ["console", "${oc.env:OPENAI_API_KEY}"]},
        {"trainer.experiment_name": "${trainer.project_name}"},
    ):
        _refused(alice.post("/v1/jobs", json={"mode": "client", "config": config}), 400, "interpolation")
    listing = alice.get("/v1/jobs")
    assert listing.status_code == 200 and "sk-server-secret" not in listing.text
    assert _job_count(alice) == before


# 2 ------------------------------------------------------------------------------------


def test_2_a_client_never_picks_the_judge_endpoint(alice, recording_service):
    url, seen = recording_service
    config = {"algorithm.adv_estimator": "grpo_weighted_mul", "algorithm.enable_solution_classification": True,
              "algorithm.judge.kind": "openai", "algorithm.judge.base_url": f"{url}/v1"}
    # This server offers no OpenAI judge at all.
    _refused(alice.post("/v1/jobs", json={"config": config}), 400, "algorithm.judge.kind", "no OpenAI-compatible judge")
    assert seen == []


def test_2_judge_base_url_and_model_are_the_operators(start_server, tmp_path, helpers, recording_service):
    url, seen = recording_service
    live = start_server(tmp_path, judge_models=["judge-a", "judge-b"], judge_base_url="http://127.0.0.1:9/v1")
    key = helpers.make_user(tmp_path, "mallory")
    base = {"algorithm.adv_estimator": "grpo_weighted_mul", "algorithm.enable_solution_classification": True,
            "algorithm.judge.kind": "openai"}
    with live.client(key) as client:
        body = _refused(client.post("/v1/jobs", json={"config": {**base, "algorithm.judge.base_url": f"{url}/v1"}}),
                        400, "'algorithm.judge.base_url' is chosen by the server operator")
        assert body["detail"] == {"field": "config.algorithm.judge.base_url"}
        _refused(client.post("/v1/jobs", json={"config": {**base, "algorithm.judge.model": "gpt-4"}}),
                 400, "'gpt-4' is not a judge model of this server", "judge-a, judge-b")
        models = client.get("/v1/models").json()
        assert models["judge_models"] == ["judge-a", "judge-b"]
        job_id = helpers.create_job(client, "hold", mode="client", steps=1,
                                    config={**base, "algorithm.judge.model": "judge-b", "trainer.total_training_steps": 1})
        shown = client.get(f"/v1/jobs/{job_id}").json()["config"]
        assert shown["algorithm.judge.model"] == "judge-b" and shown["algorithm.judge.base_url"] is None
        client.post(f"/v1/jobs/{job_id}/cancel")
    # What the job's runner trains with: the operator's endpoint, whatever the client sent.
    runner_cfg = live.settings.job_policy.runner_recipe({**base, "algorithm.judge.model": "judge-b"}, str(tmp_path))
    assert runner_cfg.algorithm.judge.base_url == "http://127.0.0.1:9/v1"
    with pytest.raises(ValueError, match="chosen by the server operator"):
        live.settings.job_policy.runner_recipe({**base, "algorithm.judge.base_url": url}, str(tmp_path))
    assert seen == []


# 3 ------------------------------------------------------------------------------------


def test_3_trust_remote_code_is_refused(alice):
    body = _refused(
        alice.post("/v1/jobs", json={"config": {"actor_rollout_ref.model.trust_remote_code": True}}),
        400, "'actor_rollout_ref.model.trust_remote_code' is the server operator's choice",
    )
    assert body["detail"] == {"field": "config.actor_rollout_ref.model.trust_remote_code"}


def test_3_model_path_names_a_served_model_never_a_folder(alice, server, helpers):
    served = alice.get("/v1/models").json()
    assert served == {"models": [{"name": TINY_MODEL_NAME, "default": True}], "judge_models": []}
    # Another user's checkpoint folder that exists on the server, and one that does not:
    # the same refusal, so nothing tells them apart (and no path is echoed but the client's own).
    done = helpers.create_job(alice, "quick", steps=2)
    helpers.wait_status(alice, done, "completed")
    existing = str(server.settings.job_dir(done) / "checkpoints" / "global_step_2")
    missing = str(server.settings.data_dir / "no-such-folder")
    errors = []
    for path in (existing, missing):
        body = _refused(alice.post("/v1/jobs", json={"config": {"actor_rollout_ref.model.path": path}}),
                        400, "is not a model served here", f"served models: {TINY_MODEL_NAME}")
        errors.append(body["error"].replace(path, "PATH"))
    assert errors[0] == errors[1]
    # The critic's model is a served model's name too.
    body = _refused(alice.post("/v1/jobs", json={"config": {"algorithm.adv_estimator": "gae",
                                                             "critic.model.path": existing}}),
                    400, "critic.model.path", "is not a model served here")
    assert body["detail"] == {"field": "config.critic.model.path"}
    job_id = helpers.create_job(alice, "quick", steps=1, config={"actor_rollout_ref.model.path": TINY_MODEL_NAME,
                                                                  "trainer.total_training_steps": 1})
    assert alice.get(f"/v1/jobs/{job_id}").json()["config"]["actor_rollout_ref.model.path"] == TINY_MODEL_NAME


def test_3_the_runner_gets_the_operators_path_and_code_switch(tmp_path):
    from opentinker.server.policy import parse_served_models

    policy = JobPolicy(models=parse_served_models(["qwen=/models/qwen", "/models/phi"], ["qwen"]))
    cfg = policy.runner_recipe({"actor_rollout_ref.model.path": "qwen"}, str(tmp_path))
    assert cfg.actor_rollout_ref.model.path == "/models/qwen" and cfg.actor_rollout_ref.model.trust_remote_code
    default = policy.runner_recipe({}, str(tmp_path))
    assert default.actor_rollout_ref.model.path == "/models/qwen"  # the first --model is the default
    phi = policy.runner_recipe({"actor_rollout_ref.model.path": "/models/phi"}, str(tmp_path))
    assert phi.actor_rollout_ref.model.trust_remote_code is False
    tiny = policy.runner_recipe({"actor_rollout_ref.model.path": TINY_MODEL_NAME}, str(tmp_path))
    assert tiny.actor_rollout_ref.model.path is None  # the embedded tiny model, built on first use
    assert cfg.trainer.default_local_dir == f"{tmp_path}/checkpoints"


# 9 ------------------------------------------------------------------------------------


def _raw_post(client: httpx.Client, path: str, text: str, **headers: str) -> httpx.Response:
    return client.post(path, content=text.encode("utf-8"), headers={"Content-Type": "application/json", **headers})


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"mode": "client", "config": {"trainer.experiment_name": "\\ud800"}}', "config.trainer.experiment_name"),
        ('{"name": "\\ud800"}', "body: name: '\\ud800' (a lone surrogate) is not valid text"),
        ('{"config": {"trainer.total_training_steps": 9223372036854775808}}', "is out of range"),
        ('{"config": {"trainer.total_training_steps": 9007199254740992}}', "at most 9007199254740991 in magnitude"),
        ('{"config": {"actor_rollout_ref.actor.optim.lr": NaN}}', "not a finite number"),
        # Nesting is a 400 (JSON Schema cannot state a depth), refused before decoding (middleware.py).
        ('{"dataset": [{"x": ' + "[" * 256 + "]" * 256 + "}]}", "nested deeper than 32 levels"),
        ('{"dataset": [{"x": ' + "[" * 5000 + "]" * 5000 + "}]}", "nested deeper than 32 levels"),
    ],
    ids=["surrogate-config", "surrogate-name", "int-2**63", "int-2**53", "nan", "depth-256", "depth-5000"],
)
def test_9_values_that_broke_the_job_list_are_refused_at_the_edge(alice, text, needle):
    before = _job_count(alice)
    _refused(_raw_post(alice, "/v1/jobs", text), 400 if "nested" in needle else 422, needle)
    listing = alice.get("/v1/jobs")
    assert listing.status_code == 200 and _job_count(alice) == before


def test_9_huge_integers_in_step_after_and_last_event_id(alice, helpers):
    job_id = helpers.create_job(alice, "hold", mode="client", steps=2)
    _refused(_raw_post(alice, f"/v1/jobs/{job_id}/steps", '{"step": 9223372036854775808, "rows": [{}]}'), 422,
             "step: 9223372036854775808 is out of range")
    _refused(alice.get(f"/v1/jobs/{job_id}/events", params={"after": 2**63, "stream": "false"}), 422, "query.after")
    _refused(alice.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(2**63)}), 422, "Last-Event-ID")
    _refused(alice.get(f"/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "9" * 5000}), 422, "Last-Event-ID")
    _refused(alice.get("/v1/jobs/not-a-job-id"), 422, "path.job_id")
    assert alice.get("/v1/jobs").status_code == 200
    alice.post(f"/v1/jobs/{job_id}/cancel")


def test_9_a_stored_job_list_survives_a_restart(start_server, tmp_path, helpers):
    key = helpers.make_user(tmp_path, "dave")
    first = start_server(tmp_path)
    with first.client(key) as client:
        _refused(_raw_post(client, "/v1/jobs", '{"name": "\\ud800"}'), 422, "lone surrogate")
        helpers.create_job(client, "quick \u00e9\U0001f600", steps=1)
    first.stop()
    second = start_server(tmp_path)
    with second.client(key) as client:
        jobs = client.get("/v1/jobs")
        assert jobs.status_code == 200 and jobs.json()["jobs"][0]["name"] == "quick \u00e9\U0001f600"


# 10 -----------------------------------------------------------------------------------


def test_10_client_rows_that_would_kill_the_job_are_refused_before_202(alice, helpers):
    job_id = helpers.create_job(alice, "hold", mode="client", steps=3,
                                config={"trainer.total_training_steps": 3, "data.max_prompt_length": 32})
    # A queued job answers a push 503 (its runner is not up): on a loaded machine its actor takes a while.
    helpers.wait_status(alice, job_id, "running")
    url = f"/v1/jobs/{job_id}/steps"
    good = {"prompt": [{"role": "user", "content": "What is 2 + 2?"}], "reward_model": {"ground_truth": "4"}}
    cases = [
        ({"prompt": good["prompt"]}, "rows[1]: needs 'reward_model'"),
        ({**good, "prompt": [{"role": "user", "content": "What is 2 + 2? " * 40}]},
         "rows[1]: prompt has", "more than data.max_prompt_length=32"),
        ({**good, "reward_model": {"ground_truth": {"answer": 4}}}, "'reward_model.ground_truth' must be an integer"),
        ({**good, "reward_model": {"ground_truth": "four"}}, "'reward_model.ground_truth' must be an integer"),
        ({**good, "prompt": [{"role": "wizard", "content": "hi"}]}, "'prompt[0].role' must be one of"),
    ]
    for row, *needles in cases:
        _refused(alice.post(url, json={"step": 1, "rows": [good, row]}), 400, *needles)
    surrogate = json.dumps({"step": 1, "rows": [good]}).replace("2 + 2", "\\ud800")
    _refused(_raw_post(alice, url, surrogate), 422, "lone surrogate")
    assert alice.post(url, json={"step": 1, "rows": [good]}).status_code == 202
    assert helpers.job_status(alice, job_id) == "running"  # nothing of that reached the job
    alice.post(f"/v1/jobs/{job_id}/cancel")


def test_10_server_mode_datasets_get_the_same_checks(alice):
    rows = [{"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reward_model": {"ground_truth": "2"}}] * 8
    _refused(alice.post("/v1/jobs", json={"dataset": [*rows, {"prompt": rows[0]["prompt"]}]}), 400,
             "dataset[8]: needs 'reward_model'")
    _refused(alice.post("/v1/jobs", json={"dataset": rows, "config": {"data.max_prompt_length": 4}}), 400,
             "dataset[0]: prompt has")


# 12 -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "config, needle",
    [
        ({"trainer.total_training_steps": 10**12}, "'trainer.total_training_steps' must be >= 1 and <= 100000"),
        ({"data.train_batch_size": 10**9}, "'data.train_batch_size' must be >= 1 and <= 4096"),
        ({"actor_rollout_ref.rollout.n": 10**7}, "'actor_rollout_ref.rollout.n' must be >= 1 and <= 64"),
        ({"data.max_response_length": 10**9}, "'data.max_response_length' must be >= 1 and <= 32768"),
        ({"data.max_prompt_length": 10**9}, "'data.max_prompt_length' must be >= 1 and <= 32768"),
        ({"actor_rollout_ref.actor.optim.lr": 2.0}, "'actor_rollout_ref.actor.optim.lr' must be >= 0 and <= 1"),
        ({"actor_rollout_ref.rollout.replicas": 100},
         "'actor_rollout_ref.rollout.replicas' must be >= 1 and <= 8"),
        ({"actor_rollout_ref.rollout.tensor_model_parallel_size": 64},
         "'actor_rollout_ref.rollout.tensor_model_parallel_size' must be >= 1 and <= 8"),
        ({"actor_rollout_ref.rollout.max_model_len": 10**9},
         "'actor_rollout_ref.rollout.max_model_len' must be >= 16 and <= 131072"),
    ],
)
def test_12_upper_bounds(alice, config, needle):
    _refused(alice.post("/v1/jobs", json={"config": config}), 400, needle)


@pytest.mark.parametrize("literal", ["NaN", "1e400", "-Infinity"])
def test_12_non_finite_numbers(alice, literal):
    text = '{"config": {"actor_rollout_ref.actor.optim.lr": %s}}' % literal
    _refused(_raw_post(alice, "/v1/jobs", text), 422, "config.actor_rollout_ref.actor.optim.lr", "not a finite number")


def test_12_the_operator_sets_the_bounds(start_server, tmp_path, helpers):
    compile_decode = "actor_rollout_ref.rollout.compile_decode"
    live = start_server(tmp_path, config_limits={"trainer.total_training_steps": 10, "actor_rollout_ref.rollout.n": 4,
                                                 compile_decode: 0})
    key = helpers.make_user(tmp_path, "erin")
    with live.client(key) as client:
        _refused(client.post("/v1/jobs", json={"config": {compile_decode: True, "actor_rollout_ref.rollout.n": 4}}),
                 400, f"config key '{compile_decode}' is turned off on this server")
        _refused(client.post("/v1/jobs", json={"config": {"trainer.total_training_steps": 11,
                                                           "actor_rollout_ref.rollout.n": 4}}),
                 400, "must be >= 1 and <= 10 (a limit of this server)")
        _refused(client.post("/v1/jobs", json={"config": {"actor_rollout_ref.rollout.n": 8}}), 400, "<= 4")
        helpers.create_job(client, "quick", steps=10, config={"trainer.total_training_steps": 10,
                                                                "actor_rollout_ref.rollout.n": 4, compile_decode: False})
    with pytest.raises(ValueError, match="no numeric range"):
        start_server(tmp_path / "other", config_limits={"trainer.experiment_name": 3})
    with pytest.raises(ValueError, match="is a switch: its limit is 0 \\(off\\) or 1"):
        start_server(tmp_path / "other", config_limits={compile_decode: 0.5})


# 14 -----------------------------------------------------------------------------------


def test_14_bodies_past_the_limit_get_413(start_server, tmp_path, helpers):
    live = start_server(tmp_path, max_body_bytes=1 << 20)
    key = helpers.make_user(tmp_path, "frank")
    rows = [{"prompt": [{"role": "user", "content": "x" * 1000}], "reward_model": {"ground_truth": "1"}}] * 2000
    payload = json.dumps({"dataset": rows}).encode()
    with live.client(key) as client:
        declared = client.post("/v1/jobs", content=payload, headers={"Content-Type": "application/json"})
        _refused(declared, 413, "request body too large", "at most 1048576 bytes")

        def chunks():  # no Content-Length: counted as it streams in
            for start in range(0, len(payload), 65536):
                yield payload[start:start + 65536]

        streamed = client.post("/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"})
        _refused(streamed, 413, "request body too large")
        assert client.get("/v1/jobs").json()["jobs"] == []
        assert client.get("/v1/health").status_code == 200


# 16 -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, nearest",
    [
        ("algorithm.adv_estimator", "grpoo", "grpo"),
        ("actor_rollout_ref.actor.policy_loss", "vanila", "vanilla"),
        ("actor_rollout_ref.actor.loss_agg_mode", "token_mean", "token-mean"),
        ("actor_rollout_ref.actor.kl_loss_type", "k4", None),
        ("actor_rollout_ref.actor.strategy", "deepspeed", None),
        ("actor_rollout_ref.rollout.name", "sglang", None),
        ("actor_rollout_ref.rollout.placement", "seperate", "separate"),
        ("actor_rollout_ref.actor.optim.warmup_style", "linear", None),
    ],
)
def test_16_named_choices_are_checked_at_creation(alice, key, value, nearest):
    body = _refused(alice.post("/v1/jobs", json={"config": {key: value}}), 400,
                    f"config key '{key}': unknown value '{value}'", "(valid: ")
    if nearest:
        assert f"did you mean '{nearest}'?" in body["error"]

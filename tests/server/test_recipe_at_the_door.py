"""Every config a job cannot train with is refused by ``POST /v1/jobs`` with a 400 naming the key,
before a job exists: ranges, types, nulls, unknown keys, choices and the rules that span keys
(opentinker/recipe/rules.py), on a live server."""

from __future__ import annotations

import pytest

from opentinker.config import VALID_KEYS, make_config, to_dotted
from opentinker.recipe import RecipeSpec, spec_keys

SMALL = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2}

INVALID = [  # (config, the job's mode, what the 400 must name)
    # ranges
    ({"data.train_batch_size": 0}, "server", "'data.train_batch_size' must be >= 1"),
    ({"actor_rollout_ref.actor.optim.lr": 2.0}, "server", "'actor_rollout_ref.actor.optim.lr' must be >= 0 and <= 1"),
    ({"actor_rollout_ref.rollout.n": 65}, "server", "'actor_rollout_ref.rollout.n' must be >= 1 and <= 64"),
    ({"actor_rollout_ref.rollout.top_p": 0}, "server", "'actor_rollout_ref.rollout.top_p' must be > 0"),
    ({"trainer.total_training_steps": 0}, "server", "'trainer.total_training_steps' must be >= 1"),
    ({"algorithm.gamma": 1.5}, "server", "'algorithm.gamma' must be >= 0 and <= 1"),
    ({"trainer.env_outage_timeout_s": 7200}, "server", "'trainer.env_outage_timeout_s' must be >= 0 and <= 3600"),
    # types
    ({"data.train_batch_size": "8"}, "server", "'data.train_batch_size' expects int"),
    ({"actor_rollout_ref.actor.use_kl_loss": "yes"}, "server", "'actor_rollout_ref.actor.use_kl_loss' expects bool"),
    ({"trainer.logger": "console"}, "server", "'trainer.logger' expects list"),
    ({"actor_rollout_ref.actor.optim.lr": True}, "server", "'actor_rollout_ref.actor.optim.lr' expects float"),
    ({"trainer.seed": 1.5}, "server", "'trainer.seed' expects int"),
    # nulls where a value is needed
    ({"async_training.max_staleness": None}, "server", "'async_training.max_staleness' expects int, got null"),
    ({"trainer.total_training_steps": None}, "server", "'trainer.total_training_steps' expects int, got null"),
    ({"data.max_response_length": None}, "server", "'data.max_response_length' expects int, got null"),
    ({"algorithm.adv_estimator": None}, "server", "'algorithm.adv_estimator' expects str, got null"),
    # unknown keys and sections
    ({"actor_rollout_ref.actor.optim.learning_rate": 1e-5}, "server",
     "unknown config key 'actor_rollout_ref.actor.optim.learning_rate'"),
    ({"trainer.total_steps": 5}, "server", "unknown config key 'trainer.total_steps'"),
    ({"data": 5}, "server", "config key 'data' is given both as a value"),
    # choices
    ({"algorithm.adv_estimator": "ppo"}, "server", "'algorithm.adv_estimator': unknown value 'ppo'"),
    ({"actor_rollout_ref.rollout.name": "sglang"}, "server", "'actor_rollout_ref.rollout.name': unknown value 'sglang'"),
    # plain values only
    ({"trainer.experiment_name": "${oc.env:HOME}"}, "server", "'trainer.experiment_name': '${...}' interpolation"),
    # rules that span keys
    ({"actor_rollout_ref.rollout.n": 1}, "server", "needs actor_rollout_ref.rollout.n >= 2"),
    ({"data.train_batch_size": 3}, "server",
     "data.train_batch_size (3) must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size (2)"),
    ({"actor_rollout_ref.rollout.val_n": 2}, "server", "val_n > 1 needs actor_rollout_ref.rollout.val_temperature > 0"),
    ({"actor_rollout_ref.rollout.compile_decode": True, "actor_rollout_ref.rollout.slot_decode": True}, "server",
     "compile_decode and actor_rollout_ref.rollout.slot_decode are two decode loops"),
    ({"actor_rollout_ref.actor.strategy": "fsdp"}, "server",
     "actor_rollout_ref.actor.strategy=fsdp needs trainer.n_gpus_per_node >= 1"),
    ({"algorithm.rollout_correction.rollout_rs": "token"}, "server",
     "needs algorithm.rollout_correction.rollout_rs_threshold"),
    ({"actor_rollout_ref.rollout.max_model_len": 64}, "server",
     "actor_rollout_ref.rollout.max_model_len (64) is shorter than data.max_prompt_length + data.max_response_length"),
    ({"async_training.max_staleness": 1}, "client", "async_training.max_staleness > 0 draws each step's prompts"),
    ({"trainer.nnodes": 2}, "server", "trainer.nnodes=2 spreads FSDP ranks over nodes: it needs "
     "actor_rollout_ref.actor.strategy=fsdp"),
    ({"actor_rollout_ref.rollout.name": "vllm", "async_training.max_staleness": 1, "trainer.device": "cuda"},
     "server", "async_training.max_staleness > 0 with vLLM on a GPU needs actor_rollout_ref.rollout.placement=separate"),
    ({"actor_rollout_ref.actor.optim.betas": [0.9]}, "server", "'actor_rollout_ref.actor.optim.betas' must be two numbers"),
]


def test_the_recipe_spec_names_every_config_key_and_round_trips():
    assert spec_keys() == list(VALID_KEYS)  # the tables are read off the schema, in its order
    cfg = make_config({**SMALL, "actor_rollout_ref.actor.optim.lr": 3e-5, "trainer.logger": ["console"]})
    spec = RecipeSpec.from_config(cfg)
    assert spec.to_dotted() == to_dotted(cfg)
    assert spec.actor_rollout_ref.actor.optim.lr == 3e-5 and spec.actor_rollout_ref.actor.optim.betas == (0.9, 0.999)


def test_at_least_25_invalid_configs_are_refused_at_the_door_naming_the_key(alice):
    assert len(INVALID) >= 25
    before = {job["job_id"] for job in alice.get("/v1/jobs").json()["jobs"]}
    for config, mode, named in INVALID:
        answer = alice.post("/v1/jobs", json={"mode": mode, "config": {**SMALL, **config}})
        assert answer.status_code == 400, (config, answer.status_code, answer.text)
        assert named in answer.json()["error"], (config, answer.json()["error"])
        field = answer.json()["detail"]["field"]  # the key to change, where one key is at fault
        assert field == "config" or field.removeprefix("config.") in answer.json()["error"], (config, field)
    after = {job["job_id"] for job in alice.get("/v1/jobs").json()["jobs"]}
    assert after == before  # no job row was created for any of them


@pytest.mark.parametrize("config, mode, named", [case for case in INVALID if case[1] == "client" or
                                                   "vLLM" in case[2]])
def test_the_client_refuses_the_same_before_sending(config, mode, named):
    from opentinker import GenericEnvironment
    from opentinker.config import ConfigError

    with pytest.raises(ConfigError, match="async_training.max_staleness > 0"):  # as it is made, or sent
        env = GenericEnvironment({**SMALL, **config}, dataset=[{"prompt": [{"role": "user", "content": "1+1=?"}]}])
        env.job_create(mode=mode)

"""Issue 32's refusals, each with the audit's request against a real server on 127.0.0.1:
``null`` where a config key needs a number is a 400 naming the key at ``POST /v1/jobs``
(it was a 500, or a job that failed at run time); JSON nested too deeply is a 400 on every
route (it was a 500 RecursionError on the Tinker routes this server does not offer); a
spoofed ``X-Forwarded-For`` does not reset the failed-key limiter (uvicorn trusted it from
127.0.0.1)."""

from __future__ import annotations

import httpx
import pytest

AUDIT_NUMERIC_KEYS = ["trainer.total_training_steps", "data.train_batch_size", "actor_rollout_ref.rollout.n",
                      "async_training.max_staleness"]


def _job_count(client: httpx.Client) -> int:
    return len(client.get("/v1/jobs").json()["jobs"])


def _nested(key: str, value) -> dict:
    """``{"a.b.c": v}`` as ``{"a": {"b": {"c": v}}}`` (a config may be sent either way)."""
    *sections, leaf = key.split(".")
    tree = {leaf: value}
    for section in reversed(sections):
        tree = {section: tree}
    return tree


@pytest.mark.parametrize("key", AUDIT_NUMERIC_KEYS)
def test_null_for_a_numeric_config_key_is_a_400_naming_it(alice, key):
    before = _job_count(alice)
    for config in ({key: None}, _nested(key, None)):
        answer = alice.post("/v1/jobs", json={"name": "nulls", "config": config})
        assert answer.status_code == 400, answer.text
        assert f"config key '{key}' expects int, got null" in answer.json()["error"]
    assert _job_count(alice) == before  # nothing was stored, so nothing fails at run time


@pytest.mark.parametrize("value", ["1", 1.5, True, [1], {"n": 1}])
def test_other_wrong_types_for_max_staleness_are_a_400_naming_it(alice, value):
    answer = alice.post("/v1/jobs", json={"config": {"async_training.max_staleness": value}})
    assert answer.status_code == 400, answer.text
    assert "async_training.max_staleness" in answer.json()["error"]


def test_keys_whose_default_is_null_still_accept_null(alice, helpers):
    config = {"trainer.total_training_steps": 1, "actor_rollout_ref.rollout.max_model_len": None,
              "actor_rollout_ref.actor.clip_ratio_low": None, "algorithm.rollout_correction.rollout_is": None}
    answer = alice.post("/v1/jobs", json={"name": "null defaults", "config": config})
    assert answer.status_code == 201, answer.text
    helpers.wait_status(alice, answer.json()["job_id"], "completed")

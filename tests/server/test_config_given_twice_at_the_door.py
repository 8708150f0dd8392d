"""A job whose config gives a key twice (dotted and nested) is refused by ``POST /v1/jobs`` with
a 400 naming the key and both spellings, before a job exists (the audit's config: the nested
value used to win silently), on a live server."""

from __future__ import annotations

TWICE = {"actor_rollout_ref.actor.optim.lr": 1e-5, "actor_rollout_ref": {"actor": {"optim": {"lr": 3e-5}}}}


def test_a_key_given_dotted_and_nested_is_a_400_naming_both_spellings(start_server, tmp_path, helpers):
    live = start_server(tmp_path)
    with live.client(helpers.make_user(tmp_path, "dana")) as dana:
        answer = dana.post("/v1/jobs", json={"mode": "server", "config": TWICE})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"] == (
            "config key 'actor_rollout_ref.actor.optim.lr' is given twice, as ['actor_rollout_ref.actor.optim.lr'] "
            "and as ['actor_rollout_ref']['actor']['optim']['lr']; give it once")
        assert answer.json()["detail"]["field"] == "config.actor_rollout_ref.actor.optim.lr"
        assert dana.get("/v1/jobs").json()["jobs"] == []  # no job was made

        # Other keys of the same section, given both ways, are one config.
        fine = {"actor_rollout_ref.actor.optim.lr": 1e-5,
                "actor_rollout_ref": {"actor": {"optim": {"weight_decay": 0.1}}}, "trainer.total_training_steps": 2}
        job_id = helpers.create_job(dana, "both-ways", steps=2, config=fine)
        config = dana.get(f"/v1/jobs/{job_id}").json()["config"]
        assert config["actor_rollout_ref.actor.optim.lr"] == 1e-5
        assert config["actor_rollout_ref.actor.optim.weight_decay"] == 0.1
        helpers.wait_status(dana, job_id, "completed")

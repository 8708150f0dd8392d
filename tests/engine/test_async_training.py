"""Asynchronous off-policy training (async_training.max_staleness) on the real tiny model: the
rollout runs in its own process ahead of the update, each sample comes from the policy version
the metrics name, the rollout correction sees and corrects the gap, checkpoints re-draw the
prompts in flight."""

from __future__ import annotations

import os

import pytest
import torch

from opentinker.config import ConfigError, make_config
from opentinker.engine.rollout.base import named_tensors
from opentinker.engine.ppo.trainer import RLTrainer

FAST = [
    "data.train_batch_size=2",
    "actor_rollout_ref.actor.ppo_mini_batch_size=2",
    "actor_rollout_ref.rollout.n=4",
    "data.max_response_length=8",
    "data.val_batch_size=8",
    "trainer.progress_bar=false",
    "trainer.test_freq=-1",
    "trainer.device=cpu",
    "actor_rollout_ref.actor.optim.lr=1e-3",  # big steps: versions differ clearly
]


class RecordingTrainer(RLTrainer):
    """Keeps each trained batch and the weights after each update (what the test checks against)."""

    def __init__(self, *args, **kwargs):
        self.batches, self.weights_after, self.prompts = [], [], []
        super().__init__(*args, **kwargs)

    def train_on(self, rollout, timer):
        batch, metrics = super().train_on(rollout, timer)
        self.batches.append(batch)
        self.prompts.append([p.prompt_ids for p in rollout.prompts])
        self.weights_after.append({n: t.detach().clone() for n, t in named_tensors(self.backend.weights())})
        return batch, metrics


def rollout_gap(backend, weights, batch) -> float:
    """Largest gap between the batch's sampler logprobs and the logprobs under ``weights``."""
    backend.model.load_state_dict(weights)
    logprobs = backend.forward(batch).logprobs
    mask = batch.response_mask
    return float(((logprobs - batch.tensors["rollout_logprobs"]) * mask).abs().max())


def test_rollouts_run_ahead_in_their_own_process_and_sample_with_the_version_they_report(
        ray_session, tiny_model_dir, make_backend):
    trainer = RecordingTrainer(make_config([*FAST, "async_training.max_staleness=2"]))
    try:
        assert trainer.rollout.pid != os.getpid()  # the transformers engine runs in a Ray actor
        history = [trainer.train_step() for _ in range(5)]
    finally:
        trainer.close()
    assert [h["staleness/max"] for h in history] == [0.0, 1.0, 2.0, 2.0, 2.0]
    initial = make_backend().model.state_dict()
    versions = [initial, *trainer.weights_after]  # version v: the weights after step v
    scorer = make_backend()
    for step, (metrics, batch) in enumerate(zip(history, trainer.batches), start=1):
        version = step - 1 - int(metrics["staleness/max"])
        assert rollout_gap(scorer, versions[version], batch) < 1e-4, step  # sampled with that version
        # ... and not with the policy the step trains (the test can tell versions apart)
        if version != step - 1:
            assert rollout_gap(scorer, versions[step - 1], batch) > 1e-3, step
    assert abs(history[0]["rollout_corr/kl"]) < 1e-6  # same weights in both processes
    # One optimizer step per update: the gap is measured on the update's own pass, no extra one.
    assert all("timing_s/old_logprob" not in h and h["rollout_corr/kl"] != 0 for h in history[1:])
    assert all(h["timing_s/rollout_wait"] >= 0 for h in history)


def test_rollout_correction_weights_and_masks_stale_tokens(ray_session, tiny_model_dir):
    # The remote engine decodes on slots here (the other tests: the eager loop): its logprobs
    # must be the trainer's, an importance ratio of 1 on the first, on-policy step.
    trainer = RLTrainer(make_config([
        *FAST, "async_training.max_staleness=1", "actor_rollout_ref.rollout.slot_decode=true",
        "algorithm.rollout_correction.rollout_is=sequence",
        "algorithm.rollout_correction.rollout_is_threshold=1.5",
        "algorithm.rollout_correction.rollout_rs=token",
        "algorithm.rollout_correction.rollout_rs_threshold=1.01"]))
    try:
        history = [trainer.train_step() for _ in range(3)]
    finally:
        trainer.close()
    first, stale = history[0], history[1:]
    assert first["rollout_corr/rollout_rs_masked_fraction"] == 0.0  # on-policy: every ratio ~1
    assert first["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-5)
    assert all(h["rollout_corr/rollout_rs_masked_fraction"] > 0 for h in stale)
    assert all(h["rollout_corr/rollout_is_std"] > 0 for h in stale)
    assert all(0 < h["rollout_corr/rollout_is_eff_sample_size"] <= 1 for h in stale)


def test_a_checkpoint_draws_the_prompts_in_flight_again_on_resume(ray_session, tiny_model_dir, tmp_path):
    overrides = [*FAST, "async_training.max_staleness=1", f"trainer.default_local_dir={tmp_path}",
                 "trainer.total_training_steps=3"]
    trainer = RecordingTrainer(make_config(overrides))
    try:
        trainer.train_step()
        trainer.train_step(save=True)  # step 3's rollout is in flight now
        trainer.train_step()
    finally:
        trainer.close()
    resumed = RecordingTrainer(make_config([*overrides, f"trainer.resume_mode={tmp_path}/global_step_2"]))
    try:
        assert resumed.global_step == 2
        resumed.train_step()
    finally:
        resumed.close()
    assert resumed.prompts[0] == trainer.prompts[2]


def test_client_pushed_batches_are_refused_with_the_key_to_change(ray_session, tiny_model_dir):
    trainer = RLTrainer(make_config([*FAST, "async_training.max_staleness=1"]))
    try:
        with pytest.raises(ConfigError, match="max_staleness=0"):
            trainer.step([{"prompt": [{"role": "user", "content": "What is 1 + 2?"}],
                           "reward_model": {"ground_truth": "3"}}])
    finally:
        trainer.close()


def test_rollout_rs_needs_its_threshold():
    with pytest.raises(ConfigError, match="rollout_rs_threshold"):
        make_config(["algorithm.rollout_correction.rollout_rs=token"])


def test_bypass_mode_uses_the_samplers_logprobs_as_the_old_ones(tiny_model_dir):
    trainer = RecordingTrainer(make_config([*FAST, "algorithm.rollout_correction.bypass_mode=true"]))
    try:
        metrics = trainer.train_step()
    finally:
        trainer.close()
    batch = trainer.batches[0]
    assert torch.equal(batch.tensors["old_logprobs"], batch.tensors["rollout_logprobs"])
    assert "timing_s/old_logprob" not in metrics  # nothing recomputed


def test_multi_turn_agent_loops_run_asynchronously_on_the_remote_engine(ray_session, tiny_model_dir):
    """Guess-the-number episodes against a real env server on 127.0.0.1, k = 1: the agent
    loops' turns go to the engine in its own process; env tokens stay out of the loss."""
    from opentinker.environments.games import GuessNumberEnv
    from opentinker.environments.gym_interaction import GymEnvironmentInteraction
    from opentinker.environments.server import running_env_server

    with running_env_server(GuessNumberEnv) as urls:
        trainer = RecordingTrainer(
            make_config([*FAST, "async_training.max_staleness=1", "data.max_response_length=96",
                         "actor_rollout_ref.rollout.multi_turn.max_assistant_turns=3"]),
            train_rows=[{"extra_info": {"interaction_kwargs": {"name": "guess"}}} for _ in range(8)],
            interactions={"guess": GymEnvironmentInteraction({"env_endpoint": urls[0]})})
        try:
            history = [trainer.train_step() for _ in range(2)]
        finally:
            trainer.close()
    assert [h["staleness/max"] for h in history] == [0.0, 1.0]
    assert all(h["env/guess/turns_mean"] > 1 and h["env/guess/env_errors"] == 0 for h in history)
    batch = trainer.batches[1]
    lengths = torch.tensor([len(r) for r in batch.response_ids])
    inside = torch.arange(batch.response_width)[None, :] < lengths[:, None]
    env_tokens = inside & (batch.response_mask == 0)
    assert env_tokens.any()  # the env's turns are in the responses ...
    assert float(batch.tensors["rollout_logprobs"][env_tokens].abs().max()) == 0.0  # ... and were not sampled


def test_an_asynchronous_job_on_one_gpu_is_told_to_give_the_rollout_gpus_of_its_own():
    from opentinker.engine.rollout.builtin_engines import shared_gpu_warning

    assert shared_gpu_warning("cpu") is None  # on CPU the actor has a core of its own
    warning = shared_gpu_warning("cuda")
    assert "0.65x" in warning and "actor_rollout_ref.rollout.placement=separate" in warning


def test_a_rollout_actor_the_cluster_cannot_place_fails_at_once_with_what_it_needs(ray_session, tiny_model_dir):
    import ray

    from opentinker.engine.rollout.remote import RemoteRolloutEngine

    groups_before = len(ray.util.placement_group_table())
    # This cluster has no GPU: the actor's half of one can never be placed.
    with pytest.raises(RuntimeError, match=r"needs 1 CPU and 0\.5 GPU, and the Ray cluster could not place it "
                                           r"in 1 s \(available: CPU \d+, GPU 0\)"):
        RemoteRolloutEngine(str(tiny_model_dir), device="cuda", placement_timeout_s=1)
    states = [g["state"] for g in ray.util.placement_group_table().values()][groups_before:]
    assert all(state == "REMOVED" for state in states)  # nothing left waiting in the cluster

"""The tinker-cookbook (0.6.1, `make install-cookbook`; skipped where it is not installed, as
in CI), unmodified, against a live server: its RL loop with its own default loss, and its
on-policy distillation (a teacher's compute_logprobs as the reward)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("tinker_cookbook")


def test_math_rl_runs_with_the_cookbooks_default_loss_stable_reinforce(server, keys, tiny_model_dir, tmp_path):
    """No loss_fn given: math_rl's default, stable_reinforce, samples with
    record_stability_info and sends datums with provenance spans; one step trains."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TINKER_TELEMETRY": "0",
           "TINKER_API_KEY": "tml-" + keys["alice"], "TINKER_COOKBOOK_RUNS_DIR": str(tmp_path / "runs")}
    log = tmp_path / "rl"
    command = [sys.executable, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic",
               f"model_name={tiny_model_dir}", "renderer_name=qwen3_instruct", "lora_rank=4", "groups_per_batch=2",
               "group_size=2", "max_tokens=4", "max_steps=1", "eval_every=0", "save_every=0", f"log_path={log}",
               "behavior_if_log_dir_exists=delete", f"base_url={server.url}"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "stable_reinforce" in done.stdout + done.stderr  # the session's name carries the loss
    (step,) = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines()
               if '"grad_norm:mean"' in line]
    assert step["step"] == 0 and step["env/all/total_episodes"] == 4


def test_on_policy_distillation_runs_with_the_tiny_model_as_student_and_teacher(server, keys, tiny_model_dir,
                                                                                  tmp_path):
    """The cookbook's on-policy distillation recipe, unmodified: the student samples, the
    teacher scores the samples with compute_logprobs (prompt logprobs), the reverse KL is the
    advantage. Its dataset (DeepMath, from the Hub) is a local folder of the same name in the
    working directory, which `datasets.load_dataset` reads instead. Teacher = student's base and
    the LoRA starts at zero, so the first step's KL is the sampler's and prompt scorer's
    agreement on the same tokens: about 0."""
    data = tmp_path / "zwhe99" / "DeepMath-103K"
    data.mkdir(parents=True)
    questions = [f"What is {a} + {b}?" for a, b in [(2, 3), (4, 1), (7, 2), (5, 5)]]
    (data / "train.jsonl").write_text("".join(json.dumps({"question": q}) + "\n" for q in questions))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "HF_DATASETS_CACHE": str(tmp_path / "hf-datasets"), "TINKER_TELEMETRY": "0",
           "TINKER_API_KEY": "tml-" + keys["alice"], "TINKER_COOKBOOK_RUNS_DIR": str(tmp_path / "runs")}
    log = tmp_path / "distill"
    command = [sys.executable, "-m", "tinker_cookbook.recipes.distillation.on_policy_distillation",
               f"model_name={tiny_model_dir}", f"teacher_model={tiny_model_dir}", "dataset=deepmath",
               "renderer_name=qwen3_instruct", "lora_rank=4", "groups_per_batch=2", "group_size=2", "max_tokens=4",
               "learning_rate=1e-4", "max_steps=2", "eval_every=0", "save_every=0", f"log_path={log}",
               "behavior_if_log_dir_exists=delete", f"base_url={server.url}"]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    steps = [json.loads(line) for line in (log / "metrics.jsonl").read_text().splitlines() if '"teacher_kl"' in line]
    print("on-policy distillation, teacher_kl per step:", [(step["step"], step["teacher_kl"]) for step in steps])
    assert [step["step"] for step in steps] == [0, 1]
    assert abs(steps[0]["teacher_kl"]) < 1e-3, steps[0]
    assert all("optim/lr" in step for step in steps)

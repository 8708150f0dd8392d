"""The tinker-cookbook (0.6.1, `make install-cookbook`; skipped where it is not installed, as
in CI), unmodified, against a live server: its RL loop with its own default loss."""

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

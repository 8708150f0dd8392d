"""The API process (FastAPI, both APIs) builds what it hands the workers without importing torch:
the model workers and the trainer, in their own processes, do."""

from __future__ import annotations

import subprocess
import sys


def test_the_api_process_builds_worker_calls_and_recipes_without_torch():
    script = """
import sys
import opentinker.server.app
from opentinker.server.tinker import host
from opentinker.server.tinker.routes import training
from opentinker.engine.tinker.calls import ForwardBackwardCall, ModelSpec
from opentinker.recipe import RecipeSpec
spec = ModelSpec(None, lora_rank=4, train_mlp=False)
assert spec.target_modules() == "q_proj,k_proj,v_proj,o_proj,lm_head"  # train_unembed: the SDK's default
assert ModelSpec(None, lora_rank=4, train_attn=False, train_unembed=False).target_modules() == (
    "gate_proj,up_proj,down_proj")
ForwardBackwardCall("m", [], "cross_entropy")
RecipeSpec.build({"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2}, mode="client")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "peft", "vllm"))
assert not heavy, heavy
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"

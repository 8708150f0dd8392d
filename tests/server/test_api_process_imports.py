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
from opentinker.engine.backend import BackendSpec
from opentinker.engine.tinker.calls import ForwardBackwardCall, model_backend_spec
from opentinker.config import build_recipe
spec = model_backend_spec(None, lora_rank=4, train_mlp=False)
assert isinstance(spec, BackendSpec) and spec.multi_adapter and spec.shared_base().lora is None
assert spec.lora.target_modules == "q_proj,k_proj,v_proj,o_proj,lm_head"  # train_unembed: the SDK's default
assert model_backend_spec(None, lora_rank=4, train_attn=False, train_unembed=False).lora.target_modules == (
    "gate_proj,up_proj,down_proj")
full = model_backend_spec(None, strategy="fsdp", ranks=2)
assert full.lora is None and not full.multi_adapter and full.ranks == 2  # a backend of its own
ForwardBackwardCall("m", [], "cross_entropy")
build_recipe({"data.train_batch_size": 4, "actor_rollout_ref.actor.ppo_mini_batch_size": 2}, mode="client")
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "peft", "vllm"))
assert not heavy, heavy
print("ok")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"

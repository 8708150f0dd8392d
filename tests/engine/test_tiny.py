"""The embedded tiny model: real builds, real loading, no mocks.

The SFT-warmed model ships in the package (``opentinker/tiny/model``); short variants are built
into ``tmp_path`` for the determinism check, and the base model for the build lock.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from opentinker import tiny  # noqa: E402
from opentinker.tiny.build import build_tiny_model  # noqa: E402
from opentinker.tiny.corpus import render_chat  # noqa: E402
from opentinker.tiny.sft import _ArithmeticEncoder, evaluate_arithmetic  # noqa: E402
from opentinker.environments.arithmetic import HELDOUT_SEED, make_problems  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_AND_WEIGHT_FILES = (
    "model.safetensors",
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return tiny.ensure_tiny_model()


@pytest.fixture(scope="module")
def tokenizer(tiny_dir):
    return AutoTokenizer.from_pretrained(tiny_dir)


@pytest.fixture(scope="module")
def model(tiny_dir):
    loaded = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    loaded.eval()
    return loaded


# ---------------------------------------------------------------- the cached default folder


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENTINKER_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tiny.default_cache_dir() == tmp_path / "explicit"
    monkeypatch.delenv("OPENTINKER_CACHE_DIR")
    assert tiny.default_cache_dir() == tmp_path / "xdg" / "opentinker"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert tiny.default_cache_dir() == Path.home() / ".cache" / "opentinker"
    folder = tiny.tiny_model_dir(tmp_path)
    assert folder.name == f"{tiny.TINY_MODEL_NAME}-{tiny.TINY_MODEL_VERSION}"
    assert tiny.tiny_model_dir(tmp_path, warm=False).name.endswith("-base")
    # The warm model is the shipped folder wherever the cache is.
    assert tiny.tiny_model_dir() == tiny.SHIPPED_DIR == Path(tiny.__file__).parent / "model"


def test_loads_offline_as_a_plain_hugging_face_folder(tiny_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_dir)
    n_params = sum(p.numel() for p in model.parameters())
    assert 1_000_000 <= n_params <= 5_000_000
    assert model.config.model_type == "qwen2"
    assert model.config.tie_word_embeddings
    assert model.config.vocab_size == len(tokenizer)
    assert 1000 <= len(tokenizer) <= 2000
    report = tiny.read_tiny_report(tiny_dir)
    assert report["num_parameters"] == n_params
    assert report["version"] == tiny.TINY_MODEL_VERSION and report["warm"]


def test_special_tokens_and_ids(tokenizer, model):
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|endoftext|>"
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in tiny.SPECIAL_TOKENS}
    assert len(set(ids.values())) == 3
    for token, token_id in ids.items():
        assert tokenizer(token, add_special_tokens=False)["input_ids"] == [token_id]
    for config in (model.config, model.generation_config):
        assert config.eos_token_id == ids["<|im_end|>"]
        assert config.pad_token_id == ids["<|endoftext|>"]
        assert config.bos_token_id == ids["<|endoftext|>"]
    # Nothing is added around plain text.
    assert tokenizer("hi")["input_ids"] == tokenizer("hi", add_special_tokens=False)["input_ids"]


def test_chat_template_renders_chatml(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 12 + 34?"},
        {"role": "assistant", "content": "46"},
    ]
    expected = (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWhat is 12 + 34?<|im_end|>\n"
        "<|im_start|>assistant\n46<|im_end|>\n"
    )
    assert tokenizer.apply_chat_template(messages, tokenize=False) == expected
    assert render_chat(messages) == expected
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == expected[: expected.rindex("46")]

    ids = tokenizer(expected, add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert tokens.count("<|im_start|>") == 3 and tokens.count("<|im_end|>") == 3
    # The assistant mask covers exactly the answer and its <|im_end|>.
    out = tokenizer.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    marked = [t for t, m in zip(out["input_ids"], out["assistant_masks"]) if m]
    assert tokenizer.decode(marked) == "46<|im_end|>"


def test_digits_are_single_tokens_and_text_round_trips(tokenizer, tiny_dir):
    from tokenizers import Tokenizer

    tokens = tokenizer.convert_ids_to_tokens(tokenizer("What is 1234 + 56?")["input_ids"])
    assert [t for t in tokens if any(c.isdigit() for c in t)] == ["1", "2", "3", "4", "5", "6"]
    raw = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    texts = [
        "Guess a number between 1 and 100. Too high. Too low. Correct!",
        "<tool_call>calc(12*7)</tool_call><tool_response>84</tool_response>",
        "Tom has 3 apples.\n#### 42",
        "héllo wörld — naïve café, 日本語, emoji 😀🚀, math ∑ x² ≤ ½",
        "  leading and   inner spaces\ttabs\r\nwindows lines\n\n",
        "<|im_start|>user\nhi<|im_end|>\n",
        "",
    ]
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids) == text
        # The saved tokenizer.json and what AutoTokenizer builds from it agree.
        assert raw.encode(text, add_special_tokens=False).ids == ids


def test_forward_pass_gives_finite_logits(tokenizer, model):
    chats = [tokenizer.apply_chat_template(p.messages(), tokenize=False, add_generation_prompt=True)
             for p in make_problems(3, HELDOUT_SEED, "heldout")]
    batch = tokenizer(chats, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        logits = model(**batch).logits
    assert logits.shape == (*batch["input_ids"].shape, len(tokenizer))
    assert torch.isfinite(logits).all()


def test_sft_encoding_matches_the_chat_template(tokenizer):
    # Training concatenates prompt ids and answer ids; that must be how the full chat tokenizes.
    encoder = _ArithmeticEncoder(tokenizer)
    for problem in make_problems(20, 0, "train"):
        prompt, answer = encoder(problem)
        full = problem.messages() + [{"role": "assistant", "content": problem.answer}]
        text = tokenizer.apply_chat_template(full, tokenize=False)
        assert tokenizer(text, add_special_tokens=False)["input_ids"][:-1] == prompt + answer


def test_shipped_model_scores_what_its_report_says(tokenizer, model, tiny_dir):
    # The README's "held-out accuracy" starts from this number on every machine: the weights
    # are the shipped bytes, and their greedy answers are what the build measured.
    report = tiny.read_tiny_report(tiny_dir)
    problems = make_problems(report["heldout_problems"], HELDOUT_SEED, "heldout")
    greedy = evaluate_arithmetic(model, tokenizer, problems)
    # A near-tie may break the other way on another CPU's kernels: one problem in 200 at most.
    assert abs(greedy - report["heldout_greedy_accuracy"]) <= 1 / len(problems), greedy
    assert 0.1 < greedy < 0.9
    # Sampling at temperature 1 is worse than greedy: room for RL to sharpen the policy.
    assert report["heldout_sampled_accuracy"] < report["heldout_greedy_accuracy"]


def test_the_shipped_folder_is_used_as_it_is(tiny_dir):
    before = {path.name: (path.stat().st_mtime_ns, _sha256(path)) for path in tiny_dir.iterdir()}
    assert tiny.ensure_tiny_model(progress=False) == tiny_dir == tiny.SHIPPED_DIR
    assert {path.name: (path.stat().st_mtime_ns, _sha256(path)) for path in tiny_dir.iterdir()} == before


# ---------------------------------------------------------------- builds into tmp_path


def test_rebuilding_gives_identical_files(tmp_path):
    recipe = replace(tiny.DEFAULT_RECIPE, eval_problems=16)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    reports = [
        build_tiny_model(tmp_path / name, sft_steps=20, progress=False, recipe=recipe)
        for name in ("a", "b")
    ]
    for name in TOKENIZER_AND_WEIGHT_FILES:
        assert _sha256(tmp_path / "a" / name) == _sha256(tmp_path / "b" / name), name
    assert reports[0]["sft_steps"] == reports[1]["sft_steps"] == 20
    assert reports[0]["build_id"] != reports[1]["build_id"]
    assert math.isfinite(reports[0]["sft_final_loss"])
    # The builder gives back the caller's torch settings.
    assert torch.get_num_threads() == threads
    assert torch.are_deterministic_algorithms_enabled() == deterministic


def test_concurrent_ensure_builds_once(tmp_path):
    # Two processes ask for the (quick) base model at once: one builds, the other waits for it.
    script = textwrap.dedent(
        f"""
        import json, sys
        from opentinker.tiny import ensure_tiny_model, read_tiny_report
        folder = ensure_tiny_model({str(tmp_path)!r}, warm=False, progress=False)
        print(json.dumps({{"folder": str(folder), "build_id": read_tiny_report(folder)["build_id"]}}))
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, env=env)
        for _ in range(2)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0] == results[1]
    folder = Path(results[0]["folder"])
    assert folder == tiny.tiny_model_dir(tmp_path, warm=False)
    report = tiny.read_tiny_report(folder)
    assert report["warm"] is False and report["sft_steps"] == 0
    # Nothing is left behind but the model folder and its lock file.
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([folder.name, f".{folder.name}.lock"])
    assert AutoModelForCausalLM.from_pretrained(folder).config.vocab_size == report["vocab_size"]

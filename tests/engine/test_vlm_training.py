"""Pictures through a training step of the embedded tiny VLM: the rollout engines (eager and
slot decode) sample with the prompts' pictures and their logprobs are the training forward's;
padded, packed and shared-prompt layouts agree; a GRPO run on digit sums raises held-out
accuracy and its checkpoint is a VLM folder with its image processor; bad pictures fail their
row by name."""

from __future__ import annotations

import base64
import json
import struct
import subprocess
import sys
import zlib

import pytest

torch = pytest.importorskip("torch")

from opentinker.engine.backend.forward import ResponseScorer  # noqa: E402
from opentinker.engine.batch import TokenBatch  # noqa: E402
from opentinker.engine.data import chat_prompt_ids, tokenize_rows, with_pictures  # noqa: E402
from opentinker.engine.model_loading import (  # noqa: E402
    eos_token_ids, load_causal_lm, load_tokenizer, resolve_model_path,
)
from opentinker.engine.rollout import SamplingParams  # noqa: E402
from opentinker.engine.rollout.transformers_engine import TransformersRolloutEngine  # noqa: E402
from opentinker.engine.vision import ImagePrompt, VisionPromptEncoder  # noqa: E402
from opentinker.environments import digit_sum  # noqa: E402
from opentinker.images import ImageLimits  # noqa: E402

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def vlm():
    path = resolve_model_path("tiny-vlm")
    tokenizer = load_tokenizer(path)
    model = load_causal_lm(path).eval()
    encoder = VisionPromptEncoder.for_model(path, tokenizer)
    return path, tokenizer, model, encoder


def _prompts(tokenizer, encoder, problems):
    return [encoder.encode(p.messages(), chat_prompt_ids(tokenizer, p.messages())) for p in problems]


def _engine(path, tokenizer, slot: bool) -> TransformersRolloutEngine:
    return TransformersRolloutEngine(load_causal_lm(path), eos_token_ids(tokenizer, path), tokenizer.pad_token_id,
                                     seed=3, tokenizer=tokenizer, slot_decode=slot)


def test_a_picture_prompt_carries_its_pixels_and_image_tokens(vlm):
    path, tokenizer, model, encoder = vlm
    assert VisionPromptEncoder.for_model(resolve_model_path(None), tokenizer) is None  # a text model
    prompt = _prompts(tokenizer, encoder, [digit_sum.DigitSumProblem(3, 4, 0)])[0]
    assert isinstance(prompt, ImagePrompt) and prompt.images.grids == ((1, 4, 8),)
    assert prompt.count(model.config.image_token_id) == 8 and prompt.images.positions.shape == (4, len(prompt))
    # A picture of 2 x 4 merged tokens moves the rotary positions 4 on, the text ones 8.
    assert prompt.images.rope_delta == -4


@pytest.mark.parametrize("slot", [False, True], ids=["eager", "slot"])
def test_rollout_logprobs_with_pictures_are_the_training_forwards(vlm, slot):
    path, tokenizer, model, encoder = vlm
    problems = digit_sum.make_problems(24, digit_sum.HELDOUT_SEED, "heldout")
    prompts = _prompts(tokenizer, encoder, problems)
    engine = _engine(path, tokenizer, slot)
    greedy = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    texts = tokenizer.batch_decode([c.token_ids for c in greedy], skip_special_tokens=True)
    right = sum(digit_sum.score(t, p.answer) for t, p in zip(texts, problems))
    assert right >= 6, texts  # the warm model reads the pictures (about half right)
    # Alone or beside other prompts whose text is the same token for token: the same answer
    # (a prefill that merged prompts by their tokens alone would give every row one picture).
    assert [c.token_ids for c in engine.generate(prompts[5:6], SamplingParams(temperature=0, max_tokens=6))] == [
        greedy[5].token_ids]

    per_sample = [p for p in prompts[:4] for _ in range(4)]
    completions = engine.generate(per_sample, SamplingParams(temperature=1.0, max_tokens=8))
    batch = TokenBatch.from_responses(per_sample, [c.token_ids for c in completions],
                                      images=[p.images for p in per_sample])
    with torch.no_grad():
        trained = ResponseScorer(tokenizer.pad_token_id, CPU)(model, batch, 1.0, False)[0]
    sampled = batch.pad_response_values([c.logprobs for c in completions])
    assert float(((trained - sampled) * batch.response_mask).abs().max()) < 1e-5


def test_padded_packed_and_shared_prompt_layouts_agree_with_pictures(vlm):
    path, tokenizer, model, encoder = vlm
    prompts = _prompts(tokenizer, encoder, digit_sum.make_problems(3, digit_sum.TRAIN_SEED))
    generator = torch.Generator().manual_seed(0)
    rows = [p for p in prompts for _ in range(3)]
    responses = [torch.randint(0, 1500, (2 + 3 * (i % 3),), generator=generator).tolist() for i in range(len(rows))]
    batch = TokenBatch.from_responses(rows, responses, images=[p.images for p in rows])
    with torch.no_grad():
        padded = ResponseScorer(tokenizer.pad_token_id, CPU)(model, batch, 1.0, False, share_prefix=False)[0]
        packed = ResponseScorer(tokenizer.pad_token_id, CPU, use_remove_padding=True)(
            model, batch, 1.0, False, share_prefix=False)[0]
        shared = ResponseScorer(tokenizer.pad_token_id, CPU)(model, batch, 1.0, False, share_prefix=True)[0]
        blind = ResponseScorer(tokenizer.pad_token_id, CPU)(
            model, TokenBatch.from_responses(rows, responses), 1.0, False, share_prefix=False)[0]
    assert float((packed - padded).abs().max()) < 1e-5
    assert float((shared - padded).abs().max()) < 1e-5
    assert float((blind - padded).abs().max()) > 0.1  # the pictures are in the numbers
    # The three prompts share their text: a sub-batch keeps each row's own picture.
    assert batch.select([6, 0]).images == [batch.images[6], batch.images[0]]


def test_rows_with_pictures_are_checked_and_get_their_pixels_when_drawn(vlm):
    path, tokenizer, model, encoder = vlm
    rows = [p.as_row() for p in digit_sum.make_problems(4, digit_sum.TRAIN_SEED)]
    prompts = tokenize_rows(rows, tokenizer, 128, "train", pictures=encoder)
    assert all(p.pictures and not isinstance(p.prompt_ids, ImagePrompt) for p in prompts)  # no pixels kept
    drawn = with_pictures(prompts, tokenizer, encoder)
    assert [list(p.prompt_ids) for p in drawn] == [p.prompt_ids for p in prompts]
    assert all(isinstance(p.prompt_ids, ImagePrompt) for p in drawn)

    with pytest.raises(ValueError, match="train row 0: the prompt has pictures but the model is not a vision-language"):
        tokenize_rows(rows[:1], tokenizer, 128, "train")
    bomb_row = json.loads(json.dumps(rows[0]))
    png = digit_sum.DigitSumProblem(1, 2, 0).png()
    start = png.index(b"IHDR")  # the header declares 100000 x 100000 (CRC fixed): a decompression bomb
    chunk = b"IHDR" + struct.pack(">II", 100_000, 100_000) + png[start + 12:start + 17]
    bomb = png[:start] + chunk + struct.pack(">I", zlib.crc32(chunk)) + png[start + 21:]
    bomb_row["prompt"][0]["content"][0]["image"] = "data:image/png;base64," + base64.b64encode(bomb).decode()
    with pytest.raises(ValueError, match="train row 1: a picture (of 100000 x 100000|is too large)"):
        tokenize_rows([rows[0], bomb_row], tokenizer, 128, "train", pictures=encoder)
    small = VisionPromptEncoder(path, tokenizer, encoder.layout, ImageLimits(max_pixels=64 * 64))
    with pytest.raises(ValueError, match="train row 0: .*pixels"):
        tokenize_rows(rows[:1], tokenizer, 128, "train", pictures=small)  # 56 x 112 is over 64 x 64


def test_grpo_on_digit_sums_raises_heldout_accuracy_and_checkpoints_a_vlm_folder(tmp_path):
    metrics_file = tmp_path / "metrics.jsonl"
    done = subprocess.run(
        [sys.executable, "-m", "opentinker.engine.ppo.cli", "actor_rollout_ref.model.path=tiny-vlm",
         "data.task=digit_sum", "data.max_response_length=8", "trainer.total_training_steps=20",
         "trainer.test_freq=20", "data.val_batch_size=100", "actor_rollout_ref.actor.optim.lr=3e-5",
         "trainer.seed=0", "trainer.progress_bar=false", f"trainer.default_local_dir={tmp_path / 'run'}",
         f"--metrics-out={metrics_file}"],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "same text" not in done.stderr  # the prompts' text is one question, their pictures differ
    history = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    accuracy = [m["val/accuracy"] for m in history if "val/accuracy" in m]
    assert accuracy[-1] >= accuracy[0] + 0.15, accuracy
    actor = tmp_path / "run" / "global_step_20" / "actor"
    assert (actor / "preprocessor_config.json").is_file()  # the folder reads pictures as the model did
    assert json.loads((actor / "config.json").read_text())["model_type"] == "qwen2_vl"
    # The vision tower is frozen by default (actor_rollout_ref.model.train_vision): only the
    # language model moved.
    from safetensors.torch import load_file

    trained = load_file(actor / "model.safetensors")
    shipped = load_file(f"{resolve_model_path('tiny-vlm')}/model.safetensors")
    vision = [name for name in shipped if ".visual." in f".{name}"]
    assert vision and all(torch.equal(trained[name], shipped[name]) for name in vision)
    assert not torch.equal(trained["model.layers.0.mlp.up_proj.weight"],
                           shipped["model.layers.0.mlp.up_proj.weight"])


def test_the_vision_tower_trains_only_when_asked_and_lora_adapts_the_language_model():
    from opentinker.engine.backend import BackendSpec, make_backend
    from opentinker.engine.backend.spec import LoraSettings

    def trainable(**options) -> list[str]:
        backend = make_backend(BackendSpec("tiny-vlm", device="cpu", **options))
        return [name for name, p in backend.model.named_parameters() if p.requires_grad]

    frozen, whole = trainable(), trainable(train_vision=True)
    assert frozen and not any(".visual." in name for name in frozen)
    assert set(whole) - set(frozen) and all(".visual." in name for name in set(whole) - set(frozen))
    adapters = trainable(lora=LoraSettings(4), train_vision=True)
    assert adapters and all("lora_" in name and "language_model" in name for name in adapters)


def test_two_fsdp_ranks_train_the_vlm_as_one_process(ray_session, vlm):
    """Pictures through FSDP2 (2 gloo ranks): the vision tower's blocks and the language model's
    layers sharded; the same logprobs and the same weights after an update as one process, the
    vision tower unchanged (frozen)."""
    from opentinker.engine.backend import AdamParams, BackendSpec, make_backend
    from opentinker.engine.backend.fsdp import FSDPBackend

    path, tokenizer, model, encoder = vlm
    prompts = _prompts(tokenizer, encoder, digit_sum.make_problems(3, digit_sum.TRAIN_SEED))
    rows = [p for p in prompts for _ in range(2)]
    responses = [[20 + i, 21, 22][: 1 + i % 3] for i in range(len(rows))]
    batch = TokenBatch.from_responses(rows, responses, images=[p.images for p in rows])
    batch.tensors["advantages"] = torch.linspace(-1, 1, len(batch)).unsqueeze(-1) * batch.response_mask
    sharded = FSDPBackend(BackendSpec(path, tokenizer.pad_token_id, strategy="fsdp", ranks=2, device="cpu"))
    try:
        local = make_backend(BackendSpec(path, tokenizer.pad_token_id, device="cpu"))
        assert torch.allclose(sharded.forward(batch).logprobs, local.forward(batch).logprobs, atol=1e-5)
        for backend in (sharded, local):
            backend.forward_backward(batch, "rl_policy", {"policy_loss": "vanilla"})
            backend.optim_step(AdamParams(lr=1e-3, eps=1e-3))
        after = [{n: t for bucket in b.weights() for n, t in bucket} for b in (sharded, local)]
        for name, tensor in after[1].items():
            assert torch.allclose(after[0][name], tensor, atol=1e-5), name
            if ".visual." in f".{name}":
                assert torch.equal(tensor, model.state_dict()[name]), name  # frozen on both
    finally:
        sharded.close()

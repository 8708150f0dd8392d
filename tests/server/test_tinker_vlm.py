"""The official ``tinker`` SDK on the embedded tiny VLM (``--model tiny-vlm``): image chunks in
``forward_backward``, ``forward`` and ``sample``. SFT on picture datums lowers the loss; the
pictures are in the numbers; a sampled answer follows the picture; two LoRA clients training
at once on the shared worker each get what they get alone; an image chunk whose
``expected_tokens`` is wrong, a picture over the operator's bound, an image chunk for a text
model and an asset pointer are refused by name."""

from __future__ import annotations

import concurrent.futures
import os

import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from opentinker.environments import digit_sum  # noqa: E402

pytestmark = pytest.mark.heavy  # minutes: scheduled first (tests/conftest.py)

os.environ.setdefault("TINKER_TELEMETRY", "0")
VLM, TINY = "tiny-vlm", "opentinker-tiny-arith"
IMAGE_TOKENS = 8  # a 56 x 112 digit-sum picture


@pytest.fixture(scope="module")
def served(ray_cluster, tmp_path_factory, helpers):
    data_dir = tmp_path_factory.mktemp("tinker-vlm")
    live = helpers.LiveServer(helpers.test_settings(data_dir, models=[VLM], max_image_pixels=200 * 200)).start()
    try:
        yield live, "tml-" + helpers.make_user(data_dir, "vlm-user")
    finally:
        live.stop()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from opentinker.tiny_vlm import ensure_tiny_vlm

    return AutoTokenizer.from_pretrained(str(ensure_tiny_vlm()))


def _halves(tokenizer) -> tuple[list[int], list[int]]:
    """The digit-sum chat's prompt tokens before and after its one picture."""
    chat = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": digit_sum.QUESTION}]}]
    ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    at = ids.index(pad)
    return ids[:at], ids[at + 1:]


def _picture(problem, expected: int | None = IMAGE_TOKENS) -> types.ImageChunk:
    return types.ImageChunk(data=problem.png(), format="png", expected_tokens=expected)


def prompt_of(tokenizer, problem, expected: int | None = IMAGE_TOKENS) -> types.ModelInput:
    before, after = _halves(tokenizer)
    return types.ModelInput(chunks=[types.EncodedTextChunk(tokens=before), _picture(problem, expected),
                                    types.EncodedTextChunk(tokens=after)])


def sft_datum(tokenizer, problem, answer: str | None = None) -> types.Datum:
    """The picture's question and its answer: weight 1 on the answer's tokens and <|im_end|>;
    targets at the picture's positions are free (0: a client cannot spell them)."""
    before, after = _halves(tokenizer)
    reply = tokenizer(answer or problem.answer, add_special_tokens=False)["input_ids"] + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")]
    sequence = before + [None] * IMAGE_TOKENS + after + reply  # None: a picture's token
    inputs = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=before), _picture(problem),
                                      types.EncodedTextChunk(tokens=after + reply[:-1])])
    targets = [0 if token is None else token for token in sequence[1:]]
    weights = [0.0] * (len(sequence) - 1 - len(reply)) + [1.0] * len(reply)
    return types.Datum(model_input=inputs, loss_fn_inputs={"target_tokens": targets, "weights": weights})


def _train(service, tokenizer, problems, seed: int, steps: int = 4) -> list[float]:
    client = service.create_lora_training_client(base_model=VLM, rank=8, seed=seed).result()
    data = [sft_datum(tokenizer, p) for p in problems]
    losses = []
    for _ in range(steps):
        losses.append(client.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        client.optim_step(types.AdamParams(learning_rate=2e-3)).result()
    return losses


def test_sft_on_picture_datums_lowers_the_loss_and_two_clients_at_once_train_as_alone(served, tokenizer):
    server, key = served
    problems = digit_sum.make_problems(8, digit_sum.SFT_SEED, "train")
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    alone = [_train(service, tokenizer, problems[:4], seed=1), _train(service, tokenizer, problems[4:], seed=2)]
    assert all(run[-1] < 0.8 * run[0] for run in alone), alone
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the same two runs, at once, on the shared worker
        together = list(pool.map(lambda args: _train(service, tokenizer, *args), [(problems[:4], 1), (problems[4:], 2)]))
    for solo, shared in zip(alone, together):
        assert shared == pytest.approx(solo, rel=1e-4, abs=1e-4)


def test_the_pictures_are_in_the_numbers_and_a_sampled_answer_follows_the_picture(served, tokenizer):
    server, key = served
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    client = service.create_lora_training_client(base_model=VLM, rank=4, seed=0).result()
    shown, other = digit_sum.DigitSumProblem(3, 4, 1), digit_sum.DigitSumProblem(8, 1, 1)
    answer = "7"
    right = client.forward([sft_datum(tokenizer, shown, answer)], "cross_entropy").result()
    wrong_picture = client.forward([sft_datum(tokenizer, other, answer)], "cross_entropy").result()
    assert right.metrics["loss:sum"] != pytest.approx(wrong_picture.metrics["loss:sum"], abs=1e-3)

    sampler = service.create_sampling_client(base_model=VLM)
    problems = digit_sum.make_problems(12, digit_sum.HELDOUT_SEED, "heldout")
    futures = [sampler.sample(prompt=prompt_of(tokenizer, p), num_samples=1,
                              sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)) for p in problems]
    texts = [tokenizer.decode(f.result().sequences[0].tokens, skip_special_tokens=True) for f in futures]
    assert sum(digit_sum.score(t, p.answer) for t, p in zip(texts, problems)) >= 3, texts  # the warm model: ~half
    # compute_logprobs: the prompt's logprobs with its picture (not those of the picture's tokens alone).
    logprobs = sampler.compute_logprobs(prompt_of(tokenizer, shown)).result()
    assert len(logprobs) == prompt_of(tokenizer, shown).length and logprobs[0] is None


def test_bad_image_chunks_are_refused_by_name(served, tokenizer):
    server, key = served
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    client = service.create_lora_training_client(base_model=VLM, rank=4, seed=0).result()
    problem = digit_sum.DigitSumProblem(1, 2, 0)
    wrong = sft_datum(tokenizer, problem)
    wrong.model_input.chunks[1] = _picture(problem, expected=9)
    with pytest.raises(Exception, match="expected_tokens is 9, but this 112 x 56 picture is 8 tokens"):
        client.forward_backward([wrong], "cross_entropy").result()
    sampler = service.create_sampling_client(base_model=VLM)
    with pytest.raises(Exception, match="expected_tokens is 5, but this 112 x 56 picture is 8 tokens"):
        sampler.sample(prompt=prompt_of(tokenizer, problem, expected=5), num_samples=1,
                       sampling_params=types.SamplingParams(max_tokens=2)).result()
    from PIL import Image
    import io

    big = io.BytesIO()
    Image.new("RGB", (300, 300), "white").save(big, format="PNG")
    large = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]),
                                     types.ImageChunk(data=big.getvalue(), format="png", expected_tokens=None)])
    with pytest.raises(Exception, match="300 x 300 = 90,000 pixels is over the limit of 40,000"):
        sampler.sample(prompt=large, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result()
    pointer = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[1, 2]), types.ImageAssetPointerChunk(
        format="png", location="/etc/passwd", expected_tokens=8)])
    with pytest.raises(Exception, match="reads no file or URL a client names"):
        sampler.sample(prompt=pointer, num_samples=1, sampling_params=types.SamplingParams(max_tokens=2)).result()
    text_model = service.create_sampling_client(base_model=TINY)
    with pytest.raises(Exception, match="not a vision-language model"):
        text_model.sample(prompt=prompt_of(tokenizer, problem), num_samples=1,
                          sampling_params=types.SamplingParams(max_tokens=2)).result()
    # The model trains on after the refusals.
    assert client.forward_backward([sft_datum(tokenizer, problem)], "cross_entropy").result().metrics["loss:sum"] > 0

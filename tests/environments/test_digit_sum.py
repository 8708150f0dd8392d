"""The visual task's pictures: drawn from the problem alone, split without sharing a picture,
scored like the arithmetic task."""

from __future__ import annotations

import base64
import io

from PIL import Image

from opentinker.environments import digit_sum


def test_a_picture_is_drawn_from_its_problem_alone():
    first, second = digit_sum.make_problems(2, seed=5)
    assert first.png() == digit_sum.DigitSumProblem(first.a, first.b, first.variant).png()
    assert first.png() != second.png()
    image = Image.open(io.BytesIO(first.png()))
    assert image.size == (digit_sum.WIDTH, digit_sum.HEIGHT) and image.mode == "RGB"
    # ink on the left half and on the right half: one digit each
    pixels = image.convert("L").load()
    background = pixels[0, 0]
    for half in (range(0, 56), range(56, 112)):
        assert any(abs(pixels[x, y] - background) > 60 for x in half for y in range(56))


def test_the_row_carries_the_picture_as_a_data_url_and_the_sum_as_ground_truth():
    problem = digit_sum.DigitSumProblem(7, 8, 3)
    row = problem.as_row()
    image_part, text_part = row["prompt"][0]["content"]
    assert image_part["type"] == "image" and text_part == {"type": "text", "text": digit_sum.QUESTION}
    header, payload = image_part["image"].split(",", 1)
    assert header == "data:image/png;base64" and base64.b64decode(payload) == problem.png()
    assert row["reward_model"]["ground_truth"] == "15"
    assert digit_sum.score("15", "15") == 1.0 and digit_sum.score("The sum is 14.", "15") == 0.0


def test_held_out_pictures_never_appear_in_training():
    train = digit_sum.make_problems(2000, digit_sum.TRAIN_SEED, "train")
    heldout = digit_sum.make_problems(200, digit_sum.HELDOUT_SEED, "heldout")
    assert not {p.variant for p in train} & {p.variant for p in heldout}
    assert len({(p.a, p.b) for p in train}) == 100  # every pair of digits is trained on

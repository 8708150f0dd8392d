"""Digit sums: the visual task the embedded tiny VLM is warmed up and trained on.

A picture of two digits side by side (56 x 112 pixels: 8 image tokens for a Qwen2-VL vision
tower with 14-pixel patches merged 2 x 2) and the question "What is the sum of the two digits in
the picture?". Each picture is drawn from its problem alone (the digits, and a variant number that
seeds the font size, position and shades), so the client, the engine and the tests draw the
same pixels. Pillow draws them, imported when a picture is drawn: the rest (wording, scoring,
splits) needs no package.
"""

from __future__ import annotations

import io
import random
import zlib
from dataclasses import dataclass
from typing import Literal

from opentinker.environments.arithmetic import score_answer
from opentinker.images import image_part

QUESTION = "What is the sum of the two digits in the picture?"
HEIGHT, WIDTH = 56, 112

Split = Literal["train", "heldout"]


@dataclass(frozen=True)
class DigitSumProblem:
    """Two digits drawn side by side; ``variant`` picks how (font size, offsets, shades)."""

    a: int
    b: int
    variant: int

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def image(self):
        """The picture as a Pillow image (RGB)."""
        return draw_digits(self.a, self.b, self.variant)

    def png(self) -> bytes:
        out = io.BytesIO()
        self.image().save(out, format="PNG")
        return out.getvalue()

    def messages(self) -> list[dict]:
        """One user turn: the picture (HF-style image part, a PNG data URL), then the question."""
        return [{"role": "user", "content": [image_part(self.png()), {"type": "text", "text": QUESTION}]}]

    def as_row(self) -> dict:
        return {"prompt": self.messages(), "reward_model": {"ground_truth": self.answer}, "data_source": "digit_sum"}


def draw_digits(a: int, b: int, variant: int):
    """Digits ``a`` and ``b`` (a Pillow RGB image), each in its half of the picture, drawn as
    ``variant`` says."""
    from PIL import Image, ImageDraw, ImageFont

    rng = random.Random(zlib.crc32(f"{a},{b},{variant}".encode()))
    image = Image.new("L", (WIDTH, HEIGHT), rng.randint(200, 255))
    draw = ImageDraw.Draw(image)
    for half, digit in enumerate((a, b)):
        # Near the middle of its half, a little moved and resized: each digit stays within its
        # own 2 x 2 image tokens, so telling digits apart is learnable by a tiny vision tower.
        font = ImageFont.load_default(size=rng.randint(36, 40))
        left, top, right, bottom = draw.textbbox((0, 0), str(digit), font=font)
        x = half * HEIGHT + (HEIGHT - (right - left)) // 2 + rng.randint(-2, 2) - left
        y = (HEIGHT - (bottom - top)) // 2 + rng.randint(-2, 2) - top
        draw.text((x, y), str(digit), fill=rng.randint(0, 60), font=font)
    return image.convert("RGB")


def make_problems(count: int, seed: int, split: Split = "train") -> list[DigitSumProblem]:
    """``count`` problems, drawn deterministically from ``seed``. The splits share digit pairs
    (there are only 100) but never a picture: a variant is held out by its own hash."""
    rng = random.Random(seed)
    want_heldout = split == "heldout"
    problems: list[DigitSumProblem] = []
    while len(problems) < count:
        problem = DigitSumProblem(rng.randint(0, 9), rng.randint(0, 9), rng.randrange(1 << 30))
        if (zlib.crc32(f"v{problem.variant}".encode()) % 10 == 0) == want_heldout:
            problems.append(problem)
    return problems


def score(response: str, ground_truth: str) -> float:
    """1.0 when the response's first integer is the sum, else 0.0 (as the arithmetic task)."""
    return score_answer(response, ground_truth)


# Seeds are kept apart so that held-out pictures never share a stream with training ones.
TRAIN_SEED = 11
HELDOUT_SEED = 12
SFT_SEED = 13
VALIDATION_SEED = 14

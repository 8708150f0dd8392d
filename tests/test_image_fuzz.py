"""Fuzzing the picture reader: thousands of seeded mutations of real PNG and JPEG files (bytes
flipped, cut short, headers rewritten, chunks repeated) and random bytes. Each one reads as a
picture within the bounds or is refused with an ImageError naming a bound; nothing else is ever
raised, and nothing over the bounds is ever decoded."""

from __future__ import annotations

import io
import random

import pytest

PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from opentinker.images import ImageError, ImageLimits, image_size, read_image  # noqa: E402

LIMITS = ImageLimits(max_bytes=64 * 1024, max_pixels=256 * 256, max_side=512)
BOUNDS = {"max_bytes", "format", "max_side", "max_pixels", "frames", "decode", "aspect"}


def _seeds() -> list[bytes]:
    out = []
    for fmt in ("PNG", "JPEG", "WEBP"):
        buffer = io.BytesIO()
        Image.new("RGB", (40, 24), (200, 30, 90)).save(buffer, format=fmt)
        out.append(buffer.getvalue())
    return out


def _mutate(data: bytes, rng: random.Random) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        kind = rng.randrange(5)
        if kind == 0 and data:  # flip bytes
            for _ in range(rng.randint(1, 8)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1 and len(data) > 1:  # cut short
            del data[rng.randint(1, len(data) - 1):]
        elif kind == 2 and len(data) > 24:  # a header's width/height bytes rewritten (PNG: 16-24)
            data[16:24] = rng.randbytes(8)
        elif kind == 3 and data:  # a span repeated
            start = rng.randrange(len(data))
            data[start:start] = data[start:start + rng.randint(1, 64)] * rng.randint(1, 50)
        else:  # bytes inserted
            at = rng.randrange(len(data) + 1)
            data[at:at] = rng.randbytes(rng.randint(1, 32))
    return bytes(data)


@pytest.mark.parametrize("seed", range(4))
def test_mutated_pictures_are_read_within_bounds_or_refused_by_name(seed):
    rng = random.Random(seed)
    originals = _seeds()
    read = refused = 0
    for case in range(600):
        data = rng.randbytes(rng.randint(0, 200)) if case % 10 == 0 else _mutate(rng.choice(originals), rng)
        try:
            picture = read_image(data, LIMITS)
        except ImageError as error:
            assert error.limit in BOUNDS, (error.limit, str(error))
            refused += 1
            continue
        width, height = picture.size
        assert width * height <= LIMITS.max_pixels and max(width, height) <= LIMITS.max_side
        assert image_size(data, LIMITS) == (width, height)  # the header's size is the decoded one
        read += 1
    assert read > 0 and refused > 0

"""Pictures as untrusted input: every bound is checked before the decode that could allocate,
and each refusal names its bound."""

from __future__ import annotations

import base64
import io
import resource
import struct
import zlib

import pytest
from PIL import Image, features

from opentinker.images import (
    ImageError, ImageLimits, data_url_payload, image_part, image_url, message_images, read_image,
    read_message_images,
)
from opentinker.rows import prompt_problem


def _png(width=8, height=6, color=(200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def _data_url(data: bytes, subtype="png") -> str:
    return f"data:image/{subtype};base64," + base64.b64encode(data).decode()


def _declaring(data: bytes, width: int, height: int) -> bytes:
    """A PNG whose header says ``width`` x ``height`` (CRC fixed), its pixel data unchanged: the
    shape of a decompression bomb."""
    start = data.index(b"IHDR")
    header = struct.pack(">II", width, height) + data[start + 12:start + 17]
    chunk = b"IHDR" + header
    return data[:start] + chunk + struct.pack(">I", zlib.crc32(chunk)) + data[start + 21:]


def test_both_part_styles_name_their_picture():
    url = _data_url(_png())
    chat = [{"role": "system", "content": "hi"},
            {"role": "user", "content": [{"type": "image", "image": url}, {"type": "text", "text": "and"},
                                         {"type": "image_url", "image_url": {"url": url}}]}]
    assert list(message_images(chat)) == [url, url]
    assert image_url({"type": "text", "text": "x"}) is None
    with pytest.raises(ImageError) as error:
        image_url({"type": "image_url", "image_url": {"link": url}})
    assert error.value.limit == "url"


def test_a_good_picture_decodes_to_rgb():
    image = read_image(data_url_payload(_data_url(_png(8, 6))))
    assert image.size == (8, 6) and image.mode == "RGB" and image.getpixel((0, 0)) == (200, 30, 30)


@pytest.mark.parametrize("url, limit", [
    ("https://example.com/cat.png", "url"),
    ("file:///etc/passwd", "url"),
    ("data:text/plain;base64,aGk=", "url"),
    ("data:image/png;base64,@@@@", "base64"),
])
def test_only_data_urls_of_pictures_are_read(url, limit):
    with pytest.raises(ImageError) as error:
        data_url_payload(url)
    assert error.value.limit == limit


def test_the_size_is_refused_from_the_text_length_before_decoding():
    url = "data:image/png;base64," + "A" * (8 * 1024 * 1024)
    with pytest.raises(ImageError, match="over the limit of 4,194,304 bytes") as error:
        data_url_payload(url)
    assert error.value.limit == "max_bytes"


def test_a_decompression_bomb_is_refused_from_its_header_with_memory_flat():
    bomb = _declaring(_png(1, 1), 60000, 60000)  # 3.6e9 pixels declared: ~10 GiB once decoded
    assert len(bomb) < 200
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    for _ in range(20):
        with pytest.raises(ImageError) as error:
            read_image(bomb)
        assert error.value.limit in {"max_side", "max_pixels"}  # Pillow's own bomb check may speak first
    bomb = _declaring(_png(1, 1), 8000, 8000)  # under the side limit, over the pixel count
    with pytest.raises(ImageError, match="64,000,000 pixels is over the limit of 16,777,216") as error:
        read_image(bomb)
    assert error.value.limit == "max_pixels"
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 20 * 1024, f"peak RSS grew by {grown_kib} KiB"


def test_truncated_and_foreign_files_are_refused():
    data = _png(64, 64)
    with pytest.raises(ImageError) as error:
        read_image(data[: len(data) // 2])
    assert error.value.limit == "decode"
    bmp = io.BytesIO()
    Image.new("RGB", (4, 4)).save(bmp, format="BMP")
    with pytest.raises(ImageError, match="PNG, JPEG, WEBP") as error:
        read_image(bmp.getvalue())
    assert error.value.limit == "format"
    with pytest.raises(ImageError) as error:
        read_image(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    assert error.value.limit in {"format", "decode"}


@pytest.mark.skipif(not features.check("webp"), reason="this Pillow has no WebP")
def test_an_animated_picture_is_refused():
    out = io.BytesIO()
    frames = [Image.new("RGB", (8, 8), c) for c in ((255, 0, 0), (0, 255, 0))]
    frames[0].save(out, format="WEBP", save_all=True, append_images=frames[1:])
    with pytest.raises(ImageError) as error:
        read_image(out.getvalue())
    assert error.value.limit == "frames"


def test_the_operator_bounds_apply_and_the_count_per_row():
    limits = ImageLimits(max_bytes=10_000, max_pixels=100, max_side=20, max_images_per_row=2)
    with pytest.raises(ImageError) as error:
        read_image(_png(11, 10), limits)
    assert error.value.limit == "max_pixels"
    url = _data_url(_png(4, 4))
    chat = [{"role": "user", "content": [{"type": "image", "image": url}] * 3}]
    with pytest.raises(ImageError, match="3 pictures are over the limit of 2 per row") as error:
        read_message_images(chat, limits)
    assert error.value.limit == "max_images_per_row"
    assert [im.size for im in read_message_images([{"role": "user", "content": chat[0]["content"][:2]}], limits)] \
        == [(4, 4), (4, 4)]


def test_image_part_makes_a_data_url_from_bytes_a_file_or_a_pillow_image(tmp_path):
    png = _png(5, 3)
    path = tmp_path / "picture.png"
    path.write_bytes(png)
    jpeg = io.BytesIO()
    Image.new("RGB", (4, 4)).save(jpeg, format="JPEG")
    for source in (png, path, str(path)):
        part = image_part(source)
        assert part["type"] == "image" and part["image"].startswith("data:image/png;base64,")
        assert data_url_payload(image_url(part)) == png
    assert image_part(jpeg.getvalue())["image"].startswith("data:image/jpeg;base64,")
    assert read_image(data_url_payload(image_part(Image.new("RGB", (6, 2)))["image"])).size == (6, 2)
    with pytest.raises(ImageError) as error:
        image_part(b"GIF89a....")
    assert error.value.limit == "format"


def test_a_rows_parts_are_checked_for_shape_on_either_side():
    """rows.prompt_problem (the client's and the door's): text parts and picture parts whose
    picture is a data: URL; the picture itself is read on the server."""
    text = {"type": "text", "text": "What is it?"}
    assert prompt_problem([{"role": "user", "content": [image_part(_png()), text]}]) is None
    assert prompt_problem([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _data_url(_png())}}]}]) is None
    assert prompt_problem([{"role": "user", "content": "What is it?"}]) is None
    cases = [
        ([], "'prompt[0].content' must not be an empty list of parts"),
        ([text, {"type": "image", "image": "https://example.com/a.png"}],
         "'prompt[0].content[1]': a picture must be a data: URL"),
        ([{"type": "image"}], "'prompt[0].content[0]': an 'image' part needs its picture as a data URL string"),
        ([{"type": "text", "text": 3}], "'prompt[0].content[0].text' must be a string"),
        ([{"type": "video", "video": "data:video/mp4;base64,AAAA"}], "'prompt[0].content[0]' must be a text part"),
        (["just a string"], "'prompt[0].content[0]' must be a text part"),
    ]
    for content, needle in cases:
        assert needle in (prompt_problem([{"role": "user", "content": content}]) or ""), content

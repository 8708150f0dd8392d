"""Pictures in chat messages: where they are, and reading them as untrusted input.

A message's ``content`` may be a list of parts. A picture is an HF-style part
``{"type": "image", "image": URL}`` or an OpenAI-style one
``{"type": "image_url", "image_url": {"url": URL}}``, and ``URL`` must be a ``data:`` URL
(``data:image/png;base64,...``). A server never fetches a URL a client names.

:func:`read_image` checks every bound before anything is decoded that could allocate by the
picture's own say-so:

1. the encoded size, from the base64 text's length, before decoding it;
2. the format, from the file's header (PNG, JPEG and WebP only);
3. the width, height and pixel count, also from the header. A decompression bomb (a small file
   declaring a huge picture) is refused here, before its pixels exist;
4. then the decode itself, where a truncated or corrupt file is refused.

Each refusal is an :class:`ImageError` naming the bound and both numbers. The operator sets the
bounds (:class:`ImageLimits`). Pillow is imported only by :func:`read_image` (the server side);
finding pictures and checking their shape needs no package, so the thin client uses this module
too.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import io
import math
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

IMAGE_PART_TYPES = ("image", "image_url")
_DATA_URL = re.compile(r"data:image/(?P<subtype>[a-z0-9.+-]{1,20});base64,", re.IGNORECASE)


class ImageError(ValueError):
    """A picture refused; ``limit`` names the bound it broke (``max_bytes``, ``format``, ...)."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class ImageLimits:
    """What a server accepts in one picture and one row (the operator's flags)."""

    max_bytes: int = 4 * 1024 * 1024  # encoded, per picture
    max_pixels: int = 4096 * 4096  # width x height
    max_side: int = 8192
    max_images_per_row: int = 8
    formats: tuple[str, ...] = ("PNG", "JPEG", "WEBP")

    @classmethod
    def checked_upstream(cls) -> ImageLimits:
        """For a process decoding pictures the server's API process has already read under the
        operator's bounds (a Tinker worker): no size bound of its own, only the formats."""
        huge = 2**62
        return cls(max_bytes=huge, max_pixels=huge, max_side=huge, max_images_per_row=huge)


def image_url(part: Any) -> str | None:
    """The URL of an image part (either style), or None when ``part`` is not an image part.
    Raises :class:`ImageError` for an image part without a URL string."""
    if not isinstance(part, Mapping) or part.get("type") not in IMAGE_PART_TYPES:
        return None
    url = part.get("image") if part["type"] == "image" else (part.get("image_url") or {})
    if isinstance(url, Mapping):
        url = url.get("url")
    if not isinstance(url, str):
        raise ImageError(f"an {part['type']!r} part needs its picture as a data URL string "
                         "('data:image/png;base64,...')", "url")
    return url


def message_images(messages: Any) -> Iterator[str]:
    """The picture URLs of a chat, in order (messages whose content is a list of parts)."""
    for message in messages if isinstance(messages, list) else ():
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, list):
            for part in content:
                url = image_url(part)
                if url is not None:
                    yield url


_MAGIC = ((b"\x89PNG\r\n\x1a\n", "png"), (b"\xff\xd8\xff", "jpeg"))


def turn_with_pictures(text: str, urls: list[str]) -> str | list[dict[str, Any]]:
    """A user turn: ``text`` as it is, or with pictures the content list of their image parts
    (HF-style, each a data URL) followed by the text."""
    if not urls:
        return text
    return [*({"type": "image", "image": url} for url in urls), {"type": "text", "text": text}]


def image_part(source: Any) -> dict[str, str]:
    """An HF-style image part ``{"type": "image", "image": <data URL>}`` of a picture given as
    PNG, JPEG or WebP bytes, a file's path, or a Pillow image (written as PNG)."""
    if hasattr(source, "save") and hasattr(source, "size"):  # a Pillow image
        out = io.BytesIO()
        source.save(out, format="PNG")
        source = out.getvalue()
    elif isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as file:
            source = file.read()
    if not isinstance(source, (bytes, bytearray)):
        raise TypeError(f"image_part takes bytes, a path or a Pillow image, got {type(source).__name__}")
    data = bytes(source)
    subtype = next((name for magic, name in _MAGIC if data.startswith(magic)), None)
    if subtype is None and data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        subtype = "webp"
    if subtype is None:
        raise ImageError("image_part: the picture is not PNG, JPEG or WebP (by its first bytes)", "format")
    return {"type": "image", "image": f"data:image/{subtype};base64," + base64.b64encode(data).decode("ascii")}


def data_url_payload(url: str, limits: ImageLimits = ImageLimits()) -> bytes:
    """The bytes of a ``data:image/...;base64,`` URL, its size checked before it is decoded."""
    match = _DATA_URL.match(url)
    if match is None:
        shown = url[:40] + ("..." if len(url) > 40 else "")
        raise ImageError(f"a picture must be a data URL ('data:image/png;base64,...'); got {shown!r} "
                         "(the server fetches no URL)", "url")
    payload = url[match.end():]
    size = len(payload) * 3 // 4
    if size > limits.max_bytes:
        raise ImageError(f"a picture of about {size:,} bytes is over the limit of {limits.max_bytes:,} bytes",
                         "max_bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageError(f"a picture's base64 data is not valid: {error}", "base64") from error


def read_image(data: bytes, limits: ImageLimits = ImageLimits()):
    """The decoded picture (a Pillow RGB image) of ``data``, each bound checked first (see the
    module's docstring)."""
    with _checked(data, limits) as image:
        try:
            image.load()
        except (OSError, SyntaxError, ValueError) as error:
            raise ImageError(f"a picture could not be decoded (truncated or corrupt): {error}", "decode") from error
        return image.convert("RGB")


def image_size(data: bytes, limits: ImageLimits = ImageLimits()) -> tuple[int, int]:
    """``(width, height)`` of the picture ``data``, read from its header under ``limits``
    (nothing decoded: what the API process checks before a worker decodes the picture)."""
    with _checked(data, limits) as image:
        return image.size


@contextlib.contextmanager
def _checked(data: bytes, limits: ImageLimits):
    """The picture opened (its header read) with every bound but the decode's checked."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"a picture of {len(data):,} bytes is over the limit of {limits.max_bytes:,} bytes",
                         "max_bytes")
    try:
        image = Image.open(io.BytesIO(data), formats=list(limits.formats))  # reads the header only
    except UnidentifiedImageError as error:
        raise ImageError(f"a picture must be one of {', '.join(limits.formats)}; this one is not", "format") from error
    except Image.DecompressionBombError as error:  # Pillow's own bound, below ours only if ours is raised
        raise ImageError(f"a picture is too large to decode: {error}", "max_pixels") from error
    except (OSError, SyntaxError, ValueError) as error:
        raise ImageError(f"a picture could not be decoded (truncated or corrupt): {error}", "decode") from error
    with image:
        width, height = image.size
        if max(width, height) > limits.max_side:
            raise ImageError(f"a picture of {width} x {height} pixels has a side over the limit of "
                             f"{limits.max_side}", "max_side")
        if width * height > limits.max_pixels:
            raise ImageError(f"a picture of {width} x {height} = {width * height:,} pixels is over the "
                             f"limit of {limits.max_pixels:,}", "max_pixels")
        if getattr(image, "n_frames", 1) != 1:
            raise ImageError(f"a picture must have one frame, this one has {image.n_frames}", "frames")
        yield image


@dataclass(frozen=True)
class PictureTokens:
    """How a vision-language model folder turns a picture into tokens: its image token and its
    (Qwen2-VL-style) processor's sizing, read from ``config.json`` and
    ``preprocessor_config.json`` without torch."""

    image_token_id: int
    patch: int
    merge: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def of_folder(cls, folder: str | os.PathLike) -> PictureTokens | None:
        """None for a text model (or a folder without a Qwen2-VL-style processor config)."""
        import json
        from pathlib import Path

        folder = Path(folder)
        try:
            config = json.loads((folder / "config.json").read_text())
            processor = json.loads((folder / "preprocessor_config.json").read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(config, dict) or not isinstance(processor, dict) or "image_token_id" not in config:
            return None
        size = processor.get("size") or {}
        try:
            return cls(int(config["image_token_id"]), int(processor.get("patch_size", 14)),
                       int(processor.get("merge_size", 2)),
                       int(processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56),
                       int(processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280))
        except (TypeError, ValueError):
            return None

    def count(self, width: int, height: int) -> int:
        """The image tokens of a ``width`` x ``height`` picture."""
        return qwen2_vl_tokens(width, height, self.patch, self.merge, self.min_pixels, self.max_pixels)


def qwen2_vl_tokens(width: int, height: int, patch: int, merge: int, min_pixels: int, max_pixels: int) -> int:
    """How many image tokens Qwen2-VL's processor makes of a ``width`` x ``height`` picture: it
    resizes each side to a multiple of ``patch * merge`` (rounded), keeping the pixel count
    within [min_pixels, max_pixels] at about the same aspect, then merges ``merge`` x ``merge``
    patches into a token. (transformers' ``smart_resize``, as arithmetic: no torch.)"""
    factor = patch * merge
    if max(width, height) / min(width, height) > 200:
        raise ImageError(f"a picture of {width} x {height} has an aspect ratio over 200", "aspect")
    h, w = round(height / factor) * factor, round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h, w = max(factor, math.floor(height / beta / factor) * factor), max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h, w = math.ceil(height * beta / factor) * factor, math.ceil(width * beta / factor) * factor
    return (h // patch) * (w // patch) // (merge * merge)


def read_message_images(messages: Any, limits: ImageLimits = ImageLimits(), earlier: int = 0) -> list:
    """Every picture of a chat, decoded under ``limits`` (their count included, with ``earlier``
    pictures the same conversation already holds)."""
    return [read_image(data_url_payload(url, limits), limits) for url in _counted_urls(messages, limits, earlier)]


def check_message_images(messages: Any, limits: ImageLimits = ImageLimits()) -> None:
    """What :func:`read_message_images` checks, from the files' headers: nothing is decoded
    (where another process decodes the pictures later)."""
    for url in _counted_urls(messages, limits, 0):
        image_size(data_url_payload(url, limits), limits)


def _counted_urls(messages: Any, limits: ImageLimits, earlier: int) -> list[str]:
    urls = list(message_images(messages))
    total = earlier + len(urls)
    if total > limits.max_images_per_row:
        raise ImageError(f"{total} pictures are over the limit of {limits.max_images_per_row} per row",
                         "max_images_per_row")
    return urls

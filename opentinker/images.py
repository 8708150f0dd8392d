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
import io
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
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"a picture of {len(data):,} bytes is over the limit of {limits.max_bytes:,} bytes",
                         "max_bytes")
    try:
        with Image.open(io.BytesIO(data), formats=list(limits.formats)) as image:  # reads the header only
            width, height = image.size
            if max(width, height) > limits.max_side:
                raise ImageError(f"a picture of {width} x {height} pixels has a side over the limit of "
                                 f"{limits.max_side}", "max_side")
            if width * height > limits.max_pixels:
                raise ImageError(f"a picture of {width} x {height} = {width * height:,} pixels is over the "
                                 f"limit of {limits.max_pixels:,}", "max_pixels")
            if getattr(image, "n_frames", 1) != 1:
                raise ImageError(f"a picture must have one frame, this one has {image.n_frames}", "frames")
            image.load()
            return image.convert("RGB")
    except UnidentifiedImageError as error:
        raise ImageError(f"a picture must be one of {', '.join(limits.formats)}; this one is not", "format") from error
    except Image.DecompressionBombError as error:  # Pillow's own bound, below ours only if ours is raised
        raise ImageError(f"a picture is too large to decode: {error}", "max_pixels") from error
    except (OSError, SyntaxError, ValueError) as error:
        if isinstance(error, ImageError):
            raise
        raise ImageError(f"a picture could not be decoded (truncated or corrupt): {error}", "decode") from error


def read_message_images(messages: Any, limits: ImageLimits = ImageLimits()) -> list:
    """Every picture of a chat, decoded under ``limits`` (their count included)."""
    urls = list(message_images(messages))
    if len(urls) > limits.max_images_per_row:
        raise ImageError(f"{len(urls)} pictures are over the limit of {limits.max_images_per_row} per row",
                         "max_images_per_row")
    return [read_image(data_url_payload(url, limits), limits) for url in urls]

"""A reward curve as a PNG, with no plotting dependency (the thin client stays thin).

Draws a light grid, the raw per-step values and, when given, a smoothed line, scaled to the
data's range; the file is an ordinary 8-bit RGB PNG written with zlib.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from pathlib import Path

Color = tuple[int, int, int]
BACKGROUND: Color = (255, 255, 255)
GRID: Color = (225, 225, 225)
AXIS: Color = (90, 90, 90)
RAW: Color = (150, 180, 230)
SMOOTH: Color = (20, 70, 170)


def moving_average(values: Sequence[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


class _Canvas:
    def __init__(self, width: int, height: int):
        self.width, self.height = width, height
        self.pixels = bytearray(BACKGROUND * (width * height))

    def dot(self, x: int, y: int, color: Color, radius: int = 0) -> None:
        for dx in range(-radius, radius + 1):
            for dy in range(-radius, radius + 1):
                px, py = x + dx, y + dy
                if 0 <= px < self.width and 0 <= py < self.height:
                    offset = 3 * (py * self.width + px)
                    self.pixels[offset: offset + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Color, radius: int = 0) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps), color, radius)

    def png(self) -> bytes:
        rows = b"".join(b"\x00" + bytes(self.pixels[3 * y * self.width: 3 * (y + 1) * self.width])
                        for y in range(self.height))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


def write_curve_png(values: Sequence[float], path: str | Path, *, width: int = 640, height: int = 360,
                    smooth_window: int = 5) -> Path:
    """Plot ``values`` (one per step) to ``path``; returns the path."""
    if not values:
        raise ValueError("write_curve_png: no values to plot")
    canvas = _Canvas(width, height)
    margin = 30
    left, right, top, bottom = margin, width - margin, margin, height - margin
    low, high = min(values), max(values)
    if high - low < 1e-9:
        low, high = low - 0.5, high + 0.5
    for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = round(bottom - fraction * (bottom - top))
        canvas.line(left, y, right, y, GRID)
    canvas.line(left, bottom, right, bottom, AXIS)
    canvas.line(left, top, left, bottom, AXIS)

    def point(i: int, value: float) -> tuple[int, int]:
        x = left + (right - left) * (i / max(1, len(values) - 1))
        y = bottom - (bottom - top) * (value - low) / (high - low)
        return round(x), round(y)

    for series, color, radius in ((values, RAW, 0), (moving_average(values, smooth_window), SMOOTH, 1)):
        points = [point(i, v) for i, v in enumerate(series)]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            canvas.line(x0, y0, x1, y1, color, radius)
        if len(points) == 1:
            canvas.dot(*points[0], color, 2)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(canvas.png())
    return path

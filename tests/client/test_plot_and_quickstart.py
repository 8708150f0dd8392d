"""The reward-curve PNG and `opentinker quickstart` (real server process, tiny model)."""

from __future__ import annotations

import struct
import subprocess
import sys
import zlib

import pytest

from opentinker.client.plot import moving_average, write_curve_png


def read_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height, depth, color = struct.unpack(">IIBB", data[16:26])
    chunks, offset = [], 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset:offset + 4])
        kind, body = data[offset + 4:offset + 8], data[offset + 8:offset + 8 + length]
        assert struct.unpack(">I", data[offset + 8 + length:offset + 12 + length])[0] == zlib.crc32(kind + body)
        chunks.append((kind, body))
        offset += 12 + length
    raw = zlib.decompress(b"".join(body for kind, body in chunks if kind == b"IDAT"))
    rows = [raw[y * (3 * width + 1) + 1:(y + 1) * (3 * width + 1)] for y in range(height)]
    return width, height, depth, color, rows


def test_curve_png_is_valid_and_rises_like_the_data(tmp_path):
    path = write_curve_png([0.1, 0.2, 0.3, 0.5, 0.8], tmp_path / "curve.png", width=200, height=100)
    width, height, depth, color, rows = read_png(path)
    assert (width, height, depth, color) == (200, 100, 8, 2)
    smooth_blue = bytes((20, 70, 170))

    def curve_rows_at(x: int) -> list[int]:
        return [y for y, row in enumerate(rows) if row[3 * x:3 * x + 3] == smooth_blue]

    # a rising series is drawn lower on the left than on the right (y grows downwards)
    assert min(curve_rows_at(35)) > max(curve_rows_at(165))


def test_moving_average_and_empty_input(tmp_path):
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    with pytest.raises(ValueError, match="no values"):
        write_curve_png([], tmp_path / "x.png")


@pytest.mark.slow
def test_quickstart_runs_end_to_end(tiny_model_dir, tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "opentinker.client.cli", "quickstart", "--steps", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "completed after 4 steps" in result.stdout
    assert read_png(tmp_path / "reward_curve.png")[0] == 640
    assert (tmp_path / "checkpoint" / "global_step_4" / "config.json").exists()
    assert "server stopped" in result.stdout

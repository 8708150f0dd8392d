"""The reward-curve PNG (matplotlib) and `opentinker quickstart` (real server process, tiny model)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from opentinker.client.plot import PlotUnavailableError, curve_figure, moving_average, write_curve_png

np = pytest.importorskip("numpy")
Image = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")


def read_png(path):
    """(width, height, pixels as an [height, width, 3] uint8 array) of a PNG file."""
    with Image.open(path) as image:
        assert image.format == "PNG"
        return image.width, image.height, np.asarray(image.convert("RGB"))


def test_curve_png_is_valid_and_rises_like_the_data(tmp_path):
    path = write_curve_png([0.1, 0.2, 0.3, 0.5, 0.8], tmp_path / "curve.png", width=400, height=300)
    width, height, pixels = read_png(path)
    assert (width, height) == (400, 300)
    smooth_blue = np.array((0x14, 0x46, 0xAA))
    on_curve = np.abs(pixels.astype(int) - smooth_blue).max(axis=2) <= 8
    columns = np.flatnonzero(on_curve.any(axis=0))
    assert len(columns) > width // 3  # the smoothed line spans the plot area
    left, right = columns[len(columns) // 10], columns[-len(columns) // 10]
    # a rising series is drawn lower on the left than on the right (y grows downwards)
    assert np.flatnonzero(on_curve[:, left]).min() > np.flatnonzero(on_curve[:, right]).max()


def test_curve_has_axes_labels_title_and_both_lines():
    figure = curve_figure([0.1, 0.4, 0.2], metric="reward/mean", title="my run", steps=[2, 4, 6])
    (axes,) = figure.axes
    assert (axes.get_xlabel(), axes.get_ylabel(), axes.get_title()) == ("step", "reward/mean", "my run")
    raw, smooth = axes.get_lines()
    assert list(raw.get_xdata()) == [2, 4, 6] and list(raw.get_ydata()) == [0.1, 0.4, 0.2]
    assert list(smooth.get_ydata()) == pytest.approx(moving_average([0.1, 0.4, 0.2], 3))
    assert curve_figure([0.5]).axes[0].get_title() == "reward/mean per training step"


def test_moving_average_and_empty_input(tmp_path):
    assert moving_average([1, 2, 3, 4], 2) == [1, 1.5, 2.5, 3.5]
    with pytest.raises(ValueError, match="no values"):
        write_curve_png([], tmp_path / "x.png")


def test_without_matplotlib_the_error_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)  # not installed
    with pytest.raises(PlotUnavailableError, match=r"opentinker\[plot\]"):
        write_curve_png([0.1, 0.2], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


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

"""``python -m opentinker.tiny_vlm``: where the tiny VLM is and its accuracy; ``--rebuild`` builds
it again into the cache and says whether the rebuild matches the shipped bytes."""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path

from opentinker.tiny_vlm.folder import SHIPPED_DIR, ensure_tiny_vlm, read_tiny_vlm_report


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opentinker.tiny_vlm",
                                     description="Print where the embedded tiny VLM is and its accuracy; build it on request.")
    parser.add_argument("--rebuild", action="store_true", help="build it again into the cache and compare the weights")
    parser.add_argument("--cache-dir", default=None, help="where builds go; default: $OPENTINKER_CACHE_DIR, "
                        "$XDG_CACHE_HOME/opentinker or ~/.cache/opentinker")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    folder = ensure_tiny_vlm(args.cache_dir if args.rebuild else None, progress=not args.quiet, force=args.rebuild)
    print(folder)
    print(describe(read_tiny_vlm_report(folder)))
    if args.rebuild and (SHIPPED_DIR / "model.safetensors").is_file():
        same = _sha256(folder / "model.safetensors") == _sha256(SHIPPED_DIR / "model.safetensors")
        print("the rebuild's weights are byte-identical to the shipped ones" if same else
              "the rebuild's weights differ from the shipped ones (another CPU's float32 kernels); "
              "training uses the shipped folder")
    return 0


def describe(report: dict) -> str:
    return (f"{report['name']} {report['version']}: {report['num_parameters']:,} parameters, "
            f"{report['sft_steps']} SFT steps; held-out digit sums {report['heldout_greedy_accuracy']:.3f} "
            f"on {report['heldout_problems']} pictures (text arithmetic {report['heldout_text_arithmetic_accuracy']:.3f}), "
            f"built in {report['build_seconds']:.1f}s")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


if __name__ == "__main__":
    raise SystemExit(main())

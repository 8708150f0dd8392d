"""``python -m opentinker.tiny``: where the tiny model is and its accuracy; ``--rebuild`` builds
it again into the cache and says whether the rebuild matches the shipped bytes."""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Sequence
from pathlib import Path

from opentinker.tiny.folder import SHIPPED_DIR, ensure_tiny_model, read_tiny_report

WEIGHTS = "model.safetensors"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m opentinker.tiny",
        description="Print where the embedded tiny model is and its accuracy; build it on request.",
    )
    parser.add_argument("--rebuild", action="store_true",
                        help="build the SFT-warmed model again into the cache (about 4 minutes on 2 cores) "
                             "and compare it with the shipped one")
    parser.add_argument("--base", action="store_true", help="the random-init model (no SFT warm-up), built once")
    parser.add_argument("--cache-dir", default=None, help="where builds go; default: $OPENTINKER_CACHE_DIR, "
                        "$XDG_CACHE_HOME/opentinker or ~/.cache/opentinker")
    parser.add_argument("--quiet", action="store_true", help="no progress output")
    args = parser.parse_args(argv)
    if args.cache_dir is not None and not (args.rebuild or args.base):
        parser.error("--cache-dir is where builds go: give it with --rebuild or --base (the warm model ships "
                     "in the package)")
    folder = ensure_tiny_model(args.cache_dir, warm=not args.base, progress=not args.quiet, force=args.rebuild)
    print(folder)
    print(describe(read_tiny_report(folder)))
    if args.rebuild:
        same = _sha256(folder / WEIGHTS) == _sha256(SHIPPED_DIR / WEIGHTS)
        print(f"shipped: {describe(read_tiny_report(SHIPPED_DIR))}")
        print("the rebuild's weights are byte-identical to the shipped ones" if same else
              "the rebuild's weights differ from the shipped ones (another CPU's float32 kernels); "
              "training uses the shipped folder")
    return 0


def describe(report: dict) -> str:
    return (f"{report['name']} {report['version']} ({'warm' if report['warm'] else 'base'}): "
            f"{report['num_parameters']:,} parameters, vocab {report['vocab_size']}, "
            f"held-out accuracy greedy {report['heldout_greedy_accuracy']:.3f} / "
            f"sampled {report['heldout_sampled_accuracy']:.3f} on {report['heldout_problems']} problems, "
            f"built in {report['build_seconds']:.1f}s")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


if __name__ == "__main__":
    raise SystemExit(main())

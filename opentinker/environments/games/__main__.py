"""``python -m opentinker.environments.games <name> [--host H] [--port P] [--shards N]``."""

from __future__ import annotations

import argparse
import json
import logging

from opentinker.environments.games import BUILTIN_ENVIRONMENTS


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m opentinker.environments.games",
        description="Serve one of OpenTinker's built-in environments over the env protocol.",
    )
    parser.add_argument("name", choices=sorted(BUILTIN_ENVIRONMENTS))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--shards", type=int, default=1, help="serve N independent shards on consecutive ports")
    parser.add_argument("--idle-timeout", type=float, default=600.0, help="seconds before an idle instance is dropped")
    parser.add_argument(
        "--env-kwargs", default="{}", help='JSON object of constructor arguments, e.g. \'{"max_attempts": 10}\''
    )
    args = parser.parse_args(argv)
    env_kwargs = json.loads(args.env_kwargs)
    if not isinstance(env_kwargs, dict):
        parser.error("--env-kwargs must be a JSON object")

    from opentinker.environments.server import serve_environment

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    serve_environment(
        BUILTIN_ENVIRONMENTS[args.name],
        host=args.host,
        port=args.port,
        num_shards=args.shards,
        idle_timeout_s=args.idle_timeout,
        env_kwargs=env_kwargs,
    )


if __name__ == "__main__":
    main()

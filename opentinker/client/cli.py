"""``opentinker``: the command line of the thin client.

::

    opentinker jobs list
    opentinker jobs show ID
    opentinker jobs logs ID [--follow]
    opentinker jobs cancel ID
    opentinker jobs resume ID           # continue a stopped job from its last checkpoint
    opentinker jobs checkpoints ID
    opentinker jobs download ID [--name NAME] [--dest DIR]
    opentinker models                 # what actor_rollout_ref.model.path may name here
    opentinker tokenizer NAME         # a served model's tokenizer into the Hugging Face cache
    opentinker chat JOB[/CHECKPOINT] [-m MESSAGE]   # talk to a job's model (its current weights)
    opentinker config keys [--markdown]   # every recipe key: default, allowed values, what it does

The server and key come from ``--base-url`` / ``--api-key`` (before or after the command)
or ``$OPENTINKER_BASE_URL`` / ``$OPENTINKER_API_KEY``.

More commands (e.g. ``opentinker quickstart``) plug in with :func:`add_command`: a
function that gets the top-level subparsers object, adds its parser and sets
``handler=fn(args) -> int | None`` on it with ``set_defaults``. :func:`make_client` builds
the client from the parsed flags.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, TextIO

from opentinker.client.client import ENV_API_KEY, ENV_BASE_URL, OpenTinkerClient
from opentinker.client.errors import OpenTinkerError
from opentinker.client.progress import EnvTotals
from opentinker.protocol import Event, JobInfo

__all__ = ["add_command", "build_parser", "format_event", "format_jobs_table", "main", "make_client"]

CommandSetup = Callable[["argparse._SubParsersAction[argparse.ArgumentParser]"], None]
_EXTRA_COMMANDS: list[CommandSetup] = []


def add_command(setup: CommandSetup) -> CommandSetup:
    """Register a top-level subcommand (usable as a decorator); see the module docstring."""
    _EXTRA_COMMANDS.append(setup)
    return setup


# ---------------------------------------------------------------------- formatting


def _when(timestamp: float | None) -> str:
    if not timestamp:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows)]
    lines = ["  ".join(str(cell).ljust(width) for cell, width in zip(line, widths)).rstrip() for line in [headers, *rows]]
    return "\n".join(lines)


def _shorten(text: str | None, limit: int = 60) -> str:
    if not text:
        return ""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def format_jobs_table(jobs: Sequence[JobInfo]) -> str:
    if not jobs:
        return "no jobs"
    rows = [
        [
            job.job_id,
            job.name or "-",
            job.mode,
            job.status.value,
            f"{job.step}/{job.total_steps}",
            _when(job.created_at),
            _shorten(job.error, 50),
        ]
        for job in sorted(jobs, key=lambda j: j.created_at)
    ]
    return _table(["JOB ID", "NAME", "MODE", "STATUS", "STEP", "CREATED", "ERROR"], rows)


def format_job(job: JobInfo, env: EnvTotals | None = None) -> str:
    """``jobs show``: the job's fields, its relay and, with ``env``, what its envs cost so far."""
    fields = [
        ("job id", job.job_id),
        ("name", job.name or "-"),
        ("mode", job.mode),
        ("status", job.status.value),
        ("step", f"{job.step}/{job.total_steps}"),
        ("created", _when(job.created_at)),
        ("updated", _when(job.updated_at)),
    ]
    if job.error:
        fields.append(("error", job.error))
    if job.relay is not None:
        names = ", ".join(job.relay.interactions)
        if job.status.finished:
            state = f"not needed (the job is {job.status.value})"
        elif job.relay.connected:
            state = f"connected since {_when(job.relay.connected_since)}"
        else:
            state = ("not connected (its env calls wait: `opentinker jobs logs -f ID` on the machine with the env "
                     "carries them)")
        fields.append(("relay", f"{state}; interactions: {names}"))
    if env is not None and (env.env_errors or env.redone or env.waited_s):
        fields.append(("envs", f"{env.env_errors} episode(s) ended in an error of the env's own; {env.redone} "
                               f"step(s) redone after an env outage; {env.waited_s:.0f} s waiting for envs"))
    width = max(len(k) for k, _ in fields)
    lines = [f"{k.ljust(width)}  {v}" for k, v in fields]
    if job.config:
        lines.append("config:")
        lines += [f"  {key} = {job.config[key]!r}" for key in sorted(job.config)]
    return "\n".join(lines)


def _number(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def format_event(event: Event) -> str:
    """One readable line per event: ``HH:MM:SS  #id  type      summary``."""
    data = event.data
    if event.type == "status":
        summary = str(data.get("status"))
        if data.get("reason"):
            summary += f" ({data['reason']})"
    elif event.type == "progress":
        summary = f"step {data.get('step')}/{data.get('total_steps')}"
    elif event.type == "metrics":
        metrics = data.get("metrics") or {}
        summary = f"step {data.get('step')}  " + "  ".join(f"{k}={_number(metrics[k])}" for k in sorted(metrics))
    elif event.type == "checkpoint":
        summary = f"{data.get('name')} (step {data.get('step')})"
    elif event.type in ("error", "log"):
        summary = str(data.get("message"))
        if data.get("error_id"):  # what to quote to the operator, who has the trace
            summary += f" (error id {data['error_id']})"
    else:
        summary = str(data)
    clock = time.strftime("%H:%M:%S", time.localtime(event.created_at))
    return f"{clock}  #{event.id:<4} {event.type:<10} {summary}".rstrip()


# ---------------------------------------------------------------------- commands


def make_client(args: argparse.Namespace) -> OpenTinkerClient:
    return OpenTinkerClient(
        getattr(args, "base_url", None), getattr(args, "api_key", None), timeout=getattr(args, "timeout", 30.0)
    )


def _print(text: str, out: TextIO | None = None) -> None:
    print(text, file=out or sys.stdout, flush=True)


def _jobs_list(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        _print(format_jobs_table(client.list_jobs()))
    return 0


def _jobs_show(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        job = client.job(args.job_id)
        env = EnvTotals()
        for metrics in job.metrics():
            env.add(metrics.get("metrics") or {})
        _print(format_job(job.info(), env))
    return 0


def _jobs_logs(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        job = client.job(args.job_id)
        if args.follow:
            # A job this machine started with relay: client gets its env calls carried while followed.
            relay = job.start_relay() if args.relay else None
            if relay is not None:
                _print(f"carrying the env calls of job {args.job_id} to "
                       f"{', '.join(url for route in relay.routes.values() for url in route.shards)}", sys.stderr)
            try:
                for event in job.stream():
                    _print(format_event(event))
            finally:
                job.stop_relay()
        else:
            events = job.events()
            for event in events:
                _print(format_event(event))
            if not events:
                _print(f"job {args.job_id} has no events yet")
    return 0


def _jobs_cancel(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        info = client.job(args.job_id).cancel()
        _print(f"job {info.job_id}: {info.status.value} (step {info.step}/{info.total_steps})")
    return 0


def _jobs_resume(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        info = client.job(args.job_id).resume()
        _print(f"job {info.job_id}: {info.status.value}, resuming after step {info.step}/{info.total_steps}")
        if info.relay is not None:
            _print(f"its env calls ({', '.join(info.relay.interactions)}) go through the client relay: "
                   f"`opentinker jobs logs -f {info.job_id}` on the machine with the env carries them")
    return 0


def _jobs_checkpoints(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        checkpoints = client.job(args.job_id).checkpoints()
        if not checkpoints:
            _print(f"job {args.job_id} has no checkpoints yet")
        else:
            _print(_table(["NAME", "STEP", "CREATED"], [[c.name, str(c.step), _when(c.created_at)] for c in checkpoints]))
    return 0


def _jobs_download(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        path = client.job(args.job_id).download_checkpoint(args.name, args.dest)
        _print(f"checkpoint extracted to {path}")
    return 0


def _connection_options(parser: argparse.ArgumentParser, *, suppress: bool) -> None:
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument("--base-url", default=default, help=f"server URL (default: ${ENV_BASE_URL})")
    parser.add_argument("--api-key", default=default, help=f"API key (default: ${ENV_API_KEY})")
    parser.add_argument(
        "--timeout", type=float, default=argparse.SUPPRESS if suppress else 30.0, help="seconds per request (default: 30)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opentinker",
        description="OpenTinker thin client: inspect and control training jobs on an opentinker-server.",
        epilog=f"The server and key default to ${ENV_BASE_URL} and ${ENV_API_KEY}.",
    )
    _connection_options(parser, suppress=False)
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    jobs = commands.add_parser("jobs", help="list, inspect, follow and cancel training jobs")
    job_commands = jobs.add_subparsers(dest="jobs_command", metavar="ACTION")
    job_commands.required = True

    def leaf(name: str, help_text: str, handler: Callable[[argparse.Namespace], int], with_id: bool = True):
        sub = job_commands.add_parser(name, help=help_text, description=help_text)
        if with_id:
            sub.add_argument("job_id", metavar="ID", help="the job id")
        _connection_options(sub, suppress=True)
        sub.set_defaults(handler=handler)
        return sub

    leaf("list", "list every job: id, name, mode, status, step, created", _jobs_list, with_id=False)
    leaf("show", "show one job's status, progress, error and resolved config", _jobs_show)
    logs = leaf("logs", "print a job's events (status, progress, metrics, checkpoints, errors)", _jobs_logs)
    logs.add_argument("-f", "--follow", action="store_true", help="keep streaming until the job finishes (and carry "
                      "the env calls of a job this machine started with relay: client)")
    logs.add_argument("--no-relay", dest="relay", action="store_false",
                      help="with --follow: do not carry the job's env calls from this machine")
    leaf("cancel", "cancel a job", _jobs_cancel)
    leaf("resume", "continue a stopped job from its last checkpoint", _jobs_resume)
    leaf("checkpoints", "list a job's checkpoints", _jobs_checkpoints)
    download = leaf("download", "download a checkpoint (a Hugging Face folder) and extract it", _jobs_download)
    download.add_argument("--name", default=None, help="checkpoint name (default: the latest)")
    download.add_argument("--dest", default=None, help="folder to extract into (default: ./<name>)")

    models = commands.add_parser("models", help="the models this server trains (names for actor_rollout_ref.model.path)")
    _connection_options(models, suppress=True)
    models.set_defaults(handler=_models)

    tokenizer = commands.add_parser(
        "tokenizer", help="put a served model's tokenizer in the Hugging Face cache (the tinker SDK's "
        "get_tokenizer() then works offline)",
        description="Fetches the tokenizer files of a model this server serves (GET /v1/models/NAME/tokenizer) "
        "and writes them where Hugging Face looks for NAME, so that AutoTokenizer.from_pretrained(NAME), which "
        "training_client.get_tokenizer() calls, loads them without the Hub (set HF_HUB_OFFLINE=1 to skip "
        "its network check).")
    tokenizer.add_argument("model", help="a served model's name (opentinker models)")
    tokenizer.add_argument("--cache-dir", default=None,
                           help="the Hub cache folder (default: $HF_HUB_CACHE, else $HF_HOME/hub, else "
                                "~/.cache/huggingface/hub)")
    _connection_options(tokenizer, suppress=True)
    tokenizer.set_defaults(handler=_tokenizer)

    for setup in _EXTRA_COMMANDS:
        setup(commands)
    return parser


def _models(args: argparse.Namespace) -> int:
    with make_client(args) as client:
        listed = client.models()
    rows = [[m.name, "default" if m.default else ""] for m in listed.models]
    rows += [[name, "judge"] for name in listed.judge_models]
    _print(_table(["MODEL", ""], rows))
    return 0


def _tokenizer(args: argparse.Namespace) -> int:
    from opentinker.client.tokenizer_cache import place_in_hf_cache

    with make_client(args) as client:
        files = client.tokenizer_files(args.model)
    folder = place_in_hf_cache(files, args.cache_dir)
    print(f"the tokenizer of {args.model} ({len(files.files)} files) is in {folder}")
    return 0


@add_command
def _chat_command(commands) -> None:
    chat = commands.add_parser(
        "chat", help="talk to a trained model: a job's current weights or one of its checkpoints",
        description="A conversation with JOB_ID (a running job answers with its current weights, a stopped one "
        "with its newest checkpoint) or JOB_ID/CHECKPOINT, through the server's /v1/chat/completions. "
        "Replies are printed as they are generated; an empty line ends the conversation.",
    )
    chat.add_argument("model", metavar="JOB[/CHECKPOINT]", help="a job id, or job id/checkpoint name")
    chat.add_argument("-m", "--message", default=None, help="send this one message, print the reply and exit")
    chat.add_argument("--system", default=None, help="a system message to start the conversation with")
    chat.add_argument("--max-tokens", type=int, default=256, help="longest reply, in tokens (default 256)")
    chat.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 is greedy (default 0.7)")
    chat.add_argument("--seed", type=int, default=None, help="sample reproducibly")
    _connection_options(chat, suppress=True)

    def run(args: argparse.Namespace) -> int:
        from opentinker.client.chat import chat_repl

        options = {"max_tokens": args.max_tokens, "temperature": args.temperature}
        if args.seed is not None:
            options["seed"] = args.seed
        with make_client(args) as client:
            return chat_repl(client, args.model, message=args.message, system=args.system,
                             stdin=sys.stdin, stdout=sys.stdout, **options)

    chat.set_defaults(handler=run)


@add_command
def _config_command(commands) -> None:
    config = commands.add_parser("config", help="the training recipe's keys (no server needed)")
    actions = config.add_subparsers(dest="config_command", metavar="ACTION")
    actions.required = True
    keys = actions.add_parser("keys", help="every recipe key: its default, what it allows and what it does",
                              description="Every key a training recipe takes, read off the recipe's schema "
                              "(docs/config_keys.md is the same list).")
    keys.add_argument("--markdown", action="store_true", help="as the Markdown of docs/config_keys.md")

    def run(args: argparse.Namespace) -> int:
        from opentinker.recipe import reference

        sys.stdout.write(reference.markdown() if args.markdown else reference.plain())
        return 0

    keys.set_defaults(handler=run)


@add_command
def _quickstart_command(commands) -> None:
    quickstart = commands.add_parser(
        "quickstart",
        help="start a local server, train a short GRPO job, plot the reward curve",
        description="Start opentinker-server on a free loopback port, train a short GRPO job through the "
        "client (the embedded tiny model on arithmetic, or --model smollm2-135m-instruct on word problems "
        "with LoRA), write the reward curve as a PNG, print held-out accuracy before -> after, download the "
        "checkpoint, and stop the server. Needs the server extra.",
    )
    quickstart.add_argument("--model", default=None, choices=["smollm2-135m-instruct"],
                            help="train this real pretrained model instead of the tiny one "
                                 "(make install-pretrained first); about half an hour on 2 cores")
    quickstart.add_argument("--steps", type=int, default=None,
                            help="training steps (default: 150 for the tiny model, 20 for smollm2-135m-instruct)")
    quickstart.add_argument("--out", default="opentinker-quickstart", help="folder for the curve, checkpoint and server data")
    quickstart.add_argument("--port", type=int, default=None, help="server port (default: a free one)")

    def run(args: argparse.Namespace) -> int:
        from opentinker.client.quickstart import run_quickstart  # starts a server: keep it out of import time

        try:
            run_quickstart(args.steps, args.out, args.port, model=args.model)
        except ValueError as error:  # e.g. the pretrained model's package is not installed
            print(f"error: {error}", file=sys.stderr)
            return 1
        return 0

    quickstart.set_defaults(handler=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.handler(args)
    except KeyboardInterrupt:
        return 130
    except (OpenTinkerError, OSError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())

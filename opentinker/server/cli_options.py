"""The command line of ``opentinker-server``: every flag of ``serve``, by what it governs, and the
``admin`` commands. ``cli.py`` runs what is parsed."""

from __future__ import annotations

import argparse
from pathlib import Path

from opentinker.server.settings import DATA_DIR_ENV, default_data_dir

__all__ = ["build_parser"]


def _add_data_dir(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--data-dir",
        type=Path,
        default=default_data_dir(),
        help=f"where the job store and job folders live; serve and the admin commands must agree on it "
             f"(default: ${DATA_DIR_ENV}, else ~/.opentinker-server; here %(default)s)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="opentinker-server", description="OpenTinker training server.")
    commands = parser.add_subparsers(dest="command", required=True)
    _serve_parser(commands)
    _admin_parser(commands)
    return parser


def _serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="run the HTTP control plane")
    serve.add_argument("--host", default="127.0.0.1", help="interface to bind (default: %(default)s)")
    serve.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    _add_data_dir(serve)
    serve.add_argument("--ray-address", default=None, help="an existing Ray cluster; default: start a local one")
    serve.add_argument("--ray-num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    serve.add_argument("--ray-all-interfaces", action="store_true",
                       help="let a local Ray listen on every interface (default: loopback only)")
    _operator_options(serve)
    _quota_options(serve)
    _tinker_options(serve)
    _accounting_options(serve)
    _serving_options(serve)


def _operator_options(serve: argparse.ArgumentParser) -> None:
    operator = serve.add_argument_group("what jobs may use (nothing else is reachable from a job)")
    operator.add_argument("--model", action="append", default=[], metavar="[NAME=]PATH",
                          help="serve this model (a local folder, a .gguf file, a preset such as smollm2-135m-instruct, "
                          "or a hub name) under NAME (default: the path); "
                          "repeatable; the first is the default; the embedded tiny model is always served")
    operator.add_argument("--trust-remote-code", action="append", default=[], metavar="NAME",
                          help="let the served model NAME run the code in its folder (repeatable)")
    operator.add_argument("--allow-env-host", action="append", default=[], metavar="HOST[:PORTS]",
                          help="env servers may live here: a name, *.suffix, an IP, a CIDR block or *, with an "
                          "optional port or LOW-HIGH range (repeatable; default: none)")
    operator.add_argument("--max-env-shards", type=int, default=16, help="env servers one interaction may name")
    operator.add_argument("--no-env-relay", dest="env_relays", action="store_false",
                          help="refuse interactions with relay: client (env calls carried by the job's client "
                          "to an env on the user's machine); by default they are allowed")
    operator.add_argument("--max-env-relays-per-user", type=int, default=4, metavar="N",
                          help="client relays one user may hold connected at once (one per job)")
    operator.add_argument("--env-relay-in-flight", type=int, default=256, metavar="N",
                          help="env calls one relay carries at once; more wait (backpressure)")
    operator.add_argument("--env-relay-buffer-mb", type=int, default=64, metavar="MB",
                          help="a relay's answers read and not yet handed to its job, in MB; past it the "
                          "relay stops reading (backpressure); answers to no call are dropped unread")
    operator.add_argument("--max-image-bytes", type=int, default=4 * 1024 * 1024, metavar="BYTES",
                          help="the largest picture file a dataset row may carry (a vision-language model's)")
    operator.add_argument("--max-image-pixels", type=int, default=4096 * 4096, metavar="N",
                          help="the most pixels (width x height, read from the file's header before any "
                          "decoding) of one picture")
    operator.add_argument("--max-images-per-row", type=int, default=8, metavar="N",
                          help="the most pictures one dataset row may carry")
    operator.add_argument("--allow-interaction", action="append", default=[], metavar="module.Class",
                          help="also allow this Interaction class path in jobs (repeatable)")
    operator.add_argument("--judge-model", action="append", default=[], metavar="MODEL",
                          help="an OpenAI-compatible strategy-judge model jobs may use (repeatable; the first "
                          "is the default); called with this server's OPENAI_API_KEY")
    operator.add_argument("--judge-base-url", default=None,
                          help="the judge's OpenAI-compatible endpoint (default: $OPENAI_BASE_URL, else OpenAI)")
    operator.add_argument("--allow-logger", action="append", default=[], metavar="NAME",
                          help="let jobs log to NAME (wandb: with this server's credentials) besides the console")
    operator.add_argument("--limit", action="append", default=[], metavar="KEY=MAX",
                          help="upper bound of a numeric config key, e.g. trainer.total_training_steps=1000; "
                          "KEY=0 turns off a switch jobs may not use (actor_rollout_ref.rollout.compile_decode)")


def _quota_options(serve: argparse.ArgumentParser) -> None:
    quotas = serve.add_argument_group("quotas")
    quotas.add_argument("--max-running-jobs", type=int, default=2, help="jobs per user running at once")
    quotas.add_argument("--max-queued-jobs", type=int, default=8, help="jobs per user waiting for a slot")
    quotas.add_argument("--max-checkpoint-gb", type=float, default=200.0, metavar="GB",
                        help="all users' checkpoints on disk (RL jobs' and the Tinker API's); past it a job's "
                             "checkpoint is not kept (a warning event; the job goes on) and a Tinker save answers "
                             "429 (default: %(default)s)")
    quotas.add_argument("--max-job-checkpoint-gb", type=float, default=50.0, metavar="GB",
                        help="per user: their RL jobs' checkpoints on disk; past it a job's checkpoint is not kept "
                             "(a warning event; the job goes on) (default: %(default)s)")
    quotas.add_argument("--client-idle-timeout", type=float, default=900.0, metavar="SECONDS",
                        help="stop a client-mode job that has had no step to train this long")
    quotas.add_argument("--max-body-mb", type=float, default=64.0, help="largest request body accepted")
    quotas.add_argument("--max-rows-per-step", type=int, default=4096, help="client mode: rows in one pushed step")
    quotas.add_argument("--max-queued-steps", type=int, default=4, help="client mode: batches a job may queue")
    quotas.add_argument("--auth-failures-per-minute", type=int, default=20, metavar="N",
                        help="wrong API keys one client address may send in a minute; past it they are answered "
                             "429 with Retry-After (a right key is still accepted); 0: no limit (default: %(default)s)")
    quotas.add_argument("--trusted-proxy", action="append", default=[], metavar="ADDR",
                        help="a reverse proxy in front of this server (IP address or network, repeatable): its "
                             "X-Forwarded-For names the client (the address the limit above counts); without "
                             "one, proxy headers are ignored")


def _tinker_options(serve: argparse.ArgumentParser) -> None:
    tinker = serve.add_argument_group("the Tinker API (/api/v1)")
    tinker.add_argument("--tinker-strategy", choices=["local", "fsdp"], default="local",
                        help="backend of each training client's model (default: %(default)s)")
    tinker.add_argument("--tinker-ranks", type=int, default=1,
                        help="FSDP ranks of each base model's shared LoRA worker and of each fully fine-tuned "
                             "model (--tinker-strategy fsdp)")
    tinker.add_argument("--tinker-max-models", type=int, default=8,
                        help="live training clients on the server, whoever's; past it create_model answers 429 "
                             "(default: %(default)s)")
    tinker.add_argument("--tinker-max-resident-adapters", type=int, default=None, metavar="N",
                        help="LoRA models kept in memory per base model's shared worker; the least recently used "
                             "others wait on disk and come back, unchanged, on their next request (default: all)")
    tinker.add_argument("--tinker-pass-tokens", type=int, default=4096, metavar="N",
                        help="padded tokens (rows x the longest row) one batched pass of a shared LoRA worker "
                             "holds at most, and rows x longest^2 <= 1024 x N attention cells: the pass's memory "
                             "(about 155 KB a token on the tiny model), whatever the requests' mix of lengths "
                             "(default: %(default)s)")
    tinker.add_argument("--tinker-cycle-tokens", type=int, default=1024, metavar="N",
                        help="one user's share of each cycle of a shared LoRA worker, in the same units; bigger "
                             "forward_backward calls run in chunks over several cycles, so a small request waits "
                             "about one cycle whoever sends what (default: %(default)s)")
    tinker.add_argument("--tinker-max-models-per-user", type=int, default=4,
                        help="training clients in use per user; an idle LoRA model (see --tinker-idle-model-s) "
                             "does not count (default: %(default)s)")
    tinker.add_argument("--tinker-idle-model-s", type=float, default=60.0, metavar="S",
                        help="a LoRA model with no request for this long is idle: it waits (on disk with "
                             "--tinker-max-resident-adapters) and its next request brings it back; it counts "
                             "against the memory budget only (default: %(default)s)")
    tinker.add_argument("--tinker-max-idle-models-per-user", type=int, default=16,
                        help="idle LoRA models kept per user (default: %(default)s)")
    tinker.add_argument("--tinker-memory-gb", type=float, default=None, metavar="GB",
                        help="memory the live training clients may take together, by an estimate from the model's "
                             "weight files (x1.25 LoRA, x4 full fine-tuning); past it create_model answers 429 "
                             "(default: half of this machine's RAM)")
    tinker.add_argument("--tinker-max-sessions", type=int, default=32,
                        help="active sessions (ServiceClients) per user (default: %(default)s)")
    tinker.add_argument("--tinker-max-queued-requests", type=int, default=256,
                        help="per model: training requests waiting or running; past it they answer 429 "
                             "(default: %(default)s)")
    tinker.add_argument("--tinker-max-queued-requests-per-user", type=int, default=1024,
                        help="the same over all of a user's models (default: %(default)s)")
    tinker.add_argument("--tinker-session-timeout", type=float, default=300.0, metavar="SECONDS",
                        help="a session without a heartbeat this long ends and its models are unloaded")
    tinker.add_argument("--tinker-max-pending-sample-tokens", type=int, default=524_288, metavar="TOKENS",
                        help="per user: num_samples x max_tokens of sampling calls not yet done; past it asample "
                             "answers 429 (default: %(default)s)")
    tinker.add_argument("--tinker-sampler-max-rows", type=int, default=64, metavar="ROWS",
                        help="sequences the sampler decodes in one forward pass (default: %(default)s)")
    tinker.add_argument("--tinker-sampler-max-tokens", type=int, default=16_384, metavar="TOKENS",
                        help="prompt + max_tokens of one forward pass's sequences together: what bounds its "
                             "cost, so how long another user waits for it, and its KV cache; a user may have "
                             "twice that decoding, everyone together eight times (default: %(default)s)")
    tinker.add_argument("--tinker-sampler-adapter-cache-mb", type=int, default=1024, metavar="MB",
                        help="LoRA adapters the sampler of each base model keeps loaded, in MB (the least recently "
                             "used are evicted); reserved in --tinker-memory-gb for every served model "
                             "(default: %(default)s)")
    tinker.add_argument("--tinker-max-lora-rank", type=int, default=128, metavar="RANK",
                        help="the largest LoRA rank create_model accepts (never past the model's hidden size); "
                             "past it 400 (default: %(default)s)")
    tinker.add_argument("--tinker-max-checkpoints", type=int, default=1000, metavar="N",
                        help="per user: checkpoints kept (save_state and sampler snapshots, ephemeral ones "
                             "included); past it a save answers 429 (default: %(default)s)")
    tinker.add_argument("--tinker-max-checkpoint-gb", type=float, default=50.0, metavar="GB",
                        help="per user: bytes on disk of those checkpoints; past it a save answers 429, one larger "
                             "than the whole quota 400 (default: %(default)s)")
    tinker.add_argument("--tinker-max-checkpoint-ttl", type=int, default=10 * 365 * 86400, metavar="SECONDS",
                        help="the longest ttl_seconds a save may ask; past it 400 (a save without one is kept "
                             "until deleted) (default: %(default)s, 10 years)")


def _accounting_options(serve: argparse.ArgumentParser) -> None:
    group = serve.add_argument_group("sharing and accounting (projects, signed URLs, the audit log, usage)")
    group.add_argument("--max-projects-per-user", type=int, default=100, metavar="N",
                       help="project names one user may put sessions in (default: %(default)s)")
    group.add_argument("--identity-token-s", type=int, default=900, metavar="SECONDS",
                       help="lifetime of the identity tokens the Tinker SDK trades its API key for (whoami); a "
                            "revoked key's tokens stop working at once (default: %(default)s)")
    group.add_argument("--public-url", default=None, metavar="URL",
                       help="this server's address as clients reach it, for the signed download URLs it hands "
                            "out (default: the address each request came to)")
    group.add_argument("--signed-url-s", type=int, default=3600, metavar="SECONDS",
                       help="how long a signed download URL works (default: %(default)s)")
    group.add_argument("--external-weights-dir", type=Path, default=None, metavar="DIR",
                       help="where save_weights_external writes a user's exported weights, each user in a "
                            "folder of their own (default: <data-dir>/external)")
    group.add_argument("--audit-retention-days", type=float, default=90.0, metavar="DAYS",
                       help="audit log entries are kept this long (default: %(default)s)")
    group.add_argument("--audit-max-entries", type=int, default=1_000_000, metavar="N",
                       help="the most audit log entries kept; the oldest go first (default: %(default)s)")
    group.add_argument("--usage-retention-days", type=float, default=400.0, metavar="DAYS",
                       help="hourly usage buckets are kept this long (default: %(default)s)")
    group.add_argument("--price", action="append", default=[], metavar="KIND=USD",
                       help="show estimated costs: USD per million tokens (training, sampling_prefill, "
                            "sampling_sample), per GB-month (storage), per hour (compute_s) or per checkpoint "
                            "(checkpoint); repeatable; without any, usage is reported without prices")


def _serving_options(serve: argparse.ArgumentParser) -> None:
    serving = serve.add_argument_group("serving trained models (/v1/chat/completions, /v1/completions)")
    serving.add_argument("--serve-device", choices=["cpu", "cuda"], default="cpu",
                         help="where saved checkpoints are loaded to answer requests (default: %(default)s)")
    serving.add_argument("--serve-max-models", type=int, default=2, help="checkpoints kept loaded at once")
    serving.add_argument("--serve-max-tokens", type=int, default=1024, help="the largest max_tokens a request may ask")
    serve.add_argument("--dashboard-session-hours", type=float, default=12.0, metavar="HOURS",
                       help="how long a dashboard login (at /) lasts (default: %(default)s)")
    serve.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])



def _admin_parser(commands) -> None:
    admin = commands.add_parser("admin", help="manage users and API keys (works while the server runs)")
    admin_commands = admin.add_subparsers(dest="admin_command", required=True)
    create_user = admin_commands.add_parser("create-user", help="add a user")
    create_user.add_argument("name")
    create_user.add_argument("--admin", action="store_true", help="make the user an admin (see set-admin)")
    _add_data_dir(create_user)
    create_key = admin_commands.add_parser("create-key", help="make an API key for a user (shown once)")
    create_key.add_argument("user")
    _add_data_dir(create_key)
    list_users = admin_commands.add_parser("list-users", help="users and their number of active keys")
    _add_data_dir(list_users)
    list_keys = admin_commands.add_parser(
        "list-keys", help="API keys: id, user, first characters, created, state, last used (to the minute)")
    list_keys.add_argument("--user", help="only this user's keys")
    _add_data_dir(list_keys)
    revoke_key = admin_commands.add_parser(
        "revoke-key", help="revoke an API key at once (both APIs and the dashboard), by its id from list-keys "
                           "or by the key itself; or every key of a user (--user)")
    revoked_keys = revoke_key.add_mutually_exclusive_group(required=True)
    revoked_keys.add_argument("key", metavar="KEY_ID|KEY", nargs="?", help="an id from list-keys, or the key itself")
    revoked_keys.add_argument("--user", help="revoke all of this user's active keys")
    _add_data_dir(revoke_key)
    _usage_parser(admin_commands)
    _audit_parsers(admin_commands)


def _usage_parser(admin_commands) -> None:
    usage = admin_commands.add_parser(
        "usage", help="what each user's work used, per kind: tokens trained and sampled, compute seconds, "
                      "checkpoints written, checkpoint GB-hours (quantities; the server's --price gives costs)")
    usage.add_argument("--user", help="only this user's usage")
    usage.add_argument("--since", type=float, default=None, metavar="DAYS",
                       help="the last DAYS days, to the end of the current hour (default: 30)")
    usage.add_argument("--start", default=None, metavar="TIME", help="from this UTC time or date (ISO 8601)")
    usage.add_argument("--end", default=None, metavar="TIME", help="until this UTC time or date (default: now)")
    _add_data_dir(usage)


def _audit_parsers(admin_commands) -> None:
    audit = admin_commands.add_parser(
        "audit", help="the audit log, newest first: who created, deleted, shared or downloaded what, on both APIs, "
                      "which key was used, which requests were refused")
    audit.add_argument("--user", help="only what this user did or was about")
    when = audit.add_mutually_exclusive_group()
    when.add_argument("--day", metavar="YYYY-MM-DD", help="only this UTC day")
    when.add_argument("--since", type=float, metavar="HOURS", help="only the last HOURS hours")
    audit.add_argument("--event", action="append", default=[], metavar="EVENT",
                       help="only this event, e.g. key_refused, job_create (repeatable)")
    audit.add_argument("--limit", type=int, default=50, metavar="N", help="at most N entries (default: %(default)s)")
    _add_data_dir(audit)
    set_admin = admin_commands.add_parser(
        "set-admin", help="make a user an admin (their keys read every user's audit log, usage, sessions and "
                          "checkpoints, read-only), or not (--off)")
    set_admin.add_argument("name")
    set_admin.add_argument("--off", action="store_true", help="no longer an admin")
    _add_data_dir(set_admin)

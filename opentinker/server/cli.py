"""``opentinker-server``: run the control plane, and manage users and API keys.

    opentinker-server serve [--host 127.0.0.1] [--port 8000] [--data-dir DIR] [--ray-address ADDR]
                            [--model [NAME=]PATH ...] [--allow-env-host HOST[:PORTS] ...]
                            [--allow-interaction module.Class ...] [--judge-model M ...]
                            [--limit KEY=MAX ...] (see --help for every flag)
    opentinker-server admin create-user NAME [--data-dir DIR]
    opentinker-server admin create-key USER [--data-dir DIR]     # prints the key once
    opentinker-server admin list-users [--data-dir DIR]
    opentinker-server admin list-keys [--user NAME] [--data-dir DIR]
    opentinker-server admin revoke-key KEY_ID|KEY | --user NAME [--data-dir DIR]
    opentinker-server admin usage [--user NAME] [--since DAYS | --start T --end T] [--data-dir DIR]
    opentinker-server admin audit [--user NAME] [--day YYYY-MM-DD | --since HOURS] [--event EVENT ...]
                                  [--limit N] [--data-dir DIR]
    opentinker-server admin set-admin NAME [--off] [--data-dir DIR]   # create-user NAME --admin too

Without ``--data-dir``, ``serve`` and the admin commands use ``$OPENTINKER_DATA_DIR``, else
``~/.opentinker-server``: a key works only on a server started on the folder it was made in.

Heavy imports (Ray, the app) happen only in ``serve``, so admin commands start fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from opentinker.server.cli_options import build_parser
from opentinker.server.settings import ServerSettings

EXIT_USAGE = 2


def _fail(message: str) -> int:
    print(f"opentinker-server: error: {message}", file=sys.stderr)
    return EXIT_USAGE


def _list_keys(store, user_name: str | None) -> int:
    user = None
    if user_name is not None:
        user = store.get_user(user_name)
        if user is None:
            return _fail(f"no user {user_name!r} (opentinker-server admin list-users)")
    keys = store.list_api_keys(user)
    if not keys:
        print("no API keys yet; make one with: opentinker-server admin create-key USER")
    print("id\tuser\tkey starts\tcreated (UTC)\tstate\tlast used (UTC)")
    for key in keys:
        state = "revoked" if key.revoked else "active"
        print(f"{key.id}\t{key.user_name}\t{key.prefix}...\t{_utc(key.created_at)}\t{state}\t{_utc(key.last_used_at)}")
    return 0


def _utc(timestamp: float | None) -> str:
    return "never" if timestamp is None else time.strftime("%Y-%m-%d %H:%M", time.gmtime(timestamp))


def _revoke_key(store, key: str | None, user_name: str | None) -> int:
    """By id (digits, from list-keys), by the key itself, or all of a user's; never echoes a key."""
    from opentinker.server import auth

    everywhere = "(the main API, the Tinker API and the dashboard)"
    if user_name is not None:
        user = store.get_user(user_name)
        if user is None:
            return _fail(f"no user {user_name!r} (opentinker-server admin list-users)")
        ids = [k.id for k in store.list_api_keys(user) if not k.revoked and store.revoke_api_key_id(k.id)]
        if not ids:
            return _fail(f"{user_name!r} has no active API key (opentinker-server admin list-keys)")
        print(f"revoked {len(ids)} key(s) of {user_name!r} (id {', '.join(map(str, ids))}): they are refused "
              f"from now on {everywhere}")
        return 0
    assert key is not None
    if key.isdigit():
        done, what = store.revoke_api_key_id(int(key)), f"key id {key}"
    else:
        done, what = auth.revoke_api_key(store, key.removeprefix("tml-")), "that key"
    if not done:
        return _fail(f"no active API key with {what} (opentinker-server admin list-keys)")
    print(f"revoked {what}: it is refused from now on {everywhere}")
    return 0


def _admin(args: argparse.Namespace) -> int:
    from opentinker.server import admin_audit, auth
    from opentinker.server.store import Store

    store = Store(Path(args.data_dir).expanduser() / "opentinker.db")
    try:
        if args.admin_command == "create-user":
            try:
                user = auth.create_user(store, args.name)
            except ValueError as exc:
                return _fail(str(exc))
            print(f"created user {user.name!r}; make a key with: opentinker-server admin create-key {user.name}")
            if args.admin:
                return admin_audit.set_admin(store, user.name, True)
        elif args.admin_command == "create-key":
            try:
                key = auth.create_api_key(store, args.user)
            except LookupError as exc:
                return _fail(f"{exc}; create it first with: opentinker-server admin create-user {args.user}")
            (info,) = store.list_api_keys(key_hash=auth.hash_key(key))
            print(f"API key id {info.id} for {args.user!r}, written to {store.path} (only a server started with "
                  f"--data-dir {Path(args.data_dir).expanduser()} accepts it; list-keys and revoke-key name it by "
                  "that id; the key is stored hashed and will not be shown again; with the tinker SDK, send it as "
                  "tml-<key>):")
            print(key)
        elif args.admin_command == "list-users":
            users = store.list_users()
            if not users:
                print("no users yet; add one with: opentinker-server admin create-user NAME")
            for user, active_keys in users:
                print(f"{user.name}\t{active_keys} active key(s)" + ("\tadmin" if user.is_admin else ""))
        elif args.admin_command == "list-keys":
            return _list_keys(store, args.user)
        elif args.admin_command == "revoke-key":
            return _revoke_key(store, args.key, args.user)
        elif args.admin_command == "audit":
            return admin_audit.print_audit(store, args)
        elif args.admin_command == "set-admin":
            return admin_audit.set_admin(store, args.name, not args.off)
        elif args.admin_command == "usage":
            from opentinker.server.admin_reports import print_usage

            try:
                print_usage(store, args.user, args.since, args.start, args.end)
            except ValueError as exc:
                return _fail(str(exc))
        return 0
    finally:
        store.close()


def _parse_pairs(flag: str, items: Sequence[str], example: str) -> dict[str, float]:
    pairs = {}
    for item in items:
        key, sep, value = item.partition("=")
        try:
            pairs[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"{flag} {item!r}: expected {example}")
    return pairs


def _parse_limits(items: Sequence[str]) -> dict[str, float]:
    return _parse_pairs("--limit", items, "KEY=MAX, e.g. trainer.total_training_steps=1000")


def _parse_prices(items: Sequence[str]) -> dict[str, float]:
    return _parse_pairs("--price", items, "KIND=USD, e.g. training=0.40")


def prepare_served_models(models) -> None:
    """Convert the served presets and GGUF files into Hugging Face folders now (once; cached),
    so a missing package or an unreadable file stops the server with the reason at start, not
    the first job; PretrainedModelError (a ValueError) names the model and the fix."""
    from opentinker.pretrained import PretrainedModelError
    from opentinker.pretrained.convert import converted_folder

    for model in models:
        if model.path is None:
            continue
        try:
            folder = converted_folder(model.path)
        except PretrainedModelError as error:
            raise PretrainedModelError(f"--model {model.name}: {error}") from error
        if folder is not None:
            logging.getLogger("opentinker.server").info("serving %s from %s", model.name, folder)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from opentinker.server.app import create_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = ServerSettings(
            host=args.host,
            port=args.port,
            data_dir=args.data_dir,
            ray_address=args.ray_address,
            ray_all_interfaces=args.ray_all_interfaces,
            ray_num_cpus=args.ray_num_cpus,
            models=args.model,
            trust_remote_code=args.trust_remote_code,
            env_hosts=args.allow_env_host,
            max_env_shards=args.max_env_shards,
            env_relays=args.env_relays,
            max_env_relays_per_user=args.max_env_relays_per_user,
            env_relay_in_flight=args.env_relay_in_flight,
            env_relay_buffer_mb=args.env_relay_buffer_mb,
            max_image_bytes=args.max_image_bytes,
            max_image_pixels=args.max_image_pixels,
            max_images_per_row=args.max_images_per_row,
            allowed_interactions=args.allow_interaction,
            judge_models=args.judge_model,
            judge_base_url=args.judge_base_url,
            loggers=["console", *args.allow_logger],
            config_limits=_parse_limits(args.limit),
            max_running_jobs_per_user=args.max_running_jobs,
            max_queued_jobs_per_user=args.max_queued_jobs,
            max_checkpoint_gb=args.max_checkpoint_gb,
            max_job_checkpoint_gb=args.max_job_checkpoint_gb,
            client_idle_timeout_s=args.client_idle_timeout,
            max_body_bytes=int(args.max_body_mb * 2**20),
            max_rows_per_step=args.max_rows_per_step,
            max_queued_steps=args.max_queued_steps,
            auth_failures_per_minute=args.auth_failures_per_minute,
            trusted_proxies=args.trusted_proxy,
            tinker_strategy=args.tinker_strategy,
            tinker_ranks=args.tinker_ranks,
            tinker_max_models_per_user=args.tinker_max_models_per_user,
            tinker_idle_model_s=args.tinker_idle_model_s,
            tinker_max_idle_models_per_user=args.tinker_max_idle_models_per_user,
            tinker_max_models=args.tinker_max_models,
            tinker_memory_gb=args.tinker_memory_gb,
            tinker_max_sessions_per_user=args.tinker_max_sessions,
            tinker_max_queued_requests=args.tinker_max_queued_requests,
            tinker_max_queued_requests_per_user=args.tinker_max_queued_requests_per_user,
            tinker_session_timeout_s=args.tinker_session_timeout,
            tinker_max_pending_sample_tokens=args.tinker_max_pending_sample_tokens,
            tinker_sampler_max_rows=args.tinker_sampler_max_rows,
            tinker_max_resident_adapters=args.tinker_max_resident_adapters,
            tinker_pass_tokens=args.tinker_pass_tokens,
            tinker_cycle_tokens=args.tinker_cycle_tokens,
            tinker_sampler_max_tokens=args.tinker_sampler_max_tokens,
            tinker_sampler_adapter_cache_mb=args.tinker_sampler_adapter_cache_mb,
            tinker_max_lora_rank=args.tinker_max_lora_rank,
            tinker_max_checkpoints=args.tinker_max_checkpoints,
            tinker_max_checkpoint_gb=args.tinker_max_checkpoint_gb,
            tinker_max_checkpoint_ttl_s=args.tinker_max_checkpoint_ttl,
            max_projects_per_user=args.max_projects_per_user,
            identity_token_s=args.identity_token_s,
            public_url=args.public_url,
            signed_url_s=args.signed_url_s,
            external_weights_dir=args.external_weights_dir,
            audit_retention_days=args.audit_retention_days,
            audit_max_entries=args.audit_max_entries,
            usage_retention_days=args.usage_retention_days,
            prices=_parse_prices(args.price),
            dashboard_session_s=args.dashboard_session_hours * 3600,
            serve_device=args.serve_device,
            serve_max_models=args.serve_max_models,
            serve_max_tokens=args.serve_max_tokens,
        )
        prepare_served_models(settings.job_policy.models)
        app = create_app(settings)
    except ValueError as exc:
        return _fail(str(exc))
    url = f"http://{settings.host}:{settings.port}"
    logging.getLogger("opentinker.server").info(
        "opentinker-server listening on %s (API docs: %s/docs; data: %s)", url, url, settings.data_dir
    )
    # Event streams stay open for a job's whole life: give them a few seconds at shutdown,
    # not forever, so the lifespan (kill the actors, close the store) always runs.
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=args.log_level, timeout_graceful_shutdown=5,
                **settings.uvicorn_options())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return _admin(args)


if __name__ == "__main__":
    sys.exit(main())

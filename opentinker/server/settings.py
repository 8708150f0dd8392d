"""What the operator chooses when starting ``opentinker-server``."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentinker.config import check_limits
from opentinker.environments.endpoints import EndpointPolicy
from opentinker.images import ImageLimits
from opentinker.server.policy import JOB_CHECKPOINTS, JobPolicy, parse_served_models


DATA_DIR_ENV = "OPENTINKER_DATA_DIR"


def _proxy_address(item: str) -> str:
    """``item`` (an IP address or network) as uvicorn matches it; ValueError naming the flag."""
    text = str(item).strip()
    try:
        return str(ipaddress.ip_address(text)) if "/" not in text else str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        raise ValueError(f"trusted_proxies (--trusted-proxy): {item!r} is not an IP address or network "
                         "(e.g. 10.0.0.5 or 10.0.0.0/24)") from None


def default_data_dir() -> Path:
    """``$OPENTINKER_DATA_DIR``, else ``~/.opentinker-server``: what ``serve`` and every admin
    command use without ``--data-dir``, so that keys are made where the server looks for them."""
    configured = os.environ.get(DATA_DIR_ENV, "").strip()
    return Path(configured).expanduser() if configured else Path.home() / ".opentinker-server"


@dataclass
class ServerSettings:
    """Server configuration; the CLI's flags map one to one onto these fields.

    ``data_dir`` holds the SQLite store (``opentinker.db``) and one folder per job
    (``jobs/<job_id>``: checkpoints and whatever the runner writes).

    Everything a client's job may reach on this machine is listed here and nowhere else:
    the served models, the judge's endpoint and models, the env hosts, the loggers, the
    interaction classes, and the limits on what a job and a user may take.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = field(default_factory=default_data_dir)
    ray_address: str | None = None  # None: start a local Ray for this server
    ray_all_interfaces: bool = False  # a local Ray listens on loopback only unless this is set
    ray_num_cpus: int | None = None  # only used when starting a local Ray
    # Served models: "NAME=PATH" or "PATH" (the first is the default); the tiny model is always served.
    models: list[str] = field(default_factory=list)
    trust_remote_code: list[str] = field(default_factory=list)  # served model names allowed to run their code
    judge_base_url: str | None = None  # the OpenAI-compatible judge's endpoint (None: OPENAI_BASE_URL / OpenAI)
    judge_models: list[str] = field(default_factory=list)  # judge models jobs may pick; none: no openai judge
    loggers: list[str] = field(default_factory=lambda: ["console"])  # e.g. add "wandb" (the server's account)
    allowed_interactions: list[str] = field(default_factory=list)  # extra dotted class paths
    env_hosts: list[str] = field(default_factory=list)  # "HOST[:PORT[-PORT]]" env servers may live at
    max_env_shards: int = 16  # shards one interaction may name
    env_relays: bool = True  # interactions with relay: client (the job's client carries the env calls)
    max_env_relays_per_user: int = 4  # client relays one user holds connected at once
    env_relay_in_flight: int = 256  # env calls one relay carries at once (more wait)
    # MB of a relay's answers read from its client and not yet handed to the job's runner; past
    # it the relay stops reading until they are (backpressure). Frames that answer no call sent
    # on that connection are dropped unread and never count.
    env_relay_buffer_mb: int = 64
    # Pictures in dataset rows (a vision-language model's): each is refused before it is decoded
    # when its file, side or pixel count is over these, or a row has more pictures.
    max_image_bytes: int = 4 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    max_images_per_row: int = 8
    config_limits: dict[str, float] = field(default_factory=dict)  # upper bounds replacing config.RANGES'
    # Quotas per user: jobs running at once, and jobs waiting for a slot behind them.
    max_running_jobs_per_user: int = 2
    max_queued_jobs_per_user: int = 8
    # Checkpoints' bytes on disk: every checkpoint on the server, all users' (RL jobs' and the
    # Tinker API's), and each user's RL jobs' checkpoints (the Tinker API's per user:
    # tinker_max_checkpoint_gb). Past either a job's checkpoint is not kept (a warning event; the
    # job goes on) and a Tinker save is refused (429; 400 for one larger than the whole cap).
    max_checkpoint_gb: float = 200.0
    max_job_checkpoint_gb: float = 50.0
    client_idle_timeout_s: float = 900.0  # a client-mode job with no step to train this long is stopped
    max_body_bytes: int = 64 * 2**20  # request bodies past this are answered 413
    max_rows_per_step: int = 4096  # client mode: rows in one pushed batch
    max_queued_steps: int = 4  # client mode: batches pushed but not yet trained, per job
    max_concurrent_env_checks: int = 4  # POST /v1/env/check running at once (server-wide)
    event_poll_s: float = 0.2  # how often runner events are drained
    cancel_grace_s: float = 30.0  # after a cancel, how long the runner may finish its step
    runner_call_timeout_s: float = 10.0  # control calls (queued, request_checkpoint) to a runner
    keepalive_s: float = 10.0  # SSE comment interval, so proxies keep idle streams open
    endpoint_check_timeout_s: float = 3.0  # POST /v1/env/check: per env server /health
    env_check_budget_s: float = 6.0  # POST /v1/env/check: all its probes (the rest are reported not answered)
    max_env_check_probes: int = 32  # POST /v1/env/check: distinct env endpoints per check (400 beyond)
    dashboard_session_s: float = 12 * 3600.0  # a dashboard login (cookie) lasts this long
    # Wrong API keys one client address may send in a minute before they are answered 429
    # instead of 401 (a right key is still accepted: auth.FailedAuthLimiter); 0: no limit.
    auth_failures_per_minute: int = 20
    # Reverse proxies (IP addresses or networks) whose X-Forwarded-For names the client: the
    # address the limiter above counts and the logs show. Empty: proxy headers are ignored
    # (uvicorn's own default trusts 127.0.0.1, so any local caller could pick its address).
    trusted_proxies: list[str] = field(default_factory=list)
    # The Tinker API (/api/v1): how its models run and how long its sessions and results live.
    tinker_strategy: str = "local"  # each model's backend: local (one process) | fsdp
    tinker_ranks: int = 1  # FSDP ranks per shared LoRA base / fully fine-tuned model (tinker_strategy=fsdp)
    tinker_max_models_per_user: int = 4  # training clients in use per user (idle LoRA models not counted)
    tinker_idle_model_s: float = 60.0  # a LoRA model without requests this long is idle (it waits, uncounted)
    tinker_max_idle_models_per_user: int = 16  # idle LoRA models kept per user (their adapters: memory or disk)
    tinker_max_models: int = 8  # live training clients on the server, whoever's (429 past it)
    # LoRA adapters each shared base worker keeps in memory; the least recently used others wait
    # on disk (under data_dir/tinker/offload) and come back on their next request. None: all.
    tinker_max_resident_adapters: int | None = None
    # A shared base worker's batched pass holds at most this many padded tokens (rows x the
    # longest row; about 155 KB each on the tiny model) and rows x longest^2 <= 1024 x this
    # attention cells: its memory, whatever a request's mix of lengths (one row always fits).
    tinker_pass_tokens: int = 4096
    # One user's share of a shared worker's cycle, in the same units: every busy user gets one
    # per cycle, so this bounds how long a small request waits behind others' big ones.
    tinker_cycle_tokens: int = 1024
    # Admission by estimated model memory (weight files x 1.25 for LoRA, x 4 for full fine-tuning);
    # None: half of this machine's RAM.
    tinker_memory_gb: float | None = None
    tinker_max_sessions_per_user: int = 32  # active sessions per user (400 past it)
    tinker_max_queued_requests: int = 256  # per model: training requests waiting or running (429 past it)
    tinker_max_queued_requests_per_user: int = 1024  # the same over all of a user's models
    tinker_session_timeout_s: float = 300.0  # a session without a heartbeat this long ends
    tinker_long_poll_s: float = 25.0  # retrieve_future holds this long before try_again (< the SDK's 45 s)
    tinker_keep_ephemeral: int = 4  # ephemeral sampler snapshots kept per model
    tinker_max_pending_sample_tokens: int = 524_288  # per user: num_samples x max_tokens of sampling not yet done
    tinker_sampler_max_rows: int = 64  # sequences the sampler decodes in one forward pass
    tinker_sampler_max_tokens: int = 16_384  # prompt + max_tokens of one forward's sequences: its cost and KV bound
    # LoRA adapters the sampler keeps loaded, per base model, in MB (least recently used evicted);
    # counted in the memory admission (--tinker-memory-gb) for every served model.
    tinker_sampler_adapter_cache_mb: int = 1024
    # LoRA rank at most (and never past the model's hidden size): 128 covers what LoRA is used at
    # (8-64 typically, the cookbook's default 32) and bounds an adapter to ~1/3 of a 7-8B model's
    # width; each unit of rank costs memory in the worker, the sampler and every checkpoint.
    tinker_max_lora_rank: int = 128
    # Checkpoints per user (save_state and sampler snapshots, ephemeral ones included): how many,
    # and their bytes on disk (429 past either; 400 for one larger than the whole quota).
    tinker_max_checkpoints: int = 1000
    tinker_max_checkpoint_gb: float = 50.0
    # The longest ttl_seconds a save may ask (400 past it; the SDK's own range ends at 10 years).
    # A checkpoint saved without one is kept until deleted (the SDK's contract), within the quota.
    tinker_max_checkpoint_ttl_s: int = 10 * 365 * 86400
    # Sharing and accounting: projects, signed download URLs, the audit log, usage metering.
    max_projects_per_user: int = 100  # project names one user may use (assign_session_project)
    identity_token_s: int = 900  # lifetime of the Tinker SDK's identity tokens (JWTs), refreshed at half of it
    public_url: str | None = None  # the base of signed URLs handed out (default: the request's own base URL)
    signed_url_s: int = 3600  # how long a signed download URL (external weights, session traces) works
    external_weights_dir: Path | None = None  # where save_weights_external writes (default <data_dir>/external)
    audit_retention_days: float = 90.0
    audit_max_entries: int = 1_000_000
    usage_retention_days: float = 400.0
    prices: dict[str, float] = field(default_factory=dict)  # usage kind -> USD (--price); none: no costs shown
    # Serving trained models (/v1/chat/completions, /v1/completions).
    serve_device: str = "cpu"  # where saved checkpoints are loaded to answer: cpu | cuda (one GPU)
    serve_max_models: int = 2  # checkpoints kept loaded at once (least recently used dropped)
    serve_max_tokens: int = 1024  # the largest max_tokens a request may ask for
    job_policy: JobPolicy = field(init=False, repr=False)  # derived: what jobs may ask for

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser()
        for name in ("models", "trust_remote_code", "judge_models", "loggers", "allowed_interactions", "env_hosts"):
            setattr(self, name, list(getattr(self, name)))
        for name in ("max_queued_steps", "max_running_jobs_per_user", "max_env_shards", "max_body_bytes",
                     "max_rows_per_step", "max_concurrent_env_checks", "max_env_check_probes", "tinker_ranks",
                     "tinker_max_models_per_user", "tinker_keep_ephemeral", "serve_max_models", "serve_max_tokens",
                     "tinker_max_pending_sample_tokens", "tinker_sampler_max_rows", "tinker_sampler_max_tokens",
                     "tinker_max_models", "tinker_max_sessions_per_user", "tinker_max_queued_requests",
                     "tinker_max_queued_requests_per_user", "tinker_sampler_adapter_cache_mb", "tinker_max_lora_rank",
                     "tinker_max_checkpoints", "tinker_max_checkpoint_ttl_s", "tinker_pass_tokens",
                     "tinker_cycle_tokens", "tinker_max_idle_models_per_user", "max_projects_per_user",
                     "identity_token_s", "signed_url_s", "audit_max_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_env_relays_per_user", "env_relay_in_flight", "env_relay_buffer_mb", "max_image_bytes",
                     "max_image_pixels", "max_images_per_row"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_queued_jobs_per_user", "auth_failures_per_minute"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        self.trusted_proxies = [_proxy_address(item) for item in self.trusted_proxies]
        if self.external_weights_dir is None:
            self.external_weights_dir = self.data_dir / "external"
        self.external_weights_dir = Path(self.external_weights_dir).expanduser()
        from opentinker.server.accounting.usage import KINDS  # here: settings import nothing heavy at module level

        for kind, price in self.prices.items():
            if kind not in KINDS or price < 0:
                raise ValueError(f"prices (--price): {kind}={price} must name a usage kind ({', '.join(KINDS)}) "
                                 "and a price >= 0")
        if self.public_url is not None and not self.public_url.startswith(("http://", "https://")):
            raise ValueError(f"public_url (--public-url) must start with http:// or https://, got {self.public_url!r}")
        if self.serve_device not in ("cpu", "cuda"):
            raise ValueError(f"serve_device must be 'cpu' or 'cuda', got {self.serve_device!r}")
        if self.tinker_strategy not in ("local", "fsdp"):
            raise ValueError(f"tinker_strategy must be 'local' or 'fsdp', got {self.tinker_strategy!r}")
        if self.tinker_max_resident_adapters is not None and self.tinker_max_resident_adapters < 1:
            raise ValueError(f"tinker_max_resident_adapters must be >= 1 (or None: no limit), got "
                             f"{self.tinker_max_resident_adapters}")
        for name in ("tinker_max_checkpoint_gb", "max_checkpoint_gb", "max_job_checkpoint_gb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.tinker_memory_gb is not None and not self.tinker_memory_gb > 0:
            raise ValueError(f"tinker_memory_gb must be > 0, got {self.tinker_memory_gb}")
        if not 0 < self.tinker_long_poll_s < 45:
            raise ValueError(f"tinker_long_poll_s must be in (0, 45) (the SDK's read timeout), got {self.tinker_long_poll_s}")
        for name in ("event_poll_s", "client_idle_timeout_s", "endpoint_check_timeout_s", "env_check_budget_s",
                     "tinker_session_timeout_s", "tinker_idle_model_s",
                     "dashboard_session_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self.config_limits = check_limits(self.config_limits)
        # Built now so that a bad --model, --allow-env-host or --allow-logger fails at startup.
        self.job_policy = JobPolicy(
            models=parse_served_models(self.models, self.trust_remote_code),
            judge_base_url=self.judge_base_url,
            judge_models=tuple(self.judge_models),
            loggers=tuple(self.loggers),
            limits=dict(self.config_limits),
            allowed_interactions=tuple(self.allowed_interactions),
            endpoint_policy=EndpointPolicy.from_strings(self.env_hosts, own_port=self.port),
            max_env_shards=self.max_env_shards,
            env_relays=self.env_relays,
            env_relay_in_flight=self.env_relay_in_flight,
            image_limits=ImageLimits(max_bytes=self.max_image_bytes, max_pixels=self.max_image_pixels,
                                     max_images_per_row=self.max_images_per_row),
        )
        unknown_loggers = set(self.loggers) - {"console", "wandb"}
        if unknown_loggers:
            raise ValueError(f"unknown loggers {sorted(unknown_loggers)} (known: console, wandb)")

    def uvicorn_options(self) -> dict[str, Any]:
        """``uvicorn.run``/``Config`` keywords. Proxies: X-Forwarded-For and X-Forwarded-Proto
        are read only from ``trusted_proxies``, and not at all without one (so neither uvicorn's
        default nor ``$FORWARDED_ALLOW_IPS`` applies). WebSocket messages: up to what a client
        relay's answer may be (an env's 16 MiB answer, JSON-escaped), and at most one received
        and not yet read per connection (``ws_max_queue``; uvicorn's default 32 would let a
        relay's client park ~1 GiB in uvicorn's ``websockets`` implementation, which reads ahead
        of the app; its sans-I/O one, what ``ws="auto"`` picks in recent uvicorn, pauses reading
        after each message whatever the setting). The relay route is the app's only WebSocket and
        reads one message at a time, so a queue of one costs it nothing."""
        from opentinker.server.routers.relay import MAX_MESSAGE_BYTES

        # No per-message compression: a 32 KB deflated frame would make the server inflate and
        # parse 32 MiB, and the client relay sends uncompressed frames anyway.
        sizes = {"ws_max_size": MAX_MESSAGE_BYTES, "ws_max_queue": 1, "ws_per_message_deflate": False}
        if not self.trusted_proxies:
            return {"proxy_headers": False, **sizes}
        return {"proxy_headers": True, "forwarded_allow_ips": list(self.trusted_proxies), **sizes}

    @property
    def db_path(self) -> Path:
        return self.data_dir / "opentinker.db"

    def job_dir(self, job_id: str) -> Path:
        return self.data_dir / "jobs" / job_id

    def job_checkpoint_dir(self, job_id: str, name: str) -> Path:
        """The folder of the job's checkpoint ``name`` (its runner's ``trainer.default_local_dir``
        is the job's ``checkpoints`` folder)."""
        return self.job_dir(job_id) / JOB_CHECKPOINTS / name

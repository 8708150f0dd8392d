"""What the operator chooses when starting ``opentinker-server``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


def default_data_dir() -> Path:
    return Path.home() / ".opentinker-server"


@dataclass
class ServerSettings:
    """Server configuration; the CLI's flags map one to one onto these fields.

    ``data_dir`` holds the SQLite store (``opentinker.db``) and one folder per job
    (``jobs/<job_id>``: checkpoints and whatever the runner writes).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = field(default_factory=default_data_dir)
    ray_address: str | None = None  # None: start a local Ray for this server
    default_model: str | None = None  # None: the embedded tiny model
    allowed_interactions: list[str] = field(default_factory=list)  # extra dotted class paths
    ray_num_cpus: int | None = None  # only used when starting a local Ray
    max_queued_steps: int = 4  # client mode: batches pushed but not yet trained, per job
    event_poll_s: float = 0.2  # how often runner events are drained and SSE streams poll
    cancel_grace_s: float = 30.0  # after a cancel, how long the runner may finish its step
    runner_call_timeout_s: float = 10.0  # control calls (queued, request_checkpoint) to a runner
    keepalive_s: float = 10.0  # SSE comment interval, so proxies keep idle streams open
    endpoint_check_timeout_s: float = 3.0  # POST /v1/env/check: per env server /health

    def __post_init__(self) -> None:
        self.data_dir = Path(self.data_dir).expanduser()
        self.allowed_interactions = list(self.allowed_interactions)
        if self.max_queued_steps < 1:
            raise ValueError(f"max_queued_steps must be >= 1, got {self.max_queued_steps}")
        if self.event_poll_s <= 0:
            raise ValueError(f"event_poll_s must be > 0, got {self.event_poll_s}")

    @property
    def db_path(self) -> Path:
        return self.data_dir / "opentinker.db"

    def job_dir(self, job_id: str) -> Path:
        return self.data_dir / "jobs" / job_id

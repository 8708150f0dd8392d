"""What a job's runner reports, made safe to store and show: its events as plain JSON of known
types (``normalize_events``), its ``run()`` answer as the job's final status (``final_status``)
and a Ray failure as one short line (``ray_failure_reason``)."""

from __future__ import annotations

import contextlib
import math
import re
from typing import Any

from ray.exceptions import RayActorError, RayTaskError

from opentinker.protocol import JobStatus

__all__ = ["final_status", "normalize_events", "ray_failure_reason"]

RUNNER_EVENT_TYPES = ("progress", "metrics", "checkpoint", "error", "log")


_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")


def ray_failure_reason(exc: BaseException) -> str:
    """A short account of a Ray failure: the runner's own exception when there is one."""
    if isinstance(exc, RayTaskError):
        cause = getattr(exc, "cause", None)
        if cause is not None:
            return f"{type(cause).__name__}: {cause}"
        return _last_line(str(exc))
    if isinstance(exc, RayActorError):
        text = _ANSI_ESCAPE.sub("", str(exc))
        if exc.actor_init_failed:  # the message ends with the constructor's exception
            return f"the job's runner failed to start: {_last_line(text)}"
        # Skip Ray's fixed first line and its tab-indented ids; keep the exit detail.
        lines = [line.strip() for line in text.splitlines()[1:] if line.strip() and not line.startswith("\t")]
        detail = " ".join(lines)
        if len(detail) > 300:
            detail = detail[:300] + "..."
        return "the job's runner process died" + (f": {detail}" if detail else "")
    return f"{type(exc).__name__}: {exc}"


def _last_line(text: str) -> str:
    lines = [line.strip() for line in _ANSI_ESCAPE.sub("", text).splitlines() if line.strip()]
    return lines[-1] if lines else text


def _jsonable(value: Any) -> Any:
    """Runner data as plain JSON: numpy/torch scalars unwrapped, NaN/inf as null (strict
    JSON has neither), anything else unknown as its string."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    item = getattr(value, "item", None)
    if callable(item):
        with contextlib.suppress(Exception):
            return _jsonable(item())
    return str(value)


def normalize_events(raw: Any) -> list[dict[str, Any]]:
    """Runner events as ``{"type", "data"}`` with a known type. A runner cannot emit
    ``status`` (the manager owns the job's status) or invent types: those become ``log``."""
    events: list[dict[str, Any]] = []
    for event in raw or []:
        if not isinstance(event, dict):
            events.append({"type": "log", "data": {"message": str(event)}})
            continue
        type_ = event.get("type")
        data = event.get("data")
        data = _jsonable(data) if isinstance(data, dict) else {"value": _jsonable(data)}
        if type_ not in RUNNER_EVENT_TYPES:
            data = {"message": f"runner event of type {type_!r}", "type": str(type_), "data": data}
            type_ = "log"
        events.append({"type": type_, "data": data})
    return events


def final_status(result: Any) -> tuple[JobStatus, str | None, int | None]:
    """A runner's ``run()`` answer as the job's final (status, error, step); one that breaks
    the contract (not a dict, an unknown or non-final status) is a failure saying so."""
    if not isinstance(result, dict):
        return JobStatus.FAILED, f"the runner's run() returned {result!r}, not a dict", None
    try:
        status = JobStatus(result.get("status"))
    except ValueError:
        status = JobStatus.FAILED
        result = {**result, "error": f"the runner's run() returned unknown status {result.get('status')!r}"}
    if not status.finished or status is JobStatus.INTERRUPTED:
        status = JobStatus.FAILED
        result = {**result, "error": f"the runner's run() returned non-final status {result.get('status')!r}"}
    step, error = result.get("step"), result.get("error")
    return status, str(error) if error else None, step if isinstance(step, int) else None

"""What the env-server interactions (gym HTTP, OpenEnv) share: joining a base URL and a path,
config values checked to a range, how an env's failing answer is described (its status and
its ``{"error": ...}`` text, never a body it does not understand), an answer's JSON read with
its depth bound, and which statuses mean "not here right now"."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from opentinker.environments.interaction import EnvironmentServerError
from opentinker.json_limits import JsonTooDeep

if TYPE_CHECKING:
    from opentinker.environments.transport import Answer

__all__ = ["MAX_ERROR_CHARS", "UNAVAILABLE_STATUSES", "answer_json", "bounded", "join_url", "reply_problem",
           "reply_shape"]

MAX_ERROR_CHARS = 300  # of an env's {"error": ...} text quoted in an EnvironmentServerError
MEDIA_TYPE = re.compile(r"[A-Za-z0-9!#$&^_.+-]{1,64}/[A-Za-z0-9!#$&^_.+-]{1,64}")


def join_url(base: str, path: str) -> str:
    return base.rstrip("/") + "/" + path.lstrip("/")


#: Answers that say "not here right now" (a proxy without its backend, a server starting or
#: draining) rather than "my code failed": the env is unreachable, as when nothing listens.
UNAVAILABLE_STATUSES = (502, 503, 504)


def bounded(config: dict[str, Any], key: str, default: float, low: float, high: float, *,
            integer: bool, above_low: bool = False) -> Any:
    """``config[key]`` (``default`` when missing or null) checked to lie within [low, high]."""
    value = config.get(key)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{key} must be a number, got {type(value).__name__}")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{key} must be a whole number, got {value!r}")
        value = int(value)
    else:
        value = float(value)
    in_range = (value > low if above_low else value >= low) and value <= high  # False for NaN
    if not in_range:
        raise ValueError(f"{key} must be {'>' if above_low else '>='} {low:g} and <= {high:g}, got {value!r}")
    return value


def reply_shape(answer: Answer) -> str:
    """Content type and size of an answer: what an error may say about a body it does not quote."""
    media_type = answer.content_type.split(";")[0].strip()
    shown = media_type if MEDIA_TYPE.fullmatch(media_type) else "unknown content type"
    return f"{shown}, {len(answer.body)} bytes"


def reply_problem(answer: Answer) -> str:
    """``HTTP <status>`` plus the env protocol's ``{"error": ...}`` text, or else only the answer's shape."""
    try:
        data = answer.json()
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        message = data["error"]
        if len(message) > MAX_ERROR_CHARS:
            message = message[:MAX_ERROR_CHARS] + "..."
        return f"HTTP {answer.status}: {message}"
    return f"HTTP {answer.status} ({reply_shape(answer)})"


def answer_json(url: str, answer: Answer) -> Any:
    """The answer's body as JSON, or the env's own error naming ``url``: a body that is not JSON,
    or nests deeper than an env answer may (its shape said, never its text)."""
    try:
        return answer.json()
    except JsonTooDeep as exc:
        raise EnvironmentServerError(url, f"answer {exc} ({reply_shape(answer)})") from exc
    except ValueError as exc:
        raise EnvironmentServerError(url, f"invalid JSON in answer ({reply_shape(answer)})") from exc

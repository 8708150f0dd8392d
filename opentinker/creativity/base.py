"""What every strategy judge shares: the protocol, metrics, de-duplication and the cache.

Only the standard library is imported here, so ``import opentinker.creativity`` stays light.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from opentinker.creativity.prompt import canonical_labels

logger = logging.getLogger(__name__)

Group = tuple[str, Sequence[str]]


class JudgeConfigError(ValueError):
    """A judge cannot be built as configured (missing API key, unknown option, ...)."""


@runtime_checkable
class StrategyJudge(Protocol):
    """Labels the responses of each prompt by solution strategy (what the trainer calls)."""

    def label_groups(self, groups: Sequence[Group]) -> list[list[str] | None]:
        """For each ``(question, responses)`` group: one label per response (equal label = same
        strategy), or ``None`` when judging that group failed (the trainer then uses weight 1)."""
        ...

    def pop_metrics(self) -> dict[str, float]:
        """Metrics since the last call (``judge/...``), then reset."""
        ...


class JudgeMetrics:
    """Thread-safe counters behind ``pop_metrics``.

    Keys (all ``judge/``-prefixed): ``groups`` (groups asked for), ``calls`` (model requests or
    ``generate`` calls, retries included), ``failures`` (failed calls: API errors, timeouts and
    invalid answers), ``invalid_outputs`` (the part of ``failures`` where the model answered but
    the answer was no valid grouping), ``fallback_groups`` (groups returned as ``None``),
    ``cache_hits``, ``skipped_groups`` (labelled without a model: one response or all identical),
    ``prompt_tokens``, ``completion_tokens``, and ``latency_s_mean`` (mean seconds per call,
    present only when there were calls). A judge reports only the counters that apply to it.
    """

    def __init__(self, keys: Sequence[str]):
        self._keys = tuple(keys)
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._counts = {key: 0.0 for key in self._keys}
        self._latency_total = 0.0
        self._latency_count = 0

    def add(self, key: str, value: float = 1.0) -> None:
        with self._lock:
            self._counts[key] = self._counts.get(key, 0.0) + float(value)

    def add_latency(self, seconds: float) -> None:
        with self._lock:
            self._latency_total += float(seconds)
            self._latency_count += 1

    def peek(self) -> dict[str, float]:
        with self._lock:
            return self._snapshot()

    def pop(self) -> dict[str, float]:
        with self._lock:
            snapshot = self._snapshot()
            self._reset()
            return snapshot

    def _snapshot(self) -> dict[str, float]:
        metrics = {f"judge/{key}": value for key, value in self._counts.items()}
        if self._latency_count:
            metrics["judge/latency_s_mean"] = self._latency_total / self._latency_count
        return metrics


@dataclass(frozen=True)
class DedupedGroup:
    """The distinct responses of a group and, for each original response, the index of its
    distinct text. Responses that differ only in whitespace count as the same; each distinct
    text is kept as first seen (stripped), in order of first appearance."""

    question: str
    unique: tuple[str, ...]
    index_map: tuple[int, ...]

    @classmethod
    def of(cls, question: str, responses: Sequence[str]) -> "DedupedGroup":
        if isinstance(responses, (str, bytes)):
            raise TypeError("responses must be a sequence of strings, got a single string")
        position: dict[str, int] = {}
        unique: list[str] = []
        index_map = []
        for text in responses:
            key = " ".join(str(text).split())
            if key not in position:
                position[key] = len(unique)
                unique.append(str(text).strip())
            index_map.append(position[key])
        return cls(str(question), tuple(unique), tuple(index_map))

    @property
    def trivial_labels(self) -> list[str] | None:
        """Labels without asking a model: ``[]`` for no responses, all ``"s0"`` when every
        response is the same text (which covers a single response); otherwise ``None``."""
        if len(self.unique) <= 1:
            return ["s0"] * len(self.index_map)
        return None

    def expand(self, unique_labels: Sequence[str]) -> list[str]:
        """Labels of the distinct texts -> canonical labels of all original responses."""
        if len(unique_labels) != len(self.unique):
            raise ValueError(f"expected {len(self.unique)} labels, got {len(unique_labels)}")
        return canonical_labels([unique_labels[index] for index in self.index_map])


def cache_key(*parts: object) -> str:
    """sha256 of the JSON encoding of ``parts`` (strings, numbers, lists)."""
    blob = json.dumps(parts, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class JudgementCache:
    """``key -> labels`` in memory, optionally persisted as one JSON object in ``path``.

    The file is read when the cache is made (a missing file is an empty cache; an unreadable
    one is logged and ignored) and rewritten atomically by :meth:`save` when entries were added.
    Several judges may share a file, but then the last one to save wins.
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path).expanduser() if path is not None else None
        self._entries: dict[str, list[str]] = {}
        self._dirty = False
        self._lock = threading.Lock()
        if self.path is not None and self.path.exists():
            try:
                loaded = json.loads(self.path.read_text(encoding="utf-8"))
                if not isinstance(loaded, dict):
                    raise ValueError("not a JSON object")
                self._entries = {
                    str(key): [str(label) for label in labels]
                    for key, labels in loaded.items()
                    if isinstance(labels, list)
                }
            except (OSError, ValueError) as error:
                logger.warning("ignoring the unreadable judge cache %s: %s", self.path, error)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> list[str] | None:
        with self._lock:
            labels = self._entries.get(key)
            return list(labels) if labels is not None else None

    def put(self, key: str, labels: Sequence[str]) -> None:
        with self._lock:
            self._entries[key] = list(labels)
            self._dirty = True

    def save(self) -> None:
        if self.path is None:
            return
        with self._lock:
            if not self._dirty:
                return
            payload = json.dumps(self._entries, ensure_ascii=False)
            self._dirty = False
        temporary = None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(prefix=self.path.name + ".", suffix=".tmp", dir=self.path.parent)
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(payload)
            os.replace(temporary, self.path)
        except OSError as error:
            logger.warning("cannot write the judge cache %s: %s", self.path, error)
            if temporary is not None and os.path.exists(temporary):
                os.unlink(temporary)

"""Each user's checkpoints (``save_state`` checkpoints and sampler snapshots, ephemeral ones
included): at most ``max_count`` of them and ``max_bytes`` on disk, so that no user fills the
disk the store and every job share.

A save is checked twice: at submit, by an estimate of its size (the model's previous
checkpoint of that kind, else from the model's size: ``model_facts.estimated_checkpoint_bytes``)
against what the user's checkpoints take on disk plus the saves accepted and not yet landed
(each holds its estimate from submit until it lands or fails); and once written, by its
measured size against what has landed. A checkpoint a save replaces (``overwrite``, or the
ephemeral snapshots it pushes out) is counted as freed. The bytes are checked as every bound on
checkpoint bytes is (:class:`~opentinker.server.checkpoint_caps.ByteCap`); the server's cap on all
users' checkpoints is checked beside this quota (``TinkerService.reserve_checkpoint``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from opentinker.server.checkpoint_caps import ByteCap, QuotaExceeded

__all__ = ["CheckpointQuota", "QuotaExceeded", "Usage"]


@dataclass(frozen=True)
class Usage:
    count: int = 0
    nbytes: int = 0


class CheckpointQuota:
    def __init__(self, max_count: int, max_bytes: int):
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._tokens = itertools.count(1)
        self._in_flight: dict[int, tuple[int, str, int]] = {}  # token -> (user, model id, estimated bytes)

    @property
    def bytes_cap(self) -> ByteCap:
        return ByteCap(self.max_bytes, "--tinker-max-checkpoint-gb", "checkpoint quota per user",
                       "your checkpoints (saves under way included)", "your others")

    def in_flight(self, user_id: int | None, model_alive: Callable[[str], bool]) -> Usage:
        """The user's saves accepted and not landed (None: every user's). A save whose model is
        gone never runs (its request failed with the model): its reservation is dropped here."""
        for token, (_, model_id, _) in list(self._in_flight.items()):
            if not model_alive(model_id):
                del self._in_flight[token]
        mine = [nbytes for user, _, nbytes in self._in_flight.values() if user_id in (None, user)]
        return Usage(len(mine), sum(mine))

    def check(self, landed: Usage, in_flight: Usage, estimate: int, freed: Usage = Usage()) -> None:
        """Before a save: QuotaExceeded unless it fits beside the landed and in-flight ones."""
        count = landed.count + in_flight.count - freed.count
        if count + 1 > self.max_count and estimate <= self.max_bytes:  # else the bytes' 400 says why
            raise QuotaExceeded(f"you have {count} checkpoints (saves under way included), the most this server "
                                f"keeps per user (--tinker-max-checkpoints {self.max_count}); delete some "
                                "(RestClient.delete_checkpoint) or wait for saves under way or TTLs to end", retry=True)
        self.bytes_cap.check(landed.nbytes + in_flight.nbytes - freed.nbytes, estimate, "a checkpoint of this model",
                             "delete some (RestClient.delete_checkpoint) or wait for saves under way or TTLs to end")

    def check_landed(self, landed: Usage, size: int, freed: Usage = Usage()) -> None:
        """Once written (``size``: measured on disk): QuotaExceeded unless it fits beside the
        landed ones."""
        if landed.count - freed.count + 1 > self.max_count:
            raise QuotaExceeded(f"your checkpoints reached this server's most per user while this one was written "
                                f"(--tinker-max-checkpoints {self.max_count}); it was not kept", retry=False)
        self.bytes_cap.check_landed(landed.nbytes - freed.nbytes, size)

    def reserve(self, user_id: int, model_id: str, estimate: int) -> int:
        """A save accepted: its estimate counts until :meth:`release` (a token)."""
        token = next(self._tokens)
        self._in_flight[token] = (user_id, model_id, estimate)
        return token

    def release(self, token: int) -> None:
        self._in_flight.pop(token, None)

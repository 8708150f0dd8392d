"""Each user's budget of sampled tokens waiting to be generated.

A sampling call costs ``num_samples x max_tokens`` (the most it can generate) from when it is
accepted until its future settles. Past the budget ``asample`` answers 429 with Retry-After
(the SDK pauses its sampling a second and sends again), so one user can queue at most a
budget's worth of decoding however many calls they send; a single call that costs more than
the whole budget could never run and is refused as the user's error. In memory only: after a
restart nothing is pending (the futures of the old process failed).
"""

from __future__ import annotations

import threading


class OverBudget(Exception):
    """The call does not fit now (``retry`` True: wait and resend) or ever (False)."""

    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


class SampleBudget:
    def __init__(self, tokens_per_user: int):
        self.tokens_per_user = tokens_per_user
        self._pending: dict[int, int] = {}
        self._lock = threading.Lock()

    def reserve(self, user_id: int, cost: int) -> None:
        if cost > self.tokens_per_user:
            raise OverBudget(f"asample: num_samples x max_tokens is {cost:,} tokens, more than this server lets one "
                             f"user have waiting ({self.tokens_per_user:,}); split it into smaller calls", retry=False)
        with self._lock:
            pending = self._pending.get(user_id, 0)
            if pending + cost > self.tokens_per_user:
                raise OverBudget(f"asample: you have {pending:,} sampled tokens waiting; this call's {cost:,} would pass "
                                 f"the per-user budget of {self.tokens_per_user:,}; retry when some finish", retry=True)
            self._pending[user_id] = pending + cost

    def release(self, user_id: int, cost: int) -> None:
        with self._lock:
            left = self._pending.get(user_id, 0) - cost
            if left > 0:
                self._pending[user_id] = left
            else:
                self._pending.pop(user_id, None)

    def pending(self, user_id: int) -> int:
        return self._pending.get(user_id, 0)

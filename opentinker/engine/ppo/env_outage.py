"""Waiting out an environment-server outage inside one training step.

A step any of whose samples failed because an env server could not be reached
(``EnvironmentServerError.unreachable``: connection errors, timeouts, HTTP 502/503/504, a
dropped client relay, a broken session, a server at capacity for too long; a server answering
with errors of its own is not waited for) is neither trained on its survivors nor skipped: the
trainer waits, probing the servers' ``GET /health`` between backoff sleeps (0.5 s doubling to
10 s; a client relay that connects meanwhile ends the sleep at once), and redoes the same step's
rollout as soon as every one answers. After
``trainer.env_outage_timeout_s`` of waiting the job fails with
:class:`EnvironmentUnavailableError`. A time budget, not a count of steps: a restart that
takes 25 s costs that plus at most one backoff sleep, and no step is lost from the run.

The trainer hands in how to probe (``AgentLoopRunner.probe_health``), warn (job events) and
check for a cancel; the clock and sleep can be replaced, so the backoff is testable in no time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from opentinker.engine.ppo.agent_runner import env_endpoint_of

if TYPE_CHECKING:
    from opentinker.engine.agent_loop import Trajectory

FIRST_DELAY_S = 0.5
MAX_DELAY_S = 10.0
WARN_EVERY_S = 10.0  # at most one "still waiting" warning this often: no flood on a long outage
PROBE_TIMEOUT_S = 2.0  # a /health that takes longer counts as down

#: ``probe(urls) -> {url: error text, or None when its /health answered 2xx}``
Probe = Callable[[Sequence[str]], Mapping[str, "str | None"]]


class EnvironmentUnavailableError(RuntimeError):
    """The job cannot go on because of its environments: an env server stayed unreachable
    for ``trainer.env_outage_timeout_s``, or ``trainer.max_consecutive_empty_steps`` steps in
    a row had nothing to train on. The message names the env endpoints and the last error."""


def unreachable_endpoints(
    trajectories: Sequence["Trajectory"], interaction_names: Sequence[str | None]
) -> dict[str, str]:
    """``{base URL: "URL (interaction 'name')"}`` of the env servers some of ``trajectories``
    could not reach (empty when every failure was an answer of the env's own, e.g. a 500)."""
    endpoints: dict[str, str] = {}
    for trajectory, name in zip(trajectories, interaction_names):
        url = trajectory.info.get("error_url")
        if url and trajectory.info.get("env_unreachable"):
            base = env_endpoint_of(url)
            endpoints.setdefault(base, base + (f" (interaction {name!r})" if name else ""))
    return endpoints


class EnvOutage:
    """One step's wait for its env servers: :meth:`wait` after each failed try of the step
    (returns once every server's /health answers, raises when the time is up), then
    :meth:`resumed` once the step got through.

    The clock starts at the first failed try and runs across tries, so a server that
    answers /health but keeps refusing /reset with 503 still ends the wait on time.
    """

    def __init__(
        self,
        step: int,
        timeout_s: float,
        probe: Probe,
        warn: Callable[[str], None],
        check_cancelled: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        wake: Callable[[float], bool] | None = None,
    ):
        self.step = step
        self.timeout_s = float(timeout_s)
        self.probe = probe
        self.warn = warn
        self.check_cancelled = check_cancelled  # raises to stop the job (a cancel must not wait 300 s)
        self.clock = clock
        self.sleep = sleep
        # wake(seconds): wait up to that long for something that ends the sleep early (a client
        # relay connecting); True when it came. None: plain sleeps.
        self.wake = wake
        self.started = clock()
        self.tries = 0  # failed tries of the step so far
        self.delay = FIRST_DELAY_S
        self.endpoints: dict[str, str] = {}
        self.last_error = ""
        self.lost = ""  # "N of M episodes" of the last failed try
        self._last_warned: float | None = None

    def waited(self) -> float:
        return self.clock() - self.started

    def _names(self) -> str:
        return ", ".join(self.endpoints.values())

    def wait(self, endpoints: Mapping[str, str], last_error: str, failed: int = 0, total: int = 0) -> None:
        """Sleep and probe ``endpoints`` (base URL -> name) until all answer /health;
        :class:`EnvironmentUnavailableError` once ``timeout_s`` has passed without that.
        ``failed`` of ``total`` episodes of the try failed so."""
        self.tries += 1
        self.endpoints, self.last_error = dict(endpoints), last_error
        self.lost = f"{failed} of {total} episodes" if total else "episodes"
        while True:
            waited = self.waited()
            if waited >= self.timeout_s:
                raise EnvironmentUnavailableError(
                    f"step {self.step}: env server(s) {self._names()} still unreachable after {waited:.1f} s "
                    f"(trainer.env_outage_timeout_s={self.timeout_s:g}; the step was tried {self.tries} "
                    f"time(s) and not trained); last error: {self.last_error}"
                )
            self._maybe_warn(waited)
            self._sleep(min(self.delay, self.timeout_s - waited))
            self.delay = min(self.delay * 2, MAX_DELAY_S)
            down = {url: error for url, error in self.probe(list(self.endpoints)).items() if error}
            if not down:
                return
            self.last_error = "; ".join(down.values())

    def resumed(self) -> None:
        """Say that the step went through after the wait (one warning, not one per probe)."""
        self.warn(f"step {self.step}: env server(s) {self._names()} answered again after {self.waited():.1f} s; "
                  f"the step was redone (try {self.tries + 1}) and nothing was skipped")

    def _maybe_warn(self, waited: float) -> None:
        now = self.clock()
        if self._last_warned is not None and now - self._last_warned < WARN_EVERY_S:
            return
        first = self._last_warned is None
        self._last_warned = now
        left = self.timeout_s - waited
        if first:
            what = (f"{self.lost} could not reach env server(s) {self._names()}; the step is not trained on the "
                    f"rest but redone whole as soon as their /health answers")
        else:
            what = f"still waiting for env server(s) {self._names()} after {waited:.0f} s"
        self.warn(f"step {self.step}: {what}; the job fails in {left:.0f} s otherwise "
                  f"(trainer.env_outage_timeout_s={self.timeout_s:g}); last error: {self.last_error}")

    def _sleep(self, seconds: float) -> None:
        """``sleep`` in short slices, checking for a cancel between them; ends early on a wake."""
        end = self.clock() + max(seconds, 0.0)
        while True:
            self.check_cancelled()
            left = end - self.clock()
            if left <= 0:
                return
            if self.wake is not None:
                if self.wake(min(left, 0.2)):
                    return
            else:
                self.sleep(min(left, 0.2))

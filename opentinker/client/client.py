"""``OpenTinkerClient``: the laptop side of the v1 HTTP API (httpx, pydantic; no torch).

Retries and idempotency — the rule this module keeps:

* Connection errors (refused, reset, timed out, a server that hung up) and 502/503/504
  answers are retried ``retries`` times with exponential backoff (``backoff * 2**attempt``,
  capped at ``max_backoff``, plus a little jitter; a ``Retry-After`` header on a 503 is
  honoured, capped at 60 s). Other answers are never retried here (429 is retried by
  :meth:`JobHandle.push_step`, which knows it is safe). The retrying itself is tenacity's
  (:mod:`opentinker.client.retries` holds the policies).
* GET requests are retried freely. A request with side effects (every POST) is re-sent
  only with an ``Idempotency-Key`` header, and the client always sends one on a POST: a
  fresh uuid4 per logical call (or the caller's key), reused unchanged on every retry of
  that call. So a POST whose answer was lost is re-sent with the key the server already
  saw, and the server answers with the original result instead of acting twice (a second
  job, a second step). A POST without a key is never re-sent.
* Per route: ``POST /v1/jobs`` relies on the server honouring the key (it must map the key
  to the job it created); ``POST .../steps`` is idempotent by step index as well;
  ``POST .../cancel`` is idempotent by nature (cancelling a cancelled job changes nothing,
  and :meth:`JobHandle.cancel` turns a 409 for an already finished job into that job's
  info); ``POST .../checkpoints`` asks for a save at the end of the current step, and asking
  twice asks for the same save; ``POST /v1/env/check`` has no side effects.
"""

from __future__ import annotations

import os
import random
import uuid
from urllib.parse import quote
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import httpx

from opentinker.client.errors import (
    ConfigurationError,
    ConnectionFailedError,
    OpenTinkerError,
    error_from_response,
)
from opentinker.client.jobs import JobHandle
from opentinker.client.retries import (
    MAX_RETRY_AFTER_S, RETRY_STATUSES, RetryableStatus, retry_rate_limited, retry_transient,
)
from opentinker.environments.registry import InteractionSpec
from opentinker.protocol import (
    API_PREFIX,
    EnvCheck,
    EnvCheckResult,
    Health,
    JobCreate,
    JobCreated,
    ModelList,
    JobInfo,
    JobList,
    JobMode,
    TokenizerFiles,
)
from opentinker.version import __version__

if TYPE_CHECKING:
    from opentinker.client.environment import GenericEnvironment

__all__ = ["ENV_API_KEY", "ENV_BASE_URL", "IDEMPOTENCY_HEADER", "OpenTinkerClient"]

ENV_BASE_URL = "OPENTINKER_BASE_URL"
ENV_API_KEY = "OPENTINKER_API_KEY"
IDEMPOTENCY_HEADER = "Idempotency-Key"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: How long an env check refused because another of the user's is running (429) is tried again.
ENV_CHECK_PATIENCE_S = 120.0


def _user_agent() -> str:
    return f"opentinker-client/{__version__}"


class OpenTinkerClient:
    """A connection to one OpenTinker server.

    ``base_url`` and ``api_key`` default to ``$OPENTINKER_BASE_URL`` and
    ``$OPENTINKER_API_KEY``; a missing one is a :class:`ConfigurationError` naming both.
    ``timeout`` is the per-request timeout in seconds, ``retries`` how often a failed
    connection or a 502/503/504 is retried (see the module docstring for which requests
    may be re-sent). Use it as a context manager, or call :meth:`close`.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 30,
        retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        stream_read_timeout: float = 120.0,
    ):
        base_url = base_url or os.environ.get(ENV_BASE_URL) or None
        api_key = api_key or os.environ.get(ENV_API_KEY) or None
        missing = [name for name, value in ((ENV_BASE_URL, base_url), (ENV_API_KEY, api_key)) if not value]
        if missing:
            raise ConfigurationError(
                f"no OpenTinker server configured: missing {' and '.join(missing)}. Set the environment "
                f"variables {ENV_BASE_URL} (e.g. http://gpu-node:8000) and {ENV_API_KEY}, or pass "
                "OpenTinkerClient(base_url=..., api_key=...)."
            )
        base_url = base_url.strip().rstrip("/")
        if not base_url.startswith(("http://", "https://")):
            raise ConfigurationError(f"base URL must start with http:// or https://, got {base_url!r}")
        if base_url.endswith(API_PREFIX):  # accept ".../v1" as well as the server root
            base_url = base_url[: -len(API_PREFIX)]
        if retries < 0:
            raise ConfigurationError(f"retries must be >= 0, got {retries}")
        self.base_url = base_url
        self.api_key = api_key
        self.timeout = float(timeout)
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.stream_read_timeout = float(stream_read_timeout)
        # A proxy from the environment is for remote servers; loopback never goes through one.
        loopback = httpx.URL(base_url).host in ("127.0.0.1", "localhost", "::1")
        self._http = httpx.Client(timeout=self.timeout, headers={"User-Agent": _user_agent()}, trust_env=not loopback)

    # ------------------------------------------------------------------ plumbing

    def __repr__(self) -> str:
        return f"OpenTinkerClient(base_url={self.base_url!r})"

    def __enter__(self) -> OpenTinkerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def url(self, path: str) -> str:
        """The absolute URL of an API path such as ``/jobs`` (the ``/v1`` prefix is added)."""
        if not path.startswith(API_PREFIX + "/"):
            path = API_PREFIX + "/" + path.lstrip("/")
        return self.base_url + path

    def headers(self, *, auth: bool = True, idempotency_key: str | None = None) -> dict[str, str]:
        headers: dict[str, str] = {}
        if auth:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if idempotency_key:
            headers[IDEMPOTENCY_HEADER] = idempotency_key
        return headers

    def backoff_delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number ``attempt + 1``."""
        delay = min(self.max_backoff, self.backoff * (2**attempt))
        delay += random.uniform(0, delay * 0.25)
        if retry_after is not None:
            delay = max(delay, min(retry_after, MAX_RETRY_AFTER_S))
        return delay

    @staticmethod
    def may_resend(method: str, headers: Mapping[str, str]) -> bool:
        """Whether a request may be sent again after a failure whose effect is unknown."""
        return method.upper() in SAFE_METHODS or bool(headers.get(IDEMPOTENCY_HEADER))

    def connection_error(self, exc: Exception, attempts: int) -> ConnectionFailedError:
        tries = f" after {attempts} attempts" if attempts > 1 else ""
        return ConnectionFailedError(
            f"cannot reach the OpenTinker server at {self.base_url}{tries}: {type(exc).__name__}: {exc}"
        )

    def request(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: Mapping[str, Any] | None = None,
        auth: bool = True,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> httpx.Response:
        """Send one logical request (with retries) and return the successful answer.

        A POST always carries an ``Idempotency-Key`` (``idempotency_key`` or a new uuid4),
        the same on every retry. Raises the typed error of an error answer, or
        :class:`ConnectionFailedError` once the retries are spent.
        """
        method = method.upper()
        if method not in SAFE_METHODS and not idempotency_key:
            idempotency_key = uuid.uuid4().hex
        headers = self.headers(auth=auth, idempotency_key=idempotency_key)
        url = self.url(path)

        def send() -> httpx.Response:
            response = self._http.request(
                method, url, json=json, params=params, headers=headers, timeout=timeout or self.timeout
            )
            if response.status_code in RETRY_STATUSES:
                raise RetryableStatus(response)
            return response

        response = retry_transient(self, send, resend=self.may_resend(method, headers))
        if response.is_error:
            raise error_from_response(response)
        return response

    def open_stream(
        self,
        path: str,
        *,
        headers: Mapping[str, str] | None = None,
        params: Mapping[str, Any] | None = None,
        read_timeout: float | None = None,
    ):
        """A streaming ``GET`` (context manager over the :class:`httpx.Response`); no retries
        here: the caller (event stream, download) knows how to resume."""
        all_headers = self.headers()
        all_headers.update(headers or {})
        timeout = httpx.Timeout(self.timeout, read=read_timeout if read_timeout is not None else self.timeout)
        return self._http.stream("GET", self.url(path), headers=all_headers, params=params, timeout=timeout)

    def request_json(self, method: str, path: str, **kw: Any) -> Any:
        """:meth:`request`, then the answer's JSON body ({} for an empty one)."""
        response = self.request(method, path, **kw)
        if response.status_code == 204 or not response.content:
            return {}
        try:
            return response.json()
        except ValueError as exc:
            raise OpenTinkerError(
                f"the server answered {method} {path} with something that is not JSON "
                f"(HTTP {response.status_code}): {response.text[:200]!r}"
            ) from exc

    # ------------------------------------------------------------------ routes

    def health(self) -> Health:
        """``GET /v1/health`` (no API key needed)."""
        return Health.model_validate(self.request_json("GET", "/health", auth=False))

    def version(self) -> dict[str, Any]:
        """``GET /v1/version``: the server's version information."""
        return self.request_json("GET", "/version")

    def models(self) -> ModelList:
        """``GET /v1/models``: the names ``actor_rollout_ref.model.path`` may take on this server
        (and the strategy-judge models ``algorithm.judge.model`` may pick)."""
        return ModelList.model_validate(self.request_json("GET", "/models"))

    def tokenizer_files(self, model: str) -> TokenizerFiles:
        """``GET /v1/models/{model}/tokenizer``: a served model's tokenizer files (see
        :func:`opentinker.client.tokenizer_cache.place_in_hf_cache`)."""
        return TokenizerFiles.model_validate(self.request_json("GET", f"/models/{quote(model, safe='')}/tokenizer"))

    def create_job(self, job: JobCreate | Mapping[str, Any], *, idempotency_key: str | None = None) -> JobHandle:
        """``POST /v1/jobs``; returns a handle on the new job."""
        job = job if isinstance(job, JobCreate) else JobCreate.model_validate(job)
        body = self.request_json("POST", "/jobs", json=job.model_dump(mode="json"), idempotency_key=idempotency_key)
        return JobHandle(self, JobCreated.model_validate(body).job_id)

    def list_jobs(self) -> list[JobInfo]:
        """``GET /v1/jobs``: every job the API key can see."""
        return JobList.model_validate(self.request_json("GET", "/jobs")).jobs

    def get_job(self, job_id: str) -> JobHandle:
        """A handle on an existing job (raises :class:`NotFoundError` when there is none)."""
        handle = JobHandle(self, job_id)
        handle.info()
        return handle

    def job(self, job_id: str) -> JobHandle:
        """A handle on ``job_id`` without asking the server whether it exists."""
        return JobHandle(self, job_id)

    def check_environment(
        self, specs: Iterable[InteractionSpec | Mapping[str, Any]]
    ) -> EnvCheckResult:
        """``POST /v1/env/check``: the server validates the specs against its allowlist and
        reaches every env endpoint's ``/health``. A check changes nothing, so one refused because
        another is running (429: one at a time per user) is sent again after its ``Retry-After``,
        for up to ``ENV_CHECK_PATIENCE_S``."""
        parsed = [s if isinstance(s, InteractionSpec) else InteractionSpec.model_validate(s) for s in specs]
        body = EnvCheck(interactions=parsed).model_dump(mode="json")
        answer = retry_rate_limited(lambda: self.request_json("POST", "/env/check", json=body),
                                    timeout=ENV_CHECK_PATIENCE_S)
        return EnvCheckResult.model_validate(answer)

    # ------------------------------------------------------------------ training

    def submit(
        self,
        env: GenericEnvironment | Mapping[str, Any] | JobCreate | None = None,
        *,
        steps: int | None = None,
        mode: JobMode | None = None,
        name: str | None = None,
    ) -> JobHandle:
        """Create a training job from ``env`` and return its handle without waiting.

        ``env`` is a :class:`GenericEnvironment` (checked with ``env.setup(self)`` first if it
        was not yet), a config dict of verl-style overrides (the server's built-in task), or a
        ready :class:`JobCreate`. ``steps`` sets ``trainer.total_training_steps``.
        ``mode="server"`` uploads the dataset rows with the job; ``mode="client"`` creates the
        job and pushes one batch from the env's dataloader per step from a background thread,
        running ahead of training as far as the server's queue allows (``handle.wait()``
        reports a failure of that thread). ``mode=None``: a JobCreate's own mode, else "server".
        """
        from opentinker.client.environment import GenericEnvironment

        if mode not in (None, "server", "client"):
            raise ValueError(f"mode must be 'server' or 'client', got {mode!r}")
        if isinstance(env, JobCreate):
            update: dict[str, Any] = {}
            if mode is not None:
                update["mode"] = mode
            if name is not None:
                update["name"] = name
            if steps is not None:
                update["config"] = {**env.config, "trainer.total_training_steps": int(steps)}
            job = env.model_copy(update=update) if update else env
            if job.mode == "client":
                raise ValueError("client mode needs a GenericEnvironment to draw step batches from")
            return self.create_job(job)
        mode = mode or "server"
        if env is None or isinstance(env, Mapping):
            env = GenericEnvironment(dict(env or {}))
        if not isinstance(env, GenericEnvironment):
            raise TypeError(f"expected a GenericEnvironment, a config dict or a JobCreate, got {type(env).__name__}")
        if not env.is_set_up_for(self):
            env.setup(self)
        handle = self.create_job(env.job_create(mode=mode, steps=steps, name=name))
        handle.start_relay(env.interaction_specs)  # interactions with relay: client; a no-op for others
        if mode == "client":
            handle.start_pushing(env.step_batches())
        return handle

    def fit(
        self,
        env: GenericEnvironment | Mapping[str, Any] | JobCreate | None = None,
        *,
        steps: int | None = None,
        wait: bool = True,
        mode: JobMode | None = None,
        name: str | None = None,
        progress: bool = True,
        timeout: float | None = None,
        wandb_project: str | None = None,
    ) -> JobInfo | JobHandle:
        """Train on ``env``: :meth:`submit`, then (``wait=True``) :meth:`JobHandle.wait` with a
        progress bar, returning the final :class:`JobInfo` (a failed job raises
        :class:`JobFailedError`). With ``wait=False`` returns the handle.

        Ctrl-C while waiting: a client-mode job is cancelled (nobody would feed it); a
        server-mode job keeps running on the server (``opentinker jobs cancel ID`` stops it).
        """
        handle = self.submit(env, steps=steps, mode=mode, name=name)
        if not wait:
            return handle
        try:
            return handle.wait(timeout=timeout, progress=progress, wandb_project=wandb_project)
        except KeyboardInterrupt:
            if handle.is_pushing:
                handle.stop_pushing()
                try:
                    handle.cancel()
                except OpenTinkerError:
                    pass
            else:
                import sys

                relayed = " (its env calls wait for this machine: `opentinker jobs logs -f " \
                    f"{handle.job_id}` carries them again)" if handle.relay is not None else ""
                print(
                    f"\njob {handle.job_id} keeps running on the server{relayed}; "
                    f"`opentinker jobs cancel {handle.job_id}` stops it",
                    file=sys.stderr,
                )
            raise

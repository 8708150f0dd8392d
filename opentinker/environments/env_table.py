"""The live environment instances of one env server and what the protocol does to them
(:class:`EnvTable`): ``/reset`` makes and resets an instance, ``/step`` applies one step under
the instance's lock (a retried step answered from memory), ``/finalize`` closes it, and a sweep
closes the idle ones; plus the requests' models, the per-job counters and how the user's
``reset``/``step`` return values become the protocol's answers. ``server.py`` serves it."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi.encoders import jsonable_encoder
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from opentinker.images import image_part

logger = logging.getLogger("opentinker.environments.server")

DEFAULT_JOB = "default"  # the statistics key of requests that carry no job_id
_MAX_JOB_ID_CHARS = 256

__all__ = ["DEFAULT_JOB", "EnvInstance", "EnvJobStats", "EnvServerError", "EnvServerStats", "EnvTable",
           "FinalizeRequest", "ResetRequest", "StepRequest"]


# --------------------------------------------------------------------------- requests


class ResetRequest(BaseModel):
    """Unknown fields are allowed: they are passed to ``reset`` as keyword arguments."""

    model_config = ConfigDict(extra="allow")

    instance_id: str
    job_id: str | None = Field(default=None, max_length=_MAX_JOB_ID_CHARS)
    seed: int | None = None


class StepRequest(BaseModel):
    instance_id: str
    action: str
    step: int | None = Field(default=None, ge=0, description="steps already applied to the instance")
    job_id: str | None = Field(default=None, max_length=_MAX_JOB_ID_CHARS)


class FinalizeRequest(BaseModel):
    instance_id: str
    job_id: str | None = Field(default=None, max_length=_MAX_JOB_ID_CHARS)


# --------------------------------------------------------------------------- state


class EnvServerError(Exception):
    """An error answered as ``{"error": message, "instance_id"?: ...}`` with ``status``."""

    def __init__(self, status: int, message: str, instance_id: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.instance_id = instance_id


@dataclass
class EnvInstance:
    """One live environment object and its bookkeeping."""

    instance_id: str
    env: Any
    job_id: str | None = None
    created_at: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    steps: int = 0
    done: bool = False
    last_reply: dict | None = None  # the answer of the last applied step, for a retried /step
    busy: int = 0  # requests currently holding or waiting for the lock
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    def touch(self) -> None:
        self.last_used = time.monotonic()


@dataclass
class EnvJobStats:
    """Request counters; ``replayed_steps`` are retried /step requests answered from memory."""

    resets: int = 0
    steps: int = 0
    replayed_steps: int = 0
    finalized: int = 0
    expired: int = 0
    user_errors: int = 0


MAX_TRACKED_JOBS = 256  # job ids with counters of their own in /health


@dataclass
class EnvServerStats(EnvJobStats):
    """Totals over all jobs, and ``by_job``: the same counters per job id (``DEFAULT_JOB``
    for requests without one), for the ``MAX_TRACKED_JOBS`` most recently active jobs (a
    client picks job ids: the table must not grow with them)."""

    by_job: OrderedDict[str, EnvJobStats] = field(default_factory=OrderedDict)

    def count(self, job_id: str | None, counter: str) -> None:
        key = job_id if job_id is not None else DEFAULT_JOB
        job = self.by_job.pop(key, None) or EnvJobStats()
        self.by_job[key] = job  # now the most recent
        if len(self.by_job) > MAX_TRACKED_JOBS:
            self.by_job.popitem(last=False)
        for counts in (self, job):
            setattr(counts, counter, getattr(counts, counter) + 1)


# --------------------------------------------------------------------------- helpers


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _json_info(info: Any, what: str) -> dict:
    if info is None:
        return {}
    if not isinstance(info, dict):
        raise TypeError(f"{what} info must be a dict, got {type(info).__name__}")
    return jsonable_encoder(info)


def _observation_fields(observation: Any, what: str) -> dict:
    """An observation as the protocol's fields: a string is ``{"observation"}``; a dict
    ``{"text", "images"}`` (pictures as PNG/JPEG/WebP bytes, a file path, a Pillow image or a
    data URL) adds ``"images"``, each a data URL."""
    if isinstance(observation, str):
        return {"observation": observation}
    if isinstance(observation, dict) and isinstance(observation.get("text"), str):
        pictures = observation.get("images") or []
        if not isinstance(pictures, (list, tuple)):
            raise TypeError(f"{what} observation 'images' must be a list, got {type(pictures).__name__}")
        urls = [p if isinstance(p, str) and p.startswith("data:") else image_part(p)["image"] for p in pictures]
        return {"observation": observation["text"], **({"images": urls} if urls else {})}
    raise TypeError(f"{what} observation must be a str or a dict {{'text': str, 'images': [...]}}, "
                    f"got {type(observation).__name__}")


def _normalize_reset(result: Any) -> dict:
    """A reset return value as the protocol's ``{"observation", "system_prompt", "info"}``."""
    system_prompt = None
    info: Any = {}
    if isinstance(result, str):
        observation = result
    elif isinstance(result, dict):
        if "observation" not in result:
            raise TypeError("reset() returned a dict without an 'observation' key")
        observation = result["observation"]
        system_prompt = result.get("system_prompt")
        info = result.get("info")
    elif isinstance(result, tuple) and len(result) == 2:
        observation, info = result
    else:
        raise TypeError(
            "reset() must return a str, a dict with 'observation' or an (observation, info) "
            f"pair, got {type(result).__name__}"
        )
    fields = _observation_fields(observation, "reset()")
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise TypeError(f"reset() system_prompt must be a str or None, got {type(system_prompt).__name__}")
    return {**fields, "system_prompt": system_prompt, "info": _json_info(info, "reset()")}


def _normalize_step(result: Any) -> dict:
    """A step return value (4- or gymnasium 5-tuple) as the protocol's step response."""
    cut_short = False
    if isinstance(result, (tuple, list)) and len(result) == 4:
        observation, reward, done, info = result
    elif isinstance(result, (tuple, list)) and len(result) == 5:
        observation, reward, terminated, truncated, info = result
        done = bool(terminated) or bool(truncated)
        cut_short = bool(truncated) and not bool(terminated)  # `done` alone would lose this
    else:
        raise TypeError(
            "step() must return (observation, reward, done, info) or "
            f"(observation, reward, terminated, truncated, info), got {result!r:.200}"
        )
    fields = _observation_fields(observation, "step()")
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"step() reward must be finite, got {reward}")
    info = _json_info(info, "step()")
    if cut_short:
        info["truncated"] = True
    return {**fields, "reward": reward, "done": bool(done), "info": info}


def _close_env(env: Any, instance_id: str) -> None:
    close = getattr(env, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:  # a failing close must not take the server (or a sweep) down
        logger.exception("close() of environment instance %r failed", instance_id)


# --------------------------------------------------------------------------- the table


class EnvTable:
    """The instances of ``env_class(**env_kwargs)`` one server holds, by instance id, and its
    counters. ``idle_timeout_s`` None: instances never expire."""

    def __init__(self, env_class: type, env_kwargs: dict, idle_timeout_s: float | None):
        self.env_class, self.env_kwargs, self.idle_timeout_s = env_class, env_kwargs, idle_timeout_s
        self.instances: dict[str, EnvInstance] = {}
        self.stats = EnvServerStats()

    async def _close(self, inst: EnvInstance) -> None:
        """Close an instance already removed from ``instances``, once nobody is using it."""
        async with inst.lock:
            await run_in_threadpool(_close_env, inst.env, inst.instance_id)

    async def sweep_once(self) -> int:
        """Close the instances idle longer than ``idle_timeout_s`` and not in use; how many."""
        now = time.monotonic()
        stale = [inst for inst in self.instances.values()
                 if inst.busy == 0 and not inst.lock.locked() and now - inst.last_used > self.idle_timeout_s]
        for inst in stale:
            if self.instances.get(inst.instance_id) is inst:
                del self.instances[inst.instance_id]
                self.stats.count(inst.job_id, "expired")
                logger.info("instance %r idle for %.1fs: closed", inst.instance_id, now - inst.last_used)
        for inst in stale:
            await self._close(inst)
        return len(stale)

    async def sweep_forever(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.sweep_once()
            except Exception:  # keep sweeping whatever happens
                logger.exception("idle sweep failed")

    async def close_all(self) -> None:
        leftovers = list(self.instances.values())
        self.instances.clear()
        for inst in leftovers:
            await run_in_threadpool(_close_env, inst.env, inst.instance_id)

    def _make_and_reset(self, extra: dict) -> tuple[Any, dict]:
        env = self.env_class(**self.env_kwargs)
        try:
            return env, _normalize_reset(env.reset(**extra))
        except BaseException:
            _close_env(env, "<failed reset>")
            raise

    async def reset(self, req: ResetRequest) -> dict:
        extra = dict(req.model_extra or {})
        if req.seed is not None:
            extra["seed"] = req.seed
        try:
            env, response = await run_in_threadpool(self._make_and_reset, extra)
        except Exception as exc:
            self.stats.count(req.job_id, "user_errors")
            logger.warning("reset of %r failed: %s", req.instance_id, _describe(exc))
            raise EnvServerError(500, _describe(exc), req.instance_id) from exc
        old = self.instances.get(req.instance_id)
        self.instances[req.instance_id] = EnvInstance(req.instance_id, env, job_id=req.job_id)
        self.stats.count(req.job_id, "resets")
        if old is not None:
            await self._close(old)
        return response

    async def step(self, req: StepRequest) -> dict:
        inst = self.instances.get(req.instance_id)
        if inst is None:
            raise EnvServerError(404, f"unknown instance_id {req.instance_id!r}", req.instance_id)
        inst.busy += 1
        try:
            inst.touch()
            async with inst.lock:
                return await self._step_locked(inst, req)
        finally:
            inst.touch()
            inst.busy -= 1

    async def _step_locked(self, inst: EnvInstance, req: StepRequest) -> dict:
        if self.instances.get(req.instance_id) is not inst:  # finalized/replaced while we waited
            raise EnvServerError(404, f"unknown instance_id {req.instance_id!r}", req.instance_id)
        if req.job_id is not None and req.job_id != inst.job_id:
            raise EnvServerError(409, f"instance {req.instance_id!r} belongs to another job than {req.job_id!r}",
                                 req.instance_id)
        if req.step is not None and req.step != inst.steps:
            if req.step == inst.steps - 1 and inst.last_reply is not None:
                self.stats.count(inst.job_id, "replayed_steps")  # a retry whose answer was lost
                return inst.last_reply
            raise EnvServerError(409, f"step index mismatch for instance {req.instance_id!r}: expected step "
                                      f"{inst.steps}, got {req.step}", req.instance_id)
        if inst.done:
            raise EnvServerError(409, f"instance {req.instance_id!r} is done; call /reset or /finalize",
                                 req.instance_id)
        try:
            response = _normalize_step(await run_in_threadpool(lambda: inst.env.step(req.action)))
        except Exception as exc:
            self.stats.count(inst.job_id, "user_errors")
            logger.warning("step of %r failed: %s", req.instance_id, _describe(exc))
            raise EnvServerError(500, _describe(exc), req.instance_id) from exc
        inst.steps += 1
        inst.done = response["done"]
        inst.last_reply = response
        self.stats.count(inst.job_id, "steps")
        return response

    async def finalize(self, req: FinalizeRequest) -> dict:
        inst = self.instances.pop(req.instance_id, None)
        if inst is not None:
            self.stats.count(inst.job_id, "finalized")
            await self._close(inst)
        return {"ok": True}

    def health(self) -> dict:
        live = Counter(inst.job_id if inst.job_id is not None else DEFAULT_JOB for inst in self.instances.values())
        jobs = {job: {"instances": live.get(job, 0), **asdict(counts)} for job, counts in self.stats.by_job.items()}
        return {"status": "ok", "instances": len(self.instances), "env": self.env_class.__name__, "jobs": jobs}

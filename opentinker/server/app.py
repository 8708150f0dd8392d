"""``create_app(settings)``: the control plane's FastAPI app.

Startup opens the store, marks jobs a previous process left running as ``interrupted``
(their Ray actors died with it; queued jobs stay queued), queues again those that have a
checkpoint to resume from, starts the JobManager (Ray) and schedules the queued jobs. OpenAPI docs are at ``/docs`` and ``/openapi.json``, public like
``/v1/health`` and the dashboard's page and static files (``/``, ``/dashboard/static/``);
every other route needs an API key (or the dashboard's session cookie, made from one).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI

import opentinker
from opentinker.environments.registry import default_registry
from opentinker.json_value import add_json_value_schema
from opentinker.protocol import API_PREFIX
from opentinker.server import dashboard
from opentinker.server.auth import FailedAuthLimiter
from opentinker.server.errors import install_error_handlers
from opentinker.server.event_bus import EventBus
from opentinker.server.jobs import JobManager
from opentinker.server.middleware import BodyLimits
from opentinker.server.model_serving import ModelServing
from opentinker.server.request_body import add_body_schemas
from opentinker.server.revocation import CredentialWatch
from opentinker.server.routers import checkpoints, completions, env, events, health, jobs, models, relay, steps
from opentinker.server.routers import usage as usage_router
from opentinker.server.routers import audit as audit_router
from opentinker.server import audit_hooks
from opentinker.server.routers.relay import RelayBoard
from opentinker.server.settings import ServerSettings
from opentinker.server.store import Store
from opentinker.server.tinker import routes as tinker_routes
from opentinker.server.accounting import AuditLog, UsageMeter
from opentinker.server.tinker.service import TinkerService, tinker_settings
from opentinker.server.validation import Tokenizers

log = logging.getLogger("opentinker.server")


def interrupted_reason(now: dt.datetime | None = None) -> str:
    now = now or dt.datetime.now(dt.timezone.utc)
    return f"the server stopped while this job was running (restarted at {now.isoformat(timespec='seconds')})"


def _document(app: FastAPI, settings: ServerSettings) -> dict:
    """The OpenAPI document, with the bounds that are this server's settings (not the models')."""
    document = add_body_schemas(add_json_value_schema(FastAPI.openapi(app)))
    document["components"]["schemas"]["StepBatch"]["properties"]["rows"]["maxItems"] = settings.max_rows_per_step
    return document


def create_app(settings: ServerSettings | None = None, *, runner_cls: type | None = None) -> FastAPI:
    """The app for ``settings``; ``runner_cls`` replaces the default JobRunner (tests)."""
    settings = settings or ServerSettings()
    # Built now, so a bad --allow-interaction path fails at startup, not on the first job.
    registry = default_registry(allowed=settings.allowed_interactions)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        store = Store(settings.db_path)
        app.state.event_bus = EventBus(asyncio.get_running_loop())
        store.on_events = app.state.event_bus.notify
        interrupted = store.mark_unfinished_interrupted(interrupted_reason(), keep_queued=True)
        if interrupted:
            log.warning("marked %d running job(s) interrupted: %s", len(interrupted), ", ".join(interrupted))
        manager = JobManager(store, settings, runner_cls=runner_cls)
        manager.start()
        app.state.store = store
        app.state.credential_watch = CredentialWatch(store)  # ends streams and long polls of revoked keys
        app.state.manager = manager
        app.state.serving = ModelServing(store, manager, settings)
        app.state.env_check_slots = asyncio.Semaphore(settings.max_concurrent_env_checks)
        app.state.env_checks_by_user = set()  # users with a check running: one each
        app.state.audit = AuditLog(store, settings.audit_retention_days, settings.audit_max_entries)
        audit_hooks.install(app)  # key_use from the store, kept job checkpoints from the manager
        app.state.usage = UsageMeter(store, settings.usage_retention_days)
        app.state.tinker = TinkerService(store, settings.data_dir, settings.job_policy,
                                          tinker_settings(settings), audit=app.state.audit, usage=app.state.usage)
        await app.state.tinker.start()
        for job_id in interrupted:  # those with a checkpoint continue from it
            if await manager.resume(job_id, "resuming from its last checkpoint after a server restart"):
                log.info("job %s resumes from its last checkpoint", job_id)
        await manager.schedule()  # jobs queued before a restart
        try:
            yield
        finally:
            await app.state.tinker.shutdown()
            await app.state.serving.shutdown()
            await manager.shutdown()
            await app.state.credential_watch.close()
            store.close()

    app = FastAPI(
        title="OpenTinker server",
        version=opentinker.__version__,
        description="Reinforcement learning of LLMs as a service. Every route but /v1/health (and these "
        "docs: /docs, /openapi.json) needs `Authorization: Bearer <api key>`; errors are "
        "`{\"error\": ..., \"detail\": ...}` with the status saying what kind.",
        lifespan=lifespan,
    )
    app.openapi = lambda: app.openapi_schema or _document(app, settings)
    app.state.settings = settings
    app.state.registry = registry
    app.state.step_locks = {}
    app.state.relays = RelayBoard(settings.max_env_relays_per_user)  # connected client relays
    app.state.tokenizers = Tokenizers(settings.job_policy)
    limit = settings.auth_failures_per_minute
    app.state.auth_limiter = FailedAuthLimiter(limit) if limit else None
    install_error_handlers(app)
    for module in (health, models, jobs, steps, events, checkpoints, env, completions, relay, usage_router,
                   audit_router):
        app.include_router(module.router, prefix=API_PREFIX)
    app.include_router(tinker_routes.router)  # the Tinker API, under /api/v1
    app.include_router(dashboard.router)  # the web dashboard at / and its login, /v1/session
    app.add_middleware(BodyLimits, max_bytes=settings.max_body_bytes)  # and JSON nesting (400), for every route
    return app

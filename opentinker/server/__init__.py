"""The training server: a FastAPI control plane in front of Ray (``opentinker-server``).

``create_app(settings)`` in :mod:`opentinker.server.app` builds the app; the job store is
:mod:`.store` (SQLite), API keys are :mod:`.auth`, Ray actors are driven by
:mod:`.jobs`, and each resource has its router in :mod:`.routers`. Nothing here is
imported by the thin client.
"""

"""The web dashboard served at ``/``: a plain-JS page (``static/``, uPlot vendored, no build
step) over the same API a client uses, logged in with an API key (see :mod:`.routes`)."""

from opentinker.server.dashboard.routes import router

__all__ = ["router"]

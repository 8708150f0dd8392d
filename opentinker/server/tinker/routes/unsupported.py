"""Routes the SDK knows that this server does not offer: a 400 saying why (not a bare 404)."""

from __future__ import annotations

from fastapi import Depends, Request, Response

from opentinker.server.store import User
from opentinker.server.tinker.service import TinkerService
from opentinker.server.tinker.routes.common import (
    refuse_seq,
    service,
    tinker_router,
    tinker_user,
    user_error,
)

router = tinker_router()


# Known SDK routes this server does not offer, and why (a 400 the SDK shows, not a bare 404).
UNSUPPORTED = {
    ("POST", "create_custom_loss"): "server-side custom losses are not offered; forward_backward_custom runs them "
                                    "client-side",
    ("POST", "join_sampling_session"): "joining sampling sessions is off (sample_join_sampling_session=false)",
    ("POST", "cancel_future"): "cancelling futures is off (client/dynamic_config sample_cancel_enabled=false)",
}

def _unsupported(name: str, reason: str):
    async def refuse(request: Request, user: User = Depends(tinker_user),
                     svc: TinkerService = Depends(service)) -> Response:
        try:  # a training client's refused request still used its seq_id: release it
            body = await request.json()
            refuse_seq(svc, body.get("model_id"), body.get("seq_id"), user)
        except (ValueError, AttributeError, RecursionError):  # the middleware counts only JSON bodies' nesting
            pass
        raise user_error(f"{request.method} {request.url.path}: {reason}")

    refuse.undocumented = True  # not offered: left out of the OpenAPI document
    return refuse


for (_method, _name), _reason in UNSUPPORTED.items():
    router.add_api_route(f"/{_name}", _unsupported(_name, _reason), methods=[_method], name=f"unsupported {_name}")

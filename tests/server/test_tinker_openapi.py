"""The Tinker API's OpenAPI document (``/api/v1/openapi.json``) lists every operation the
server offers, with whichever FastAPI is installed: FastAPI 0.165 keeps included routers
(not routes) in ``APIRouter.routes``, and a document made from those had no paths at all,
which left the schemathesis fuzzer nothing to test."""

from __future__ import annotations

import fastapi
import httpx

import opentinker.server.tinker.routes as tinker_routes
from opentinker.server.tinker.routes import unsupported

# The document itself, the routes the SDK knows but this server does not offer, and the links
# handed out signed (downloads: no key) are left out.
_NOT_DOCUMENTED = {("GET", "/api/v1/openapi.json")} | {
    (method, f"/api/v1/{name}") for method, name in unsupported.UNSUPPORTED
} | {("GET", "/api/v1/downloads/external/{run_id}/{name}/{write}/{file}"), ("GET", "/api/v1/session_traces/{session_id}")}


def _offered_operations() -> set[tuple[str, str]]:
    """(method, path) of every route of every Tinker resource module, read from each module's
    router (``routes._PARTS``), not from the document's own list of them."""
    found = set()
    for part in tinker_routes._PARTS:
        for route in part.routes:
            found |= {(method, route.path.replace("{file:path}", "{file}")) for method in route.methods}
    return found - _NOT_DOCUMENTED


def test_the_document_lists_every_offered_operation(server):
    offered = _offered_operations()
    assert len(offered) >= 42, offered  # the operations of SDK 0.38.0 this server offers
    answer = httpx.get(f"{server.url}/api/v1/openapi.json", timeout=30, trust_env=False)
    assert answer.status_code == 200, answer.text
    documented = {(method.upper(), path) for path, operations in answer.json()["paths"].items()
                  for method in operations}
    assert documented == offered, (
        f"with fastapi {fastapi.__version__} the Tinker document lists {len(documented)} operations, the routes "
        f"{len(offered)}: missing {sorted(offered - documented)}, extra {sorted(documented - offered)}")


def test_every_documented_operation_is_routed(server):
    """Each operation in the document reaches a route (401 without a key, not 404 or 405)."""
    paths = httpx.get(f"{server.url}/api/v1/openapi.json", timeout=30, trust_env=False).json()["paths"]
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as raw:
        for path, operations in paths.items():
            url = path.replace("{checkpoint_id}", "weights/x").replace("{", "").replace("}", "")
            for method in operations:
                expected = 200 if path == "/api/v1/healthz" else 401
                assert raw.request(method.upper(), url).status_code == expected, (method, path)

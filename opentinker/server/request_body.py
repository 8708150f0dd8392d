"""Request bodies read and validated off the event loop (``POST /v1/jobs``: a dataset can weigh 64 MiB).

FastAPI reads, decodes and validates a body on the event loop before the route runs: for a
26 MiB dataset of small rows that is seconds in which no other request is answered.
:func:`read_model` streams the body into a spooled temporary file instead (the
``BodyLimits`` middleware counts its bytes and nesting as they arrive: 413 past the limit,
400 past 32 levels), then decodes (:func:`large_json.loads`) and validates it in a worker
thread, with the 422s FastAPI would give. Such a route declares its body for the OpenAPI document with
:func:`documented_body`; :func:`add_body_schemas` puts those models among the document's
component schemas (FastAPI no longer sees them).
"""

from __future__ import annotations

import asyncio
import email.message
import json
import tempfile
from typing import IO, Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import GenerateJsonSchema

from opentinker.server import large_json
from opentinker.server.errors import ApiError

M = TypeVar("M", bound=BaseModel)

SPOOL_BYTES = 1 << 20  # a body past 1 MiB waits on disk, not in memory, while the rest arrives
_COMPONENTS = "#/components/schemas/"
_documented: dict[str, type[BaseModel]] = {}


def _is_json(content_type: str | None) -> bool:
    # FastAPI's rule: application/json or application/*+json; anything else is not decoded.
    if not content_type:
        return False
    message = email.message.Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _decode(spool: IO[bytes], model: type[M], is_json: bool) -> M:
    """The body as ``model``; errors are the 422s FastAPI gives for a body it validates itself."""
    spool.seek(0)
    raw = spool.read()
    if not raw:
        raise RequestValidationError([{"type": "missing", "loc": ("body",), "msg": "Field required", "input": None}])
    body: Any = raw  # not JSON: validated as bytes, which fails as FastAPI's would
    if is_json:
        try:
            body = large_json.loads(raw)
        except json.JSONDecodeError as exc:
            raise RequestValidationError([{"type": "json_invalid", "loc": ("body", exc.pos), "msg": "JSON decode error",
                                           "input": {}, "ctx": {"error": exc.msg}}]) from None
        except (ValueError, RecursionError):  # not UTF-8, or nested too deeply for the decoder
            raise ApiError(422, "request body: not valid JSON, or nested too deeply to parse") from None
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(
            [{**error, "loc": ("body", *error["loc"])} for error in exc.errors(include_url=False)]
        ) from None


async def read_model(request: Request, model: type[M]) -> M:
    """The request's JSON body as ``model``, read and validated off the event loop (422 as
    for a body FastAPI validates; 413 past ``--max-body-mb``, from the middleware)."""
    is_json = _is_json(request.headers.get("content-type"))
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_BYTES) as spool:
        async for chunk in request.stream():
            spool.write(chunk)
        return await asyncio.to_thread(_decode, spool, model, is_json)


def documented_body(model: type[BaseModel]) -> dict[str, Any]:
    """``openapi_extra`` of a route that reads its body with :func:`read_model`."""
    _documented[model.__name__] = model
    schema = {"$ref": _COMPONENTS + model.__name__}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def add_body_schemas(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` with the schemas of the models named by :func:`documented_body` (and of
    the models they use) among its components, made as FastAPI makes those of the bodies it reads."""
    components = document.setdefault("components", {}).setdefault("schemas", {})
    generator = GenerateJsonSchema(ref_template=_COMPONENTS + "{model}")
    inputs = [(name, "validation", model.__pydantic_core_schema__) for name, model in _documented.items()]
    _, definitions = generator.generate_definitions(inputs=inputs)  # type: ignore[arg-type]
    for name, schema in definitions.items():
        if components.setdefault(name, schema) != schema:
            raise RuntimeError(f"two different schemas are named {name!r} in the OpenAPI document")
    return document

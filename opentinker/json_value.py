"""The free-form JSON parts of request bodies (a job's config, dataset rows, an
interaction's config), typed for the OpenAPI document with the rule the server enforces
(``protocol.wire_problem``): any JSON value whose numbers lie within I-JSON's exact
integer range, +-(2**53 - 1) (RFC 7493: what every JSON parser keeps exactly; fuzzers and
JavaScript compare numbers as doubles, so a bound of 2**63 would not mean what it says).
Their schema is ``#/components/schemas/JsonValue`` (recursive), added to the
document by :func:`add_json_value_schema`.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import WithJsonSchema

MAX_INT = 2**63 - 1  # what SQLite (and every int64 on the way) can hold
MAX_JSON_INT = 2**53 - 1  # the largest integer a JSON number keeps exactly everywhere (I-JSON)
_REF = {"$ref": "#/components/schemas/JsonValue"}
JSON_VALUE_SCHEMA: dict[str, Any] = {
    "description": "any JSON value; numbers (integers or not) within +-(2**53 - 1)",
    "anyOf": [
        {"type": "string"},
        {"type": "number", "minimum": -MAX_JSON_INT, "maximum": MAX_JSON_INT},
        {"type": "boolean"},
        {"type": "null"},
        {"type": "array", "items": _REF},
        {"type": "object", "additionalProperties": _REF},
    ],
}

#: A JSON object of free-form values (bounded as above).
JsonObject = Annotated[dict[str, Any], WithJsonSchema({"type": "object", "additionalProperties": _REF})]


def add_json_value_schema(document: dict[str, Any]) -> dict[str, Any]:
    """``document`` (an OpenAPI document) with ``JsonValue`` among its component schemas."""
    document.setdefault("components", {}).setdefault("schemas", {})["JsonValue"] = JSON_VALUE_SCHEMA
    return document

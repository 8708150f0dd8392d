"""What an OpenEnv server's ``GET /schema`` says about how to talk to it: which action field
gets the model's text, which observation field becomes the next user turn.

``/schema`` answers ``{"action": <JSON Schema>, "observation": <JSON Schema>, "state": ...}``
(pydantic's ``model_json_schema()`` of the env's Action and Observation classes). The
functions here are pure (no aiohttp, no torch): the trainer's
:class:`~opentinker.environments.openenv_interaction.OpenEnvInteraction`, the server's env
check and the thin client all apply them to the same schema and get the same answer.
Each raises ValueError with a message naming the schema's fields when the configuration
does not fit the env.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

__all__ = [
    "ACTION_FIELD_NAMES",
    "OBSERVATION_FIELD_NAMES",
    "action_field_for",
    "describe_fields",
    "field_text",
    "observation_field_for",
    "observation_fields",
    "observation_text",
    "IMAGE_FIELD_NAMES",
    "image_field_for",
    "observation_pictures",
]

#: Names an action's text field usually has, most likely first (used when action_field is not set
#: and the action has several string fields).
ACTION_FIELD_NAMES = ("text", "message", "content", "response", "answer", "action", "command", "code",
                      "query", "input", "guess", "move")
#: The same for the observation field that becomes the next user turn.
OBSERVATION_FIELD_NAMES = ("text", "message", "prompt", "observation", "content", "feedback", "output",
                           "result", "response", "question", "board", "state")
#: Observation fields that usually hold pictures (a data URL, base64 PNG/JPEG, or a list of them).
IMAGE_FIELD_NAMES = ("image", "images", "screenshot", "screenshots", "frame", "pixels", "picture")
_NEVER_TEXT = ("metadata",)  # the base classes' metadata dict: never the turn's text
_MAX_FIELDS_NAMED = 20
_MAX_NAME_CHARS = 64


def _model(schema: Any, key: str) -> Mapping[str, Any]:
    if not isinstance(schema, Mapping):
        raise ValueError(f"the env's /schema is not a JSON object (got {type(schema).__name__})")
    model = schema.get(key)
    if not isinstance(model, Mapping) or not isinstance(model.get("properties", {}), Mapping):
        raise ValueError(f"the env's /schema has no {key!r} JSON Schema with 'properties'; is it an OpenEnv server?")
    return model


def _properties(model: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    props = model.get("properties") or {}
    return {str(name): (prop if isinstance(prop, Mapping) else {}) for name, prop in props.items()}


def _types(prop: Mapping[str, Any], defs: Mapping[str, Any], depth: int = 0) -> set[str]:
    """The JSON types a property may take (``anyOf``/``oneOf``/``allOf`` and local ``$ref`` followed)."""
    if depth > 8:
        return set()
    found: set[str] = set()
    kind = prop.get("type")
    if isinstance(kind, str):
        found.add(kind)
    elif isinstance(kind, list):
        found.update(k for k in kind if isinstance(k, str))
    for values_key in ("enum",):
        values = prop.get(values_key)
        if isinstance(values, list):
            found.update("string" if isinstance(v, str) else "other" for v in values)
    if "const" in prop:
        found.add("string" if isinstance(prop["const"], str) else "other")
    for key in ("anyOf", "oneOf", "allOf"):
        branches = prop.get(key)
        if isinstance(branches, list):
            for branch in branches:
                if isinstance(branch, Mapping):
                    found |= _types(branch, defs, depth + 1)
    ref = prop.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        target = defs.get(ref[len("#/$defs/"):])
        found |= _types(target, defs, depth + 1) if isinstance(target, Mapping) else {"object"}
    return found


def _is_text(prop: Mapping[str, Any], defs: Mapping[str, Any]) -> bool:
    return "string" in _types(prop, defs)


def _name(name: str) -> str:
    return repr(name if len(name) <= _MAX_NAME_CHARS else name[:_MAX_NAME_CHARS] + "...")


def describe_fields(model: Mapping[str, Any], exclude: tuple[str, ...] = ()) -> str:
    """``'answer' (string, required), 'metadata' (object)``: a model's fields for an error message."""
    defs = model.get("$defs") if isinstance(model.get("$defs"), Mapping) else {}
    required = set(model.get("required") or ())
    parts = []
    for name, prop in _properties(model).items():
        if name in exclude:
            continue
        kinds = "|".join(sorted(_types(prop, defs) - {"other"})) or "any"
        parts.append(f"{_name(name)} ({kinds}{', required' if name in required else ''})")
    more = f" and {len(parts) - _MAX_FIELDS_NAMED} more" if len(parts) > _MAX_FIELDS_NAMED else ""
    return (", ".join(parts[:_MAX_FIELDS_NAMED]) + more) or "none"


def action_field_for(schema: Any, action_field: str | None = None, action_extra: Mapping[str, Any] | None = None) -> str:
    """The action field that gets the model's turn text.

    ``action_field`` must be a string field of the env's action; left out, it is the action's
    only string field (besides ``action_extra``'s), else the first of :data:`ACTION_FIELD_NAMES`
    it has. Every field the action requires must be ``action_field`` or in ``action_extra``,
    and ``action_extra`` may name only the action's fields (an OpenEnv action forbids others).
    """
    model = _model(schema, "action")
    defs = model.get("$defs") if isinstance(model.get("$defs"), Mapping) else {}
    props = _properties(model)
    extra = dict(action_extra or {})
    fields = describe_fields(model)
    closed = model.get("additionalProperties") is False
    unknown = [name for name in extra if name not in props]
    if unknown and closed:
        raise ValueError(f"action_extra names {', '.join(_name(n) for n in unknown)}, which the env's action does not "
                         f"have (its fields: {fields})")
    if action_field is not None:
        if action_field not in props:
            raise ValueError(f"action_field {_name(action_field)} is not a field of the env's action (its fields: "
                             f"{fields})")
        if not _is_text(props[action_field], defs):
            raise ValueError(f"action_field {_name(action_field)} is not a string field of the env's action, so it "
                             f"cannot take the model's text (its fields: {fields})")
        if action_field in extra:
            raise ValueError(f"action_field {_name(action_field)} is also in action_extra; name it in one of them")
        chosen = action_field
    else:
        texts = [name for name, prop in props.items()
                 if name not in extra and name not in _NEVER_TEXT and _is_text(prop, defs)]
        preferred = [name for name in ACTION_FIELD_NAMES if name in texts]
        if len(texts) == 1:
            chosen = texts[0]
        elif preferred:
            chosen = preferred[0]
        else:
            raise ValueError("set action_field: the env's action has "
                             + ("no string field for the model's text" if not texts else "several string fields")
                             + f" (its fields: {fields})")
    missing = [name for name in model.get("required") or () if name != chosen and name not in extra]
    if missing:
        raise ValueError(f"the env's action requires {', '.join(_name(str(n)) for n in missing)}, which neither "
                         f"action_field ({_name(chosen)}) nor action_extra gives (its fields: {fields})")
    return chosen


def observation_fields(schema: Any) -> dict[str, Mapping[str, Any]] | None:
    """The fields an observation sends (its schema's, less ``reward`` and ``done``, which come
    beside it), or None when the schema has no observation model to go by."""
    try:
        model = _model(schema, "observation")
    except ValueError:
        return None
    return {name: prop for name, prop in _properties(model).items() if name not in ("reward", "done")}


def observation_field_for(schema: Any, observation_field: str | None = None,
                          template_names: tuple[str, ...] | list[str] = ()) -> str | None:
    """The observation field whose text becomes the next user turn; None: the observation's JSON.

    ``observation_field`` must be one of the observation's fields (when the schema lists them);
    left out, it is the only string field, else the first of :data:`OBSERVATION_FIELD_NAMES`
    that is a string field, else None. ``template_names`` (fields an observation template
    names) must be fields of the observation too.
    """
    props = observation_fields(schema)
    if props is None:  # nothing to check against: the payload decides
        return observation_field
    model = _model(schema, "observation")
    defs = model.get("$defs") if isinstance(model.get("$defs"), Mapping) else {}
    fields = describe_fields(model, exclude=("reward", "done"))
    unknown = [name for name in template_names if name not in props]
    if unknown:
        raise ValueError(f"observation_template names {', '.join('{' + n + '}' for n in unknown)}, which the env's "
                         f"observation does not have (its fields: {fields})")
    if observation_field is not None:
        if observation_field not in props:
            raise ValueError(f"observation_field {_name(observation_field)} is not a field of the env's observation "
                             f"(its fields: {fields})")
        return observation_field
    texts = [name for name, prop in props.items() if name not in _NEVER_TEXT and _is_text(prop, defs)]
    if len(texts) == 1:
        return texts[0]
    preferred = [name for name in OBSERVATION_FIELD_NAMES if name in texts]
    return preferred[0] if preferred else None


def image_field_for(schema: Any, image_field: str | None = None) -> str | None:
    """The observation field whose pictures open the next user turn (a vision-language model's),
    or None. ``image_field`` must be one of the observation's fields (when the schema lists them);
    left out, the first of :data:`IMAGE_FIELD_NAMES` the observation has as a string or an array."""
    props = observation_fields(schema)
    if props is None:
        return image_field
    model = _model(schema, "observation")
    defs = model.get("$defs") if isinstance(model.get("$defs"), Mapping) else {}
    if image_field is not None:
        if image_field not in props:
            raise ValueError(f"image_field {_name(image_field)} is not a field of the env's observation (its fields: "
                             f"{describe_fields(model, exclude=('reward', 'done'))})")
        return image_field
    for name in IMAGE_FIELD_NAMES:
        if name in props and _types(props[name], defs) & {"string", "array"}:
            return name
    return None


def observation_pictures(observation: Mapping[str, Any], field: str | None) -> list[str]:
    """The pictures of ``field`` as data URLs: a data URL, a bare base64 picture (its format is
    read from its own bytes later), or a list of them; none for an empty or missing field.
    ValueError for anything else."""
    if field is None:
        return []
    value = observation.get(field)
    if value is None or value == "" or value == []:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, str) and v for v in values):
        raise ValueError(f"observation field {_name(field)} must hold pictures as data URLs or base64 strings")
    return [v if v.startswith("data:") else "data:image/png;base64," + v for v in values]


def field_text(value: Any) -> str:
    """A field's value as turn text: a string as it is, None as "", anything else as JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return json.dumps(value, ensure_ascii=False, default=str)


def observation_text(observation: Mapping[str, Any], field: str | None, pictures: str | None = None) -> str:
    """The text of ``observation`` (an observation's fields, as sent) for the next user turn:
    ``field``'s value, or the whole observation as JSON (an empty ``metadata`` and the
    ``pictures`` field left out) when ``field`` is None or the observation lacks it."""
    if field is not None and field in observation:
        return field_text(observation[field])
    shown = {k: v for k, v in observation.items() if not (k in _NEVER_TEXT and not v) and k != pictures}
    return json.dumps(shown, ensure_ascii=False, default=str)

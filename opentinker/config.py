"""The recipe's wire format: verl-style dotted keys, parsed and checked.

Every key, its default and its checks are declared once, on the recipe's schema
(``opentinker/recipe/components.py``); the tables here (``VALID_KEYS``, ``DEFAULTS``,
``TYPES``, ``CHOICES``, ``RANGES``, ``SWITCHES``) are read off it. An override such as
``actor_rollout_ref.actor.optim.lr=1e-5`` is checked against them: a typo is an error naming
the bad key and the closest valid one; a value of the wrong type, an unknown name (with the
closest valid one) or a number out of range (whose upper bound a server operator may lower or
raise with ``limits``) is an error naming the key. Values are plain data:
OmegaConf's ``${...}`` interpolation and resolvers are refused, so a config can never read
the environment or other keys of the machine that resolves it.
No torch here: the client validates configs before sending them.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from omegaconf import DictConfig, ListConfig, OmegaConf

from opentinker.recipe.components import JobMode
from opentinker.recipe.knobs import ConfigError, knobs_of
from opentinker.recipe.spec import RecipeSpec

__all__ = ["ConfigError", "build_recipe", "check_values", "make_config"]


def _flat_keys(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flat_keys(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


_KEYS = list(knobs_of(RecipeSpec))


#: Every valid key and its default (read off the recipe's schema, ``opentinker/recipe/components.py``).
VALID_KEYS: dict[str, Any] = {info.key: info.default for info in _KEYS}
_SECTIONS = {key.rsplit(".", 1)[0] for key in VALID_KEYS if "." in key}
#: The type each key's values take (a tuple field takes a list).
TYPES: dict[str, type] = {info.key: info.kind for info in _KEYS}
#: Keys whose value is one of a few names (for a list-valued key: each item). Registries of
#: the engine add the names registered there (``register_choice``), so a custom advantage
#: estimator or policy loss registered in-process is a valid value too.
CHOICES: dict[str, list[str]] = {info.key: list(info.knob.choices) for info in _KEYS if info.knob.choices}
#: Boolean keys whose cost the client does not pay (compile_decode: a compile of 8-34 s of CPU
#: in every rollout process). An operator turns one off with ``limits={key: 0}``
#: (``opentinker-server serve --limit KEY=0``); a job that asks for it then gets a ConfigError.
SWITCHES: tuple[str, ...] = tuple(info.key for info in _KEYS if info.knob.switch)
#: ``key: (low, high)``, both inclusive (None: no bound on that side). The upper bounds are
#: sanity limits a server operator may change (``limits=`` of :func:`make_config`); keys in
#: ``_ABOVE_LOW`` must be strictly greater than their low bound.
RANGES: dict[str, tuple[float | None, float | None]] = {
    info.key: (info.knob.low, info.knob.high) for info in _KEYS if (info.knob.low, info.knob.high) != (None, None)}
_ABOVE_LOW = {info.key for info in _KEYS if info.knob.above_low}
MAX_STRING_CHARS = 1024  # any string value
MAX_LIST_ITEMS = 16  # any list value


def register_choice(key: str, name: str) -> None:
    """Make ``name`` a valid value of ``key`` (called by the engine's registries)."""
    names = CHOICES[key]
    if name not in names:
        names.append(name)


def closest_key(key: str) -> str | None:
    """The valid key most similar to ``key`` (or None when nothing is close)."""
    candidates = list(VALID_KEYS)
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in candidates if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:  # the right name in the wrong section
        return same_leaf[0]
    match = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    if match:
        return match[0]
    leaf_matches = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in candidates], n=1)
    if leaf_matches:
        return next(k for k in candidates if k.endswith("." + leaf_matches[0]))
    return None


def _check_key(key: str) -> None:
    if key in VALID_KEYS:
        return
    if key in _SECTIONS:
        raise ConfigError(f"config key '{key}' is a section, not a value; set one of its keys, e.g. "
                          f"'{next(k for k in VALID_KEYS if k.startswith(key + '.'))}'")
    hint = closest_key(key)
    suffix = f"; did you mean '{hint}'?" if hint else ""
    raise ConfigError(f"unknown config key '{key}'{suffix}")


def _check_plain(key: str, value: Any) -> None:
    """No interpolation: ``${...}`` would let OmegaConf read environment variables (``oc.env``)
    or other keys when the config is resolved, on whatever machine resolves it."""
    if isinstance(value, str) and "${" in value:
        raise ConfigError(
            f"config key '{key}': '${{...}}' interpolation is not supported; give a plain value"
        )
    if isinstance(value, (list, tuple, ListConfig)):
        for item in value:
            _check_plain(key, item)


def _check_tree(tree: Mapping[str, Any]) -> None:
    for key, value in _flat_keys(tree).items():
        _check_key(key)
        _check_plain(key, value)


def _parse_override(item: str) -> tuple[str, Any]:
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, raw = item.split("=", 1)
    key = key.strip().lstrip("+")
    # YAML scalars: numbers, booleans, null and [lists] parse as in verl's Hydra overrides.
    try:
        value = OmegaConf.to_container(OmegaConf.create(f"v: {raw}"))["v"]
    except Exception:  # not valid YAML (e.g. "a: b"): keep the raw text
        value = raw
    return key, value


def _set_dotted(tree: dict[str, Any], key: str, value: Any) -> None:
    node = tree
    *sections, leaf = key.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[leaf] = value


#: The defaults as one nested tree (what every config starts from): the schema's own defaults.
DEFAULTS: dict[str, Any] = RecipeSpec().to_tree()


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["a.b=1", "c=x"]`` -> nested dict, every key checked against the schema."""
    tree: dict[str, Any] = {}
    for item in items:
        key, value = _parse_override(item)
        _check_key(key)
        _check_plain(key, value)
        _set_dotted(tree, key, value)
    return tree


def _type_ok(expected: Any, value: Any) -> bool:
    if expected is bool:
        return isinstance(value, bool)
    if expected is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if expected is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if expected is list:
        return isinstance(value, (list, ListConfig))
    return isinstance(value, expected)


def _check_type(key: str, default: Any, value: Any) -> None:
    expected = TYPES.get(key) or (type(default) if default is not None else None)
    if expected is ListConfig:
        expected = list
    if value is None:
        # null is a value only where it is the default (and so means something); elsewhere it
        # would reach the trainer as a number or name that is not there.
        if default is None:
            return
        raise ConfigError(f"config key '{key}' expects {expected.__name__}, got null (only keys whose default "
                          f"is null accept null; leave the key out for its default, {default!r})")
    if expected is None:
        return
    if not _type_ok(expected, value):
        raise ConfigError(f"config key '{key}' expects {expected.__name__}, got {value!r}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"config key '{key}' must be a finite number, got {value!r}")
    if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
        raise ConfigError(f"config key '{key}': at most {MAX_STRING_CHARS} characters, got {len(value)}")
    if isinstance(value, (list, ListConfig)) and len(value) > MAX_LIST_ITEMS:
        raise ConfigError(f"config key '{key}': at most {MAX_LIST_ITEMS} items, got {len(value)}")


def _check_choice(key: str, value: Any) -> None:
    names = CHOICES.get(key)
    if names is None or value is None:
        return
    for item in value if isinstance(value, (list, ListConfig)) else [value]:
        if item not in names:
            close = difflib.get_close_matches(str(item), names, n=1, cutoff=0.5)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            raise ConfigError(f"config key '{key}': unknown value {item!r}{hint} (valid: {', '.join(names)})")


def _bound_text(low: float | None, high: float | None, above_low: bool) -> str:
    parts = []
    if low is not None:
        parts.append(f"{'>' if above_low else '>='} {low:g}")
    if high is not None:
        parts.append(f"<= {high:g}")
    return " and ".join(parts)


def _check_range(key: str, value: Any, limits: Mapping[str, float]) -> None:
    if key in SWITCHES:
        if value is True and limits.get(key, 1) < 1:
            raise ConfigError(f"config key '{key}' is turned off on this server (a limit of this server); "
                              "leave it out or set it to false")
        return
    if key not in RANGES or value is None or isinstance(value, bool):
        return
    low, high = RANGES[key]
    high = limits.get(key, high)
    above_low = key in _ABOVE_LOW
    too_low = low is not None and (value <= low if above_low else value < low)
    too_high = high is not None and value > high
    if too_low or too_high:
        where = " (a limit of this server)" if too_high and key in limits else ""
        raise ConfigError(f"config key '{key}' must be {_bound_text(low, high, above_low)}{where}, got {value!r}")


def check_limits(limits: Mapping[str, float]) -> dict[str, float]:
    """Operator limits as ``{key: upper bound}``; raises ConfigError for a key without a range."""
    checked = {}
    for key, high in limits.items():
        if key in SWITCHES and float(high) not in (0.0, 1.0):
            raise ConfigError(f"config key '{key}' is a switch: its limit is 0 (off) or 1 (allowed), got {high!r}")
        if key not in RANGES and key not in SWITCHES:
            _check_key(key)
            raise ConfigError(f"config key '{key}' has no numeric range to limit; limitable: "
                              f"{', '.join([*RANGES, *SWITCHES])}")
        checked[key] = float(high)
    return checked


def _leaves(mapping: Mapping[str, Any], path: tuple[str, ...] = (), keys: tuple[str, ...] = ()
            ) -> Iterator[tuple[tuple[str, ...], tuple[str, ...], Any]]:
    """``(dotted path, keys as written from the top, value)`` of each value under ``mapping``
    (an empty mapping is one: an empty section)."""
    for key, value in mapping.items():
        here, written = (*path, *str(key).split(".")), (*keys, str(key))
        if isinstance(value, Mapping) and value:
            yield from _leaves(value, here, written)
        else:
            yield here, written, value


def _given_twice(path: tuple[str, ...], first: tuple[bool, tuple[str, ...]], then: tuple[bool, tuple[str, ...]]
                 ) -> ConfigError:
    """The error for a key placed twice; ``first``/``then``: (as a section, the keys written)."""
    key = ".".join(path)

    def spelled(keys: tuple[str, ...]) -> str:
        return "".join(f"[{k!r}]" for k in keys)

    if first[0] == then[0]:  # two values (two sections merge)
        return ConfigError(f"config key '{key}' is given twice, as {spelled(first[1])} and as {spelled(then[1])}; "
                           "give it once", key=key)
    as_value, as_section = (first, then) if then[0] else (then, first)
    return ConfigError(f"config key '{key}' is given both as a value ({spelled(as_value[1])}) and as a section "
                       f"({spelled(as_section[1])}); give it one way", key=key)


def expand_dotted(mapping: Mapping[str, Any]) -> dict[str, Any]:
    """``{"a.b": 1, "c": {"d": 2}}`` -> ``{"a": {"b": 1}, "c": {"d": 2}}`` (both forms may mix).

    Each key is given once: the same key spelled twice in ``mapping`` (dotted and nested, two
    dotted spellings, a value where a section is) is a ConfigError naming the key and both
    spellings, never a silent pick of one. Different keys of a section may be given either
    way (``{"a": {"b": 1}, "a.c": 2}``); separate overrides (``make_config``'s) still stack."""
    placed: dict[tuple[str, ...], tuple[bool, tuple[str, ...]]] = {}  # path -> (a section?, keys first written)
    tree: dict[str, Any] = {}
    for path, keys, value in _leaves(mapping):
        section = isinstance(value, Mapping)  # an empty one
        for depth in range(1, len(path) + 1):
            here, now = path[:depth], (section or depth < len(path), keys)
            before = placed.setdefault(here, now)
            if before is not now and not (before[0] and now[0]):  # only sections may meet
                raise _given_twice(here, before, now)
        node = tree
        for part in path[:-1]:
            node = node.setdefault(part, {})
        if section:
            node.setdefault(path[-1], {})
        else:
            node[path[-1]] = value
    return tree


def flatten(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Nested and/or dotted overrides as flat ``{dotted.key: value}`` (keys not checked)."""
    return _flat_keys(expand_dotted(overrides))


def _merged(overrides: tuple[Mapping[str, Any] | Iterable[str] | None, ...],
            limits: Mapping[str, float] | None) -> DictConfig:
    """Defaults, then each override in order, every key and value checked (not the rules that
    span keys)."""
    merged = OmegaConf.create(DEFAULTS)
    for override in overrides:
        if override is None:
            continue
        if isinstance(override, Mapping):
            tree = expand_dotted(override)
            _check_tree(tree)
        else:
            tree = parse_overrides(override)
        try:
            merged = OmegaConf.merge(merged, tree)
        except Exception as exc:  # OmegaConf refuses some value shapes (e.g. a dict for a list)
            raise ConfigError(f"config: {exc}") from exc
    check_values(merged, limits)
    return merged


def make_config(
    *overrides: Mapping[str, Any] | Iterable[str] | None, limits: Mapping[str, float] | None = None
) -> DictConfig:
    """Defaults, then each override in order: a mapping (nested and/or dotted keys) or a
    list of ``key=value`` strings. ``limits`` replaces upper bounds of ``RANGES``. Every key,
    then every rule across keys, is checked (ConfigError naming the key)."""
    merged = _merged(overrides, limits)
    RecipeSpec.from_config(merged)  # the rules across keys (opentinker/recipe/rules.py)
    return merged


def build_recipe(*overrides: Mapping[str, Any] | Iterable[str] | None, limits: Mapping[str, float] | None = None,
                 mode: JobMode = "server", gpus: bool | None = None) -> RecipeSpec:
    """The typed spec of ``overrides`` (as :func:`make_config` takes them): every key checked,
    then every rule across keys, for a job of ``mode`` on a machine with GPUs or not (``gpus``
    None: unknown, e.g. on a client). What a process parses once and passes on."""
    return RecipeSpec.from_config(_merged(overrides, limits), mode=mode, gpus=gpus)


def check_values(cfg: DictConfig, limits: Mapping[str, float] | None = None) -> None:
    """Types, choices and ranges of every key of ``cfg``."""
    limits = dict(limits or {})
    # resolve=False: never evaluate an interpolation, even one that slipped past the checks.
    flat = _flat_keys(OmegaConf.to_container(cfg, resolve=False))
    for key, value in flat.items():
        _check_key(key)
        _check_plain(key, value)
        _check_type(key, VALID_KEYS[key], value)
        _check_choice(key, value)
        _check_range(key, value, limits)


def to_dotted(cfg: DictConfig) -> dict[str, Any]:
    """The config as flat ``{dotted.key: value}`` (for logging and the wire)."""
    return _flat_keys(OmegaConf.to_container(cfg, resolve=False))

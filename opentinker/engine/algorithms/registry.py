"""Name -> function registries and the one error every unknown name raises.

An unknown name is a configuration mistake, so the error names the bad value, suggests
the closest valid name when there is one, and lists every valid name.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Generic, TypeVar, overload

from opentinker.config import register_choice

F = TypeVar("F", bound=Callable[..., object])


def unknown_name_error(kind: str, name: object, valid: Iterable[str]) -> ValueError:
    """A ``ValueError`` for ``name`` not being one of ``valid`` (to be raised by the caller)."""
    valid = list(valid)
    message = f"Unknown {kind} {name!r}."
    close = difflib.get_close_matches(str(name), valid, n=1) if isinstance(name, str) else []
    if close:
        message += f" Did you mean {close[0]!r}?"
    message += f" Valid names: {', '.join(valid)}."
    return ValueError(message)


class Registry(Generic[F]):
    """Maps names to functions of one kind (``kind`` is used in error messages)."""

    def __init__(self, kind: str, config_key: str | None = None) -> None:
        self.kind = kind
        self.config_key = config_key  # the config key whose valid values are these names
        self._functions: dict[str, F] = {}

    def register(self, name: str, *, override: bool = False) -> Callable[[F], F]:
        """Decorator registering a function under ``name``.

        Registering a *different* function under a taken name is an error unless
        ``override=True``; re-registering the same function is a no-op.
        """
        if not isinstance(name, str) or not name:
            raise ValueError(f"A {self.kind} name must be a non-empty string, got {name!r}.")

        def decorator(fn: F) -> F:
            existing = self._functions.get(name)
            if existing is not None and existing is not fn and not override:
                raise ValueError(
                    f"The {self.kind} name {name!r} is already registered to "
                    f"{getattr(existing, '__qualname__', existing)!s}; pass override=True to replace it."
                )
            self._functions[name] = fn
            if self.config_key is not None:
                register_choice(self.config_key, name)
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered under ``name``; ``ValueError`` (with a suggestion) if none."""
        try:
            return self._functions[name]
        except (KeyError, TypeError):
            raise unknown_name_error(self.kind, name, self._functions) from None

    def names(self) -> tuple[str, ...]:
        """Registered names, in registration order."""
        return tuple(self._functions)

    def __contains__(self, name: object) -> bool:
        return name in self._functions


class RegisteredNames(Sequence[str]):
    """A read-only, always current view of a registry's names (behaves like a tuple)."""

    def __init__(self, registry: Registry) -> None:
        self._registry = registry

    @overload
    def __getitem__(self, index: int) -> str: ...

    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        return self._registry.names()[index]

    def __len__(self) -> int:
        return len(self._registry.names())

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry.names())

    def __contains__(self, name: object) -> bool:
        return name in self._registry

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (RegisteredNames, tuple, list)):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return id(self)

    def __repr__(self) -> str:
        return repr(self._registry.names())

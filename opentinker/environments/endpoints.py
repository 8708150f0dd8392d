"""Environment-server endpoints: parsed, normalised, and checked against what the operator allows.

A client names environment servers (``env_endpoint``, ``env_shards``) and the training
server then sends requests there, so an endpoint is never a free-form URL:

- it is a base URL ``scheme://host[:port]``: http or https, a host, no user info, and no
  path, query or fragment; the protocol's fixed paths (``/reset``, ``/step``,
  ``/finalize``, ``/health``) are the only ones ever requested;
- its host and port must match a rule of the operator's :class:`EndpointPolicy`
  (``opentinker-server serve --allow-env-host HOST[:PORTS]``); with no rule nothing is
  allowed, and the control plane's own address never is.

Host names are matched as names (exact, or ``*.suffix`` for sub-domains), IP literals
against IP and CIDR rules, so a rule for a name trusts what that name resolves to. The one
lookup made: an endpoint on the control plane's own port is refused when its host is, or
resolves to (within a second; a name that does not resolve in time is refused too), a
loopback or unspecified address or an address of one of this machine's interfaces. Only a
name some rule allows is looked up (a client cannot make the server resolve names of its
choosing), answers are kept for a while, and at most ``MAX_LOOKUPS`` run at once: past
that a name counts as unresolved at once, so a client naming hosts whose DNS never
answers costs seconds, not a second per name.

No torch, no server imports: the thin client normalises endpoints with the same code.
"""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import httpx

__all__ = ["EndpointError", "EndpointPolicy", "EndpointRule", "normalise_endpoint"]

MAX_URL_CHARS = 2048
_DEFAULT_PORTS = {"http": 80, "https": 443}
_LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost"}


class EndpointError(ValueError):
    """An endpoint that is malformed or not allowed; the message names the field."""


def _split(url: object, field: str) -> tuple[str, str, int]:
    if not isinstance(url, str) or not url.strip():
        raise EndpointError(f"{field} must be a non-empty URL string, got {type(url).__name__}")
    text = url.strip()
    if len(text) > MAX_URL_CHARS:
        raise EndpointError(f"{field}: a URL of at most {MAX_URL_CHARS} characters, got {len(text)}")
    try:
        parsed = httpx.URL(text)
    except Exception as exc:  # httpx.InvalidURL and friends
        raise EndpointError(f"{field}: invalid URL {text!r} ({exc})") from exc
    scheme = parsed.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parsed.host:
        raise EndpointError(f"{field} must be an http:// or https:// URL with a host, got {text!r}")
    if parsed.userinfo:
        raise EndpointError(f"{field}: user info ('user:password@') is not allowed in an env endpoint")
    if parsed.path not in ("", "/") or parsed.query or parsed.fragment:
        raise EndpointError(
            f"{field} must be a base URL 'scheme://host[:port]' with no path, query or fragment "
            f"(the env protocol's paths are fixed), got {text!r}"
        )
    return scheme, parsed.host.lower().rstrip("."), parsed.port or _DEFAULT_PORTS[scheme]


def _as_ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address an IP literal names, legacy IPv4 forms (``127.1``, ``0x7f000001``,
    ``2130706433``, which the resolver accepts too) and IPv4-mapped IPv6 included."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        if not host or host.strip("0123456789abcdefx."):
            return None
        try:
            ip = ipaddress.IPv4Address(socket.inet_aton(host))
        except OSError:
            return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def _url(scheme: str, host: str, port: int) -> str:
    ip = _as_ip(host)  # an IP in its canonical form: the request goes where the URL says
    shown = host if ip is None else f"[{ip}]" if ip.version == 6 else str(ip)
    return f"{scheme}://{shown}:{port}"


def normalise_endpoint(url: object, field: str = "env_endpoint") -> str:
    """``url`` as ``scheme://host:port`` (lower case, explicit port), or :class:`EndpointError`."""
    return _url(*_split(url, field))


@dataclass(frozen=True)
class EndpointRule:
    """One allowlist entry: a host pattern and an inclusive port range (None: any port).

    Host patterns: ``*`` (any host), a name (``envs.internal``), ``*.suffix`` (any
    sub-domain of suffix), an IP (``10.0.0.7``, ``::1``) or a CIDR block (``10.0.0.0/8``).
    """

    host: str
    ports: tuple[int, int] | None = None

    @classmethod
    def parse(cls, text: str) -> EndpointRule:
        """``HOST``, ``HOST:PORT`` or ``HOST:LOW-HIGH``; IPv6 in brackets (``[::1]:8000``)."""
        spec = text.strip()
        if not spec:
            raise ValueError("an env host rule must not be empty")
        host, ports = spec, None
        if spec.startswith("["):
            end = spec.find("]")
            if end < 0:
                raise ValueError(f"env host rule {text!r}: unclosed '['")
            host, rest = spec[1:end], spec[end + 1 :]
            if rest:
                if not rest.startswith(":"):
                    raise ValueError(f"env host rule {text!r}: expected ':PORT' after ']'")
                ports = rest[1:]
        elif spec.count(":") == 1:
            host, ports = spec.split(":")
        host = host.lower().rstrip(".")
        if host != "*" and not host.startswith("*."):
            try:
                ipaddress.ip_network(host, strict=False)
            except ValueError:
                if not host or any(c in host for c in "/:@ ") or "*" in host:
                    raise ValueError(f"env host rule {text!r}: {host!r} is not a host name, IP or CIDR block") from None
        return cls(host, _parse_ports(ports, text) if ports is not None else None)

    def matches(self, host: str, port: int) -> bool:
        if self.ports is not None and not self.ports[0] <= port <= self.ports[1]:
            return False
        if self.host == "*":
            return True
        ip = _as_ip(host)
        if ip is not None:
            try:
                return ip in ipaddress.ip_network(self.host, strict=False)
            except ValueError:  # a name rule never matches an IP literal
                return False
        if self.host.startswith("*."):
            return host.endswith(self.host[1:])
        return host == self.host

    def __str__(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and "/" not in self.host else self.host
        if self.ports is None:
            return host
        low, high = self.ports
        return f"{host}:{low}" if low == high else f"{host}:{low}-{high}"


def _parse_ports(text: str, rule: str) -> tuple[int, int]:
    low, _, high = text.partition("-")
    try:
        bounds = (int(low), int(high or low))
    except ValueError:
        raise ValueError(f"env host rule {rule!r}: ports must be PORT or LOW-HIGH, got {text!r}") from None
    if not 1 <= bounds[0] <= bounds[1] <= 65535:
        raise ValueError(f"env host rule {rule!r}: ports must satisfy 1 <= LOW <= HIGH <= 65535")
    return bounds


RESOLVE_TIMEOUT_S = 1.0
RESOLVE_CACHE_S = 30.0  # how long an answer (or its absence) is kept
RESOLVE_CACHE_SIZE = 256
MAX_LOOKUPS = 4  # lookups running at once; getaddrinfo cannot be cancelled, so a hung one holds its thread

_lock = threading.Lock()
_running = 0
_answers: OrderedDict[str, tuple[float, frozenset[str] | None]] = OrderedDict()


def _resolve(host: str) -> frozenset[str] | None:
    """The addresses ``host`` resolves to, or None when it does not within RESOLVE_TIMEOUT_S
    (or every lookup slot is taken by one that has not come back)."""
    global _running
    now = time.monotonic()
    with _lock:
        cached = _answers.get(host)
        if cached is not None and now - cached[0] < RESOLVE_CACHE_S:
            return cached[1]
        if _running >= MAX_LOOKUPS:
            return None  # not kept: the name may well resolve once the slots are free
        _running += 1
    addresses: list[frozenset[str]] = []
    done = threading.Event()

    def lookup() -> None:
        global _running
        try:
            addresses.append(frozenset(info[4][0].split("%")[0] for info in socket.getaddrinfo(host, None)))
        except (OSError, UnicodeError):
            pass
        finally:
            with _lock:
                _running -= 1
            done.set()

    # getaddrinfo has no timeout of its own; a daemon thread, so one that hangs never holds up exit.
    threading.Thread(target=lookup, name="env-endpoint-lookup", daemon=True).start()
    found = addresses[0] if done.wait(RESOLVE_TIMEOUT_S) and addresses else None
    with _lock:
        _answers[host] = (now, found)
        _answers.move_to_end(host)
        while len(_answers) > RESOLVE_CACHE_SIZE:
            _answers.popitem(last=False)
    return found


def _own_addresses() -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The addresses of this machine's interfaces, and what its host name resolves to."""
    found: set[str] = set()
    try:
        import psutil

        for addresses in psutil.net_if_addrs().values():
            found.update(a.address.split("%")[0] for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6))
    except ImportError:  # the thin client; the server has psutil
        pass
    found.update(_resolve(socket.gethostname()) or ())
    return {ip for ip in map(_as_ip, found) if ip is not None}


def _own_without_lookup(host: str) -> bool:
    """Whether ``host`` is a loopback name, or an IP literal of this machine."""
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    ip = _as_ip(host)
    return ip is not None and (ip.is_loopback or ip.is_unspecified or ip in _own_addresses())


def _resolves_to_own(host: str) -> bool:
    """Whether the name ``host`` resolves to an address of this machine, or does not resolve
    (then it cannot be shown not to be this machine)."""
    addresses = {_as_ip(a) for a in (_resolve(host) or ())}
    if not addresses:
        return True
    own = _own_addresses()
    return any(a is None or a.is_loopback or a.is_unspecified or a in own for a in addresses)


#: What a user can do about a refused endpoint without the operator: have the client carry the calls.
RELAY_HINT = ("; an env on your own machine is reached through your client instead: set \"relay\": \"client\" "
              "in the interaction's config")


@dataclass(frozen=True)
class EndpointPolicy:
    """Which env servers jobs on this server may reach (the operator's choice).

    ``own_port``: the control plane's port; ``http(s)://HOST:own_port`` is refused whatever
    the rules say when HOST is or resolves to a loopback, unspecified or own-interface address
    (or does not resolve), so a job can never send requests to the API it came from.
    """

    rules: tuple[EndpointRule, ...] = ()
    own_port: int | None = None

    @classmethod
    def from_strings(cls, rules: Iterable[str], own_port: int | None = None) -> EndpointPolicy:
        return cls(tuple(EndpointRule.parse(r) for r in rules), own_port)

    def describe(self) -> str:
        return ", ".join(str(r) for r in self.rules) or "none"

    def check(self, url: object, field: str = "env_endpoint") -> str:
        """The normalised endpoint, or :class:`EndpointError` naming ``field``."""
        scheme, host, port = _split(url, field)
        normalised = _url(scheme, host, port)
        own_port = self.own_port is not None and port == self.own_port
        if own_port and _own_without_lookup(host):
            raise EndpointError(f"{field} {normalised} is this training server's own address")
        if not any(rule.matches(host, port) for rule in self.rules):
            if not self.rules:
                raise EndpointError(
                    f"{field} {normalised}: this server allows no environment servers; its operator "
                    "can allow hosts with 'opentinker-server serve --allow-env-host HOST[:PORTS]'" + RELAY_HINT
                )
            raise EndpointError(
                f"{field} {normalised} is not allowed on this server (allowed env hosts: {self.describe()})"
                + RELAY_HINT
            )
        # After the rules: only names the operator allowed are ever looked up.
        if own_port and _as_ip(host) is None and _resolves_to_own(host):
            raise EndpointError(f"{field} {normalised} is this training server's own address (the name resolves "
                                "to this machine, or did not resolve within a second)")
        return normalised

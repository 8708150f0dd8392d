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
loopback or unspecified address or an address of one of this machine's interfaces.

No torch, no server imports: the thin client normalises endpoints with the same code.
"""

from __future__ import annotations

import ipaddress
import socket
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
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


def _own_addresses() -> set[str]:
    """The addresses of this machine's interfaces, and what its host name resolves to."""
    found: set[str] = set()
    try:
        import psutil

        for addresses in psutil.net_if_addrs().values():
            found.update(a.address.split("%")[0] for a in addresses if a.family in (socket.AF_INET, socket.AF_INET6))
    except ImportError:  # the thin client; the server has psutil
        pass
    found.update(_resolve(socket.gethostname()) or ())
    return found


def _resolve(host: str) -> set[str] | None:
    """The addresses ``host`` resolves to, or None when it does not within RESOLVE_TIMEOUT_S."""
    with ThreadPoolExecutor(max_workers=1) as pool:  # getaddrinfo itself has no timeout
        future = pool.submit(socket.getaddrinfo, host, None)
        try:
            return {info[4][0].split("%")[0] for info in future.result(timeout=RESOLVE_TIMEOUT_S)}
        except (OSError, UnicodeError, FutureTimeout):
            return None
        finally:
            pool.shutdown(wait=False)


def _is_own(host: str) -> bool:
    """Whether ``host`` is, or resolves to, an address of this machine (see the module doc)."""
    if host in _LOOPBACK_NAMES or host.endswith(".localhost"):
        return True
    ip = _as_ip(host)
    addresses = {ip} if ip is not None else {_as_ip(a) for a in (_resolve(host) or ())}
    if ip is None and not addresses:
        return True  # does not resolve: it cannot be shown not to be this machine
    own = {_as_ip(a) for a in _own_addresses()}
    return any(a is None or a.is_loopback or a.is_unspecified or a in own for a in addresses)


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
        if self.own_port is not None and port == self.own_port and _is_own(host):
            raise EndpointError(f"{field} {normalised} is this training server's own address")
        if not any(rule.matches(host, port) for rule in self.rules):
            if not self.rules:
                raise EndpointError(
                    f"{field} {normalised}: this server allows no environment servers; its operator "
                    "can allow hosts with 'opentinker-server serve --allow-env-host HOST[:PORTS]'"
                )
            raise EndpointError(
                f"{field} {normalised} is not allowed on this server (allowed env hosts: {self.describe()})"
            )
        return normalised

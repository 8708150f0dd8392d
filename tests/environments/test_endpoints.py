"""The one DNS lookup an endpoint check makes (the server's own port on a host name): only for
names the operator allowed, and bounded when the resolver never answers.

A resolver that never answers cannot be set up per test (resolv.conf is the machine's), so
these tests stand in for ``socket.getaddrinfo``: recording real lookups, or hanging.
"""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest

from opentinker.environments import endpoints
from opentinker.environments.endpoints import EndpointError, EndpointPolicy

OWN_PORT = 8123


@pytest.fixture
def lookups(monkeypatch):
    """The host names looked up while the test runs (the real resolver answers)."""
    seen: list[str] = []
    real = socket.getaddrinfo

    def recording(host, *args, **kwargs):
        seen.append(host)
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", recording)
    return seen


def test_a_name_no_rule_allows_is_refused_without_a_lookup(lookups):
    policy = EndpointPolicy.from_strings(["envs.example"], own_port=OWN_PORT)
    name = f"{uuid.uuid4().hex}.attacker.example"
    with pytest.raises(EndpointError, match=f"env_endpoint http://{name}:{OWN_PORT} is not allowed on this server"):
        policy.check(f"http://{name}:{OWN_PORT}")
    with pytest.raises(EndpointError, match="own address"):  # literals need no lookup, allowed or not
        policy.check(f"http://127.0.0.1:{OWN_PORT}")
    assert name not in lookups


def test_an_allowed_name_that_resolves_to_this_machine_is_refused_on_the_own_port_only():
    name = socket.gethostname()  # resolves to an address of this machine
    policy = EndpointPolicy.from_strings([name], own_port=OWN_PORT)
    assert policy.check(f"http://{name}:{OWN_PORT + 1}") == f"http://{name.lower()}:{OWN_PORT + 1}"
    with pytest.raises(EndpointError, match=f"env_endpoint http://{name.lower()}:{OWN_PORT} is this training server's own"):
        policy.check(f"http://{name}:{OWN_PORT}", "env_endpoint")


def test_a_resolver_that_never_answers_costs_seconds_not_a_second_per_name(monkeypatch):
    """Names under an allowed ``*.suffix`` whose DNS hangs: the first MAX_LOOKUPS wait out
    RESOLVE_TIMEOUT_S each, the rest find every lookup slot taken and are refused at once.
    All are refused (a name that does not resolve cannot be shown not to be this machine)."""
    never = threading.Event()
    real = socket.getaddrinfo

    def hanging(host, *args, **kwargs):
        if host.endswith(".slow.example"):
            never.wait(60)
            raise socket.gaierror("released by the test")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", hanging)
    policy = EndpointPolicy.from_strings(["*.slow.example"], own_port=OWN_PORT)
    run = uuid.uuid4().hex
    try:
        started = time.monotonic()
        for i in range(20):
            with pytest.raises(EndpointError, match="did not resolve within a second"):
                policy.check(f"http://n{i}-{run}.slow.example:{OWN_PORT}")
        elapsed = time.monotonic() - started
    finally:
        never.set()  # let the hung lookups end, freeing their slots for the other tests
    # 20 s if every name waited its second; MAX_LOOKUPS (4) s here, with room for a loaded machine.
    assert elapsed < endpoints.MAX_LOOKUPS * endpoints.RESOLVE_TIMEOUT_S + 4
    deadline = time.monotonic() + 10
    while endpoints._running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert endpoints._running == 0

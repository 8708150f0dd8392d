"""Issue 32's refusals, each with the audit's request against a real server on 127.0.0.1:
``null`` where a config key needs a number is a 400 naming the key at ``POST /v1/jobs``
(it was a 500, or a job that failed at run time); JSON nested too deeply is a 400 on every
route (it was a 500 RecursionError on the Tinker routes this server does not offer); a
spoofed ``X-Forwarded-For`` does not reset the failed-key limiter (uvicorn trusted it from
127.0.0.1)."""

from __future__ import annotations

import logging

import httpx
import pytest

AUDIT_NUMERIC_KEYS = ["trainer.total_training_steps", "data.train_batch_size", "actor_rollout_ref.rollout.n",
                      "async_training.max_staleness"]


def _job_count(client: httpx.Client) -> int:
    return len(client.get("/v1/jobs").json()["jobs"])


def _nested(key: str, value) -> dict:
    """``{"a.b.c": v}`` as ``{"a": {"b": {"c": v}}}`` (a config may be sent either way)."""
    *sections, leaf = key.split(".")
    tree = {leaf: value}
    for section in reversed(sections):
        tree = {section: tree}
    return tree


@pytest.mark.parametrize("key", AUDIT_NUMERIC_KEYS)
def test_null_for_a_numeric_config_key_is_a_400_naming_it(alice, key):
    before = _job_count(alice)
    for config in ({key: None}, _nested(key, None)):
        answer = alice.post("/v1/jobs", json={"name": "nulls", "config": config})
        assert answer.status_code == 400, answer.text
        assert f"config key '{key}' expects int, got null" in answer.json()["error"]
    assert _job_count(alice) == before  # nothing was stored, so nothing fails at run time


@pytest.mark.parametrize("value", ["1", 1.5, True, [1], {"n": 1}])
def test_other_wrong_types_for_max_staleness_are_a_400_naming_it(alice, value):
    answer = alice.post("/v1/jobs", json={"config": {"async_training.max_staleness": value}})
    assert answer.status_code == 400, answer.text
    assert "async_training.max_staleness" in answer.json()["error"]


def test_keys_whose_default_is_null_still_accept_null(alice, helpers):
    config = {"trainer.total_training_steps": 1, "actor_rollout_ref.rollout.max_model_len": None,
              "actor_rollout_ref.actor.clip_ratio_low": None, "algorithm.rollout_correction.rollout_is": None}
    answer = alice.post("/v1/jobs", json={"name": "null defaults", "config": config})
    assert answer.status_code == 201, answer.text
    helpers.wait_status(alice, answer.json()["job_id"], "completed")


# Deep JSON -----------------------------------------------------------------------------

DEEP = "[" * 5000 + "]" * 5000  # json.loads raises RecursionError on it
JSON = {"Content-Type": "application/json"}


def _tinker(server, key: str) -> httpx.Client:
    return httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": f"tml-{key}"}, timeout=30,
                        trust_env=False)


def _too_deep(answer: httpx.Response) -> None:
    assert answer.status_code == 400, answer.text
    assert answer.json() == {"error": "request body: arrays and objects nested deeper than 32 levels; this server "
                                      "accepts at most 32", "detail": {"max_depth": 32}}


def test_deep_json_to_an_unsupported_tinker_route_is_a_400(server, keys, caplog):
    not_offered = "cancelling futures is off"
    with _tinker(server, keys["alice"]) as raw, caplog.at_level(logging.ERROR, logger="opentinker"):
        # The audit's request (a 500 RecursionError before).
        _too_deep(raw.post("/cancel_future", content=f'{{"model_id": {DEEP}}}', headers=JSON))
        _too_deep(raw.put("/sessions/s/project", content=DEEP, headers=JSON))
        _too_deep(raw.post("/cancel_future", content=DEEP))  # no Content-Type: still JSON to the route
        # Streamed (no Content-Length): counted as it arrives.
        _too_deep(raw.post("/cancel_future", content=iter([b'{"model_id": ', DEEP.encode()[:7000], DEEP.encode()[7000:],
                                                          b"}"]), headers=JSON))
        # Protobuf bodies are not counted (forward_backward's are binary); the route decodes
        # this one as JSON all the same, and answers its own 400.
        answer = raw.post("/cancel_future", content=DEEP, headers={"Content-Type": "application/x-protobuf"})
        assert answer.status_code == 400 and not_offered in answer.json()["error"], answer.text
        # 32 levels are accepted, 33 are not; brackets inside a string do not count.
        answer = raw.post("/cancel_future", content='{"model_id": ' + "[" * 31 + "]" * 31 + "}", headers=JSON)
        assert answer.status_code == 400 and not_offered in answer.json()["error"], answer.text
        _too_deep(raw.post("/cancel_future", content='{"model_id": ' + "[" * 32 + "]" * 32 + "}", headers=JSON))
        answer = raw.post("/cancel_future", json={"model_id": "[{" * 5000 + '\\"'})
        assert answer.status_code == 400 and not_offered in answer.json()["error"], answer.text
    assert not caplog.records  # a client's mistake, not the server's: nothing logged as an error


def test_deep_json_is_a_400_on_the_servers_own_routes_and_the_tinker_json_routes(server, keys, alice):
    before = _job_count(alice)
    _too_deep(alice.post("/v1/jobs", content=f'{{"name": "deep", "config": {{"x": {DEEP}}}}}', headers=JSON))
    _too_deep(alice.post("/v1/env/check", content=f'{{"interactions": {DEEP}}}', headers=JSON))
    _too_deep(alice.post("/v1/chat/completions", content=f'{{"model": "m", "messages": {DEEP}}}', headers=JSON))
    assert _job_count(alice) == before
    with _tinker(server, keys["alice"]) as raw:
        _too_deep(raw.post("/create_session", content=f'{{"tags": {DEEP}, "sdk_version": "raw"}}', headers=JSON))
        _too_deep(raw.post("/optim_step", content=f'{{"model_id": "m", "seq_id": 1, "adam_params": {DEEP}}}',
                           headers=JSON))
    with httpx.Client(base_url=server.url, timeout=30, trust_env=False) as anonymous:  # the dashboard's login
        _too_deep(anonymous.post("/v1/session", content=f'{{"api_key": {DEEP}}}',
                                 headers={**JSON, "X-OpenTinker-Dashboard": "1"}))


# Proxy headers -------------------------------------------------------------------------

WRONG = "ot-" + "w" * 43


def _wrong_keys(url: str, count: int, forwarded_for) -> list[int]:
    """Statuses of ``count`` wrong keys sent from 127.0.0.1 (uvicorn's default trusted proxy),
    the i-th with ``X-Forwarded-For: forwarded_for(i)``, on both APIs in turn."""
    transport = httpx.HTTPTransport(local_address="127.0.0.1")
    with httpx.Client(base_url=url, transport=transport, timeout=30, trust_env=False) as client:
        return [client.get("/v1/jobs" if i % 2 else "/api/v1/sessions",
                           headers={"Authorization": f"Bearer {WRONG}", "X-API-Key": f"tml-{WRONG}",
                                    "X-Forwarded-For": forwarded_for(i)}).status_code
                for i in range(count)]


def test_a_spoofed_forwarded_for_does_not_reset_the_failed_key_limit(start_server, tmp_path):
    limit = 20  # ServerSettings' default; otherwise the default settings (no --trusted-proxy)
    live = start_server(tmp_path, auth_failures_per_minute=limit)
    statuses = _wrong_keys(live.url, limit + 5, lambda i: f"203.0.113.{i}")  # a new address each time
    assert statuses == [401] * limit + [429] * 5
    assert len(live.app.state.auth_limiter) == 1  # one address counted: 127.0.0.1, where they came from


def test_a_trusted_proxy_names_the_client(start_server, tmp_path):
    live = start_server(tmp_path, auth_failures_per_minute=20, trusted_proxies=["127.0.0.0/8"])
    # Each client the proxy names is counted on its own...
    assert _wrong_keys(live.url, 25, lambda i: f"203.0.113.{i}") == [401] * 25
    # ...and one client past the limit is refused whatever proxy it comes through.
    assert _wrong_keys(live.url, 25, lambda i: "198.51.100.7") == [401] * 20 + [429] * 5


def test_trusted_proxy_is_a_serve_flag_checked_at_startup(tmp_path, capsys):
    from opentinker.server.cli import build_parser, main

    args = build_parser().parse_args(["serve", "--trusted-proxy", "10.0.0.5", "--trusted-proxy", "10.1.0.0/16"])
    assert args.trusted_proxy == ["10.0.0.5", "10.1.0.0/16"]
    assert build_parser().parse_args(["serve"]).trusted_proxy == []
    assert main(["serve", "--data-dir", str(tmp_path), "--trusted-proxy", "proxy.local"]) == 2
    error = capsys.readouterr().err
    assert "--trusted-proxy" in error and "'proxy.local' is not an IP address or network" in error

"""POST /v1/env/check with an OpenEnv interaction: its config is checked against the env's /schema."""

from __future__ import annotations

from ..environments.openenv_server import running_openenv_server


def test_env_check_refuses_an_action_field_the_env_does_not_have(alice, tmp_path):
    with running_openenv_server(tmp_path) as live:
        def check(**config):
            spec = {"name": "arith", "class_path": "openenv", "config": {"env_endpoint": live.url, **config}}
            answer = alice.post("/v1/env/check", json={"interactions": [spec]})
            assert answer.status_code == 200, answer.text
            return answer.json()

        assert check() == {**check(), "ok": True, "problems": []}  # the field is picked from the schema
        assert check(action_field="answer")["ok"] is True
        wrong = check(action_field="reply")
        live.kill()
        down = check(action_field="reply")
    (problem,) = wrong["problems"]
    assert problem.startswith("interactions[0] ('arith'): ") and f"{live.url}/schema" in problem
    assert "action_field 'reply' is not a field of the env's action" in problem and "'answer' (string, required)" in problem
    (problem,) = down["problems"]  # a server that is down is reported once, by its /health
    assert f"{live.url}/health" in problem and "unreachable" in problem

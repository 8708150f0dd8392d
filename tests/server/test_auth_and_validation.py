"""API keys on every route, isolation between users, and the error shape of bad requests."""

from __future__ import annotations

import pytest

from opentinker.environments.server import running_app_servers

JOB = "0123456789abcdef0123456789abcdef"
ROUTES = [
    ("GET", "/v1/version", None),
    ("GET", "/v1/models", None),
    ("GET", "/v1/models/opentinker-tiny-arith/tokenizer", None),
    ("GET", "/v1/jobs", None),
    ("POST", "/v1/jobs", {"config": {}}),
    ("GET", f"/v1/jobs/{JOB}", None),
    ("POST", f"/v1/jobs/{JOB}/cancel", None),
    ("POST", f"/v1/jobs/{JOB}/resume", None),
    ("POST", f"/v1/jobs/{JOB}/steps", {"step": 1, "rows": [{"prompt": [{"role": "user", "content": "hi"}]}]}),  # noqa: E501
    ("GET", f"/v1/jobs/{JOB}/events", None),
    ("GET", f"/v1/jobs/{JOB}/checkpoints", None),
    ("POST", f"/v1/jobs/{JOB}/checkpoints", None),
    ("GET", f"/v1/jobs/{JOB}/checkpoints/global_step_1/download", None),
    ("POST", "/v1/env/check", {"interactions": []}),
    ("POST", "/v1/chat/completions", {"model": JOB, "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/completions", {"model": JOB, "prompt": "hi"}),
    ("GET", "/v1/usage", None),
    ("GET", "/v1/audit", None),
]


def test_route_table_is_complete(server):
    documented = {
        (method.upper(), path)
        for path, operations in server.app.openapi()["paths"].items()
        for method in operations
    }
    tested = {(method, path.replace(JOB, "{job_id}").replace("global_step_1", "{name}")
               .replace("opentinker-tiny-arith", "{name}")) for method, path, _ in ROUTES}
    assert documented - tested == {("GET", "/v1/health")}


@pytest.mark.parametrize("credential", ["none", "wrong", "revoked", "basic"])
@pytest.mark.parametrize("method, path, body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_every_route_but_health_needs_a_valid_key(server, keys, credential, method, path, body):
    headers = {
        "none": {},
        "wrong": {"Authorization": "Bearer ot-" + "x" * 43},
        "revoked": {"Authorization": f"Bearer {keys['revoked']}"},
        "basic": {"Authorization": "Basic YWxpY2U6c2VjcmV0"},
    }[credential]
    with server.client() as client:
        response = client.request(method, path, json=body, headers=headers)
    assert response.status_code == 401, response.text
    assert response.headers["WWW-Authenticate"] == "Bearer"
    assert set(response.json()) == {"error", "detail"} and response.json()["error"]


def test_health_needs_no_key_and_version_names_the_user(server, alice):
    with server.client() as anonymous:
        health = anonymous.get("/v1/health")
    assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["protocol"] == 1
    assert alice.get("/v1/version").json()["user"] == "alice"
    assert alice.get("/v1/nowhere").json()["error"] == "Not Found"


def test_users_cannot_touch_each_others_jobs(alice, bob, helpers):
    job_id = helpers.create_job(alice, "hold isolation", mode="client", steps=5)
    row = {"prompt": [{"role": "user", "content": "hi"}], "reward_model": {"ground_truth": "1"}}
    attempts = [
        bob.get(f"/v1/jobs/{job_id}"),
        bob.post(f"/v1/jobs/{job_id}/cancel"),
        bob.post(f"/v1/jobs/{job_id}/resume"),
        bob.post(f"/v1/jobs/{job_id}/steps", json={"step": 1, "rows": [row]}),
        bob.get(f"/v1/jobs/{job_id}/events"),
        bob.get(f"/v1/jobs/{job_id}/events", params={"stream": "false"}),
        bob.get(f"/v1/jobs/{job_id}/checkpoints"),
        bob.post(f"/v1/jobs/{job_id}/checkpoints"),
        bob.get(f"/v1/jobs/{job_id}/checkpoints/global_step_1/download"),
    ]
    for response in attempts:
        assert response.status_code == 404, (response.request.url, response.text)
        assert response.json()["error"] == f"job {job_id!r} not found"  # same as a missing job
    assert bob.get(f"/v1/jobs/{'f' * 32}").json()["error"] == f"job {'f' * 32!r} not found"
    assert job_id not in [j["job_id"] for j in bob.get("/v1/jobs").json()["jobs"]]
    assert job_id in [j["job_id"] for j in alice.get("/v1/jobs").json()["jobs"]]
    helpers.wait_status(alice, job_id, "running")  # bob's attempts did not touch it
    assert alice.post(f"/v1/jobs/{job_id}/cancel").json()["status"] == "cancelled"


@pytest.mark.parametrize(
    "body, status, needle",
    [
        ({"config": {"trainer.total_training_stepz": 3}}, 400, "trainer.total_training_stepz"),
        ({"config": {"actor_rollout_ref": {"rollout": {"n": 1}}}}, 400, "actor_rollout_ref.rollout.n"),
        ({"config": {"data.train_batch_size": "many"}}, 400, "data.train_batch_size"),
        ({"config": {"trainer.default_local_dir": "/etc"}}, 400, "trainer.default_local_dir"),
        ({"config": {"data.task": "chess"}}, 400, "data.task"),
        ({"config": {"data.task": None}}, 400, "data.task"),
        ({"mode": "bogus"}, 422, "body.mode"),
        ({"config": [1, 2]}, 422, "body.config"),
        ({"surprise": 1}, 422, "body.surprise"),
        ({"interactions": [{"name": "g"}]}, 422, "body.interactions[0].class_path"),
        ({"mode": "client", "dataset": [{"prompt": [{"role": "user", "content": "x"}]}]}, 400, "dataset"),
        ({"dataset": [{"prompt": [{"role": "user", "content": "x"}]}, {"question": "?"}]}, 400, "dataset[1]"),
        ({"dataset": [{"prompt": "just text"}]}, 400, "dataset[0]"),
        ({"dataset": []}, 422, "dataset"),
        ({"val_dataset": [{"prompt": [{"role": "user"}]}]}, 400, "val_dataset[0]"),
        ({"interactions": [{"name": "m", "class_path": "simple_text", "config": {"scorr": "math"}}]}, 400,
         "interactions[0] ('m'): config: unknown key(s) ['scorr'] for simple_text (it takes: correct_message"),
        ({"interactions": [{"name": " m", "class_path": "simple_text"}]}, 422, "body.interactions[0].name"),
        (
            {"interactions": [{"name": "g", "class_path": "gym"}, {"name": "g", "class_path": "gsm8k"}]},
            400,
            "duplicate",
        ),
    ],
)
def test_invalid_jobs_are_refused_with_the_field_named(alice, body, status, needle):
    before = len(alice.get("/v1/jobs").json()["jobs"])
    response = alice.post("/v1/jobs", json=body)
    assert response.status_code == status, response.text
    assert needle in response.json()["error"]
    assert len(alice.get("/v1/jobs").json()["jobs"]) == before  # nothing was stored


def test_unknown_interaction_class_is_refused_listing_the_allowed_ones(alice):
    response = alice.post("/v1/jobs", json={"interactions": [{"name": "x", "class_name": "os.system"}]})
    assert response.status_code == 400
    body = response.json()
    assert "'os.system' is not allowed" in body["error"]
    assert "gsm8k" in body["error"] and "gym" in body["error"]
    assert "opentinker.environments.gym_interaction.GymEnvironmentInteraction" in body["detail"]["allowed_class_paths"]


def test_step_validation_names_the_field(alice, helpers):
    job_id = helpers.create_job(alice, "quick", steps=1)
    response = alice.post(f"/v1/jobs/{job_id}/steps", json={"step": 0, "rows": []})
    assert response.status_code == 422
    assert "body.step" in response.json()["error"] and "body.rows" in response.json()["error"]
    fields = [d["field"] for d in response.json()["detail"]]
    assert fields == ["body.step", "body.rows"]


def test_env_check_resolves_specs_and_reaches_endpoints_from_the_server(alice):
    from fastapi import FastAPI

    env_app = FastAPI()

    @env_app.get("/health")
    def health():
        return {"status": "ok"}

    with running_app_servers([env_app]) as (url,):
        good = alice.post(
            "/v1/env/check", json={"interactions": [{"name": "game", "class_path": "gym", "config": {"env_endpoint": url}}]}
        )
        assert good.status_code == 200, good.text
        assert good.json()["ok"] is True and good.json()["problems"] == []
        assert "gym" in good.json()["allowed_class_paths"]

        # A second shard on the next port is not running; an unknown class; a bad URL.
        shards = alice.post(
            "/v1/env/check",
            json={
                "interactions": [
                    {"name": "game", "class_path": "gym", "config": {"env_endpoint": url, "env_shards": 2}},
                    {"name": "evil", "class_path": "subprocess.Popen"},
                    {"name": "odd", "class_path": "gym", "config": {"env_endpoint": "ftp://nowhere"}},
                ]
            },
        ).json()
    assert shards["ok"] is False
    host, port = url.rsplit(":", 1)
    problems = shards["problems"]
    assert len(problems) == 3, problems
    assert any(f"{host}:{int(port) + 1}/health" in p and "interactions[0]" in p for p in problems)
    assert any("interactions[1]" in p and "subprocess.Popen" in p for p in problems)
    assert any("interactions[2]" in p for p in problems)


def test_openapi_documents_every_error_and_the_public_docs(server):
    """Item 18: the document matches the server; only health and the docs need no key."""
    document = server.app.openapi()
    assert "/docs" in document["info"]["description"] and "/openapi.json" in document["info"]["description"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            errors = {code for code in responses if code.startswith(("4", "5"))}
            if path == "/v1/health":
                assert errors == set()
                continue
            assert {"401", "413", "422", "500"} <= errors, (method, path, errors)
            for code in errors:
                schema = responses[code]["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorBody"}, (method, path, code)
    assert "404" in document["paths"]["/v1/jobs/{job_id}"]["get"]["responses"]
    assert {"400", "409", "429"} <= set(document["paths"]["/v1/jobs"]["post"]["responses"])
    assert {"409", "429", "503"} <= set(document["paths"]["/v1/jobs/{job_id}/steps"]["post"]["responses"])
    assert "HTTPValidationError" not in document["components"]["schemas"]  # our 422 shape only
    with server.client() as anonymous:
        assert anonymous.get("/docs").status_code == 200 and anonymous.get("/openapi.json").status_code == 200
        wrong_method = anonymous.delete("/v1/jobs")
    assert wrong_method.status_code == 405 and wrong_method.headers["Allow"] == "GET, POST"

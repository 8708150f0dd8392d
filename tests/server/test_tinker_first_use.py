"""What a new Tinker user hit, trying the server from the README with the official SDK
(issue 32, part 9), each against a real server on 127.0.0.1:

- a failed Tinker request left no error id or trace in the server's log: a request that fails
  for the server's reasons (category "server") and an unexpected exception in a Tinker route
  now give the client an error id, under which the log has the trace;
- the admin commands without ``--data-dir`` wrote to another data folder than the running
  server's, and the key was then "invalid or revoked" with no hint: both now default to
  ``$OPENTINKER_DATA_DIR``, ``create-key`` says where it wrote the key, and the 401 says why a
  key that never worked may fail.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

tinker = pytest.importorskip("tinker")

from opentinker.server.settings import default_data_dir  # noqa: E402

os.environ.setdefault("TINKER_TELEMETRY", "0")
ERROR_ID = re.compile(r"\(error id ([0-9a-f]{12})\)")


def _records_with(caplog, error_id: str) -> list:
    return [r for r in caplog.records if error_id in r.getMessage()]


@pytest.mark.timeout(300)
def test_a_request_failing_on_the_servers_side_names_an_error_id_whose_trace_is_in_the_log(
        start_server, tmp_path, tiny_model_dir, helpers, caplog):
    # A served model whose folder the operator got wrong (its config is there, its weights are
    # not): the request is accepted, then the model's worker fails to start, which is the
    # server's failure, not the user's.
    broken = tmp_path / "models" / "broken"
    broken.mkdir(parents=True)
    shutil.copy(tiny_model_dir / "config.json", broken / "config.json")
    live = start_server(tmp_path / "data", models=[f"broken={broken}"])
    key = helpers.make_user(tmp_path / "data", "newcomer")
    service = tinker.ServiceClient(base_url=live.url, api_key="tml-" + key)
    try:
        with caplog.at_level("WARNING", logger="opentinker.server.tinker"):
            # The README's first lines, with the broken model.
            with pytest.raises(Exception) as failed:
                service.create_lora_training_client(base_model="broken", rank=8).result()
    finally:  # ends its session's heartbeats, which would go on warning after the server stops
        service.close("success").result()
    message = str(failed.value)
    found = ERROR_ID.search(message)
    assert found, message
    (record,) = _records_with(caplog, found.group(1))
    assert record.levelname == "ERROR" and "tinker CreateModel request" in record.getMessage()
    assert record.exc_info is not None  # the trace, for the operator
    assert "Traceback (most recent call last)" in caplog.text
    assert "Traceback" not in message  # never sent to the client


def test_an_unexpected_exception_in_a_tinker_route_answers_an_error_id_logged_with_its_trace(server, keys,
                                                                                            caplog):
    # No Tinker route is known to raise; this one, added to the running app, stands for a bug.
    def broken_route() -> None:
        raise ZeroDivisionError("a bug in a Tinker route")

    server.app.add_api_route("/api/v1/test_broken_route", broken_route, methods=["POST"])
    with caplog.at_level("ERROR", logger="opentinker.server"):
        answer = httpx.post(server.url + "/api/v1/test_broken_route", headers={"X-API-Key": "tml-" + keys["alice"]},
                            trust_env=False)
    assert answer.status_code == 500
    body = answer.json()
    found = ERROR_ID.search(body["error"])
    assert found and body["detail"] == {"type": "ZeroDivisionError", "error_id": found.group(1)}, body
    assert "a bug in a Tinker route" not in answer.text  # the message and trace stay in the log
    (record,) = _records_with(caplog, found.group(1))
    assert "POST /api/v1/test_broken_route failed" in record.getMessage()
    assert record.exc_info is not None and record.exc_info[0] is ZeroDivisionError


def test_opentinker_data_dir_is_the_default_data_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENTINKER_DATA_DIR", str(tmp_path / "shared"))
    assert default_data_dir() == tmp_path / "shared"
    monkeypatch.setenv("OPENTINKER_DATA_DIR", "")
    assert default_data_dir() == Path.home() / ".opentinker-server"
    monkeypatch.delenv("OPENTINKER_DATA_DIR")
    assert default_data_dir() == Path.home() / ".opentinker-server"


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opentinker.server.cli", *args], capture_output=True, text=True,
                          timeout=60, env=env)


@pytest.mark.timeout(300)
def test_admin_commands_and_serve_agree_on_the_data_folder_through_the_environment(ray_cluster, tmp_path):
    folder = tmp_path / "server-data"
    env = {**os.environ, "OPENTINKER_DATA_DIR": str(folder), "PYTHONUNBUFFERED": "1"}
    assert _cli("admin", "create-user", "gus", env=env).returncode == 0
    issued = _cli("admin", "create-key", "gus", env=env)
    assert issued.returncode == 0, issued.stderr
    key = issued.stdout.strip().splitlines()[-1]
    assert f"written to {folder / 'opentinker.db'}" in issued.stdout  # where the key went, said once
    assert (folder / "opentinker.db").exists()
    # A key made in another folder: the audit's "invalid or revoked" with no hint why.
    stray = _cli("admin", "create-user", "gus", "--data-dir", str(tmp_path / "elsewhere"), env=env)
    assert stray.returncode == 0
    stray_key = _cli("admin", "create-key", "gus", "--data-dir", str(tmp_path / "elsewhere"),
                     env=env).stdout.strip().splitlines()[-1]

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "opentinker.server.cli", "serve", "--port", str(port),
                                "--ray-address", ray_cluster], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        with httpx.Client(base_url=url, trust_env=False, timeout=5) as client:
            while True:
                try:
                    if client.get("/v1/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert process.poll() is None, process.stdout.read()
                assert time.monotonic() < deadline, "the server did not answer in 60 s"
                time.sleep(0.2)
            assert client.get("/v1/version", headers={"Authorization": f"Bearer {key}"}).json()["user"] == "gus"
            assert client.get("/api/v1/sessions", headers={"X-API-Key": "tml-" + key}).status_code == 200
            for refused in (client.get("/v1/version", headers={"Authorization": f"Bearer {stray_key}"}),
                            client.get("/api/v1/sessions", headers={"X-API-Key": "tml-" + stray_key})):
                assert refused.status_code == 401
                assert "--data-dir or OPENTINKER_DATA_DIR" in refused.json()["error"], refused.text
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert f"data: {folder}" in output  # serve names the folder it uses

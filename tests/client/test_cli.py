"""The ``opentinker`` command line against the protocol test server."""

from __future__ import annotations

import pytest

from opentinker.client import OpenTinkerClient
from opentinker.client.cli import add_command, build_parser, main
from opentinker.protocol import JobCreate


@pytest.fixture
def env_vars(proto, monkeypatch):
    monkeypatch.setenv("OPENTINKER_BASE_URL", proto.url)
    monkeypatch.setenv("OPENTINKER_API_KEY", proto.api_key)


def _finished_job(proto, name="cli-job", steps=2):
    with OpenTinkerClient(proto.url, proto.api_key) as client:
        job = client.create_job(JobCreate(name=name, config={"trainer.total_training_steps": steps}))
        job.wait(progress=False, timeout=20)
        return job.job_id


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "jobs" in out and "OPENTINKER_BASE_URL" in out and "--api-key" in out
    with pytest.raises(SystemExit):
        main(["jobs", "--help"])
    out = capsys.readouterr().out
    for action in ("list", "show", "logs", "cancel"):
        assert action in out


def test_jobs_list_prints_a_table(proto, env_vars, capsys):
    assert main(["jobs", "list"]) == 0
    assert capsys.readouterr().out.strip() == "no jobs"
    job_id = _finished_job(proto)
    assert main(["jobs", "list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split() == ["JOB", "ID", "NAME", "MODE", "STATUS", "STEP", "CREATED", "ERROR"]
    assert lines[1].split()[:5] == [job_id, "cli-job", "server", "completed", "2/2"]


def test_jobs_show_logs_and_cancel(proto, env_vars, capsys):
    job_id = _finished_job(proto, steps=2)
    assert main(["jobs", "show", job_id]) == 0
    out = capsys.readouterr().out
    assert f"job id   {job_id}" in out and "status   completed" in out and "trainer.total_training_steps = 2" in out

    assert main(["jobs", "logs", job_id]) == 0
    out = capsys.readouterr().out.splitlines()
    assert any("progress" in line and "step 2/2" in line for line in out)
    assert any("metrics" in line and "reward/mean=1" in line for line in out)
    assert "completed" in out[-1]

    assert main(["jobs", "logs", job_id, "--follow"]) == 0
    assert "completed" in capsys.readouterr().out.splitlines()[-1]

    assert main(["jobs", "cancel", job_id]) == 0  # already finished: says so, not an error
    assert "completed" in capsys.readouterr().out


def test_flags_override_the_environment_and_errors_exit_1(proto, monkeypatch, capsys):
    monkeypatch.delenv("OPENTINKER_BASE_URL", raising=False)
    monkeypatch.delenv("OPENTINKER_API_KEY", raising=False)
    assert main(["jobs", "list"]) == 1
    assert "OPENTINKER_BASE_URL" in capsys.readouterr().err
    assert main(["jobs", "list", "--base-url", proto.url, "--api-key", proto.api_key]) == 0
    assert main(["--base-url", proto.url, "--api-key", "wrong", "jobs", "list"]) == 1
    assert "API key" in capsys.readouterr().err
    assert main(["--base-url", proto.url, "--api-key", proto.api_key, "jobs", "show", "nope"]) == 1
    assert "nope" in capsys.readouterr().err


def test_extra_commands_plug_in(capsys, monkeypatch):
    import opentinker.client.cli as cli

    monkeypatch.setattr(cli, "_EXTRA_COMMANDS", [])

    @add_command
    def _hello(commands):
        sub = commands.add_parser("hello", help="say hello")
        sub.set_defaults(handler=lambda args: print("hello there") or 0)

    assert "hello" in build_parser().format_help()
    assert main(["hello"]) == 0
    assert capsys.readouterr().out == "hello there\n"

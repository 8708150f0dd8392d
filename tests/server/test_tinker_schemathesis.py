"""Property-based fuzzing of every operation of the Tinker API's own OpenAPI document
(``/api/v1/openapi.json``) with schemathesis, all checks on, against a real server on
127.0.0.1: no 5xx, no answer outside the document.

The server admits one model at a time (``tinker_max_models=1``): a valid ``create_model`` or
``load_weights`` the fuzzer happens to make starts a real model actor, and the next one is a
documented 429. A request the schema allows may still name something that is not there (a
session, a model, a checkpoint) or that this server refuses by design: the documented
400/404/410/429 (``positive_data_acceptance``'s expected statuses).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("schemathesis")
pytest.importorskip("tinker")

MAX_EXAMPLES = 25  # per operation and phase: about 1,500 requests in all
CONFIG = """
[checks.positive_data_acceptance]
expected-statuses = ["2xx", "400", "401", "404", "409", "410", "413", "422", "429"]
"""


def test_fuzz_every_tinker_operation_with_all_checks(start_server, tmp_path, helpers):
    live = start_server(tmp_path / "data", tinker_max_models=1, tinker_max_sessions_per_user=4)
    key = helpers.make_user(tmp_path / "data", "fuzzer")
    config = tmp_path / "schemathesis.toml"
    config.write_text(CONFIG)
    report = tmp_path / "report.json"
    command = [
        sys.executable, "-c", "from schemathesis.cli import schemathesis; schemathesis()",
        "--config-file", str(config), "run", f"{live.url}/api/v1/openapi.json", "--url", live.url,
        "--header", f"X-API-Key: tml-{key}", "--checks", "all",
        "--max-examples", str(MAX_EXAMPLES), "--seed", "1",
        "--report", "json", "--report-json-path", str(report),
    ]  # fmt: skip
    hooks = {"SCHEMATHESIS_HOOKS": str(Path(__file__).with_name("schemathesis_protobuf_hooks.py"))}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path,
                          env={**os.environ, **hooks})
    summary = json.loads(report.read_text())
    print(f"schemathesis (Tinker API): {summary['test_cases']['generated']} cases over "
          f"{summary['operations']['tested']} operations, {summary['test_cases']['with_failures']} with failures")
    assert done.returncode == 0, done.stdout[-8000:]
    document = live.client().get("/api/v1/openapi.json").json()
    operations = sum(len(methods) for methods in document["paths"].values())
    assert summary["operations"]["tested"] == operations == 28
    assert summary["test_cases"]["with_failures"] == 0 and summary["test_cases"]["errored"] == 0
    assert not summary["failures"] and not summary["errors"], (summary["failures"], summary["errors"])

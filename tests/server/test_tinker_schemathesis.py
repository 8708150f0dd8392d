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

from pathlib import Path

import pytest

pytest.importorskip("schemathesis")
pytest.importorskip("tinker")

MAX_EXAMPLES = 15  # per operation and phase: about 900 requests in all
EXPECTED_STATUSES = ["2xx", "400", "401", "403", "404", "409", "410", "413", "422", "429"]
# forward_backward's body is protobuf bytes: sent raw, like application/octet-stream.
HOOKS = Path(__file__).with_name("schemathesis_protobuf_hooks.py")


def test_fuzz_every_tinker_operation_with_all_checks(start_server, tmp_path, helpers):
    live = start_server(tmp_path / "data", tinker_max_models=1, tinker_max_sessions_per_user=4)
    key = helpers.make_user(tmp_path / "data", "fuzzer")
    done, summary = helpers.run_schemathesis(tmp_path, f"{live.url}/api/v1/openapi.json", f"X-API-Key: tml-{key}",
                                             EXPECTED_STATUSES, MAX_EXAMPLES, base_url=live.url, hooks=HOOKS)
    print(f"schemathesis (Tinker API): {summary['test_cases']['generated']} cases over "
          f"{summary['operations']['tested']} operations, {summary['test_cases']['with_failures']} with failures")
    assert done.returncode == 0, done.stdout[-8000:]
    document = live.client().get("/api/v1/openapi.json").json()
    operations = sum(len(methods) for methods in document["paths"].values())
    assert summary["operations"]["tested"] == operations == 42
    assert summary["test_cases"]["with_failures"] == 0 and summary["test_cases"]["errored"] == 0
    assert not summary["failures"] and not summary["errors"], (summary["failures"], summary["errors"])

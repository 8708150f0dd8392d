"""Usage metering through the real parts: the official ``tinker`` SDK against a live server
(tokens sent and sampled, checkpoints, storage accrual, as ``get_billing_usage`` and
``get_current_checkpoint_storage_usage`` read them), a real RL job on the embedded tiny model
(its steps' tokens under its job id in ``GET /v1/usage``), who sees whose usage, the windows
refused, ``opentinker-server admin usage`` on the same SQLite file, and the dashboard's
endpoints of a user's Tinker runs, sessions, checkpoints, usage and audit entries."""

from __future__ import annotations

import asyncio
import datetime as dt
import os
import sqlite3
import time
from pathlib import Path

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

from opentinker.server.accounting.usage import HOUR, UsageMeter  # noqa: E402
from opentinker.server.cli import main as server_cli  # noqa: E402
from opentinker.server.store import Store  # noqa: E402
from opentinker.server.tinker.metering import stored_bytes  # noqa: E402

pytestmark = pytest.mark.heavy  # minutes: scheduled first (tests/conftest.py)

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = "opentinker-tiny-arith"
DASHBOARD = {"X-OpenTinker-Dashboard": "1"}
PRICES = {"training": 0.4, "storage": 0.02}  # USD per million tokens, per GB-month: sampling stays unpriced
# One GRPO step on the embedded tiny model, sized for 2 CPU cores (as test_dashboard.py).
SMALL = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
         "actor_rollout_ref.rollout.n": 4, "trainer.test_freq": -1, "trainer.total_training_steps": 1,
         "trainer.save_freq": 1}


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


def hour(timestamp: float) -> str:
    return dt.datetime.fromtimestamp(timestamp // HOUR * HOUR, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.fixture(scope="module")
def metered(ray_cluster, tiny_model_dir, tmp_path_factory, helpers):
    """A server with the real JobRunner and prices; users uma and vic, and root, an admin."""
    data = tmp_path_factory.mktemp("usage")
    keys = {name: helpers.make_user(data, name) for name in ("uma", "vic", "root")}
    store = Store(data / "opentinker.db")
    assert store.set_admin("root", True)
    store.close()
    live = helpers.LiveServer(helpers.test_settings(data, prices=PRICES), runner_cls=None).start()
    try:
        yield live, keys, data
    finally:
        live.stop()


@pytest.fixture(scope="module")
def work(metered):
    """uma's Tinker work through the SDK (what it sent, sampled and saved), and vic's one sample."""
    live, keys, _ = metered
    began = time.time()
    service = tinker.ServiceClient(base_url=live.url, api_key="tml-" + keys["uma"], user_metadata={"team": "red"})
    tc = service.create_lora_training_client(base_model=TINY, rank=4).result()
    batches = [[datum(list(range(3, 12))), datum(list(range(20, 45)))], [datum(list(range(50, 57)))],
               [datum(list(range(5, 40))), datum(list(range(7, 10))), datum(list(range(60, 71)))]]
    for batch in batches:  # N forward_backward calls
        tc.forward_backward(batch, "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    tc.forward([datum(list(range(100, 113)))], "cross_entropy").result()  # a forward pass counts too
    sent = sum(d.model_input.length for batch in batches for d in batch) + 12
    state = tc.save_state("usage-state").result().path
    snapshot = tc.save_weights_for_sampler("usage-sampler").result().path
    sampler = service.create_sampling_client(model_path=snapshot)
    prompts, generated = [[11, 12, 13, 14], [21, 22, 23, 24, 25, 26]], 0
    for prompt in prompts:
        sample = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=2,
                                sampling_params=types.SamplingParams(max_tokens=6, seed=3)).result()
        generated += sum(len(sequence.tokens) for sequence in sample.sequences)
    vic = tinker.ServiceClient(base_url=live.url, api_key="tml-" + keys["vic"])
    vic_sample = vic.create_sampling_client(base_model=TINY).sample(
        prompt=types.ModelInput.from_ints([5, 6, 7]), num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=4, seed=1)).result()
    return {"began": began, "service": service, "tc": tc, "session": tc.model_id.split(":")[0], "sent": sent,
            "paths": [state, snapshot], "prompt_tokens": sum(map(len, prompts)), "generated": generated,
            "vic_generated": len(vic_sample.sequences[0].tokens)}


def rest_client(live, key: str):
    return tinker.RestClient(base_url=live.url, api_key="tml-" + key)


def billing(live, key: str, began: float, wait_for_storage: str | None = None) -> types.BillingUsageResponse:
    """get_billing_usage through the SDK (RestClient's, as the SDK rows name it) over the hours
    from ``began`` to the next; with ``wait_for_storage``, until that session's storage shows."""
    rest = rest_client(live, key)

    def read():
        response = rest.get_billing_usage(hour(began), hour(time.time() + 2 * HOUR)).result()
        if wait_for_storage is None or any(e.event_info.type == "storage" and e.session_id == wait_for_storage
                                           for e in response.data):
            return response
        return None

    deadline = time.monotonic() + 90  # the housekeeping accrues storage every 10 s
    while (response := read()) is None:
        assert time.monotonic() < deadline, "no storage accrued in 90 s"
        time.sleep(2)
    return response


def totals(events: list[types.BillingUsageEvent], session: str | None = None) -> dict[str, float]:
    out: dict[str, float] = {}
    for event in events:
        if session is None or event.session_id == session:
            info = event.event_info
            quantity = getattr(info, "token_count", None) or getattr(info, "count", None) or getattr(
                info, "gigabyte_hours", 0.0)
            out[info.type] = out.get(info.type, 0) + quantity
    return out


def test_billing_usage_counts_what_the_sdk_sent_sampled_and_saved(metered, work):
    live, keys, data = metered
    response = billing(live, keys["uma"], work["began"], wait_for_storage=work["session"])
    mine = totals(response.data, work["session"])
    assert mine["training"] == work["sent"]  # every forward_backward and forward: the tokens sent
    assert mine["sampling_prefill"] == work["prompt_tokens"]  # once per call, whatever its num_samples
    assert mine["sampling_sample"] == work["generated"]
    assert mine["checkpoint"] == 2
    with sqlite3.connect(data / "opentinker.db") as db:
        size = db.execute("SELECT SUM(size_bytes) FROM tinker_checkpoints WHERE user_id = "
                          "(SELECT id FROM users WHERE name = 'uma')").fetchone()[0]
        project = db.execute("SELECT project_id FROM tinker_sessions WHERE session_id = ?",
                             (work["session"],)).fetchone()[0] if "project_id" in {
            row[1] for row in db.execute("PRAGMA table_info(tinker_sessions)")} else None
    held_hours = (time.time() - work["began"] + 15) / 3600  # + what the accrual before a save may cover
    assert 0 < mine["storage"] <= size / 1e9 * held_hours  # GB-hours of what was kept, since it was kept

    events = [e for e in response.data if e.session_id == work["session"]]
    assert {e.user_name for e in response.data} == {"uma"}  # only her own
    assert all(e.base_model == TINY and e.project_id == project and e.user_id == "tml:user:uma" for e in events)
    assert {e.event_info.cached for e in events if e.event_info.type == "sampling_prefill"} == {False}
    training = [e for e in events if e.event_info.type == "training"]
    for event in training:  # priced by --price training=0.4: USD per million tokens
        assert event.estimated_cost_usd == pytest.approx(0.4 * event.event_info.token_count / 1e6)
        assert event.effective_rate_usd_per_million_tokens == 0.4
    assert all(e.estimated_cost_usd is None for e in events if e.event_info.type == "sampling_sample")
    assert response.sessions[work["session"]].user_metadata == {"team": "red"}
    assert [e.bucket_start for e in response.data] == sorted(e.bucket_start for e in response.data)

    # compute seconds are not an SDK kind: GET /v1/usage has them, with everything else.
    with live.client(keys["uma"]) as api:
        report = api.get("/v1/usage", params={"session_id": work["session"]}).json()
    kinds = {t["kind"]: t for t in report["totals"]}
    assert kinds["training"]["quantity"] == work["sent"] and kinds["training"]["unit"] == "tokens"
    assert 0 < kinds["compute_s"]["quantity"] < time.time() - work["began"]
    assert kinds["training"]["estimated_cost_usd"] == pytest.approx(0.4 * work["sent"] / 1e6)
    assert {b["session_id"] for b in report["buckets"]} == {work["session"]}


def test_current_checkpoint_storage_is_what_is_kept_now(metered, work):
    live, keys, data = metered
    rest = rest_client(live, keys["uma"])
    current = rest.get_current_checkpoint_storage_usage().result()
    (item,) = [i for i in current.data if i.user_name == "uma"]
    with sqlite3.connect(data / "opentinker.db") as db:
        count, size = db.execute("SELECT COUNT(*), SUM(size_bytes) FROM tinker_checkpoints WHERE user_id = "
                                 "(SELECT id FROM users WHERE name = 'uma')").fetchone()
    assert (item.checkpoint_count, item.size_bytes) == (count, size) and count == 2
    assert item.size_gigabytes == pytest.approx(size / 1e9)
    assert current.effective_rate_usd_per_gigabyte_month == 0.02
    assert item.estimated_monthly_cost_usd == pytest.approx(0.02 * size / 1e9)
    assert rest.get_current_checkpoint_storage_usage(project_id="no-such-project").result().data == []
    vic = rest_client(live, keys["vic"])
    assert asyncio.run(vic.get_current_checkpoint_storage_usage_async()).data == []  # uma's are not his


def test_a_user_sees_only_their_usage_and_an_admin_everyones(metered, work):
    live, keys, _ = metered
    vic = billing(live, keys["vic"], work["began"])
    assert {e.user_name for e in vic.data} == {"vic"}
    again = asyncio.run(rest_client(live, keys["vic"]).get_billing_usage_async(
        hour(work["began"]), hour(time.time() + 2 * HOUR)))  # the _async row answers the same
    assert totals(again.data) == totals(vic.data)
    assert totals(vic.data) == {"sampling_prefill": 3, "sampling_sample": work["vic_generated"]}
    admin = billing(live, keys["root"], work["began"])
    assert {"uma", "vic"} <= {e.user_name for e in admin.data}
    assert totals([e for e in admin.data if e.user_name == "vic"]) == totals(vic.data)
    assert totals([e for e in admin.data if e.user_name == "uma"], work["session"])["sampling_prefill"] == \
        work["prompt_tokens"]

    with live.client(keys["uma"]) as uma, live.client(keys["root"]) as root:
        assert uma.get("/v1/usage", params={"user": "vic"}).status_code == 404  # like no such user
        assert {t["user"] for t in uma.get("/v1/usage").json()["totals"]} == {"uma"}
        assert {t["user"] for t in root.get("/v1/usage").json()["totals"]} >= {"uma", "vic"}
        only_vic = root.get("/v1/usage", params={"user": "vic"}).json()
        assert only_vic["user"] == "vic" and {t["user"] for t in only_vic["totals"]} == {"vic"}
        page = root.get("/v1/usage", params={"limit": 1}).json()
        assert len(page["buckets"]) == 1 and page["next_offset"] == 1


def test_windows_are_checked_and_refusals_name_the_field(metered, work):
    live, keys, _ = metered
    now = time.time()
    this_hour = hour(now)
    bad = {
        "starting_on": {"ending_before": this_hour},
        "not on a UTC hour": {"starting_on": this_hour.replace(":00:00Z", ":30:00Z"), "ending_before": hour(now + HOUR)},
        "must be after": {"starting_on": this_hour, "ending_before": this_hour},
        "at most 14 days": {"starting_on": hour(now - 15 * 86400), "ending_before": this_hour},
        "in the future": {"starting_on": hour(now + 2 * HOUR), "ending_before": hour(now + 3 * HOUR)},
        "is not a time": {"starting_on": "yesterday", "ending_before": this_hour},
    }
    with httpx.Client(base_url=live.url, headers={"X-API-Key": "tml-" + keys["uma"]}, trust_env=False) as raw:
        for expected, params in bad.items():
            answer = raw.get("/api/v1/billing/usage/events", params=params)
            assert answer.status_code == 400 and expected in answer.json()["error"], (params, answer.text)
        assert raw.get("/api/v1/billing/usage/events", params={"starting_on": this_hour.replace("Z", "+00:00"),
                                                                "ending_before": hour(now + HOUR)}).status_code == 200
    rest = rest_client(live, keys["uma"])
    with pytest.raises(tinker.BadRequestError, match="ending_before"):
        rest.get_billing_usage(this_hour, hour(now - HOUR)).result()
    with live.client(keys["uma"]) as api:
        too_long = api.get("/v1/usage", params={"start": "2026-01-01T00:00:00Z", "end": "2026-03-01T00:00:00Z"})
        assert too_long.status_code == 400 and "end" in too_long.json()["error"] and "31" in too_long.json()["error"]
        backwards = api.get("/v1/usage", params={"start": "2026-03-01T00:00:00Z", "end": "2026-01-01T00:00:00Z"})
        assert backwards.status_code == 400 and "must be after start" in backwards.json()["error"]


def test_storage_accrues_gigabyte_hours_of_tinker_and_job_checkpoints(metered, work, rl_job, tmp_path):
    _, _, data = metered
    copy = tmp_path / "copy.db"  # a copy: the live server's housekeeping accrues on its own clock
    with sqlite3.connect(data / "opentinker.db") as source, sqlite3.connect(copy) as target:
        source.backup(target)
    store = Store(copy)
    try:
        kept = stored_bytes(store)
        by_job = {s.job_id: s.size_bytes for s in kept if s.job_id}
        job_size = store.query("SELECT SUM(size_bytes) AS n FROM checkpoints WHERE job_id = ?", (rl_job["id"],))[0]["n"]
        assert job_size > 0 and by_job[rl_job["id"]] == job_size
        mine = [s for s in kept if s.session_id == work["session"]]
        assert len(mine) == 1 and mine[0].base_model == TINY
        meter = UsageMeter(store)
        later = (time.time() // HOUR + 24 * 10) * HOUR + 60  # an hour of its own, ten days on
        meter.accrue_storage(kept, now=later)

        def storage(**key) -> float:
            return sum(b.quantity for b in meter.buckets(user_id=None, start=later - HOUR, end=later + HOUR,
                                                          kinds=["storage"]) if all(getattr(b, k) == v
                                                                                    for k, v in key.items()))

        before = storage(job_id=rl_job["id"]), storage(session_id=work["session"])
        assert meter.accrue_storage(kept, now=later + 1800) == pytest.approx(0.5)
        assert storage(job_id=rl_job["id"]) - before[0] == pytest.approx(job_size / 1e9 * 0.5)
        assert storage(session_id=work["session"]) - before[1] == pytest.approx(mine[0].size_bytes / 1e9 * 0.5)
    finally:
        store.close()


@pytest.fixture(scope="module")
def rl_job(metered, helpers):
    """One GRPO step of a server-mode job of uma's on the tiny model, with a checkpoint."""
    from opentinker.environments.arithmetic import make_problems

    live, keys, _ = metered
    with live.client(keys["uma"]) as api:
        job_id = helpers.create_job(api, "metered", steps=1, config=SMALL,
                                    dataset=[p.as_row() for p in make_problems(8, 1)])
        helpers.wait_status(api, job_id, "completed", timeout=600)
        events = helpers.all_events(api, job_id)
    steps = [e["data"]["metrics"] for e in events if e["type"] == "metrics" and "tokens/trained" in e["data"]["metrics"]]
    return {"id": job_id, "steps": steps, "checkpoints": sum(e["type"] == "checkpoint" for e in events)}


def test_an_rl_jobs_steps_are_metered_under_its_job_id(metered, rl_job):
    live, keys, _ = metered
    (step,) = rl_job["steps"]
    assert step["tokens/trained"] == step["tokens/prompt"] + step["tokens/generated"]  # single-turn: all the model's
    with live.client(keys["uma"]) as api:
        report = api.get("/v1/usage", params={"job_id": rl_job["id"]}).json()
    kinds = {t["kind"]: t["quantity"] for t in report["totals"]}
    assert kinds["training"] == step["tokens/trained"]
    assert kinds["sampling_prefill"] == step["tokens/prompt"]
    assert kinds["sampling_sample"] == step["tokens/generated"]
    assert kinds["compute_s"] == pytest.approx(step["timing_s/step"] - step["train/env_outage_wait_s"])
    assert kinds["checkpoint"] == rl_job["checkpoints"] == 1
    assert {(b["job_id"], b["session_id"], b["base_model"]) for b in report["buckets"]} == {(rl_job["id"], None, TINY)}


def test_admin_usage_prints_each_users_quantities(metered, work, rl_job, capsys):
    _, _, data = metered
    assert server_cli(["admin", "usage", "--data-dir", str(data), "--user", "uma", "--since", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = {tuple(line.split("\t")[:2]): line.split("\t")[2:] for line in lines if line.startswith("uma\t")}
    expected = work["sent"] + rl_job["steps"][0]["tokens/trained"]
    assert rows[("uma", "training")] == [str(round(expected)), "tokens"]
    assert rows[("uma", "checkpoint")] == ["3", "checkpoints"]
    assert set(dict(rows)) >= {("uma", kind) for kind in ("sampling_prefill", "sampling_sample", "compute_s")}
    assert not any(line.startswith("vic\t") for line in lines)
    assert server_cli(["admin", "usage", "--data-dir", str(data)]) == 0
    assert "vic\tsampling_sample\t" in capsys.readouterr().out
    assert server_cli(["admin", "usage", "--data-dir", str(data), "--user", "nobody"]) == 2
    assert "no user 'nobody'" in capsys.readouterr().err


def log_in(live, key: str) -> httpx.Client:
    """A client holding only the dashboard's session cookie (no Authorization header)."""
    with live.client() as client:
        response = client.post("/v1/session", json={"api_key": key}, headers=DASHBOARD)
        assert response.status_code == 204, response.text
    return httpx.Client(base_url=live.url, headers={"Cookie": f"ot_session={response.cookies['ot_session']}"},
                        timeout=30.0, trust_env=False)


def test_the_dashboard_shows_a_users_own_runs_sessions_checkpoints_usage_and_audit(metered, work):
    live, keys, _ = metered
    audit = live.app.state.audit
    audit.record("checkpoint_publish", user_id=live.app.state.store.get_user("uma").id, user_name="uma", path="x")
    audit.record("checkpoint_publish", user_id=live.app.state.store.get_user("vic").id, user_name="vic", path="y")
    with log_in(live, keys["uma"]) as uma, log_in(live, keys["vic"]) as vic:
        runs = uma.get("/v1/dashboard/training-runs").json()
        (run,) = [r for r in runs["runs"] if r["model_id"] == work["tc"].model_id]
        assert (run["base_model"], run["lora_rank"], run["session_id"]) == (TINY, 4, work["session"])
        assert run["state"] == "ready" and run["last_request_at"] >= work["began"]
        sessions = uma.get("/v1/dashboard/sessions").json()
        assert work["session"] in [s["session_id"] for s in sessions["sessions"]]
        checkpoints = uma.get("/v1/dashboard/checkpoints").json()
        assert sorted(c["path"] for c in checkpoints["checkpoints"]) == sorted(work["paths"])
        assert all(c["size_bytes"] > 0 and c["expires_at"] is None for c in checkpoints["checkpoints"])
        usage = uma.get("/v1/dashboard/usage").json()
        assert usage["last_24h"]["totals"]["training"] >= work["sent"] and usage["units"]["storage"] == "GB-hours"
        assert usage["last_30d"]["totals"]["training"] == usage["last_24h"]["totals"]["training"]
        entries = uma.get("/v1/dashboard/audit").json()["entries"]
        assert [e["details"].get("path") for e in entries if e["event"] == "checkpoint_publish"] == ["x"]

        assert vic.get("/v1/dashboard/training-runs").json() == {"runs": [], "total": 0}
        assert work["session"] not in [s["session_id"] for s in vic.get("/v1/dashboard/sessions").json()["sessions"]]
        assert vic.get("/v1/dashboard/checkpoints").json()["total"] == 0
        assert vic.get("/v1/dashboard/usage").json()["last_24h"]["totals"]["training"] == 0
        assert "x" not in [e["details"].get("path") for e in vic.get("/v1/dashboard/audit").json()["entries"]]
        assert uma.get("/v1/dashboard/sessions", params={"limit": 201}).status_code == 422  # pages are bounded
        one = uma.get("/v1/dashboard/sessions", params={"limit": 1}).json()
        assert len(one["sessions"]) == 1 and one["total"] >= 1
    with live.client() as anonymous:
        assert anonymous.get("/v1/dashboard/usage").status_code == 401


def test_the_page_loads_the_account_view(metered):
    live, _, _ = metered
    with live.client() as anonymous:
        page = anonymous.get("/").text
        assert "/dashboard/static/account.js" in page and 'id="tinker-runs"' in page
        assert anonymous.get("/dashboard/static/account.js").status_code == 200


# --- the account view in a real browser (as test_dashboard.py: Debian's chromium) ---------


@pytest.fixture(scope="module")
def page():
    chromium = Path("/usr/bin/chromium")
    if not chromium.exists():
        pytest.skip(f"{chromium} is not installed (Debian: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(chromium), headless=True, args=[
            "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
            "--disable-background-networking", "--disable-component-update", "--disable-sync"])
        try:
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            page.set_default_timeout(30_000)
            page.problems = []  # uncaught errors and CSP violations
            page.on("pageerror", lambda error: page.problems.append(f"pageerror: {error}"))
            page.on("console", lambda message: page.problems.append(message.text)
                    if "Content Security Policy" in message.text else None)
            yield page
        finally:
            browser.close()


def test_the_account_view_shows_runs_sessions_checkpoints_and_usage(metered, work, page):
    live, keys, _ = metered
    page.goto(live.url + "/")
    page.wait_for_selector("#login-form", state="visible")
    page.fill("#api-key", keys["uma"])
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#account", state="visible")
    model_id = work["tc"].model_id
    page.wait_for_selector(f'#tinker-runs td[title="{model_id}"]')
    page.wait_for_selector(f'#tinker-sessions td[title="{work["session"]}"]')
    for path in work["paths"]:
        page.wait_for_selector(f'#tinker-checkpoints td[title="{path}"]')
    page.wait_for_selector('#usage-totals tr[data-kind="training"] td[data-window="last_24h"]')
    shown = float(page.get_attribute('#usage-totals tr[data-kind="training"] td[data-window="last_24h"]', "data-value"))
    assert shown >= work["sent"]
    assert page.locator("#tinker-runs-empty").is_hidden() and page.locator("#tinker-checkpoints-empty").is_hidden()
    folder = Path(os.environ.get("OPENTINKER_TEST_ARTIFACTS") or Path(__file__).resolve().parents[2] / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(folder / "dashboard-account.png"), full_page=True)
    assert page.problems == []

"""The web dashboard: its page and cookie session over HTTP, then the page itself in a real
headless Chromium (Debian's ``chromium``, driven by Playwright) on a real short job.

The browser tests skip only where ``/usr/bin/chromium`` or the playwright package is
missing (``make test`` installs both on Linux). They write a full-page screenshot to
``test-artifacts/dashboard.png`` (or under ``$OPENTINKER_TEST_ARTIFACTS``).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import os
import sqlite3
import tarfile
import time
from pathlib import Path

import httpx
import pytest

from opentinker.server import auth
from opentinker.server.store import Store

HEADER = {"X-OpenTinker-Dashboard": "1"}
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
REPO = Path(__file__).resolve().parents[2]
# A few steps of GRPO on the embedded tiny model, sized for 2 CPU cores (as tests/test_e2e.py).
SMALL = {"data.train_batch_size": 2, "actor_rollout_ref.actor.ppo_mini_batch_size": 2,
         "actor_rollout_ref.rollout.n": 4, "trainer.test_freq": -1}
REAL_STEPS = 3


def log_in(server, key: str) -> tuple[httpx.Client, str]:
    """A client holding only the dashboard's cookie (no Authorization header), and the token."""
    client = server.client()
    response = client.post("/v1/session", json={"api_key": key}, headers=HEADER)
    assert response.status_code == 204, response.text
    token = response.cookies["ot_session"]
    return client, token


def cookie_headers(token: str, **extra: str) -> dict[str, str]:
    return {"Cookie": f"ot_session={token}", **extra}


# --- HTTP -------------------------------------------------------------------------------


def test_the_page_and_its_files_are_public_and_hold_no_data(server):
    with server.client() as anonymous:
        page = anonymous.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "/dashboard/static/app.js" in page.text and "uPlot.iife.min.js" in page.text
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert page.headers["x-frame-options"] == "DENY"
        script = anonymous.get("/dashboard/static/app.js")
        assert script.status_code == 200 and script.headers["content-type"].startswith("text/javascript")
        assert "textContent" in script.text and "innerHTML" not in script.text
        uplot = anonymous.get("/dashboard/static/vendor/uplot/uPlot.iife.min.js")
        assert uplot.status_code == 200 and "uPlot" in uplot.text
        assert anonymous.get("/dashboard/static/vendor/uplot/LICENSE").status_code == 200
        for missing in ("/dashboard/static/nope.js", "/dashboard/static/../routes.py",
                        "/dashboard/static/%2e%2e/routes.py", "/dashboard/static/"):
            assert anonymous.get(missing).status_code == 404, missing
        # Without a key or a session, no data.
        assert anonymous.get("/v1/session").status_code == 401
        assert anonymous.get("/v1/jobs").status_code == 401
    paths = server.app.openapi()["paths"]
    assert "/" not in paths and "/v1/session" not in paths


def test_log_in_sets_a_strict_http_only_cookie_whose_hash_alone_is_stored(server, keys, data_dir):
    client, token = log_in(server, keys["alice"])
    with contextlib.closing(client):
        response = client.post("/v1/session", json={"api_key": keys["alice"]}, headers=HEADER)
        header = response.headers["set-cookie"]
        attributes = {part.strip().split("=")[0].lower() for part in header.split(";")}
        assert {"httponly", "samesite", "path", "max-age"} <= attributes
        assert "samesite=strict" in header.lower() and "path=/" in header.lower()
        assert f"max-age={12 * 3600}" in header.lower()
        assert "secure" not in attributes  # plain http here, and no proxy is trusted (--trusted-proxy):
        with server.client() as other:
            claimed = other.post("/v1/session", json={"api_key": keys["alice"]},
                                 headers={**HEADER, "X-Forwarded-Proto": "https"})
        assert "secure" not in {part.strip().lower() for part in claimed.headers["set-cookie"].split(";")}
        session = client.get("/v1/session")
        assert session.status_code == 200 and session.json()["user"] == "alice"
        assert session.json()["key_prefix"] == keys["alice"][:8] and session.json()["expires_at"] > time.time()
    assert token != keys["alice"] and len(token) >= 40
    with sqlite3.connect(data_dir / "opentinker.db") as db:
        stored = {row[0] for row in db.execute("SELECT token_hash FROM dashboard_sessions")}
    assert hashlib.sha256(token.encode()).hexdigest() in stored and token not in stored


def test_the_cookie_is_secure_over_https_through_a_trusted_tls_proxy(start_server, tmp_path, helpers):
    """A TLS proxy on the same host (``--trusted-proxy 127.0.0.1``) says the page came over https."""
    live = start_server(tmp_path, trusted_proxies=["127.0.0.1"])
    key = helpers.make_user(tmp_path, "tls")
    with live.client() as client:
        over_https = client.post("/v1/session", json={"api_key": key}, headers={**HEADER, "X-Forwarded-Proto": "https"})
    assert over_https.status_code == 204, over_https.text
    assert "secure" in {part.strip().lower() for part in over_https.headers["set-cookie"].split(";")}


def test_the_cookie_alone_shows_the_users_own_jobs_only(server, keys, alice, bob, helpers):
    own = helpers.create_job(alice, "dashboard-own", steps=2)
    other = helpers.create_job(bob, "dashboard-other", steps=2)
    helpers.wait_status(alice, own, "completed")
    client, _ = log_in(server, keys["alice"])
    with contextlib.closing(client):
        assert "authorization" not in client.headers
        listed = [job["job_id"] for job in client.get("/v1/jobs").json()["jobs"]]
        assert own in listed and other not in listed
        assert client.get(f"/v1/jobs/{own}").json()["status"] == "completed"
        for path in (f"/v1/jobs/{other}", f"/v1/jobs/{other}/events?stream=false", f"/v1/jobs/{other}/checkpoints"):
            assert client.get(path).status_code == 404, path
        events = client.get(f"/v1/jobs/{own}/events?stream=false").json()["events"]
        assert events[-1]["data"]["status"] == "completed"
        with client.stream("GET", f"/v1/jobs/{own}/events") as stream:  # what EventSource does
            assert stream.status_code == 200
            assert [e["event"] for e in helpers.iter_sse(stream)][-1] == "status"
        name = client.get(f"/v1/jobs/{own}/checkpoints").json()["checkpoints"][-1]["name"]
        download = client.get(f"/v1/jobs/{own}/checkpoints/{name}/download")  # what a plain link does
        assert download.status_code == 200 and download.headers["content-type"] == "application/gzip"
        with tarfile.open(fileobj=io.BytesIO(download.content), mode="r:gz") as archive:
            assert any(member.name.endswith("config.json") for member in archive.getmembers())


def test_a_cookie_authenticated_change_needs_the_dashboard_header(server, keys, alice, helpers):
    job_id = helpers.create_job(alice, "dashboard-slow-csrf", steps=200)
    client, token = log_in(server, keys["alice"])
    with contextlib.closing(client):
        refused = client.post(f"/v1/jobs/{job_id}/cancel")
        assert refused.status_code == 403, refused.text
        assert "X-OpenTinker-Dashboard: 1" in refused.json()["error"]
        assert helpers.job_status(alice, job_id) in ("queued", "running")
        # Logging in and out need it too (a cross-site form must not switch accounts).
        assert client.post("/v1/session", json={"api_key": keys["alice"]}).status_code == 403
        assert client.delete("/v1/session").status_code == 403
        cancelled = client.post(f"/v1/jobs/{job_id}/cancel", headers=HEADER)
        assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    # An API client with its key needs no such header.
    assert alice.post(f"/v1/jobs/{job_id}/cancel").status_code == 200


def test_log_out_and_revoking_the_key_end_the_session(server, keys, data_dir):
    client, token = log_in(server, keys["alice"])
    with contextlib.closing(client):
        assert client.get("/v1/jobs").status_code == 200
        response = client.delete("/v1/session", headers=HEADER)
        assert response.status_code == 204
        assert "max-age=0" in response.headers["set-cookie"].lower()
    with server.client() as anonymous:
        ended = anonymous.get("/v1/jobs", headers=cookie_headers(token))
        assert ended.status_code == 401 and "log in again" in ended.json()["error"]

    store = Store(data_dir / "opentinker.db")
    try:
        key = auth.create_api_key(store, "alice")
        client, token = log_in(server, key)
        with contextlib.closing(client):
            assert client.get("/v1/jobs").status_code == 200
            assert auth.revoke_api_key(store, key)
            assert client.get("/v1/jobs").status_code == 401
            assert client.get("/v1/session").status_code == 401
    finally:
        store.close()


@pytest.mark.parametrize("key", ["ot-" + "x" * 43, "not-a-key", "revoked"])
def test_a_bad_key_logs_nobody_in(server, keys, key):
    key = keys["revoked"] if key == "revoked" else key
    with server.client() as client:
        response = client.post("/v1/session", json={"api_key": key}, headers=HEADER)
        assert response.status_code == 401
        assert response.json()["error"] == "invalid or revoked API key"
        assert "set-cookie" not in response.headers
        # A made-up cookie is no session either.
        made_up = client.get("/v1/jobs", headers=cookie_headers("x" * 43))
        assert made_up.status_code == 401 and made_up.headers["WWW-Authenticate"] == "Bearer"


def test_a_session_expires(start_server, tmp_path, helpers):
    live = start_server(tmp_path, dashboard_session_s=1.0)
    key = helpers.make_user(tmp_path, "carol")
    with live.client() as client:
        response = client.post("/v1/session", json={"api_key": key}, headers=HEADER)
        assert "max-age=1" in response.headers["set-cookie"].lower()
        token = response.cookies["ot_session"]
        assert client.get("/v1/jobs", headers=cookie_headers(token)).status_code == 200
        time.sleep(1.2)
        # Sent by hand: a browser would already have dropped it; the server must refuse it anyway.
        assert client.get("/v1/jobs", headers=cookie_headers(token)).status_code == 401
    with live.client(key) as with_key:
        assert with_key.get("/v1/jobs").status_code == 200


# --- the page in a real browser ---------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed (Debian: apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        # Debian's chromium, never a browser Playwright downloads; a new empty profile each launch.
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1400, "height": 900}, accept_downloads=True)
    page = context.new_page()
    page.set_default_timeout(30_000)
    page.problems = []  # uncaught errors and CSP violations
    page.on("pageerror", lambda error: page.problems.append(f"pageerror: {error}"))
    page.on("console", lambda message: page.problems.append(message.text)
            if "Content Security Policy" in message.text else None)
    try:
        yield page
    finally:
        context.close()


def artifacts_dir() -> Path:
    folder = Path(os.environ.get("OPENTINKER_TEST_ARTIFACTS") or REPO / "test-artifacts")
    folder.mkdir(parents=True, exist_ok=True)
    return folder


# wait_for_function gets functions, never bare expressions: Playwright polls an expression
# with eval, which the page's Content-Security-Policy (rightly) forbids.


def log_in_with_the_form(page, url: str, key: str) -> None:
    page.goto(url + "/")
    page.wait_for_selector("#login-form", state="visible")
    page.fill("#api-key", "ot-wrong")
    page.click("#login-form button[type=submit]")
    page.wait_for_function("() => document.getElementById('login-error').textContent.length > 0")
    assert page.text_content("#login-error") == "invalid or revoked API key"
    page.fill("#api-key", key)
    page.click("#login-form button[type=submit]")
    page.wait_for_selector("#dashboard", state="visible")


def open_job(page, job_id: str) -> None:
    page.locator(f'#jobs tbody tr[data-job-id="{job_id}"]').click()
    page.wait_for_selector(f'#job[data-job-id="{job_id}"]', state="visible")


def status_of(page) -> str:
    return page.get_attribute("#job-status", "data-status")


@pytest.fixture
def real_server(ray_cluster, tiny_model_dir, tmp_path, helpers):
    """A server with the real JobRunner (the trainer on the embedded tiny model) and its user's key."""
    live = helpers.LiveServer(helpers.test_settings(tmp_path / "real"), runner_cls=None).start()
    try:
        yield live, helpers.make_user(tmp_path / "real", "dana")
    finally:
        live.stop()


def test_the_page_draws_a_real_jobs_curves_live(real_server, page, helpers, tmp_path):
    from opentinker.environments.arithmetic import make_problems

    live, key = real_server
    with live.client(key) as api:
        job_id = helpers.create_job(
            api, "dashboard-demo", steps=REAL_STEPS,
            config={**SMALL, "trainer.total_training_steps": REAL_STEPS, "trainer.save_freq": REAL_STEPS},
            dataset=[p.as_row() for p in make_problems(16, 1)],
        )
        log_in_with_the_form(page, live.url, key)
        assert page.text_content("#who") == "dana"
        open_job(page, job_id)
        # Opened while it is queued or running: what follows arrives through the live stream.
        page.wait_for_selector('#job-status[data-status="completed"]', timeout=600_000)
        assert page.text_content("#job-status") == "completed"
        events = helpers.all_events(api, job_id)
        checkpoints = api.get(f"/v1/jobs/{job_id}/checkpoints").json()["checkpoints"]

    metrics = [e["data"] for e in events if e["type"] == "metrics" and "reward/mean" in e["data"]["metrics"]]
    assert [m["step"] for m in metrics] == list(range(1, REAL_STEPS + 1))
    page.wait_for_function(f"() => window.opentinkerDashboard.chartData('reward').data[0].length === {REAL_STEPS}")
    reward = page.evaluate("window.opentinkerDashboard.chartData('reward')")
    steps, series = reward["data"][0], dict(zip(reward["labels"], reward["data"][1:]))
    assert steps == list(range(1, REAL_STEPS + 1))  # one point per training step
    assert series["reward/mean"] == pytest.approx([m["metrics"]["reward/mean"] for m in metrics], rel=1e-12)
    assert series["reward/max"] == pytest.approx([m["metrics"]["reward/max"] for m in metrics], rel=1e-12)

    drawn = page.evaluate("Object.keys(window.opentinkerDashboard.charts)")
    assert {"reward", "response_length", "timing"} <= set(drawn), drawn
    kl_names = {name for name in metrics[-1]["metrics"] if name.split("/")[-1].split("_")[-1] == "kl"}
    assert kl_names  # actor/ppo_kl at least
    kl = page.evaluate("window.opentinkerDashboard.chartData('kl')")
    assert set(kl["labels"]) == kl_names and kl["data"][0] == list(range(1, REAL_STEPS + 1))
    timing = page.evaluate("window.opentinkerDashboard.chartData('timing')")
    assert "rollout" in timing["labels"] and "update" in timing["labels"]
    for chart in drawn:  # each chart is a drawn canvas with its legend
        assert page.locator(f'.chart[data-chart="{chart}"] canvas').count() == 1
        assert page.locator(f'.chart[data-chart="{chart}"] .u-legend .u-series').count() >= 2
    assert "reward/mean" in page.text_content('.chart[data-chart="reward"] .u-legend')

    # Step, checkpoints (with a download that works in the browser, by cookie) and the config.
    assert page.get_attribute("#job-step", "data-step") == str(REAL_STEPS)
    assert [c["name"] for c in checkpoints] == [f"global_step_{REAL_STEPS}"]
    row = page.locator(f'#checkpoints tr[data-checkpoint="global_step_{REAL_STEPS}"]')
    assert row.count() == 1
    with page.expect_download() as download_info:
        row.locator("a").click()
    archive = Path(download_info.value.path())
    assert gzip.open(archive).read(1)  # a gzip stream
    with tarfile.open(archive, mode="r:gz") as tar:
        assert any(member.name.endswith("model.safetensors") for member in tar.getmembers())
    assert page.text_content('#config tr[data-key="trainer.total_training_steps"] td:last-child') == str(REAL_STEPS)
    assert page.text_content('#config tr[data-key="data.train_batch_size"] td:last-child') == "2"
    assert page.locator("#cancel").is_hidden() and page.locator("#resume").is_hidden()  # completed
    assert page.locator(f'#jobs tbody tr[data-job-id="{job_id}"] .status').text_content() == "completed"

    page.screenshot(path=str(artifacts_dir() / "dashboard.png"), full_page=True)
    assert page.problems == []


def test_cancel_and_resume_buttons(server, keys, alice, page, helpers):
    # A name that would run script if it were ever put in as HTML.
    name = 'slow <img src=x onerror="window.injected=1">'
    job_id = helpers.create_job(alice, name, steps=400)
    log_in_with_the_form(page, server.url, keys["alice"])
    open_job(page, job_id)
    assert page.text_content("#job-title") == name
    assert page.evaluate("window.injected === undefined")
    page.wait_for_selector('#job-status[data-status="running"]')
    assert page.locator("#resume").is_hidden()
    # A checkpoint asked for by the API shows up in the page by its event.
    assert alice.post(f"/v1/jobs/{job_id}/checkpoints").status_code == 202
    page.wait_for_selector("#checkpoints tr[data-checkpoint]")
    page.wait_for_function("() => window.opentinkerDashboard.chartData('reward') !== null")

    page.click("#cancel")
    page.wait_for_selector('#job-status[data-status="cancelled"]')
    assert helpers.wait_status(alice, job_id, "cancelled")["status"] == "cancelled"
    assert page.locator("#cancel").is_hidden()
    resume = page.locator("#resume")
    resume.wait_for(state="visible")
    page.wait_for_function("() => !document.getElementById('resume').disabled")

    resume.click()
    page.wait_for_selector('#job-status:is([data-status="queued"], [data-status="running"])')
    assert helpers.job_status(alice, job_id) in ("queued", "running")
    assert page.locator("#action-error").is_hidden()
    page.wait_for_selector('#job-status[data-status="running"]')
    page.click("#cancel")  # the resumed run is cancelled again, from the page
    page.wait_for_selector('#job-status[data-status="cancelled"]')
    helpers.wait_status(alice, job_id, "cancelled")
    assert page.problems == []

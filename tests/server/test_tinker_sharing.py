"""Sharing and keeping weights through the official ``tinker`` SDK against a real server: a
published checkpoint loads for another user (sampled, and trained as their own run) and stays
read-only to them; an unpublished one reads as missing (and leaves an ``access_denied`` entry
for its owner); a checkpoint's TTL is set, removed and bounded; ``copy_weights`` shares the
source's folder and outlives it; ``save_weights_external`` files download by signed links
without a key, and an altered, expired or deleted one does not."""

from __future__ import annotations

import asyncio
import hashlib
import os
import warnings
import time
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlsplit

import httpx
import pytest

tinker = pytest.importorskip("tinker")
from tinker import types  # noqa: E402

pytestmark = pytest.mark.heavy  # minutes: scheduled first (tests/conftest.py)

os.environ.setdefault("TINKER_TELEMETRY", "0")
TINY = "opentinker-tiny-arith"
ADAM = types.AdamParams(learning_rate=5e-3)


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})


BATCH = [datum(list(range(10, 26))), datum(list(range(40, 49)))]


def status_of(future) -> int:
    """The HTTP status a refused SDK call raised."""
    with pytest.raises(tinker.APIStatusError) as raised:
        future.result()
    return raised.value.status_code


def digest(folder: Path) -> dict[str, str]:
    return {str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted(folder.rglob("*")) if f.is_file()}


@pytest.fixture(scope="module")
def world(server, keys):
    """alice's trained LoRA model (one step) and the SDK clients of alice and bob."""
    alice = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["alice"])
    bob = tinker.ServiceClient(base_url=server.url, api_key="tml-" + keys["bob"], project_id="archive")
    trainer = alice.create_lora_training_client(base_model=TINY, rank=4, seed=3).result()
    trainer.forward_backward(BATCH, "cross_entropy").result()
    trainer.optim_step(ADAM).result()
    svc = server.app.state.tinker
    yield {"alice": alice, "bob": bob, "trainer": trainer, "svc": svc, "store": server.app.state.store,
           "alice_rest": tinker.RestClient(base_url=server.url, api_key="tml-" + keys["alice"]),
           "bob_rest": tinker.RestClient(base_url=server.url, api_key="tml-" + keys["bob"])}
    for client in (alice, bob):
        client.close("success").result(timeout=120)


def _row(svc, tinker_path: str):
    run, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return svc.state.checkpoint(run, kind, name, None)


def _sample(service, path: str) -> list[int]:
    sampler = service.create_sampling_client(model_path=path).result()
    answer = sampler.sample(prompt=types.ModelInput.from_ints([10, 11, 12]), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=4, seed=1)).result()
    return list(answer.sequences[0].tokens)


def test_an_unpublished_checkpoint_is_missing_to_others_and_the_refusal_is_audited(world):
    trainer, bob, bob_rest, svc = world["trainer"], world["bob"], world["bob_rest"], world["svc"]
    private = trainer.save_weights_for_sampler("private").result().path
    state = trainer.save_state("private-state").result().path
    alice_id = world["store"].get_user("alice").id
    before = len(svc.audit.entries(user_id=alice_id, events=("access_denied",)))

    missing = private.replace("private", "no-such-checkpoint")
    for path in (private, missing):  # the same answer, word for word
        with pytest.raises(tinker.NotFoundError) as raised:
            bob.create_sampling_client(model_path=path).result()
        assert f"checkpoint {path!r} not found" in str(raised.value)
    assert status_of(bob_rest.get_weights_info_by_tinker_path(state)) == 404
    assert status_of(bob_rest.delete_checkpoint_from_tinker_path(state)) == 404
    assert status_of(bob_rest.publish_checkpoint_from_tinker_path(state)) == 404
    assert status_of(bob_rest.get_training_run_by_tinker_path(state)) == 404
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state(state).result()

    denied = svc.audit.entries(user_id=alice_id, events=("access_denied",))
    assert len(denied) - before == 6  # sampler (not the missing one), weights_info, delete, publish, run, load
    newest = denied[0]
    assert newest.details["asker"] == "bob" and newest.details["tinker_path"] == state
    assert newest.user_name == "alice"  # about the owner: bob's own entries say nothing of it
    bob_id = world["store"].get_user("bob").id
    # (the shared server's other tests leave bob entries of their own: only this test's paths count)
    assert not [e for e in svc.audit.entries(user_id=bob_id, events=("access_denied",))
                if e.details.get("tinker_path") in (private, state, missing)]
    assert _row(svc, state) is not None  # nothing was changed


def test_a_published_checkpoint_loads_for_another_user_and_stays_read_only(world):
    trainer, alice_rest, bob, bob_rest, svc = (world[k] for k in ("trainer", "alice_rest", "bob", "bob_rest", "svc"))
    sampler_path = trainer.save_weights_for_sampler("shared").result().path
    state_path = trainer.save_state("shared-state").result().path
    for path in (sampler_path, state_path):
        alice_rest.publish_checkpoint_from_tinker_path(path).result()
        alice_rest.publish_checkpoint_from_tinker_path(path).result()  # again: no change, no error
    listed = {c.tinker_path: c for c in alice_rest.list_checkpoints(trainer.model_id).result().checkpoints}
    assert listed[sampler_path].public and listed[state_path].public
    state_folder = Path(_row(svc, state_path).folder)
    before = digest(state_folder)

    # bob samples from it, and trains a model of his own from it.
    assert _sample(bob, sampler_path) == _sample(world["alice"], sampler_path)
    info = bob_rest.get_weights_info_by_tinker_path(state_path).result()
    assert (info.base_model, info.lora_rank) == (TINY, 4)
    run = bob_rest.get_training_run_by_tinker_path(state_path).result()
    assert run.model_owner == "alice" and run.training_run_id == trainer.model_id
    bobs = bob.create_training_client_from_state(state_path).result()
    bobs.forward_backward(BATCH, "cross_entropy").result()
    bobs.optim_step(ADAM).result()
    bob_runs = {r.training_run_id: r for r in bob_rest.list_training_runs().result().training_runs}
    assert bob_runs[bobs.model_id].model_owner == "bob" and trainer.model_id not in bob_runs
    bobs.save_state("mine").result()
    assert digest(state_folder) == before  # the published checkpoint never changes
    bob_id = world["store"].get_user("bob").id
    reads = svc.audit.entries(user_id=bob_id, events=("checkpoint_read",))
    assert {e.details["tinker_path"] for e in reads} >= {sampler_path, state_path}
    assert all(e.details["owner"] == "alice" for e in reads)

    # ... and cannot change or delete it (403: he may read it).
    assert status_of(bob_rest.delete_checkpoint_from_tinker_path(state_path)) == 403
    assert status_of(bob_rest.unpublish_checkpoint_from_tinker_path(state_path)) == 403
    assert status_of(bob_rest.set_checkpoint_ttl_from_tinker_path(state_path, 7200)) == 403
    assert _row(svc, state_path).public and _row(svc, state_path).expires_at is None

    # Unpublished: missing to bob again (his own model stays his).
    alice_rest.unpublish_checkpoint_from_tinker_path(sampler_path).result()
    alice_rest.unpublish_checkpoint_from_tinker_path(state_path).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=sampler_path).result()
    assert status_of(bob_rest.get_training_run_by_tinker_path(state_path)) == 404
    assert status_of(bob_rest.get_weights_info_by_tinker_path(state_path)) == 404
    bobs.forward_backward(BATCH, "cross_entropy").result()
    events = [e.event for e in svc.audit.entries(user_id=world["store"].get_user("alice").id, category="checkpoints")]
    assert {"checkpoint_publish", "checkpoint_unpublish"} <= set(events)


def test_a_checkpoints_ttl_is_set_removed_and_bounded(world):
    trainer, rest, svc = world["trainer"], world["alice_rest"], world["svc"]
    path = trainer.save_state("kept").result().path
    rest.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    (listed,) = [c for c in rest.list_checkpoints(trainer.model_id).result().checkpoints if c.tinker_path == path]
    assert abs(listed.expires_at.timestamp() - (time.time() + 7200)) < 60
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert _row(svc, path).expires_at is None
    for wrong in (60, 11 * 365 * 86400):
        with pytest.raises(tinker.BadRequestError, match=r"ttl_seconds .* out of range: give 3600 \(1 hour\) to"):
            rest.set_checkpoint_ttl_from_tinker_path(path, wrong).result()
    assert _row(svc, path).expires_at is None
    entries = svc.audit.entries(user_id=world["store"].get_user("alice").id, events=("checkpoint_ttl_set",))
    assert [e.details.get("ttl_seconds") for e in entries[:2]] == [None, 7200]


def test_copy_weights_shares_the_folder_and_outlives_the_source(world, server, keys):
    trainer, alice_rest, bob, bob_rest, svc = (world[k] for k in ("trainer", "alice_rest", "bob", "bob_rest", "svc"))
    source = trainer.save_weights_for_sampler("to-copy").result().path
    expected = _sample(world["alice"], source)
    with pytest.raises(tinker.NotFoundError):  # not published yet
        bob.copy_weights(source).result()
    alice_rest.publish_checkpoint_from_tinker_path(source).result()

    copied = bob.copy_weights(source, ttl_seconds=86400).result()
    copy_run, kind, name = copied.removeprefix("tinker://").split("/")
    assert (kind, name) == ("sampler_weights", "to-copy") and copy_run != trainer.model_id
    original, copy = _row(svc, source), _row(svc, copied)
    assert copy.folder == original.folder and copy.user_id != original.user_id  # no new bytes
    assert copy.expires_at is not None and copy.size_bytes == original.size_bytes
    runs = {r.training_run_id for r in bob_rest.list_training_runs().result().training_runs}
    assert copy_run in runs  # a run of bob's, in his project
    model = svc.state.model(copy_run)
    assert model.state == "copy"
    assert svc.state.store.query("SELECT project_id FROM tinker_sessions WHERE session_id = ?",
                                 (model.session_id,))[0]["project_id"] == "archive"

    with httpx.Client(base_url=server.url, headers={"X-API-Key": "tml-" + keys["bob"]}, trust_env=False,
                      timeout=30) as raw:
        body = {"source_path": source, "destination_project_id": "archive"}
        answers = [raw.post("/api/v1/copy_weights", json=body, headers={"X-Idempotency-Key": "same-key"})
                   for _ in range(2)]
        assert [a.status_code for a in answers] == [200, 200]
        assert answers[0].json() == answers[1].json()  # the same key answers the same copy
        refused = raw.post("/api/v1/copy_weights", json=dict(body, weights_access_token="t"))
        assert refused.status_code == 400 and "weights_access_token is not offered" in refused.text
        refused = raw.post("/api/v1/copy_weights", json=dict(body, ttl_seconds=5))
        assert refused.status_code == 400 and "ttl_seconds 5 is out of range" in refused.text
        trained = raw.post("/api/v1/optim_step", json={"model_id": copy_run, "seq_id": 1,
                                                       "adam_params": {"learning_rate": 0.001}})
        assert trained.status_code == 400 and "cannot be trained on" in trained.text

    # The source goes; the copy (and its files) stay and still sample the same weights.
    alice_rest.delete_checkpoint_from_tinker_path(source).result()
    assert _row(svc, source) is None and Path(copy.folder).is_dir()
    assert _sample(bob, copied) == expected
    again = bob_rest.copy_weights(copied, "archive").result()  # a copy of his copy: the same folder again
    assert _row(svc, again).folder == copy.folder
    for path in [copied, answers[0].json()["tinker_path"], again]:
        bob_rest.delete_checkpoint_from_tinker_path(path).result()
    assert not Path(copy.folder).exists()  # the last row naming it went
    bob_id = world["store"].get_user("bob").id
    owners = {e.details["source"]: e.details["source_owner"]
              for e in svc.audit.entries(user_id=bob_id, events=("checkpoint_copy",))}
    assert owners[source] == "alice" and owners[copied] == "bob"


def test_external_weights_download_by_signed_links(world, server, data_dir):
    trainer, rest, bob_rest, svc = world["trainer"], world["alice_rest"], world["bob_rest"], world["svc"]
    with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
        trainer.save_weights_external("sealed", age_encryption_recipients=["age1xyz"]).result()
    path = trainer.save_weights_external("export", ttl_seconds=86400).result().path
    assert path == f"tinker://{trainer.model_id}/external_weights/export"
    folder = Path(_row(svc, path).folder)
    alice_id = world["store"].get_user("alice").id
    assert folder.parent.parent == data_dir / "external" / str(alice_id)  # the operator's folder, per user
    (listed,) = [c for c in rest.list_checkpoints(trainer.model_id).result().checkpoints if c.tinker_path == path]
    assert listed.checkpoint_type == "external" and listed.size_bytes > 0

    answer = rest.get_external_weights_urls(path).result()
    on_disk = {str(f.relative_to(folder)): f.read_bytes() for f in folder.rglob("*") if f.is_file()}
    assert set(answer.urls) == set(on_disk) and "adapter_config.json" in on_disk
    assert answer.expires.timestamp() > time.time() + 3000
    assert status_of(bob_rest.get_external_weights_urls(path)) == 404  # not his, not published
    with httpx.Client(trust_env=False, timeout=30) as anyone:  # no key
        for file, url in answer.urls.items():
            got = anyone.get(url)
            assert got.status_code == 200 and got.content == on_disk[file], file
        url = answer.urls["adapter_config.json"]
        parts = urlsplit(url)
        query = parse_qs(parts.query)
        signature, expires = query["signature"][0], int(query["expires"][0])
        base = f"{parts.scheme}://{parts.netloc}"
        flipped = signature[:-1] + ("0" if signature[-1] != "0" else "1")
        altered = [f"{base}{parts.path}?{urlencode({'expires': expires, 'signature': flipped})}",
                   f"{base}{parts.path}?{urlencode({'expires': expires + 3600, 'signature': signature})}",
                   url.replace("adapter_config.json", "adapter_model.safetensors"),
                   url.replace("adapter_config.json", "..%2F..%2F..%2Fopentinker.db"),
                   f"{base}{parts.path}?expires={expires}"]
        for wrong in altered:
            assert anyone.get(wrong).status_code == 403, wrong
        assert anyone.get(f"{base}{parts.path}").status_code == 401  # no credential at all, as on every route
        # A link signed an hour ago for a minute: expired.
        link, _ = svc.signer.sign(parts.path, 60, now=time.time() - 3600)
        expired = anyone.get(base + link)
        assert expired.status_code == 403 and "expired" in expired.json()["error"]
        downloads = [e for e in svc.audit.entries(user_id=alice_id, events=("checkpoint_download",))
                     if e.details.get("tinker_path") == path]  # not a job's download by another test
        assert {e.details["file"] for e in downloads} >= set(on_disk)

        rest.delete_checkpoint_from_tinker_path(path).result()
        assert anyone.get(url).status_code == 404 and not folder.exists()
    exported = svc.audit.entries(user_id=alice_id, events=("checkpoint_export",))
    assert exported[0].details["tinker_path"] == path


def test_the_async_twins(world):
    """The deprecated ``_async`` methods reach the same routes."""
    trainer, rest, bob = world["trainer"], world["alice_rest"], world["bob"]

    async def run() -> tuple[str, str, dict]:
        export = await (await trainer.save_weights_external_async("twin"))
        urls = await rest.get_external_weights_urls_async(export.path)
        await rest.publish_checkpoint_from_tinker_path_async(export.path)
        await rest.set_checkpoint_ttl_from_tinker_path_async(export.path, 3600)
        copied = await rest.copy_weights_async(export.path, "twins", ttl_seconds=3600)
        copied_by_bob = await bob.copy_weights(export.path)
        await rest.unpublish_checkpoint_from_tinker_path_async(export.path)
        return export.path, copied, urls.urls, copied_by_bob

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        path, copied, urls, copied_by_bob = asyncio.run(run())
    svc = world["svc"]
    row = _row(svc, path)
    assert not row.public and row.expires_at is not None and "adapter_config.json" in urls
    assert _row(svc, copied).folder == _row(svc, copied_by_bob).folder == row.folder

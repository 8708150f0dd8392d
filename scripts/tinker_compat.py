"""Write docs/tinker-compatibility.md: the official ``tinker`` SDK, method by method, against this server.

Starts a server in-process (a fresh data dir, its own Ray) and calls every public method of the
SDK's ServiceClient, TrainingClient, SamplingClient, RestClient and AdminClient. The methods are found with
``inspect``, so one a newer SDK adds shows up as "not exercised" until CASES has a call for it;
``X_async`` reuses X's call. Exits 1 if any call failed (a server bug); the file is written anyway.

    .venv/bin/python scripts/tinker_compat.py
"""

from __future__ import annotations

import asyncio
import datetime as dt
import inspect
import itertools
import logging
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any, Callable, NamedTuple

os.environ["TINKER_TELEMETRY"] = "0"
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # the Hub is never asked; tokenizers come from the cache below


def tiny_tokenizer_in_hf_cache() -> None:
    """The tiny model's tokenizer in a private Hugging Face cache under its served name (what
    docs/tinker.md tells cookbook users to do), so the SDK's get_tokenizer() finds it offline."""
    from opentinker.tiny import ensure_tiny_model

    home = Path(tempfile.mkdtemp(prefix="tinker-compat-hf-"))
    repo = home / "hub" / "models--opentinker-tiny-arith"
    snapshot = repo / "snapshots" / "local"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("local")
    folder = ensure_tiny_model()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):  # AutoTokenizer reads config.json too
        (snapshot / name).write_bytes((folder / name).read_bytes())
    os.environ["HF_HOME"] = str(home)  # before huggingface_hub is imported: it reads this once


tiny_tokenizer_in_hf_cache()

import tinker  # noqa: E402
from tinker import types  # noqa: E402
from tinker.lib.api_future_impl import QueueState  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "tinker-compatibility.md"
COMMAND = ".venv/bin/python scripts/tinker_compat.py"
CLASSES = ("ServiceClient", "TrainingClient", "SamplingClient", "RestClient", "AdminClient")
MODEL = "opentinker-tiny-arith"
TOKENS = [1, 5, 9, 12, 40, 41, 42, 43]  # any ids below the tiny model's vocabulary (1536)
TIMEOUT_S = 120
SUPPORTED, REFUSED, FAILED, NOT_EXERCISED = "supported", "refused (clear error)", "failed", "not exercised"


def start_server() -> tuple[str, str]:
    """A server on a free loopback port with a fresh user: ``(base_url, api_key)``."""
    import ray
    import uvicorn

    from opentinker.server import auth
    from opentinker.server.app import create_app
    from opentinker.server.settings import ServerSettings
    from opentinker.server.store import Store

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    data_dir = Path(tempfile.mkdtemp(prefix="tinker-compat-"))
    store = Store(data_dir / "opentinker.db")
    key = auth.create_api_key(store, auth.create_user(store, "compat"))
    store.close()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    # Each create_* / *_from_state case starts a model of its own: more than the default 4 per user.
    settings = ServerSettings(data_dir=data_dir, port=port, tinker_long_poll_s=5, tinker_max_models_per_user=32,
                              tinker_max_models=32)
    server = uvicorn.Server(uvicorn.Config(create_app(settings), log_level="warning", loop="asyncio"))
    threading.Thread(target=lambda: server.run(sockets=[sock]), daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", "tml-" + key


# -- what the calls are made with ----------------------------------------------------------


def datum(**inputs: list[float]) -> types.Datum:
    """A next-token datum (targets: the input shifted by one) with these per-token inputs."""
    return types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                       loss_fn_inputs={"target_tokens": TOKENS[1:], **inputs})


def prompt(n: int = 3) -> types.ModelInput:
    return types.ModelInput.from_ints(TOKENS[:n])


def neg_ll(logprobs, weights):  # a per-datum loss for create_custom_loss (traced with torch.fx)
    loss = -(logprobs * weights).sum()
    return loss, {"custom/neg_ll:sum": loss}


def custom_loss(data, logprobs_list):  # a client-side loss for forward_backward_custom
    loss = sum(-(lp * d.loss_fn_inputs["weights"].to_torch()).sum() for d, lp in zip(data, logprobs_list))
    return loss, {"custom_loss": loss.item()}


N = len(TOKENS) - 1
SFT = datum(weights=[1.0] * N)
RL = datum(logprobs=[-7.0] * N, advantages=[(-1.0) ** i for i in range(N)])  # what the RL losses read
GSPO = datum(logprobs=[-7.0] * N, advantages=[(-1.0) ** i for i in range(N)], sequence_ratio_mask=[1.0] * N)
RANKS = {"logprobs": 1, "weights": 1}
ADAM = types.AdamParams(learning_rate=1e-3)
TODAY = dt.date.today()


class Fixtures:
    """Clients and checkpoints the cases share, each made on first use by SDK calls the table also
    checks (so a broken one fails the rows that need it, not the whole script)."""

    def __init__(self, base_url: str, api_key: str):
        self.base_url, self.api_key = base_url, api_key
        self._names = itertools.count()

    def name(self, prefix: str) -> str:
        return f"{prefix}-{next(self._names)}"

    def new_service(self, **kwargs: Any) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.base_url, api_key=self.api_key, **kwargs)

    def spare_checkpoint(self) -> str:
        """A checkpoint a deleting call may remove."""
        return self.training.save_weights_for_sampler(self.name("spare")).result().path

    service = cached_property(lambda self: self.new_service())
    training = cached_property(lambda self: self.service.create_lora_training_client(MODEL, rank=8).result())
    state_path = cached_property(lambda self: self.training.save_state(self.name("state")).result().path)
    sampler_path = cached_property(lambda self: self.training.save_weights_for_sampler(self.name("s")).result().path)
    sampling = cached_property(lambda self: self.service.create_sampling_client(self.sampler_path).result())
    rest = cached_property(lambda self: tinker.RestClient(base_url=self.base_url, api_key=self.api_key))
    admin = cached_property(lambda self: tinker.AdminClient(base_url=self.base_url, api_key=self.api_key))
    external_path = cached_property(lambda self: self.training.save_weights_external(self.name("ext")).result().path)


class Lazy(NamedTuple):  # an argument (or call target) made from the fixtures when its case runs
    make: Callable[[Fixtures], Any]


STATE, SAMPLER_PATH = Lazy(lambda fx: fx.state_path), Lazy(lambda fx: fx.sampler_path)
SESSION, RUN = Lazy(lambda fx: fx.service.holder.get_session_id()), Lazy(lambda fx: fx.training.model_id)
NEW_SERVICE = Lazy(Fixtures.new_service)


def named(prefix: str) -> Lazy:
    """A checkpoint name no other call uses (X and X_async share a call)."""
    return Lazy(lambda fx: fx.name(prefix))


class Case:
    """A call of the row's method on ``target`` (a fixture's name, a Lazy or an object); ``note`` says
    what its result shows."""

    def __init__(self, target: Any, *args: Any, note: Callable[[Any], Any] = lambda result: "",
                 **kwargs: Any):
        self.target, self.args, self.kwargs, self.note = target, args, kwargs, note

    def call(self, fx: Fixtures, method: str, is_async: bool) -> str:
        """Make the call and return its note; a future (APIFuture, a Backcompat*Future client) is waited for."""
        value = lambda a: a.make(fx) if isinstance(a, Lazy) else a  # noqa: E731
        bound = getattr(getattr(fx, self.target) if isinstance(self.target, str) else value(self.target), method)
        args, kwargs = [value(a) for a in self.args], {k: value(v) for k, v in self.kwargs.items()}
        if is_async:
            result = asyncio.run(settle_async(bound(*args, **kwargs)))
        else:
            result = bound(*args, **kwargs)
            result = result.result() if callable(getattr(result, "result", None)) else result
        return str(self.note(result))


async def settle_async(coroutine: Any) -> Any:
    value = await coroutine
    return await value if inspect.isawaitable(value) else value  # forward_async and co. return an APIFuture


def fb_note(out: types.ForwardBackwardOutput) -> str:
    n = len(out.loss_fn_outputs[0]["logprobs"].tolist())
    return f"{n} logprobs for {N} targets; metrics {', '.join(sorted(out.metrics))}"


def sample_note(out: types.SampleResponse) -> str:
    note = f"{len(out.sequences)} sequences of {[len(s.tokens) for s in out.sequences]} tokens with logprobs"
    if out.prompt_logprobs is not None:
        note += f"; {len(out.prompt_logprobs)} prompt logprobs"
    if out.topk_prompt_logprobs is not None:
        note += f", top-{len(out.topk_prompt_logprobs[-1] or [])} at each"
    return note


def sampler_note(sampler: tinker.SamplingClient) -> str:
    out = sampler.sample(prompt(), 1, types.SamplingParams(max_tokens=2)).result()
    return f"a sampler of {sampler.get_base_model()}; sampled {len(out.sequences[0].tokens)} tokens with it"


def model_note(tc: tinker.TrainingClient) -> str:
    info = tc.get_info()
    return f"model {tc.model_id} of {info.model_data.model_name}, lora_rank {info.lora_rank}"


def fb(loss: str, data: types.Datum = RL, **config: float) -> Case:
    return Case("training", [data], loss, config or None, note=fb_note)


def sample(**kwargs: Any) -> Case:
    return Case("sampling", prompt(), 2, types.SamplingParams(max_tokens=4, seed=0), note=sample_note, **kwargs)


client_side = lambda result: f"client-side, no request: {result}"  # noqa: E731
counted = lambda name: lambda result: f"{len(getattr(result, name))} {name}"  # noqa: E731
path_of = lambda result: result.path  # noqa: E731
lora_of = lambda result: f"{result.base_model}, lora_rank {result.lora_rank}"  # noqa: E731
deleted = lambda _: "deleted"  # noqa: E731

# "Class.method" or "Class.method[variant]" -> its call.
CASES: dict[str, Case] = {
    "ServiceClient.close": Case(NEW_SERVICE, "success", note=lambda _: "a second session, finished"),
    # The SDK copies into the client's project (project_id=, or TINKER_PROJECT_ID).
    "ServiceClient.copy_weights": Case(Lazy(lambda fx: fx.new_service(project_id="default")), STATE),
    # A loss is made once per session: this is another session's, so the LossHandle row can make its own.
    "ServiceClient.create_custom_loss": Case(
        NEW_SERVICE, neg_ll, RANKS, note=lambda h: f"a LossHandle; runs {'server' if h.loss_id else 'client'}-side"),
    "ServiceClient.create_lora_training_client": Case("service", MODEL, 4, note=model_note),
    "ServiceClient.create_rest_client": Case("service", note=lambda r: type(r).__name__),
    "ServiceClient.create_sampling_client": Case("service", base_model=MODEL, note=sampler_note),
    "ServiceClient.create_sampling_client[model_path]": Case("service", SAMPLER_PATH, note=sampler_note),
    "ServiceClient.create_training_client_from_state": Case("service", STATE, note=model_note),
    "ServiceClient.create_training_client_from_state_with_optimizer": Case("service", STATE, note=model_note),
    "ServiceClient.get_console_url": Case("service", note=client_side),
    "ServiceClient.get_server_capabilities": Case(
        "service", note=lambda r: "models: " + ", ".join(m.model_name for m in r.supported_models)),
    "ServiceClient.get_telemetry": Case("service", note=client_side),
    "TrainingClient.create_sampling_client": Case("training", SAMPLER_PATH, note=sampler_note),
    "TrainingClient.forward": fb("cross_entropy", SFT),
    "TrainingClient.forward_backward": fb("cross_entropy", SFT),
    "TrainingClient.forward_backward[importance_sampling]": fb("importance_sampling"),
    "TrainingClient.forward_backward[ppo]": fb("ppo", clip_low_threshold=0.8, clip_high_threshold=1.2),
    "TrainingClient.forward_backward[cispo]": fb("cispo"),
    "TrainingClient.forward_backward[dro]": fb("dro", beta=0.05),
    "TrainingClient.forward_backward[gspo]": fb("gspo", GSPO),
    "TrainingClient.forward_backward[stable_reinforce]": fb("stable_reinforce"),
    "TrainingClient.forward_backward_custom": Case("training", [SFT], custom_loss, note=fb_note),
    "TrainingClient.forward_backward_custom[LossHandle]": Case(
        "training", [SFT], Lazy(lambda fx: fx.service.create_custom_loss(neg_ll, RANKS).result()), note=fb_note),
    "TrainingClient.get_console_url": Case("training", note=client_side),
    "TrainingClient.get_info": Case("training", note=lambda r: f"{r.model_name}, lora_rank {r.lora_rank}"),
    "TrainingClient.get_telemetry": Case("training", note=client_side),
    "TrainingClient.get_tokenizer": Case("training", note=lambda t: type(t).__name__),
    "TrainingClient.load_state": Case("training", STATE, note=path_of),
    "TrainingClient.load_state_with_optimizer": Case("training", STATE, note=path_of),
    "TrainingClient.optim_step": Case("training", ADAM, note=lambda r: f"metrics {', '.join(sorted(r.metrics))}"),
    "TrainingClient.save_state": Case("training", named("state"), note=path_of),
    "TrainingClient.save_weights_and_get_sampling_client": Case("training", named("snap"), note=sampler_note),
    "TrainingClient.save_weights_and_get_sampling_client[ephemeral]": Case("training", note=sampler_note),
    "TrainingClient.save_weights_and_get_sampling_client[record_stability_info]": Case(
        "training", record_stability_info=True, note=sampler_note),
    "TrainingClient.save_weights_external": Case("training", named("external"), note=path_of),
    "TrainingClient.save_weights_for_sampler": Case("training", named("sampler"), note=path_of),
    "SamplingClient.compute_logprobs": Case("sampling", prompt(8), note=lambda lp: f"{len(lp)} logprobs, first None"),
    "SamplingClient.compute_logprobs[prompt_logprobs_last_n]": Case(
        "sampling", prompt(8), 3, note=lambda lp: f"{sum(x is not None for x in lp)} of {len(lp)} scored"),
    "SamplingClient.create": Case(
        tinker.SamplingClient, Lazy(lambda fx: fx.service.holder), base_model=MODEL, note=sampler_note),
    "SamplingClient.from_sampler_handle": Case(tinker.SamplingClient, Lazy(lambda fx: fx.sampling.get_sampler_handle()),
                                               api_key=Lazy(lambda fx: fx.api_key), note=sampler_note),
    "SamplingClient.get_base_model": Case("sampling", note=client_side),
    "SamplingClient.get_sampler_handle": Case("sampling", note=lambda h: f"client-side: {len(h)} characters"),
    "SamplingClient.get_telemetry": Case("sampling", note=client_side),
    "SamplingClient.get_tokenizer": Case("sampling", note=lambda t: type(t).__name__),
    "SamplingClient.on_queue_state_change": Case("sampling", QueueState.ACTIVE, None, note=client_side),
    "SamplingClient.sample": sample(),
    "SamplingClient.sample[prompt_logprobs]": sample(include_prompt_logprobs=True, topk_prompt_logprobs=2),
    "SamplingClient.sample[topk_sample_logprobs]": sample(topk_sample_logprobs=2),
    "SamplingClient.sample[prompt_alt_tokens_k]": sample(prompt_alt_tokens_k=2),
    "RestClient.assign_session_project": Case("rest", SESSION, "nightly", note=lambda _: "moved"),
    "RestClient.copy_weights": Case("rest", STATE, "archive", note=lambda path: f"a copy at {path}"),
    "RestClient.delete_checkpoint": Case(  # tinker://<run id>/<checkpoint id>
        "rest", RUN, Lazy(lambda fx: fx.spare_checkpoint().split("/", 3)[3]), note=deleted),
    "RestClient.delete_checkpoint_from_tinker_path": Case("rest", Lazy(Fixtures.spare_checkpoint), note=deleted),
    "RestClient.export_session_trace": Case("rest", SESSION, note=lambda url: f"a signed link, {url.count('&')} & params"),
    "RestClient.get_audit_log": Case("rest", note=counted("entries")),
    "RestClient.get_billing_usage": Case("rest", TODAY.isoformat(), (TODAY + dt.timedelta(days=1)).isoformat(),
                                         note=lambda r: f"{len(r.data)} hourly events"),
    "RestClient.get_current_checkpoint_storage_usage": Case(
        "rest", note=lambda r: f"{sum(d.checkpoint_count for d in r.data)} checkpoints"),
    "RestClient.get_external_weights_urls": Case("rest", Lazy(lambda fx: fx.external_path),
                                                 note=lambda r: f"{len(r.urls)} signed file links"),
    "RestClient.get_sampler": Case(  # the SDK keeps a sampler's id private
        "rest", Lazy(lambda fx: fx.sampling._sampling_session_id), note=lambda r: f"model_path {r.model_path}"),
    "RestClient.get_server_capabilities": Case("rest", note=counted("supported_models")),
    "RestClient.get_session": Case("rest", SESSION),
    "RestClient.get_telemetry": Case("rest", note=client_side),
    "RestClient.get_training_run": Case("rest", RUN, note=lora_of),
    "RestClient.get_training_run_by_tinker_path": Case("rest", STATE, note=lambda r: f"run {r.training_run_id}"),
    "RestClient.get_weights_info_by_tinker_path": Case("rest", STATE, note=lora_of),
    "RestClient.list_checkpoints": Case("rest", RUN, note=counted("checkpoints")),
    "RestClient.list_sessions": Case("rest"),
    "RestClient.list_training_runs": Case("rest", note=counted("training_runs")),
    "RestClient.list_user_checkpoints": Case("rest", note=counted("checkpoints")),
    "RestClient.publish_checkpoint_from_tinker_path": Case("rest", SAMPLER_PATH, note=lambda _: "published"),
    "RestClient.search_sessions": Case("rest", types.SessionSearchRequest(), note=counted("sessions")),
    "RestClient.set_checkpoint_ttl_from_tinker_path": Case("rest", SAMPLER_PATH, 3600, note=lambda _: "TTL set"),
    "RestClient.unpublish_checkpoint_from_tinker_path": Case("rest", SAMPLER_PATH, note=lambda _: "unpublished"),
    "RestClient.whoami": Case("rest", note=lambda r: f"user {r.user_urn}"),
    "AdminClient.get_audit_log": Case("admin", note=counted("entries")),
    "AdminClient.get_billing_usage": Case("admin", TODAY.isoformat(), (TODAY + dt.timedelta(days=1)).isoformat(),
                                          note=lambda r: f"{len(r.data)} hourly events"),
    "AdminClient.get_current_checkpoint_storage_usage": Case(
        "admin", note=lambda r: f"{sum(d.checkpoint_count for d in r.data)} checkpoints"),
    "AdminClient.get_telemetry": Case("admin", note=client_side),
}


# -- running and judging the calls ---------------------------------------------------------


@dataclass
class Row:
    cls: str
    label: str
    result: str
    note: str = ""


def with_timeout(fn: Callable[[], Any]) -> Any:
    """``fn()`` in a thread of its own, given up on (and left behind) after TIMEOUT_S."""
    future = ThreadPoolExecutor(1).submit(fn)
    try:
        return future.result(TIMEOUT_S)
    except TimeoutError:
        if future.done():  # fn's own TimeoutError
            raise
        raise TimeoutError(f"no answer in {TIMEOUT_S} s") from None


def judge(error: Exception, case: Case) -> tuple[str, str]:
    """Refused: a 4xx with the server's message, or a failed future the server put down to the request.
    The calls name only things that exist, in well-formed paths, so a 404 is a route the server lacks,
    a 405 or a "not a checkpoint path" one it misroutes (``…/publish`` read as a checkpoint id), and
    a 422 a request it misreads: failures, like 5xx, timeouts and client-side exceptions."""
    if isinstance(error, tinker.APIStatusError):
        message = (error.body if isinstance(error.body, dict) else {}).get("error") or str(error)
        misrouted = error.status_code in (404, 405, 422) or "is not a checkpoint path" in message
        if 400 <= error.status_code < 500 and not misrouted:
            return REFUSED, message
        request = error.response.request
        return FAILED, f"{error.status_code} {message!r} for {request.method} {request.url.path}"
    if isinstance(error, tinker.RequestFailedError) and error.category == types.RequestErrorCategory.User:
        return REFUSED, error.message
    return FAILED, f"{type(error).__name__}: {error}"


def cases_of(cls: str, method: str) -> tuple[str, dict[str, Case], bool]:
    """``(key prefix, cases, is_async)``: the method's own cases and variants, or for ``X_async`` X's first."""
    base = method.removesuffix("_async")
    is_async = method != base and f"{cls}.{method}" not in CASES
    prefix = f"{cls}.{base if is_async else method}"
    cases = {key: case for key, case in CASES.items() if key == prefix or key.startswith(prefix + "[")}
    return prefix, dict(itertools.islice(cases.items(), 1)) if is_async else cases, is_async


def run_method(fx: Fixtures, cls: str, method: str) -> list[Row]:
    prefix, cases, is_async = cases_of(cls, method)
    rows = [] if cases else [Row(cls, method, NOT_EXERCISED)]
    for key, case in cases.items():
        label = method + key.removeprefix(prefix).replace("[", " (").replace("]", ")")
        started = time.monotonic()
        try:  # the fixtures a call needs are made in it, under its timeout
            rows.append(Row(cls, label, SUPPORTED, with_timeout(partial(case.call, fx, method, is_async))))
        except Exception as error:  # noqa: BLE001 (the row's outcome)
            rows.append(Row(cls, label, *judge(error, case)))
        # One line, ids masked (the file changes only when an outcome does), trimmed.
        rows[-1].note = re.sub(r"[0-9a-f]{32}", "{id}", " ".join(rows[-1].note.split()))[:160]
        print(f"  {label:56} {rows[-1].result:22} {time.monotonic() - started:5.1f}s  {rows[-1].note[:100]}")
    if not cases:
        print(f"  {method:56} {NOT_EXERCISED}")
    return rows


def public_methods(cls: type) -> list[str]:
    """Public callables of ``cls``, inherited ones included (a property such as ``holder`` is not one)."""
    return [name for name, value in inspect.getmembers(cls) if not name.startswith("_") and callable(value)]


# -- the report ----------------------------------------------------------------------------

# Where the SDK's meaning is a hosted service's, what this self-hosted server does instead.
SELF_HOSTED = [
    ("whoami", "the user as `tml:user:<name>`; `org_urn` is this server's id (one server, one organization); no email"),
    ("assign_session_project, search_sessions, ServiceClient(project_id=)",
     "a project is a name in the user's own namespace (`--max-projects-per-user`); no project is shared "
     "between users; `accessible` / `user` owners reach other users' sessions only for an admin key"),
    ("publish / unpublish", "a published checkpoint is readable by every user of this server (sample, load into "
     "their own model, weights info); only its owner changes or deletes it"),
    ("copy_weights", "the copy shares the source's folder (nothing is written) and is a run that cannot be trained "
     "on; `weights_access_token` is refused (there are no other accounts to read from)"),
    ("save_weights_external", "written to the operator's `--external-weights-dir`, never to a place the client "
     "names; `age_encryption_recipients` is refused (no age encryption here)"),
    ("get_external_weights_urls, export_session_trace", "links signed by this server (HMAC, `--signed-url-s`) to "
     "itself (`--public-url`); a trace is Chrome trace-event JSON, which Perfetto opens, not `.pftrace`"),
    ("get_billing_usage, get_current_checkpoint_storage_usage", "usage metering: tokens, checkpoints and "
     "GB-hours per user, session and project; costs only where the operator set `--price`; a user reads their "
     "own, an admin key everyone's"),
    ("get_audit_log", "entries about the caller (an admin key: everyone's), one UTC day, at most 10,000"),
]


def markdown(rows: list[Row], commit: str) -> str:
    lines = ["# Tinker SDK compatibility", "",
             f"The official `tinker` SDK {tinker.__version__} against this server at commit {commit}: every "
             f"public method of its {len(CLASSES)} clients, called with tiny inputs on `{MODEL}`. Generated by `{COMMAND}` "
             "(do not edit by hand; it exits non-zero when a call failed).", "",
             "*supported*: the call returned; the note says what was checked. *refused (clear error)*: turned "
             "down with the message shown. *failed*: a server bug. *not exercised*: the script has no call for "
             "it yet. `X_async` runs X's first call; `X (variant)` rows are X with other arguments.", ""]
    for cls in CLASSES:
        lines += [f"## {cls}", "", "| method | result | note |", "|---|---|---|"]
        lines += [f"| `{r.label}` | {r.result} | {r.note.replace('|', '/')} |" for r in rows if r.cls == cls]
        lines.append("")
    lines += ["## Self-hosted meanings", "",
              "Where the SDK describes a hosted service, this server does the nearest useful thing:", ""]
    lines += [f"- `{methods}`: {meaning}." for methods, meaning in SELF_HOSTED]
    lines.append("")
    counts = [f"{sum(r.result == result for r in rows)} {result}"
              for result in (SUPPORTED, REFUSED, FAILED, NOT_EXERCISED)]
    lines.append(f"**Totals** ({len(rows)} rows): " + ", ".join(counts) + ".")
    return "\n".join(lines) + "\n"


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()


def main() -> int:
    logging.getLogger("tinker").setLevel(logging.CRITICAL)  # its retry and error lines: each row has the outcome
    warnings.simplefilter("ignore", FutureWarning)  # the SDK's deprecations (most *_async methods)
    commit = f"`{git('rev-parse', '--short', 'HEAD')}`"
    if git("status", "--porcelain", "--", "opentinker"):
        commit += " with uncommitted server changes"
    print(f"tinker {tinker.__version__}, server at {commit}: starting the server")
    fx = Fixtures(*start_server())
    rows: list[Row] = []
    for cls in CLASSES:
        print(cls)
        for method in public_methods(getattr(tinker, cls)):
            rows += run_method(fx, cls, method)
    OUTPUT.parent.mkdir(exist_ok=True)
    OUTPUT.write_text(markdown(rows, commit))
    failed = sum(r.result == FAILED for r in rows)
    print(f"wrote {OUTPUT.relative_to(ROOT)}: {len(rows)} rows, {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.stdout.reconfigure(line_buffering=True)  # progress shows as it goes, even piped
    code = main()
    os._exit(code)  # a call given up on may have left threads (and Ray) behind: do not wait for them

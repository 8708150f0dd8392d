"""One training job, run inside a Ray actor (the server wraps this plain class).

The actor is threaded (``max_concurrency > 1``): ``run`` blocks in one thread while the
server calls ``drain_events``, ``push_batch``, ``cancel``, ``request_checkpoint``,
``refuse_checkpoints`` and ``serve`` from others. ``serve`` answers a chat or text request
with the job's rollout engine between training steps, so it always sees the weights of the last finished step. Events are buffered here and pulled by the server (which makes them JSON-safe), so the actor may live on any
node of a Ray cluster; nothing in this module touches the server's database.
"""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from opentinker.config import flatten
from opentinker.environments.relay import RelayDoor, RelayHub
from opentinker.protocol import JobCreate, step_checkpoint_name
from opentinker.server.policy import JobPolicy

_BATCH_WAIT_S = 0.2  # how often a client-mode job waiting for a batch checks for cancel


class NotServingError(RuntimeError):
    """``serve`` was called while the job has no model loaded (starting, or stopped)."""


class JobCancelled(Exception):
    """Raised inside the loop when the job was asked to stop."""


class JobRunner(RelayDoor):
    def __init__(self, job_id: str, spec: dict[str, Any], job_dir: str, policy: JobPolicy | None = None,
                 resume_from_step: int | None = None):
        from opentinker.engine.cpu_threads import use_node_cores  # torch: only in the job's actor

        use_node_cores()
        self.job_id = job_id
        self.resume_from_step = resume_from_step
        self.spec = JobCreate.model_validate(spec)
        self.job_dir = Path(job_dir)
        self.policy = policy or JobPolicy()
        self._events: list[dict[str, Any]] = []
        self._events_lock = threading.Lock()
        # By step index, not FIFO: calls into a threaded actor may land out of order.
        self._batches: dict[int, list[dict]] = {}
        self._batch_ready = threading.Condition()
        self._cancel = threading.Event()
        self._checkpoint = threading.Event()
        self._checkpoint_refusal: str | None = None  # the server's: why a checkpoint would not be kept now
        self.step = 0
        self._trainer = None  # set once built: what serve() generates with
        self._stopped = False
        self._between_steps = threading.Lock()  # held by a training step, or by serve()
        # The env calls of interactions with relay: client wait here for the job's client.
        self.relay = RelayHub(max_in_flight=self.policy.env_relay_in_flight)

    @staticmethod
    def ray_actor_options(spec: dict[str, Any]) -> dict[str, Any]:
        """Ray resources for the job's actor: GPUs when the job asks for them (Ray hides GPUs
        from actors that do not reserve any). With FSDP the ranks reserve their own."""
        config = flatten(spec.get("config") or {})
        if config.get("actor_rollout_ref.actor.strategy") == "fsdp":
            return {}
        gpus = config.get("trainer.n_gpus_per_node") or 0
        return {"num_gpus": gpus} if gpus > 0 else {}

    # -- called by the server ------------------------------------------------------
    def drain_events(self) -> list[dict[str, Any]]:
        with self._events_lock:
            events, self._events = self._events, []
        return events

    def push_batch(self, step: int, rows: list[dict]) -> None:
        with self._batch_ready:
            self._batches[step] = rows
            self._batch_ready.notify_all()

    def queued(self) -> int:
        with self._batch_ready:
            return len(self._batches)

    def cancel(self) -> None:
        self._cancel.set()

    def request_checkpoint(self) -> None:
        self._checkpoint.set()

    def refuse_checkpoints(self, reason: str | None) -> None:
        """The server's checkpoint bounds: while ``reason`` is set (it names the operator's
        flag), a checkpoint due (requested, ``trainer.save_freq``, the last step) is not written
        and a warning says so; None: they are written again."""
        self._checkpoint_refusal = reason

    def serve(self, request: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Completion events (``opentinker.engine.serving.stream_completions``) from the job's
        current weights; called as a Ray streaming generator. Waits for a running step to end."""
        with self._between_steps:
            trainer = self._trainer
            if trainer is None:
                state = "has stopped (its last checkpoint is served instead)" if self._stopped else "is loading its model"
                raise NotServingError(f"job {self.job_id} {state}; try again shortly")
            # Imported once the trainer is built: while run() still imports transformers in its
            # thread, a second thread importing it too can find its lazy module half made.
            from opentinker.engine.serving import ServeRequest, stream_completions

            yield from stream_completions(trainer.rollout, trainer.tokenizer, ServeRequest.from_dict(request),
                                          trainer.pictures)

    # -- the job -------------------------------------------------------------------
    def _served_name(self) -> str:
        """The served name, never the path: where a model lives is the operator's business."""
        return self.policy.served_model(flatten(self.spec.config).get("actor_rollout_ref.model.path")).name

    def run(self) -> dict[str, Any]:
        """Train to the end (or until cancelled); never raises, returns the outcome."""
        trainer = None
        try:
            # Loading can take minutes (the embedded tiny model is built on a machine's first run).
            self._emit("log", {"message": f"loading model {self._served_name()}"})
            trainer = self._build_trainer()
            self._trainer = trainer
            # A step waiting out an env outage says so as it waits, and stops for a cancel.
            trainer.on_warning = lambda message: self._emit("log", {"level": "warning", "message": message})
            trainer.check_cancelled = self._raise_if_cancelled
            trainer.checkpoint_refusal = lambda: self._checkpoint_refusal  # the server's checkpoint bounds
            total = trainer.cfg.trainer.total_training_steps
            self._emit("log", {"message": f"model {self._served_name()} loaded; training {total} steps"})
            with self._between_steps:
                initial = trainer.initial_validation()
            if initial:
                self._emit("metrics", {"step": 0, "metrics": initial})
            while trainer.global_step < total:
                rows = self._next_rows(trainer.global_step + 1)
                save = self._checkpoint.is_set()
                self._checkpoint.clear()
                with self._between_steps:
                    metrics = trainer.train_step(rows, save=save)
                self.step = trainer.global_step
                checkpoint = metrics.pop("checkpoint", None)  # a server path: indexed, never published
                skip_reason = metrics.pop("skip_reason", None)
                if skip_reason:
                    self._emit("log", {"level": "warning", "message": f"step {self.step} skipped: {skip_reason}"})
                self._emit("metrics", {"step": self.step, "metrics": metrics})
                self._emit("progress", {"step": self.step, "total_steps": total})
                if checkpoint is not None:
                    path = Path(checkpoint)
                    self._emit("checkpoint", {"step": self.step, "name": path.parent.name, "path": str(path)})
                if self._cancel.is_set():
                    raise JobCancelled
            return {"status": "completed", "error": None, "step": self.step}
        except JobCancelled:
            return {"status": "cancelled", "error": None, "step": self.step}
        except Exception as error:  # the job fails; the server and other jobs go on
            message = f"{type(error).__name__}: {error}"
            # The user gets the message and an id to quote. The trace (server file paths) rides
            # along to the JobManager, which logs it under that id in the server's own log and
            # never stores it (this actor's log is Ray's, not forwarded: log_to_driver=False).
            error_id = uuid.uuid4().hex[:12]
            self._emit("error", {"message": message, "error_id": error_id,
                                 "traceback": traceback.format_exc(limit=20)})
            return {"status": "failed", "error": f"{message} (error id {error_id})", "step": self.step}
        finally:
            with self._between_steps:  # a request being served ends first
                self._trainer, self._stopped = None, True
                if trainer is not None:
                    trainer.close()

    def _build_trainer(self):
        from opentinker.engine.ppo.trainer import RLTrainer
        from opentinker.environments.registry import default_registry
        # The policy again, here where it counts: the client's config plus the operator's
        # model path, judge endpoint and job folder; env endpoints checked as they are built.
        spec = self.policy.runner_recipe(self.spec.config, str(self.job_dir), mode=self.spec.mode)
        # A new job starts fresh; a resumed one from the checkpoint the server chose (whose
        # step's events were published), never from a client-named path.
        spec = spec.replaced("trainer.resume_mode", "disable" if self.resume_from_step is None else str(
            Path(spec.trainer.default_local_dir) / step_checkpoint_name(self.resume_from_step)))
        registry = default_registry(allowed=self.policy.allowed_interactions)
        interactions = registry.build(self.spec.interactions, context=self.policy.interaction_context(self.job_id, self.relay))
        return RLTrainer(spec, train_rows=self.spec.dataset, val_rows=self.spec.val_dataset,
                         interactions=interactions or None, image_limits=self.policy.image_limits)

    def _raise_if_cancelled(self) -> None:
        if self._cancel.is_set():
            raise JobCancelled

    def _next_rows(self, step: int) -> list[dict] | None:
        """Server mode: None (the trainer's own loader). Client mode: the pushed batch for ``step``."""
        if self._cancel.is_set():
            raise JobCancelled
        if self.spec.mode == "server":
            return None
        with self._batch_ready:
            while step not in self._batches:
                if self._cancel.is_set():
                    raise JobCancelled
                self._batch_ready.wait(timeout=_BATCH_WAIT_S)
            return self._batches.pop(step)

    def _emit(self, event_type: str, data: dict[str, Any]) -> None:
        with self._events_lock:
            self._events.append({"type": event_type, "data": data, "created_at": time.time()})

"""What following a job shows beside its events: a progress bar (tqdm) with the latest reward and
kl and, once they happen, the run's env errors, redone steps and env waits (:class:`EnvTotals`,
which `opentinker jobs show` sums too), and the metrics logged to Weights & Biases."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any

from opentinker.protocol import Event, JobInfo, JobStatus

__all__ = ["EnvTotals", "ProgressBar", "WandbRun"]

#: metric names shown in the progress bar's postfix, first one present wins
_POSTFIX_METRICS: dict[str, tuple[str, ...]] = {"reward": ("reward/mean",), "kl": ("actor/kl", "actor/kl_loss")}


class ProgressBar:
    def __init__(self, info: JobInfo):
        from tqdm.auto import tqdm

        self.label = info.name or info.job_id
        self.bar = tqdm(total=info.total_steps or None, desc=self.label, unit="step", dynamic_ncols=True)
        self.postfix: dict[str, Any] = {}
        self.env = EnvTotals()

    def _advance(self, step: Any) -> None:
        if isinstance(step, int) and step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def on_event(self, event: Event) -> None:
        data = event.data
        if event.type == "progress":
            total = data.get("total_steps")
            if isinstance(total, int) and total > 0 and total != self.bar.total:
                self.bar.total = total
            self._advance(data.get("step"))
        elif event.type == "metrics":
            metrics = data.get("metrics") or {}
            for label, names in _POSTFIX_METRICS.items():
                value = next((metrics[n] for n in names if isinstance(metrics.get(n), (int, float))), None)
                if value is not None:
                    self.postfix[label] = float(value)
            self.env.add(metrics)
            self.postfix.update(self.env.postfix())
            if self.postfix:
                self.bar.set_postfix(self.postfix, refresh=False)
            self._advance(data.get("step"))
        elif event.type == "log" and isinstance(data.get("message"), str):  # loading, warnings, resumes
            level = data.get("level")
            self.bar.write(f"[{self.label}] {level + ': ' if isinstance(level, str) else ''}{data['message']}",
                           file=sys.stderr)
        elif event.type == "status":
            status = data.get("status")
            label = self.label if status in (None, JobStatus.RUNNING.value) else f"{self.label} [{status}]"
            self.bar.set_description_str(label, refresh=False)

    def close(self) -> None:
        self.bar.close()


class EnvTotals:
    """What the envs cost a run so far, summed from its metrics events: episodes that were env
    errors of the env's own (``env/<name>/env_errors``), steps redone after an outage
    (``train/env_outage_retries``) and the time spent waiting for envs (``train/env_outage_wait_s``)."""

    def __init__(self) -> None:
        self.env_errors = 0
        self.redone = 0
        self.waited_s = 0.0

    def add(self, metrics: Mapping[str, Any]) -> None:
        for name, value in metrics.items():
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            if name.startswith("env/") and name.endswith("/env_errors"):
                self.env_errors += int(value)
            elif name == "train/env_outage_retries":
                self.redone += int(value)
            elif name == "train/env_outage_wait_s":
                self.waited_s += float(value)

    def postfix(self) -> dict[str, Any]:
        """The progress bar's fields for what happened (none while nothing did)."""
        shown: dict[str, Any] = {}
        if self.env_errors:
            shown["env_err"] = self.env_errors
        if self.redone:
            shown["redone"] = self.redone
        if self.waited_s:
            shown["env_wait"] = f"{self.waited_s:.0f}s"
        return shown


class WandbRun:
    """Logs metrics events to Weights & Biases; wandb is imported only when asked for."""

    def __init__(self, run: Any):
        self.run = run

    @classmethod
    def start(cls, project: str, info: JobInfo) -> WandbRun | None:
        try:
            import wandb
        except ImportError:
            warnings.warn(
                f"wandb_project={project!r} was given but wandb is not installed (pip install wandb); "
                "metrics are not logged to Weights & Biases",
                stacklevel=3,
            )
            return None
        run = wandb.init(project=project, name=info.name or info.job_id, config={"job_id": info.job_id, **info.config})
        return cls(run)

    def on_event(self, event: Event) -> None:
        if event.type != "metrics":
            return
        metrics = event.data.get("metrics") or {}
        step = event.data.get("step")
        self.run.log(dict(metrics), step=step if isinstance(step, int) else None)

    def finish(self) -> None:
        self.run.finish()

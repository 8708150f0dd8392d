"""The Ray cluster under the control plane: connected (or a local one started, on loopback,
with a watchdog) at startup, released at shutdown, and asked what it can ever place."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from typing import Any

import ray

from opentinker.server.settings import ServerSettings

log = logging.getLogger("opentinker.server.jobs")


class RayCluster:
    """This server's connection to Ray. A Ray this process already had up (an embedding
    application, the tests) is used as is and left running at :meth:`disconnect`."""

    def __init__(self, settings: ServerSettings, namespace: str, leftover_prefix: str):
        self.settings = settings
        self.namespace = namespace
        self.leftover_prefix = leftover_prefix  # names of the actors a previous process may have left
        self._owns_ray = False
        self._reaper: subprocess.Popen | None = None

    def connect(self) -> None:
        """Connect to Ray (or start a local one). If this process already has Ray up (an
        embedding application, the tests), it is used as is and left running at shutdown.

        A local Ray listens on loopback only (unless ``ray_all_interfaces``) and a watchdog
        process stops it if this server dies without shutting down. On an existing cluster
        (``ray_address``), job actors a previous server process left behind are killed."""
        if ray.is_initialized():
            self._owns_ray = False
        else:
            local = not self.settings.ray_address
            kwargs: dict[str, Any] = dict(
                address=self.settings.ray_address or None,
                include_dashboard=False,
                ignore_reinit_error=True,
                log_to_driver=False,
            )
            if local and self.settings.ray_num_cpus is not None:
                kwargs["num_cpus"] = self.settings.ray_num_cpus
            with _keep_signal_handlers(), _ray_on_loopback(local and not self.settings.ray_all_interfaces):
                ray.init(**kwargs)
            self._owns_ray = True
            if local:
                self._reaper = start_reaper()
            else:
                self._kill_leftover_actors()
        log.info("ray: %s", ray.get_runtime_context().gcs_address)

    def _kill_leftover_actors(self) -> None:
        """Job actors of a previous process of this server (same store) on a shared cluster:
        their jobs are marked interrupted at startup, so nothing would ever watch them."""
        try:
            names = ray.util.list_named_actors(all_namespaces=True)
        except Exception:  # an old cluster without the API: nothing to sweep
            log.exception("could not list the cluster's named actors")
            return
        for entry in names:
            name, namespace = entry.get("name", ""), entry.get("namespace")
            if namespace == self.namespace and name.startswith(self.leftover_prefix):
                with contextlib.suppress(Exception):
                    ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
                    log.warning("killed %s, left running by a previous server process", name)

    def disconnect(self) -> None:
        """Shut down the Ray this server started (and its watchdog)."""
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        if self._reaper is not None:
            stop_reaper(self._reaper)
            self._reaper = None

    def placement_problem(self, cfg: Any) -> str | None:
        """Why the Ray cluster could never place the job's FSDP ranks (one GPU each, or one
        CPU each on CPU; with trainer.nnodes > 1, n_gpus_per_node on each of that many nodes),
        or None. Checked against the cluster's total, not what is free now: a job that must
        wait for other jobs to end is fine, one that can never start is not."""
        if cfg.actor_rollout_ref.actor.strategy != "fsdp":
            return None
        ranks = int(cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node)
        total = ray.cluster_resources()
        gpu = cfg.trainer.device == "cuda" or (cfg.trainer.device == "auto" and total.get("GPU", 0) > 0)
        resource = "GPU" if gpu else "CPU"
        have = total.get(resource, 0)
        if have < ranks:
            return (f"actor_rollout_ref.actor.strategy=fsdp with trainer.nnodes x trainer.n_gpus_per_node = {ranks} "
                    f"ranks needs {ranks} {resource} in this server's Ray cluster, which has {have:g}")
        nodes, per_node = int(cfg.trainer.nnodes), int(cfg.trainer.n_gpus_per_node)
        if nodes > 1:  # the ranks go n_gpus_per_node on each of nnodes distinct nodes (backend/fsdp.py)
            fit = sum(1 for node in ray.nodes() if node.get("Alive") and all(
                node.get("Resources", {}).get(key, 0) >= per_node for key in {resource, "CPU"}))
            if fit < nodes:
                return (f"trainer.nnodes={nodes} spreads the FSDP ranks over {nodes} distinct nodes, {per_node} on "
                        f"each, which needs {nodes} nodes with {per_node} {resource} each in this server's Ray "
                        f"cluster; it has {fit}")
        return None

    def has_gpus(self) -> bool:
        """Whether this server's Ray cluster has GPUs (what ``trainer.device=auto`` picks)."""
        return ray.cluster_resources().get("GPU", 0) > 0


@contextlib.contextmanager
def _keep_signal_handlers() -> Iterator[None]:
    """Undo the SIGTERM/SIGINT handlers ray.init installs: they exit the process at once,
    skipping uvicorn's graceful shutdown (and with it our lifespan, which kills the
    job actors and closes the store)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


@contextlib.contextmanager
def _ray_on_loopback(enabled: bool) -> Iterator[None]:
    """Make a local Ray started now listen on 127.0.0.1 only.

    Ray binds its gRPC servers to every interface unless its node IP is 127.0.0.1, and it
    turns an explicit 127.0.0.1 into the machine's reachable address; only its
    single-machine mode (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read through
    ``ray_constants.ENABLE_RAY_CLUSTER``) keeps the loopback address. Seen with Ray 2.60:
    gcs_server, raylet and workers then listen on [::ffff:127.0.0.1] only.
    """
    if not enabled:
        yield
        return
    from ray._private import ray_constants

    saved_env = os.environ.get(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR)
    saved = ray_constants.ENABLE_RAY_CLUSTER
    os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = "0"  # for the processes Ray starts
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if saved_env is None:
            os.environ.pop(ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR, None)
        else:
            os.environ[ray_constants.ENABLE_RAY_CLUSTERS_ENV_VAR] = saved_env


def start_reaper() -> subprocess.Popen | None:
    """Start the watchdog that stops this process's Ray if the process dies (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    return subprocess.Popen(
        [sys.executable, "-m", "opentinker.server.reaper", str(os.getpid())],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a signal to the server's process group spares the watchdog
    )


def stop_reaper(reaper: subprocess.Popen) -> None:
    """Close the watchdog's pipe (it then stops whatever of Ray is left) and wait for it."""
    with contextlib.suppress(Exception):
        assert reaper.stdin is not None
        reaper.stdin.close()
    try:
        reaper.wait(timeout=15)
    except subprocess.TimeoutExpired:
        reaper.kill()

"""Torch threads for the processes Ray starts.

Ray starts each actor with ``OMP_NUM_THREADS`` set to the CPUs it reserved, at least 1. The
server's actors reserve none or one (they share the node, and a reservation would cap how many
jobs and models it holds), so torch ran every job and every Tinker model on one core of a node
that has more: on 2 cores a Tinker LoRA step took 1.3x as long as the same worker in-process.
The actors that do a job's or a model's compute call :func:`use_node_cores` when they start.
"""

from __future__ import annotations

import os

import torch


def node_cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def use_node_cores() -> int:
    """Raises torch's thread count to :func:`node_cores` (never lowers one set on purpose);
    returns the count now in use."""
    cores = node_cores()
    if torch.get_num_threads() < cores:
        torch.set_num_threads(cores)
    return torch.get_num_threads()

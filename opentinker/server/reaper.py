"""``python -m opentinker.server.reaper SERVER_PID``: stop a dead server's local Ray.

``ray.init`` ties Ray's head processes to the process that started them, but not all of
them: after ``kill -9`` of a server, Ray's DashboardAgent and RuntimeEnvAgent were seen
still running (and on some set-ups a job actor went on training, writing checkpoints no
server would ever list). The server starts this watchdog in its own session with a pipe
on its stdin. While the server lives, the watchdog records the server's process tree once
a second; when the pipe closes (the server exited, however it died) it sends SIGTERM to
every recorded process that is still the same process (same pid and start time), waits a
little, and SIGKILLs what is left. Linux only (it reads ``/proc``).
"""

from __future__ import annotations

import os
import select
import signal
import sys
import time
from pathlib import Path

SCAN_INTERVAL_S = 1.0
TERM_GRACE_S = 5.0


def _start_time(pid: int) -> str | None:
    """Field 22 of /proc/PID/stat (start time in clock ticks): a pid plus this names one process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _children() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    return children


def descendants(root: int) -> dict[int, str]:
    """Every process below ``root`` (not root itself), with its start time."""
    children = _children()
    found: dict[int, str] = {}
    stack = list(children.get(root, []))
    while stack:
        pid = stack.pop()
        if pid in found:
            continue
        started = _start_time(pid)
        if started is not None:
            found[pid] = started
            stack.extend(children.get(pid, []))
    return found


def stop_processes(processes: dict[int, str], grace_s: float = TERM_GRACE_S) -> None:
    """SIGTERM, then after ``grace_s`` SIGKILL, each process that is still the one recorded."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [pid for pid, started in processes.items() if _start_time(pid) == started]
        for pid in alive:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        if sig == signal.SIGTERM and alive:
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(_start_time(p) == processes[p] for p in alive):
                time.sleep(0.1)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    server_pid = int(args[0])
    me = os.getpid()
    known: dict[int, str] = {}
    while True:
        # Whatever was seen below the server once is remembered: a process that died is
        # skipped at the end (its start time no longer matches), a reused pid too.
        known.update({pid: started for pid, started in descendants(server_pid).items() if pid != me})
        ready, _, _ = select.select([sys.stdin], [], [], SCAN_INTERVAL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):  # EOF: the server is gone
            break
    stop_processes(known)
    return 0


if __name__ == "__main__":
    sys.exit(main())

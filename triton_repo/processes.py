"""The processes of one server launch, found through /proc: every process the launcher
spawns carries LAUNCH_ID_ENV in its environment (inherited by tritonserver's Python-backend
stubs and by mpirun's ranks), so a stop finds them all, whoever their parent is by then."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

LAUNCH_ID_ENV = "SPECPIPE_LAUNCH_ID"
"""Marks every process of one launch (inherited by the stubs and mpirun's ranks), so `stop`
finds them all, whoever their parent is by then."""
KILL_TIMEOUT_S = 10.0
"""Longest wait for SIGKILLed processes to disappear (one stuck in the kernel never does)."""


@dataclass(frozen=True)
class ProcessInfo:
    """One process, from /proc/<pid>."""

    pid: int
    ppid: int
    pgid: int
    sid: int
    state: str
    """R, S, D, ...; Z: exited, not yet reaped (holds no memory)."""
    cmdline: str
    """Its arguments, joined by spaces."""
    launch_id: str
    """Its LAUNCH_ID_ENV; "" when unmarked or unreadable (another user's process)."""

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def read_process(pid: int) -> ProcessInfo | None:
    """Process `pid`, None once it is gone."""
    root = Path(f"/proc/{pid}")
    try:
        stat = (root / "stat").read_text()
        cmdline = (root / "cmdline").read_bytes()
    except OSError:
        return None
    try:
        environ = (root / "environ").read_bytes()
    except OSError:
        environ = b""
    marker = f"{LAUNCH_ID_ENV}=".encode()
    launch_id = next((v[len(marker) :] for v in environ.split(b"\0") if v.startswith(marker)), b"")
    state, ppid, pgid, sid = stat[stat.rindex(")") + 2 :].split()[:4]  # after "pid (comm) "; comm may hold spaces
    args = cmdline.replace(b"\0", b" ").decode(errors="replace").strip()
    return ProcessInfo(pid, int(ppid), int(pgid), int(sid), state, args, launch_id.decode(errors="replace"))


def list_processes() -> list[ProcessInfo]:
    """Every process in /proc, zombies included."""
    return [p for p in map(read_process, (int(n) for n in os.listdir("/proc") if n.isdigit())) if p is not None]


def launched_processes(launch_id: str, sessions: Collection[int] = ()) -> list[ProcessInfo]:
    """The live processes of one launch: those carrying its marker, or in one of `sessions`."""
    if not launch_id:
        raise ValueError("launch_id is empty: it would match every unmarked process")
    me = os.getpid()
    return [p for p in list_processes() if p.alive and p.pid != me and (p.launch_id == launch_id or p.sid in sessions)]


def kill_launch(launch_id: str, sessions: Collection[int] = (), timeout_s: float = KILL_TIMEOUT_S) -> None:
    """SIGKILL every live process of the launch, until none is left."""
    deadline = time.monotonic() + timeout_s
    while left := launched_processes(launch_id, sessions):
        if time.monotonic() > deadline:
            stuck = "; ".join(f"{p.pid} ({p.state}) {p.cmdline[:100]}" for p in left)
            raise RuntimeError(f"processes of launch {launch_id} outlived SIGKILL for {timeout_s:.0f} s: {stuck}")
        for p in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, signal.SIGKILL)
        time.sleep(0.05)

"""`python -m triton_repo.openai` in a subprocess, for tests and benchmarks: ready on entry
(its `ready_path` answers 200: by default /health/ready, i.e. Triton and its model are ready
too), stopped on exit (SIGINT: it stops uvicorn, then the Triton it started, if any)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from triton_repo.repository import PROJECT_ROOT
from triton_repo.server import STOP_GRACE_S, free_ports, log_tail


class OpenAIFrontend:
    def __init__(
        self,
        args: list[str],
        log_file: Path,
        port: int | None = None,
        startup_timeout_s: float = 600.0,
        ready_path: str = "/health/ready",
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = port or free_ports(1)[0]
        self.ready_path = ready_path
        self.env = {**os.environ, "PYTHONPATH": str(PROJECT_ROOT), **(env or {})}
        """Its environment, which the Triton it starts inherits (e.g. SPECPIPE_INJECT_FAULTS)."""
        self.command = [sys.executable, "-m", "triton_repo.openai", *args, "--openai-port", str(self.port)]
        self.log_file = log_file
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"localhost:{self.port}"

    @property
    def base_url(self) -> str:
        return f"http://localhost:{self.port}/v1"

    def __enter__(self) -> OpenAIFrontend:
        with self.log_file.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=PROJECT_ROOT,
                env=self.env,
                start_new_session=True,
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.command} exited with {self.proc.returncode}:\n{log_tail(self.log_file)}")
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
                urllib.request.urlopen(f"http://localhost:{self.port}{self.ready_path}", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"OpenAI frontend not ready after {self.startup_timeout_s:.0f} s:\n"
                                   + log_tail(self.log_file))  # fmt: skip
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGINT, then (if it has not exited in time) SIGKILL of its process group."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(STOP_GRACE_S + 15)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.proc = None

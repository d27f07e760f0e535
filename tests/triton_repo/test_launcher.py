"""The launcher, `python -m triton_repo.server`, run as a real process on free ports (port
0) with the real tritonserver: however it stops (SIGTERM; SIGINT, even when it started
with SIGINT ignored; a port already in use, before or during the start; the engine
model's stub or tritonserver itself killed while serving) it exits with the documented
code and leaves nothing behind: no process carrying its launch's SPECPIPE_LAUNCH_ID, and
no stub or tritonserver of its run directory re-parented to init."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from runtime.engine_dir import BuildConfig, EngineConfig
from runtime.faults import ENV as FAULTS_ENV
from tests.demo_engines import demo_redrafter_engine
from tests.host_tools import skip_without_tritonserver
from triton_repo.inputs import prompt_byte_limit
from triton_repo.processes import LAUNCH_ID_ENV, ProcessInfo, kill_launch, launched_processes, list_processes
from triton_repo.repository import PROJECT_ROOT
from triton_repo.server import (
    ENGINE_UP_GAUGE,
    EXIT_SERVING_FAILED,
    EXIT_START_FAILED,
    EXIT_STOPPED,
    STOP_GRACE_S,
    TERM_GRACE_S,
    engine_up,
    find_tritonserver,
    http_max_input_size,
    server_env,
    tritonserver_flags,
)

READY_TIMEOUT_S = 180.0
"""Loading takes ~15 s on 2 idle cores; other work on the machine can triple it."""
STREAM_TOKENS = 120
"""An auto-regressive stream this long lasts ~2 s: still in flight when the launcher is stopped."""


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return demo_redrafter_engine(tmp_path_factory, BuildConfig(max_batch_size=4, max_input_len=64, max_seq_len=160))


@dataclass
class Launcher:
    """One `python -m triton_repo.server` process, its output in a file."""

    proc: subprocess.Popen[bytes]
    out: Path
    run_dir: Path
    launch_id: str = ""
    signalled_at: float = 0.0

    def output(self) -> str:
        return self.out.read_text(errors="replace")

    def wait_for(self, text: str, timeout_s: float = READY_TIMEOUT_S) -> str:
        """The output once it holds `text` (fails if the launcher exits first)."""
        deadline = time.monotonic() + timeout_s
        while text not in (out := self.output()):
            assert self.proc.poll() is None, f"launcher exited ({self.proc.returncode}) before {text!r}:\n{out}"
            assert time.monotonic() < deadline, f"no {text!r} after {timeout_s:.0f} s:\n{out}"
            time.sleep(0.2)
        if not self.launch_id and (marker := re.search(rf"{LAUNCH_ID_ENV}=(\w+)", out)):
            self.launch_id = marker[1]
        return out

    def port(self, protocol: str) -> int:
        found = re.search(rf"^  {protocol}\s+\S*?localhost:(\d+)", self.wait_for("ready:"), re.M)
        assert found, self.output()
        return int(found[1])

    def signal(self, sig: signal.Signals) -> None:
        self.signalled_at = time.monotonic()
        self.proc.send_signal(sig)

    def wait_exit(self, timeout_s: float) -> tuple[int, float]:
        """Exit code, and seconds since `signal` (or since now)."""
        start = self.signalled_at or time.monotonic()
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"launcher still running {timeout_s:.0f} s later:\n{self.output()}")
        return code, time.monotonic() - start

    def leftovers(self) -> list[ProcessInfo]:
        """Live processes of this launch: marked with its id, or stubs and tritonservers of
        its run directory whose parent is init (found without the marker)."""
        assert self.launch_id, f"the launcher printed no {LAUNCH_ID_ENV}:\n{self.output()}"
        orphans = [p for p in list_processes() if p.alive and p.ppid == 1 and str(self.run_dir) in p.cmdline]
        return launched_processes(self.launch_id) + orphans

    def engine_stubs(self) -> list[ProcessInfo]:
        return [p for p in launched_processes(self.launch_id) if "/specpipe/1/model.py" in p.cmdline]


LaunchFactory = Callable[..., Launcher]


@pytest.fixture
def launch(engine_dir: Path, tmp_path: Path) -> Iterator[LaunchFactory]:
    """Start launchers; whatever a failing test leaves running is killed afterwards."""
    skip_without_tritonserver()
    started: list[Launcher] = []

    def start(*args: str, ignore_sigint: bool = False, env: dict[str, str] | None = None) -> Launcher:
        run_dir, out = tmp_path / f"run{len(started)}", tmp_path / f"launcher{len(started)}.out"
        command = [sys.executable, "-m", "triton_repo.server", "--engine", str(engine_dir), "--run-dir", str(run_dir)]
        ports = ["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0"]  # `args` may override (last wins)
        with out.open("wb") as sink:
            proc = subprocess.Popen(
                [*command, *ports, *args],
                stdout=sink,
                stderr=subprocess.STDOUT,
                cwd=PROJECT_ROOT,
                env={**os.environ, **(env or {})},
                # a background job of a non-interactive shell starts with SIGINT ignored
                preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None,
            )
        started.append(Launcher(proc, out, run_dir))
        return started[-1]

    yield start
    for launcher in started:
        if launcher.proc.poll() is None:
            launcher.proc.kill()
            launcher.proc.wait()
        if launcher.launch_id:
            kill_launch(launcher.launch_id)
        for p in list_processes():
            if p.alive and str(launcher.run_dir) in p.cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)


def stream_in_thread(http_port: int) -> tuple[threading.Thread, list[float], list[dict[str, str]]]:
    """An auto-regressive generate_stream of STREAM_TOKENS tokens, read in a thread: the
    arrival time of each event, and the events."""
    times: list[float] = []
    events: list[dict[str, str]] = []
    body = {"text_input": "def fib(n):", "max_tokens": STREAM_TOKENS, "ignore_eos": True, "method": "ar"}
    request = urllib.request.Request(
        f"http://127.0.0.1:{http_port}/v2/models/specpipe/generate_stream",
        data=json.dumps({**body, "stream": True}).encode(),
        method="POST",
    )

    def read() -> None:
        with urllib.request.urlopen(request, timeout=60) as response:
            for line in response:
                if line.startswith(b"data: "):
                    times.append(time.monotonic())
                    events.append(json.loads(line[len(b"data: ") :]))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, times, events


def test_sigterm_finishes_the_in_flight_request_then_leaves_nothing(launch: LaunchFactory) -> None:
    launcher = launch()
    http_port = launcher.port("HTTP")  # picked by the launcher (--http-port 0)
    with urllib.request.urlopen(f"http://127.0.0.1:{launcher.port('metrics')}/metrics", timeout=10) as r:
        assert engine_up(r.read().decode())
    thread, times, events = stream_in_thread(http_port)
    deadline = time.monotonic() + 30
    while not times and time.monotonic() < deadline:
        time.sleep(0.01)
    assert times, "the stream never started"
    launcher.signal(signal.SIGTERM)
    code, seconds = launcher.wait_exit(STOP_GRACE_S + 20)
    thread.join(10)
    out = launcher.output()
    assert code == EXIT_STOPPED, out
    assert seconds < STOP_GRACE_S + TERM_GRACE_S, f"stopping took {seconds:.1f} s:\n{out}"
    assert "SIGTERM: stopping" in out and out.rstrip().endswith("stopped.")
    assert times[-1] > launcher.signalled_at, "the whole stream arrived before the signal: nothing was in flight"
    assert events[-1].get("finish_reason") == "length", "the stream was cut short"
    assert int(events[-1]["num_output_tokens"]) == STREAM_TOKENS
    assert launcher.leftovers() == []
    install = find_tritonserver()
    if "--http-max-input-size" not in tritonserver_flags(install.binary, server_env(install)):
        assert out.count("no --http-max-input-size") == 1, out


def test_sigint_stops_a_launcher_started_with_sigint_ignored(launch: LaunchFactory) -> None:
    """While the model loads: tritonserver, not yet handling signals, dies of the SIGINT
    and leaves its stubs to the launcher."""
    launcher = launch(ignore_sigint=True)
    launcher.wait_for(LAUNCH_ID_ENV)
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not launcher.engine_stubs():
        assert time.monotonic() < deadline and launcher.proc.poll() is None, launcher.output()
        time.sleep(0.05)
    launcher.signal(signal.SIGINT)
    code, seconds = launcher.wait_exit(STOP_GRACE_S + 20)
    assert code == EXIT_STOPPED, launcher.output()
    assert "SIGINT: stopping" in launcher.output()
    assert seconds < STOP_GRACE_S + TERM_GRACE_S
    assert launcher.leftovers() == []
    assert launcher.leftovers() == []


def test_a_port_in_use_is_refused_before_loading(launch: LaunchFactory) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        launcher = launch("--http-port", str(port))
        code, _ = launcher.wait_exit(60)
    out = launcher.output()
    assert code == EXIT_START_FAILED, out
    assert f"HTTP port {port} is already in use" in out and "--http-port" in out
    launcher.wait_for(LAUNCH_ID_ENV)
    assert launcher.leftovers() == []
    assert not (launcher.run_dir / "tritonserver.log").exists(), "tritonserver was started anyway"


@pytest.mark.slow  # ~40-60 s on 2 cores; the default suite keeps the port pre-check and the killed stub
def test_a_port_taken_during_the_start_leaves_no_process(launch: LaunchFactory) -> None:
    """The port is free when the launcher checks it and taken before tritonserver, which
    listens only once the model is loaded, binds it: tritonserver exits, its stubs stay."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launcher = launch("--http-port", str(port))
    launcher.wait_for(LAUNCH_ID_ENV)
    deadline = time.monotonic() + 60
    while not any("tritonserver" in p.cmdline for p in launched_processes(launcher.launch_id)):
        assert time.monotonic() < deadline and launcher.proc.poll() is None, launcher.output()
        time.sleep(0.05)
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind(("0.0.0.0", port))
        holder.listen()
        code, _ = launcher.wait_exit(READY_TIMEOUT_S)
    out = launcher.output()
    assert code == EXIT_START_FAILED, out
    assert f"HTTP port {port} is already in use" in out, out
    assert launcher.leftovers() == []


def test_a_killed_engine_stub_stops_the_launcher(launch: LaunchFactory) -> None:
    """Triton would not restart the stub, and would keep answering ready."""
    launcher = launch()
    launcher.wait_for("ready:")
    (stub,) = launcher.engine_stubs()
    launcher.signalled_at = time.monotonic()
    os.kill(stub.pid, signal.SIGKILL)
    code, seconds = launcher.wait_exit(STOP_GRACE_S + 20)
    out = launcher.output()
    assert code == EXIT_SERVING_FAILED, out
    assert f"stub process {stub.pid}" in out and "an orchestrator restarts" in out
    assert seconds < STOP_GRACE_S + 1, f"took {seconds:.1f} s to notice and stop:\n{out}"
    assert launcher.leftovers() == []


@pytest.mark.slow  # ~40-60 s on 2 cores; the default suite keeps the port pre-check and the killed stub
def test_a_killed_tritonserver_stops_the_launcher_and_its_stubs(launch: LaunchFactory) -> None:
    launcher = launch()
    launcher.wait_for("ready:")
    (server,) = [p for p in launched_processes(launcher.launch_id) if p.cmdline.split()[0].endswith("/tritonserver")]
    stubs = [p for p in launched_processes(launcher.launch_id) if "triton_python_backend_stub" in p.cmdline]
    assert len(stubs) >= 2 and all(s.ppid == server.pid for s in stubs)
    launcher.signalled_at = time.monotonic()
    os.kill(server.pid, signal.SIGKILL)
    code, _ = launcher.wait_exit(30)
    out = launcher.output()
    assert code == EXIT_SERVING_FAILED, out
    assert "tritonserver exited with code -9" in out
    assert launcher.leftovers() == []


def test_a_wedged_engine_is_reported_down_and_torn_down(launch: LaunchFactory) -> None:
    """The issue's wedge: one request blocks the engine thread for good (an injected `hang`)
    while Triton keeps answering ready. Once the step has run past --stall-timeout the
    gauge reads 0, the launcher exits 3, and teardown kills the wedged stub (it used to stay
    behind, with SIGTERM taking ~50 s)."""
    stall_s = 3.0
    launcher = launch("--stall-timeout", str(stall_s), env={FAULTS_ENV: "hang:7"})
    body = json.dumps({"text_input": "def fib(n):", "max_tokens": 8, "random_seed": 7}).encode()
    url = f"http://127.0.0.1:{launcher.port('HTTP')}/v2/models/specpipe/generate"

    def send() -> None:
        with contextlib.suppress(OSError):  # never answered: the server goes away under it
            urllib.request.urlopen(urllib.request.Request(url, data=body, method="POST"), timeout=120).close()

    threading.Thread(target=send, daemon=True).start()
    launcher.signalled_at = time.monotonic()
    code, seconds = launcher.wait_exit(stall_s + STOP_GRACE_S + TERM_GRACE_S + 30)
    out = launcher.output()
    assert code == EXIT_SERVING_FAILED, out
    assert f"the engine reports itself down ({ENGINE_UP_GAUGE} 0" in out
    assert seconds < stall_s + STOP_GRACE_S + TERM_GRACE_S + 5, f"took {seconds:.1f} s to notice and stop:\n{out}"
    assert launcher.leftovers() == []


def test_engine_up_reads_the_gauge_and_takes_a_missing_one_for_up() -> None:
    assert engine_up("nv_inference_count 3\nspecpipe_queue_depth 0\n")
    assert engine_up("# TYPE specpipe_engine_up gauge\nspecpipe_engine_up 1\n")
    assert not engine_up("# TYPE specpipe_engine_up gauge\nspecpipe_engine_up 0\n")
    assert not engine_up('specpipe_engine_up{model="specpipe"} 0\nspecpipe_engine_up_other 1\n')


def test_the_request_size_limit_admits_every_prompt_the_model_admits(engine_dir: Path) -> None:
    """The worst JSON body of a prompt at the model's own byte limit (every byte a control
    character, escaped to 6) passes the door, which still refuses absurd bodies."""
    config = EngineConfig.load(engine_dir)
    model_limit = prompt_byte_limit(config, Tokenizer.from_file(str(engine_dir / config.tokenizer)))
    body = json.dumps({"text_input": "\x01" * model_limit, "max_tokens": 8, "temperature": 0.5, "stream": True})
    limit = http_max_input_size(engine_dir)
    assert len(body) <= limit < 8 * model_limit + (2 << 20)

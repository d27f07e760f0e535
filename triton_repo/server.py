"""Launch Triton Inference Server on one engine.

    python -m triton_repo.server --engine engines/demo-redrafter [--http-port 8000 --grpc-port 8001 --metrics-port 8002]

Which tritonserver: NVIDIA's container install (/opt/tritonserver, or `tritonserver` on
PATH) when there is one, else the one bundled in the `nvidia-pytriton` wheel. The wheel
ships the Python backend without its stub in place (one stub per Python version), so the
launcher assembles a backend directory in its run directory: links to the wheel's
libtriton_python.so and triton_python_backend_utils.py plus the stub of the running
interpreter. Nothing in the venv is modified. model.py imports torch and this project:
the stub's embedded Python ignores PYTHONPATH, so model.py adds the project root from its
`project_root` parameter, the server runs with this venv's bin/ first on PATH (which gives
the stub the venv's site-packages, see `server_env`), and LD_LIBRARY_PATH = this
interpreter's libpython directory (the stub then embeds the very Python the venv was
made from) + the wheel's bundled libraries. In NVIDIA's container, the system stub embeds
the container's Python: make the venv from that same Python.

Process layout (TensorRT-LLM's "leader" mode):

    tritonserver                     HTTP / gRPC / metrics
      └─ triton_python_backend_stub  model.py: tensor-parallel rank 0, owns the LLMEngine
    mpirun -n TP-1                   only when the engine's tp_size > 1
      └─ python -m runtime.tp_worker --engine E --master HOST:PORT   ranks 1..TP-1

Rank 0 and the followers rendezvous at `tp_master` (a free port the launcher picks and
writes into config.pbtxt); the followers then run their shards of every forward rank 0
sends. The launcher starts the followers first (they wait for rank 0) and stops them after
the server.

Stopping and supervision: every process the launcher spawns carries SPECPIPE_LAUNCH_ID=<uuid>
in its environment, inherited by the stubs and mpirun's ranks. Stopping sends tritonserver
SIGINT (it finishes in-flight requests for up to EXIT_TIMEOUT_S), then SIGTERM, then SIGKILLs
its process group and every process still carrying the marker, and waits until none is left:
after SIGINT or SIGTERM to the launcher, a failed start, or a death while serving. Triton
neither restarts a dead stub nor reports it (health stays 200 while every request fails), so
the launcher checks every second that tritonserver, the followers and the engine model's
stub are alive and that the model's `specpipe_engine_up` gauge is not 0; if one is not, it
tears everything down and exits with EXIT_SERVING_FAILED for an orchestrator to restart it.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import http.client
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType, TracebackType

from runtime.engine_dir import EngineConfig
from triton_repo.inputs import AdmissionCheck
from triton_repo.processes import LAUNCH_ID_ENV, kill_launch, launched_processes, read_process
from triton_repo.repository import PROJECT_ROOT, ServingConfig, add_serving_args, serving_config, write_repository

log = logging.getLogger(__name__)

SYSTEM_TRITON = Path("/opt/tritonserver")
STUB = "triton_python_backend_stub"
BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STARTUP_TIMEOUT_S = 600.0
"""Loading includes importing torch and the engine's start-up calibration."""
EXIT_TIMEOUT_S = 10
"""tritonserver --exit-timeout-secs: after SIGINT it waits this long for in-flight requests,
then exits anyway (its default, 30 s, let a wedged engine hold shutdown that long)."""
STOP_GRACE_S = EXIT_TIMEOUT_S + 5.0
"""Wait after SIGINT to tritonserver: its exit timeout, plus unloading the models."""
TERM_GRACE_S = 3.0
"""Wait after SIGTERM, before SIGKILL."""
FOLLOWER_GRACE_S = 5.0
"""Wait after SIGINT to mpirun: the followers have nothing in flight once rank 0 is gone."""
METRICS_TIMEOUT_S = 0.5
"""Timeout of the once-a-second scrape of the engine's health gauge."""
ENGINE_UP_GAUGE = "specpipe_engine_up"
"""1 while the engine thread steps normally; 0 once it died, failed fatally or stalled (triton_repo/metrics.py)."""
REQUEST_HEADROOM_BYTES = 1 << 20
"""Room in a request body for the inputs other than the prompt, and the framing."""
JSON_ESCAPE_FACTOR = 6
"""Most bytes of a JSON body per prompt byte: a control character is written `\\u00XX` (and
Python's json.dumps writes each 3-byte UTF-8 character as a 6-byte `\\uXXXX`)."""
EXIT_STOPPED, EXIT_START_FAILED, EXIT_SERVING_FAILED = 0, 1, 3
"""Launcher exit codes (2 is argparse's bad command line): see EXIT_CODES."""


@dataclass(frozen=True)
class TritonInstall:
    binary: Path
    backend_dir_source: Path
    """The install's backends directory (holding python/)."""
    stub: Path
    """Python-backend stub to use; for the wheel, the one built for the running interpreter."""
    lib_dirs: tuple[Path, ...]
    """Prepended to LD_LIBRARY_PATH."""

    @property
    def stub_in_place(self) -> bool:
        return self.stub.parent == self.backend_dir_source / "python"


def find_tritonserver() -> TritonInstall:
    """The system install if there is one (NVIDIA's container), else pytriton's bundled server."""
    on_path = shutil.which("tritonserver")
    for binary in (SYSTEM_TRITON / "bin" / "tritonserver", Path(on_path) if on_path else None):
        if binary is not None and binary.is_file():
            backends = binary.resolve().parent.parent / "backends"
            if (backends / "python" / STUB).is_file():
                return TritonInstall(binary, backends, backends / "python" / STUB, ())
    try:
        import pytriton
    except ImportError:
        raise FileNotFoundError(
            "no tritonserver found: install the bundled one with `pip install nvidia-pytriton` "
            "(requirements.txt), or run in NVIDIA's tritonserver container"
        ) from None
    root = Path(pytriton.__file__).resolve().parent / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / STUB
    if not stub.is_file():
        have = sorted(p.name for p in (root / "python_backend_stubs").iterdir())
        raise FileNotFoundError(f"nvidia-pytriton has Python-backend stubs for {have}, not for Python {version}")
    libs = Path(pytriton.__file__).resolve().parent.parent / "nvidia_pytriton.libs"
    return TritonInstall(root / "bin" / "tritonserver", root / "backends", stub, (_libpython_dir(), libs))


def _libpython_dir() -> Path:
    return Path(sysconfig.get_config_var("LIBDIR"))


def backend_directory(install: TritonInstall, run_dir: Path) -> Path:
    """A `--backend-directory` whose python/ holds the stub: the install's own when it
    does, else `run_dir/backends` with links into the install."""
    if install.stub_in_place:
        return install.backend_dir_source
    python_dir = run_dir / "backends" / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    sources = [install.backend_dir_source / "python" / name for name in BACKEND_FILES] + [install.stub]
    for src in sources:
        link = python_dir / src.name
        link.unlink(missing_ok=True)
        link.symlink_to(src)
    return python_dir.parent


def free_ports(n: int) -> list[int]:
    """n distinct ports free now (all bound at once, so no two are the same)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def server_env(install: TritonInstall) -> dict[str, str]:
    """The stub's embedded Python ignores PYTHONPATH but looks for its interpreter on PATH,
    and finds with it the venv (pyvenv.cfg) and its site-packages; pytriton does the same."""
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([str(Path(sys.prefix) / "bin"), env.get("PATH", "")])
    lib_path = [*map(str, install.lib_dirs), env.get("LD_LIBRARY_PATH", "")]
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in lib_path if p)
    return env


def log_tail(path: Path, lines: int = 40) -> str:
    if not path.is_file():
        return "(no log)"
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def tritonserver_flags(binary: Path, env: dict[str, str]) -> set[str]:
    """The `--flags` this tritonserver build accepts, from its `--help`."""
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True, env=env, timeout=60).stdout
    return set(re.findall(r"^\s*(--[\w-]+)", help_text, re.M))


def http_max_input_size(engine_dir: Path) -> int:
    """`--http-max-input-size` for an engine: the longest prompt its `max_input_len` tokens
    can hold (max_input_len x the tokenizer's longest token in UTF-8 bytes, the limit the
    model itself enforces before tokenizing, `triton_repo.inputs.prompt_byte_limit`), times
    JSON_ESCAPE_FACTOR so a JSON body the model would accept is never refused at the door,
    plus REQUEST_HEADROOM_BYTES for the other inputs."""
    return JSON_ESCAPE_FACTOR * AdmissionCheck.for_engine(engine_dir).max_prompt_bytes + REQUEST_HEADROOM_BYTES


def port_in_use_message(name: str, port: int) -> str:
    return (
        f"{name} port {port} is already in use (another tritonserver?): stop what listens on it "
        f"(`ss -ltnp 'sport = :{port}'`) or pass --{name.lower()}-port with another port (0 picks a free one)"
    )


def check_ports_free(ports: dict[str, int]) -> None:
    """Raise, naming the port and the fix, if one is taken: tritonserver itself finds out
    only once the model is loaded (minutes, for a large engine)."""
    for name, port in ports.items():
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server: TIME_WAIT is no conflict
            try:
                s.bind(("0.0.0.0", port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise RuntimeError(port_in_use_message(name, port)) from None
                raise RuntimeError(f"cannot listen on {name} port {port}: {e.strerror}") from None


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGINT (graceful: Triton finishes in-flight requests), then SIGTERM, then SIGKILL of
    the process group the launcher created for it, which still holds its children once it
    has exited; reaps it."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, TERM_GRACE_S)):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def engine_up(metrics_text: str) -> bool:
    """False if a `specpipe_engine_up` sample of a Prometheus exposition reads 0; a missing
    gauge (a model from before it existed) counts as up."""
    samples = re.findall(rf"^{ENGINE_UP_GAUGE}(?:\{{[^}}]*\}})?\s+(\S+)", metrics_text, re.M)
    return all(float(v) != 0 for v in samples)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


class TritonServer:
    """A tritonserver (plus tensor-parallel followers) serving `cfg`, ready on entry,
    stopped on exit with every process it spawned (see `stop`)."""

    def __init__(
        self,
        cfg: ServingConfig,
        run_dir: Path,
        http_port: int | None = None,
        grpc_port: int | None = None,
        metrics_port: int | None = None,
        log_file: Path | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        spare = free_ports(4)
        self.http_port = http_port or spare[0]
        self.grpc_port = grpc_port or spare[1]
        self.metrics_port = metrics_port or spare[2]
        self.tp_port = spare[3]
        self.log_file = log_file or self.run_dir / "tritonserver.log"
        self.workers_log = self.run_dir / "tp_workers.log"
        self.startup_timeout_s = startup_timeout_s
        self.tp_size = EngineConfig.load(Path(cfg.engine_dir)).build.tp_size
        self.launch_id = uuid.uuid4().hex
        """LAUNCH_ID_ENV of every process this server spawns."""
        self.proc: subprocess.Popen[bytes] | None = None
        self.workers: subprocess.Popen[bytes] | None = None
        self.stub_pid: int | None = None
        """The engine model's stub, found once the server is ready (supervised from then on)."""

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

    @property
    def stub_script(self) -> str:
        """What the engine model's stub has in its command line (the infer front's is `<name>_infer/1/...`)."""
        return f"/{self.cfg.model_name}/1/model.py"

    def __enter__(self) -> TritonServer:
        try:
            self.start()
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def start(self) -> None:
        install = find_tritonserver()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        check_ports_free({"HTTP": self.http_port, "gRPC": self.grpc_port, "metrics": self.metrics_port})
        cfg = self.cfg
        env = {**server_env(install), LAUNCH_ID_ENV: self.launch_id}
        if self.tp_size > 1:
            cfg = replace(cfg, tp_master=f"127.0.0.1:{self.tp_port}")
            self.workers = self._spawn(self._worker_command(cfg), self.workers_log, env)
        repo = self.run_dir / "models"
        write_repository(cfg, repo)
        command = [
            str(install.binary),
            f"--model-repository={repo}",
            f"--backend-directory={backend_directory(install, self.run_dir)}",
            f"--http-port={self.http_port}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-port={self.metrics_port}",
            "--allow-metrics=true",
            f"--exit-timeout-secs={EXIT_TIMEOUT_S}",
            "--log-verbose=0",
        ]
        if "--http-max-input-size" in tritonserver_flags(install.binary, env):
            command.append(f"--http-max-input-size={http_max_input_size(Path(cfg.engine_dir))}")
        else:
            log.warning(
                "this tritonserver has no --http-max-input-size: request size is not limited at the door "
                "(the model refuses prompts longer in bytes than max_input_len tokens can hold, before tokenizing)"
            )
        self.proc = self._spawn(command, self.log_file, env)

    def _worker_command(self, cfg: ServingConfig) -> list[str]:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            raise FileNotFoundError(f"engine has tp_size {self.tp_size}: tensor parallelism needs mpirun (`make mpi`)")
        python = [sys.executable, "-m", "runtime.tp_worker", "--engine", str(Path(cfg.engine_dir).resolve())]
        mpi = [mpirun, "--allow-run-as-root", "--oversubscribe", "-n", str(self.tp_size - 1)]
        return [*mpi, *python, "--master", cfg.tp_master]

    def _spawn(self, command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
        """Its own session, so a terminal's Ctrl-C reaches only the launcher, which then stops it in order."""
        with log.open("ab") as out:
            return subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=PROJECT_ROOT, start_new_session=True
            )

    def wait_ready(self) -> None:
        """Until the server and the model are ready; raises with the log's tail if a process
        exits first or the timeout passes. Then finds the engine model's stub to supervise."""
        assert self.proc is not None
        base = f"http://127.0.0.1:{self.http_port}/v2"
        urls = (f"{base}/health/ready", f"{base}/models/{self.cfg.model_name}/ready")
        deadline = time.monotonic() + self.startup_timeout_s
        while not all(_http_ok(u) for u in urls):
            self.check_alive()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"tritonserver not ready after {self.startup_timeout_s:.0f} s; log {self.log_file}:\n"
                    + log_tail(self.log_file)
                )
            time.sleep(0.5)
        stubs = [p.pid for p in launched_processes(self.launch_id) if self.stub_script in p.cmdline]
        if not stubs:
            raise RuntimeError(f"ready, but no stub process runs {self.stub_script}: cannot supervise the engine")
        self.stub_pid = stubs[0]

    def check_alive(self) -> None:
        """Raise RuntimeError, with the log's tail, if tritonserver or the tensor-parallel
        followers exited, or (once ready) the engine model's stub is gone or the engine
        reports itself down. Triton notices neither: its health endpoints stay 200 while
        every request fails. Cheap enough for once a second: two /proc reads and one scrape."""
        for proc, log, name in ((self.proc, self.log_file, "tritonserver"), (self.workers, self.workers_log, "mpirun")):
            if proc is not None and proc.poll() is not None:
                why = self._port_taken(log_tail(log))
                raise RuntimeError(f"{name} exited with code {proc.returncode}{why}; log {log}:\n" + log_tail(log))
        if self.stub_pid is None:
            return
        stub = read_process(self.stub_pid)
        if stub is None or not stub.alive or self.stub_script not in stub.cmdline:
            raise RuntimeError(
                f"the engine model's stub process {self.stub_pid} ({self.stub_script}) is gone and Triton does not "
                f"restart it; log {self.log_file}:\n" + log_tail(self.log_file)
            )
        try:
            url = f"http://127.0.0.1:{self.metrics_port}/metrics"
            with urllib.request.urlopen(url, timeout=METRICS_TIMEOUT_S) as r:
                metrics = r.read().decode(errors="replace")
        except (OSError, http.client.HTTPException):
            return  # a slow scrape is no verdict: the processes' liveness is checked above
        if not engine_up(metrics):
            raise RuntimeError(
                f"the engine reports itself down ({ENGINE_UP_GAUGE} 0: its thread died, failed or stalled); "
                f"log {self.log_file}:\n" + log_tail(self.log_file)
            )

    def _port_taken(self, log: str) -> str:
        """Which of our ports the log says tritonserver could not listen on, and the fix; "" if none."""
        taken = re.search(r":(\d+)'? already in use", log)
        port = int(taken[1]) if taken else -1
        names = {self.http_port: "HTTP", self.grpc_port: "gRPC", self.metrics_port: "metrics"}
        return f": {port_in_use_message(names[port], port)}" if port in names else ""

    def stop(self) -> None:
        """tritonserver first (rank 0 leaves the rendezvous), then its followers, each
        SIGINT -> SIGTERM -> SIGKILL of its process group; then SIGKILL every process still
        carrying this launch's marker (stubs a dead tritonserver left behind, mpirun's ranks)
        and wait until none is left. Safe to call at any point, and again."""
        sessions = [p.pid for p in (self.proc, self.workers) if p is not None]
        for proc, grace_s in ((self.proc, STOP_GRACE_S), (self.workers, FOLLOWER_GRACE_S)):
            if proc is not None:
                stop_process(proc, grace_s)
        self.proc = self.workers = self.stub_pid = None
        kill_launch(self.launch_id, sessions)


EXIT_CODES = f"""exit codes:
  {EXIT_STOPPED}  stopped by SIGINT (Ctrl-C) or SIGTERM; tritonserver first finishes in-flight requests
     (up to {EXIT_TIMEOUT_S} s)
  {EXIT_START_FAILED}  could not start: bad engine or flags, a port in use, or tritonserver exited or was not
     ready in time
  2  bad command line
  {EXIT_SERVING_FAILED}  failed while serving: tritonserver, the tensor-parallel followers or the engine model's
     stub died, or the engine reported itself down ({ENGINE_UP_GAUGE} 0, checked every second); an
     orchestrator restarts it (Triton itself restarts nothing and would keep answering "ready")
Whatever the exit, every process of the launch (environment {LAUNCH_ID_ENV}) is gone first."""


class _StopOnSignal:
    """SIGINT and SIGTERM raise KeyboardInterrupt in the main loop, once: later ones must not
    cut the teardown short. Installed explicitly, since Python leaves SIGINT ignored when it
    started ignored (a background job of a non-interactive shell)."""

    def __init__(self) -> None:
        self.armed = True
        self.received = ""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self)

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.armed:
            self.armed = False
            self.received = signal.Signals(signum).name
            raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m triton_repo.server",
        description=__doc__,
        epilog=EXIT_CODES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serving_args(ap)
    ap.add_argument("--http-port", type=int, default=8000, help="(default: %(default)s; 0 picks a free one)")
    ap.add_argument("--grpc-port", type=int, default=8001, help="(default: %(default)s; 0 picks a free one)")
    ap.add_argument("--metrics-port", type=int, default=8002, help="(default: %(default)s; 0 picks a free one)")
    ap.add_argument("--run-dir", type=Path, help="model repository, backends and logs (default: a temporary directory)")
    args = ap.parse_args(argv)
    logging.basicConfig(format="%(levelname)s: %(message)s", level=logging.INFO)
    signals = _StopOnSignal()
    code, server = EXIT_STOPPED, None
    with tempfile.TemporaryDirectory(prefix="specpipe-triton-") as tmp:
        try:
            server = TritonServer(
                serving_config(args), args.run_dir or Path(tmp), args.http_port, args.grpc_port, args.metrics_port
            )
            print(
                f"loading {args.engine} into tritonserver (log: {server.log_file}; "
                f"processes marked {LAUNCH_ID_ENV}={server.launch_id}) ...",
                flush=True,
            )
            server.start()
            server.wait_ready()
            name = args.model_name
            print(
                f"ready: model {name!r}\n"
                f"  HTTP    {server.http_url}\n  gRPC    {server.grpc_url}\n  metrics {server.metrics_url}\n"
                f"try:  curl -X POST {server.http_url}/v2/models/{name}/generate "
                """-d '{"text_input": "def fib(n):", "max_tokens": 32}'\n"""
                f"      python -m triton_repo.client --url {server.grpc_url} --prompt 'def fib(n):'\n"
                "Ctrl-C stops the server.",
                flush=True,
            )
            while True:
                server.check_alive()
                time.sleep(1.0)
        except KeyboardInterrupt:  # the handler has disarmed itself
            print(f"{signals.received or 'interrupted'}: stopping tritonserver ...", flush=True)
        except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
            signals.armed = False
            serving = server is not None and server.stub_pid is not None
            code = EXIT_SERVING_FAILED if serving else EXIT_START_FAILED
            print(f"error: {e}", file=sys.stderr, flush=True)
        finally:
            signals.armed = False
            if server is not None:
                try:
                    server.stop()
                except RuntimeError as e:
                    print(f"error: {e}", file=sys.stderr, flush=True)
                    code = code or EXIT_START_FAILED
    if code == EXIT_SERVING_FAILED:
        print(f"stopped every process of the launch; exit {code}: an orchestrator restarts the server", flush=True)
    elif code == EXIT_STOPPED:
        print("stopped.", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())

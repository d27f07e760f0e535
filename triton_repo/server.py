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
"""

from __future__ import annotations

import argparse
import contextlib
import os
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
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType, TracebackType

from runtime.engine_dir import EngineConfig
from triton_repo.repository import PROJECT_ROOT, ServingConfig, add_serving_args, serving_config, write_repository

SYSTEM_TRITON = Path("/opt/tritonserver")
STUB = "triton_python_backend_stub"
BACKEND_FILES = ("libtriton_python.so", "triton_python_backend_utils.py")
STARTUP_TIMEOUT_S = 600.0
"""Loading includes importing torch and the engine's start-up calibration."""


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


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    """SIGINT (graceful: Triton finishes in-flight requests), then SIGTERM, then SIGKILL
    of the process group the launcher created for it; reaps it."""
    for sig, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 10.0)):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return bool(r.status == 200)
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


class TritonServer:
    """A tritonserver (plus tensor-parallel followers) serving `cfg`, ready on entry,
    stopped and reaped on exit."""

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
        self.proc: subprocess.Popen[bytes] | None = None
        self.workers: subprocess.Popen[bytes] | None = None

    @property
    def http_url(self) -> str:
        return f"localhost:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"localhost:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://localhost:{self.metrics_port}/metrics"

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
        cfg = self.cfg
        env = server_env(install)
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
            "--log-verbose=0",
        ]
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
        exits first or the timeout passes."""
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

    def check_alive(self) -> None:
        """Raise with the log's tail if tritonserver or the tensor-parallel followers exited."""
        for proc, log, name in ((self.proc, self.log_file, "tritonserver"), (self.workers, self.workers_log, "mpirun")):
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{name} exited with code {proc.returncode}; log {log}:\n" + log_tail(log))

    def stop(self) -> None:
        """The server first (rank 0 leaves the rendezvous), then its followers."""
        for proc in (self.proc, self.workers):
            if proc is not None:
                stop_process(proc)
        self.proc = self.workers = None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m triton_repo.server", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_serving_args(ap)
    ap.add_argument("--http-port", type=int, default=8000, help="(default: %(default)s; 0 picks a free one)")
    ap.add_argument("--grpc-port", type=int, default=8001, help="(default: %(default)s; 0 picks a free one)")
    ap.add_argument("--metrics-port", type=int, default=8002, help="(default: %(default)s; 0 picks a free one)")
    ap.add_argument("--run-dir", type=Path, help="model repository, backends and logs (default: a temporary directory)")
    args = ap.parse_args(argv)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)
    with tempfile.TemporaryDirectory(prefix="specpipe-triton-") as tmp:
        try:
            server = TritonServer(
                serving_config(args), args.run_dir or Path(tmp), args.http_port, args.grpc_port, args.metrics_port
            )
            print(f"loading {args.engine} into tritonserver (log: {server.log_file}) ...", flush=True)
            with server:
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
        except KeyboardInterrupt:
            print("stopped.", flush=True)
            return 0
        except (ValueError, FileNotFoundError, RuntimeError, TimeoutError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())

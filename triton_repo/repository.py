"""Write a Triton model repository that serves one engine directory.

    python -m triton_repo.repository --engine engines/demo-redrafter --out work_dirs/triton [runtime flags]

gives

    <out>/<model_name>/config.pbtxt         from triton_repo/config.pbtxt.template
    <out>/<model_name>/1/model.py           a copy of triton_repo/specpipe/1/model.py
    <out>/<model_name>_infer/config.pbtxt   same template: the non-streaming front
    <out>/<model_name>_infer/1/model.py     a copy of triton_repo/specpipe_infer/1/model.py

The engine and runtime settings travel as config.pbtxt `parameters` (string values, "" for
"the runtime's default"), the way TensorRT-LLM's backend is configured, so one model.py
serves any engine. model.py is copied rather than linked so a repository stays valid
while the source tree changes under a running server.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from runtime.config import RuntimeConfig
from runtime.engine_dir import EngineConfig
from runtime.runtime_args import add_runtime_args, runtime_config, runtime_parameters
from triton_repo.template import pbtxt_string, render_template

HERE = Path(__file__).resolve().parent
PROJECT_ROOT = HERE.parent
"""model.py puts it on sys.path: the Python-backend stub does not pass PYTHONPATH on."""
TEMPLATE = HERE / "config.pbtxt.template"
MODEL_SOURCE = HERE / "specpipe" / "1" / "model.py"
INFER_SOURCE = HERE / "specpipe_infer" / "1" / "model.py"
DEVICES = ("cpu", "cuda")
STREAM_INTERVAL_MS = 20.0
"""`ServingConfig.stream_interval_ms`'s default."""


@dataclass(frozen=True)
class ServingConfig:
    """What one served model runs: the engine, where, and the runtime's settings."""

    engine_dir: Path
    model_name: str = "specpipe"
    device: str = "cpu"
    """cpu or cuda; cuda instances are placed by Triton (KIND_MODEL), CPU ones are KIND_CPU."""
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    tp_master: str = ""
    """host:port where tensor-parallel ranks 1..N-1 rendezvous with rank 0 (model.py); "" for tp_size 1."""
    stall_timeout_s: float = 120.0
    """A step running longer than this means a wedged engine: it is reported down
    (`specpipe_engine_up` 0) and the launcher stops the server."""
    torch_threads: int = 0
    """Intra-op threads of the served engine; 0 = torch's default (every core). The engine
    loads and steps on one thread of its own (`serving_model._engine_main`), which is what
    lets it use every core beside Triton's threads: demo ReDrafter, batch 1, 2 cores, 379
    tok/s served vs 409 in-process, 276 on one thread."""
    stream_interval_ms: float = STREAM_INTERVAL_MS
    """Least milliseconds between two streamed responses of one request: the text of the
    steps in between goes out together (`serving_model`'s response thread). 0: a response
    per engine step."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device {self.device!r} is not one of {DEVICES}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall timeout must be > 0 seconds, got {self.stall_timeout_s}")
        if self.torch_threads < 0:
            raise ValueError(f"torch threads must be >= 0 (0: torch's default), got {self.torch_threads}")
        if not 0 <= self.stream_interval_ms <= 1000:
            raise ValueError(f"stream interval must be in [0, 1000] ms, got {self.stream_interval_ms}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.model_name):
            raise ValueError(f"model name {self.model_name!r}: use letters, digits, '_', '.' or '-' (a directory name)")

    def parameters(self) -> dict[str, str]:
        """The config.pbtxt parameters the models read."""
        return {
            "project_root": str(PROJECT_ROOT),
            "engine_dir": str(Path(self.engine_dir).resolve()),
            "device": self.device,
            **runtime_parameters(self.runtime),
            "tp_master": self.tp_master,
            "stall_timeout_s": str(self.stall_timeout_s),
            "torch_threads": str(self.torch_threads),
            "stream_interval_ms": str(self.stream_interval_ms),
        }


def serving_config(args: argparse.Namespace, tp_master: str = "") -> ServingConfig:
    """A ServingConfig from `--engine`, `--model-name`, `--device` and the runtime flags."""
    return ServingConfig(
        args.engine,
        args.model_name,
        args.device,
        runtime_config(args),
        tp_master,
        args.stall_timeout,
        args.torch_threads,
        args.stream_interval_ms,
    )


def add_serving_args(ap: argparse.ArgumentParser) -> None:
    """Flags shared by the repository writer, the server launcher and the demo."""
    ap.add_argument("--engine", type=Path, required=True, help="engine directory (from `python -m build.engine`)")
    ap.add_argument("--model-name", default="specpipe", help="Triton model name (default: %(default)s)")
    ap.add_argument("--device", choices=DEVICES, default="cpu", help="device model.py runs on (default: %(default)s)")
    ap.add_argument(
        "--stall-timeout",
        type=float,
        default=ServingConfig.stall_timeout_s,
        help="seconds one engine step may run before the engine is reported down and the launcher stops "
        "the server (default: %(default)s)",
    )
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=ServingConfig.torch_threads,
        help="intra-op threads of the served engine; 0 = torch's default, every core (default: %(default)s)",
    )
    add_stream_interval_arg(ap)
    add_runtime_args(ap)


def add_stream_interval_arg(ap: argparse.ArgumentParser) -> None:
    """`--stream-interval-ms` (`ServingConfig.stream_interval_ms`), for `add_serving_args`
    and the NVIDIA client runners' servers (`triton_repo/nvidia_perf.py`)."""
    ap.add_argument(
        "--stream-interval-ms",
        type=float,
        default=ServingConfig.stream_interval_ms,
        help="least milliseconds between two streamed responses of a request; the tokens of the steps in "
        "between go out together (fewer, larger responses: each costs the server CPU the engine would use). "
        "0: one response per engine step (default: %(default)s)",
    )


INFER_SUFFIX = "_infer"
INFER_INSTANCES = 4
"""Instances of the non-streaming front: each waits on one request at a time (they hold
no engine, so they are cheap), and the engine batches what they forward."""


def render_config(cfg: ServingConfig, infer_front: bool = False) -> str:
    """config.pbtxt of the engine model, or (`infer_front`) of its non-streaming front."""
    fields = {k: pbtxt_string(v) for k, v in cfg.parameters().items()}
    return render_template(
        TEMPLATE,
        {
            **fields,
            "model_name": cfg.model_name + INFER_SUFFIX if infer_front else cfg.model_name,
            "decoupled": "false" if infer_front else "true",
            "instance_count": INFER_INSTANCES if infer_front else 1,
            "instance_kind": "KIND_MODEL" if cfg.device == "cuda" and not infer_front else "KIND_CPU",
            "target_model": cfg.model_name if infer_front else "",
        },
    )


def write_repository(cfg: ServingConfig, out_dir: Path) -> Path:
    """Write (or overwrite) `out_dir/<model_name>/` and `out_dir/<model_name>_infer/`; return
    the engine model's directory. Fails before writing anything if the engine directory is not one."""
    EngineConfig.load(Path(cfg.engine_dir))
    for source in (MODEL_SOURCE, INFER_SOURCE):
        if not source.is_file():
            raise FileNotFoundError(f"{source}: the Triton model code is missing from this checkout")
    for name, source, front in (
        (cfg.model_name, MODEL_SOURCE, False),
        (cfg.model_name + INFER_SUFFIX, INFER_SOURCE, True),
    ):
        model_dir = Path(out_dir) / name
        (model_dir / "1").mkdir(parents=True, exist_ok=True)
        (model_dir / "config.pbtxt").write_text(render_config(cfg, front))
        shutil.copyfile(source, model_dir / "1" / "model.py")
    return Path(out_dir) / cfg.model_name


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m triton_repo.repository",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serving_args(ap)
    ap.add_argument("--out", type=Path, required=True, help="model repository directory to write")
    ap.add_argument("--tp-master", default="", help="host:port of the tensor-parallel rendezvous (tp_size > 1)")
    args = ap.parse_args(argv)
    try:
        model_dir = write_repository(serving_config(args, tp_master=args.tp_master), args.out)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {model_dir}; serve with: tritonserver --model-repository {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

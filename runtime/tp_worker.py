"""Tensor parallelism for a server whose rank 0 is not an MPI process (TensorRT-LLM's leader
mode): under Triton, rank 0 is the Python-backend model process (`start_leader`), and ranks
1..TP-1 are followers started next to the server with

    mpirun -n TP-1 python -m runtime.tp_worker --engine ENGINE --master HOST:PORT

which `python -m triton_repo.server` (`make serve`) does, passing the same HOST:PORT to the
model as its `tp_master` parameter. Everyone meets there (rank 0 listens on PORT) through
torch.distributed's TCP rendezvous, so the leader needs no MPI; follower i of the mpirun is
tensor-parallel rank i + 1. Rank 0's messages (`runtime/tensor_parallel.py`) travel over a
gloo group (`GroupChannel`) instead of MPI, the forwards' all-reduces over the default group
as under `mpirun -n TP python -m runtime.generate`.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from runtime.config import RuntimeConfig
from runtime.engine_dir import EngineConfig
from runtime.loaded_engine import LoadedEngine
from runtime.model_runner import StepInput
from runtime.tensor_parallel import (
    GroupChannel,
    StepBroadcaster,
    TensorParallelError,
    announce_cache,
    exit_process,
    init_group,
    mpi_comm,
    serve_worker,
)

LEADER_TIMEOUT = timedelta(seconds=120)
"""How long rank 0 waits for the followers: the model's load must fail, not hang the server."""
FOLLOWER_TIMEOUT = timedelta(seconds=600)
"""How long a follower waits for rank 0, which loads its model in the server before joining."""
IDLE_TIMEOUT = timedelta(days=365)
"""How long a follower waits for the next step: as long as the server stays idle (gloo would
otherwise give up after the default group's timeout)."""


def follower_command(tp_size: int, engine_dir: str, master: str) -> str:
    return f"mpirun -n {tp_size - 1} python -m runtime.tp_worker --engine {engine_dir} --master {master}"


def join(master: str, rank: int, world_size: int, device: str | torch.device, timeout: timedelta) -> GroupChannel:
    """Join the ranks at `master` (host:port) and open the gloo group rank 0's messages take."""
    host, _, port = master.rpartition(":")
    if not host or not port.isdigit():
        raise TensorParallelError(f"tensor-parallel master address {master!r} is not host:port")
    init_group(master, rank, world_size, device, timeout)
    return GroupChannel(dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))


class ServerBroadcaster(StepBroadcaster):
    """Rank 0's broadcaster in a server: after telling the followers to stop, it also leaves
    the process group, which the server's process outlives."""

    def send_step(self, step: StepInput | None) -> None:
        super().send_step(step)
        if step is None:
            dist.destroy_process_group()


def start_leader(
    engine: LoadedEngine, settings: RuntimeConfig, tp_master: str
) -> tuple[RuntimeConfig, StepBroadcaster]:
    """Rank 0 in a server: join the followers at `tp_master`, size the KV cache and send its
    geometry; returns `settings` pinned to that size and the broadcaster to build the
    `LLMEngine` with (as `start_workers`, but the caller stops the followers, with
    `ModelRunner.shutdown`, when the server unloads the model)."""
    tp_size = engine.config.build.tp_size
    if not tp_master:
        raise TensorParallelError(
            f"engine built with --tp-size {tp_size}: ranks 1..{tp_size - 1} run in `python -m runtime.tp_worker` "
            "processes, but the model has no `tp_master` address to meet them at; serve TP engines with "
            "`make serve` / `python -m triton_repo.server`, which start the followers"
        )
    try:
        channel = join(tp_master, 0, tp_size, engine.device, LEADER_TIMEOUT)
    except dist.DistError as e:
        raise TensorParallelError(
            f"tensor-parallel rank 0 could not meet its {tp_size - 1} follower rank(s) at {tp_master} within "
            f"{LEADER_TIMEOUT.total_seconds():.0f} s ({e}); they are started by "
            f"`{follower_command(tp_size, '<engine dir>', tp_master)}`"
        ) from e
    broadcaster = ServerBroadcaster(channel)
    return announce_cache(engine, settings, broadcaster), broadcaster


def follower_rank(tp_size: int, followers: int, mpi_rank: int) -> int:
    """Tensor-parallel rank of MPI rank `mpi_rank` among `followers` processes (rank 0 is the
    leader's); the launch must match the engine."""
    if followers != tp_size - 1:
        fix = (
            "it has no followers: serve it without runtime.tp_worker"
            if tp_size == 1
            else f"run: mpirun -n {tp_size - 1} {shlex.join(sys.orig_argv)}"
        )
        raise TensorParallelError(
            f"engine built with --tp-size {tp_size} needs {tp_size - 1} follower process(es) "
            f"(rank 0 is the server's), but mpirun started {followers}; {fix}"
        )
    return mpi_rank + 1


def follower_device(device: str, rank: int) -> str:
    """`cuda` means GPU `rank` (rank 0, the leader, on GPU 0; one node); anything else is kept."""
    return f"cuda:{rank % torch.cuda.device_count()}" if device == "cuda" else device


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m runtime.tp_worker", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--engine", type=Path, required=True, help="engine directory built with --tp-size TP")
    ap.add_argument("--master", required=True, help="host:port where rank 0 listens (the model's tp_master)")
    ap.add_argument("--device", default="cpu", help="cpu, or cuda: rank r on GPU r (default: %(default)s)")
    ap.add_argument(
        "--timeout",
        type=float,
        default=FOLLOWER_TIMEOUT.total_seconds(),
        help="seconds to wait for rank 0 to join (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    try:
        tp_size = EngineConfig.load(args.engine).build.tp_size
        comm = mpi_comm()
        rank = follower_rank(tp_size, comm.Get_size(), comm.Get_rank())
        device = follower_device(args.device, rank)
        engine = LoadedEngine.load(args.engine, device=device, rank=rank)
        serve_worker(engine, join(args.master, rank, tp_size, device, timedelta(seconds=args.timeout)))
    except (ValueError, FileNotFoundError, dist.DistError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    exit_process(main())

"""Tensor parallelism at run time: one process per rank, each holding its shard of the
target (`build/tp_shard.py`) and of the KV cache.

Rank 0 owns everything that decides: the `LLMEngine` (scheduler, block manager, drafter,
sampling, verification). The other ranks only run target forwards, in rank 0's order,
from messages rank 0 broadcasts over a `Channel`:

    CacheGeometry(num_blocks, block_size)   once: the other ranks allocate the same block pool
    StepInput                               one per target forward
    None                                    stop

Every rank must run exactly the same sequence of forwards, since the forwards' all-reduces
pair up across ranks. Everything rank 0 runs goes through `ModelRunner.execute` (the
LLMEngine's calibration forwards included), which sends the step before running it.
Activations are all-reduced with torch.distributed (gloo on CPU, NCCL on CUDA).

Two launches share this module:
- the CLI (`mpirun -n TP python -m runtime.generate ...`): MPI starts every rank, tells
  each its rank and carries the (small, pickled) messages (`MPIChannel`);
- a server (`runtime/tp_worker.py`): rank 0 lives in the server's own process, outside
  any MPI world, so the messages go over a torch.distributed gloo group (`GroupChannel`).

mpi4py is imported only when an engine has more than one rank, so a `--tp-size 1` engine
runs without MPI installed.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from datetime import timedelta
from typing import Any, NamedTuple, NoReturn, Protocol, TypeAlias

import torch
import torch.distributed as dist

from runtime.config import RuntimeConfig
from runtime.kv_budget import KVBudget, kv_cache_blocks
from runtime.loaded_engine import LoadedEngine
from runtime.model_runner import ModelRunner, StepInput

WORLD_SIZE_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
"""Where Open MPI's and MPICH's (Hydra) launchers put the number of processes."""
LOCAL_RANK_ENV = ("OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
"""... and a process's rank among those on its node."""


class TensorParallelError(ValueError):
    """The launch does not match the engine, or MPI is missing."""


class CacheGeometry(NamedTuple):
    num_blocks: int
    block_size: int


def launched_world_size() -> int:
    """Processes the MPI launcher started (1 without one), read from its environment so that
    telling "no mpirun" apart needs no MPI library."""
    for name in WORLD_SIZE_ENV:
        if name in os.environ:
            return int(os.environ[name])
    return 1


def local_rank() -> int:
    return next((int(os.environ[n]) for n in LOCAL_RANK_ENV if n in os.environ), 0)


def rank_device(device: str) -> str:
    """Under MPI, `cuda` means this process's own GPU (local rank r -> cuda:r); anything else,
    and any device without MPI, is kept as given."""
    if device != "cuda" or launched_world_size() == 1:
        return device
    return f"cuda:{local_rank() % torch.cuda.device_count()}"


def mpi_comm() -> Any:
    """MPI's world communicator; mpi4py is imported (and MPI initialized) only here."""
    try:
        from mpi4py import MPI
    except (ImportError, RuntimeError) as e:  # no mpi4py, or no MPI library for it to load
        raise TensorParallelError(f"tensor parallelism needs mpi4py and an MPI library ({e}); run `make setup`") from e
    return MPI.COMM_WORLD


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _check_world_size(engine_tp_size: int, world_size: int) -> None:
    if world_size == engine_tp_size:
        return
    processes = f"{world_size} process{'es' if world_size != 1 else ''}"
    fix = (
        "run it without mpirun"
        if engine_tp_size == 1
        else f"run: mpirun -n {engine_tp_size} {shlex.join(sys.orig_argv)}"
    )
    raise TensorParallelError(f"engine built with --tp-size {engine_tp_size} but launched with {processes}; {fix}")


def init_tensor_parallel(engine_tp_size: int, device: str = "cpu") -> tuple[int, int]:
    """Check the launch against the engine and join the ranks' torch.distributed group;
    returns (rank, world_size). A `--tp-size 1` engine outside mpirun is (0, 1) with no MPI
    and no process group."""
    _check_world_size(engine_tp_size, launched_world_size())
    if engine_tp_size == 1:
        return 0, 1
    rank, world_size = join_process_group(device)
    _check_world_size(engine_tp_size, world_size)
    return rank, world_size


def join_process_group(device: str = "cpu") -> tuple[int, int]:
    """Start torch.distributed over the MPI processes (gloo on CPU, NCCL on CUDA); returns
    (rank, world_size). MASTER_ADDR (default 127.0.0.1; across nodes set it to rank 0's host)
    and MASTER_PORT (default: a free port rank 0 picks) are sent to all ranks over MPI, so
    concurrent jobs on one host never collide."""
    comm = mpi_comm()
    rank, world_size = comm.Get_rank(), comm.Get_size()
    address = None
    if rank == 0:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        address = f"{host}:{os.environ.get('MASTER_PORT') or _free_port(host)}"
    address = comm.bcast(address, root=0)
    init_group(address, rank, world_size, rank_device(device))
    return rank, world_size


def init_group(
    address: str, rank: int, world_size: int, device: str | torch.device, timeout: timedelta | None = None
) -> None:
    """Join torch.distributed's default group at `tcp://address` (host:port; rank 0 listens
    there): gloo on CPU, NCCL on CUDA with `device` made this process's current GPU. Every
    rank waits for all the others up to `timeout` (torch's default when None)."""
    backend = "gloo"
    if torch.device(device).type == "cuda":
        backend = "nccl"
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://{address}", rank=rank, world_size=world_size, timeout=timeout)


def exit_process(code: int) -> NoReturn:
    """End a CLI process. Inside a process group: destroy it, finalize MPI and leave with `os._exit`,
    skipping interpreter finalization, during which gloo's worker thread can still drop the
    last reference to a tensor and abort the process (seen about one exit in ten)."""
    if not (dist.is_available() and dist.is_initialized()):
        sys.exit(code)
    dist.destroy_process_group()
    from mpi4py import MPI

    if MPI.Is_initialized() and not MPI.Is_finalized():
        MPI.Finalize()  # mpirun treats a rank that exits without it as failed
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


Message: TypeAlias = CacheGeometry | StepInput | None
"""What rank 0 tells the other ranks (see the module docstring)."""


class Channel(Protocol):
    """Carries rank 0's messages to every other rank, in order: rank 0 sends, the others receive."""

    def send(self, message: Message) -> None: ...

    def receive(self) -> Message: ...


class MPIChannel:
    """Over MPI, when every rank is in one MPI world (`mpirun -n TP`)."""

    def __init__(self, comm: Any) -> None:
        self.comm = comm

    def send(self, message: Message) -> None:
        self.comm.bcast(message, root=0)

    def receive(self) -> Message:
        message: Message = self.comm.bcast(None, root=0)
        return message


class GroupChannel:
    """Over a torch.distributed gloo group, when rank 0 is not in the other ranks' MPI world.
    gloo whatever the forwards' backend: objects travel pickled on CPU."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group

    def send(self, message: Message) -> None:
        dist.broadcast_object_list([message], src=0, group=self.group)

    def receive(self) -> Message:
        box: list[Message] = [None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


class StepBroadcaster:
    """Rank 0's `StepSender`: each step goes to the other ranks on CPU (each moves it to
    its own device); None tells them to stop."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def send_step(self, step: StepInput | None) -> None:
        self.channel.send(None if step is None else step.to("cpu"))


def announce_cache(engine: LoadedEngine, config: RuntimeConfig, broadcaster: StepBroadcaster) -> RuntimeConfig:
    """Rank 0: size the KV cache and send its geometry to the other ranks; returns `config`
    pinned to that size, so the `LLMEngine` built from it allocates exactly the announced
    pool. If sizing fails the other ranks are told to stop, so none is left waiting."""
    try:
        max_batch_size = config.batch_limit(engine.config.build)
        num_blocks = kv_cache_blocks(engine, config.kv, config.block_size, max_batch_size, config.max_draft_tokens)
        broadcaster.channel.send(CacheGeometry(num_blocks, config.block_size))
    except BaseException:
        broadcaster.send_step(None)
        raise
    return replace(config, kv=KVBudget(max_tokens=num_blocks * config.block_size))


@contextmanager
def start_workers(engine: LoadedEngine, config: RuntimeConfig) -> Iterator[tuple[RuntimeConfig, StepBroadcaster]]:
    """Rank 0 of an `mpirun` launch: `announce_cache`, then yield the pinned config and the
    broadcaster to build the `LLMEngine` with. On exit, error or not, the other ranks are
    told to stop (what `ModelRunner.shutdown` sends), so none is left waiting."""
    broadcaster = StepBroadcaster(MPIChannel(mpi_comm()))
    pinned = announce_cache(engine, config, broadcaster)
    try:
        yield pinned, broadcaster
    finally:
        broadcaster.send_step(None)


def serve_steps(runner: ModelRunner, channel: Channel) -> int:
    """Ranks > 0: run rank 0's steps until it sends None; returns how many ran. The LM head
    is skipped (no logits indices): only rank 0 reads logits."""
    count = 0
    while (step := channel.receive()) is not None:
        assert isinstance(step, StepInput), step
        step.logits_indices = step.logits_indices[:0]
        runner.run(step)
        count += 1
    return count


def serve_worker(engine: LoadedEngine, channel: Channel | None = None) -> int:
    """Ranks > 0: allocate the KV cache rank 0 announces, then serve its steps; returns how
    many ran (none if rank 0 stopped before sizing the cache). `channel` defaults to the
    MPI world's."""
    channel = channel or MPIChannel(mpi_comm())
    geometry = channel.receive()
    if geometry is None:
        return 0
    assert isinstance(geometry, CacheGeometry), geometry
    return serve_steps(ModelRunner(engine.model, engine.model.new_kv_cache(*geometry)), channel)

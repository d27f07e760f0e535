"""Leader mode (how Triton serves a TP engine): rank 0 is a plain process that is not under
mpirun (`start_leader`), its followers are `mpirun -n TP-1 python -m runtime.tp_worker`;
together they emit exactly the TP=1 engine's greedy tokens, and launches that do not match
the engine fail clearly instead of hanging."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from build.engine import build_engine
from runtime.config import RuntimeConfig
from runtime.engine_dir import BuildConfig
from runtime.loaded_engine import LoadedEngine
from runtime.tensor_parallel import TensorParallelError
from runtime.tp_worker import start_leader
from tests.host_tools import MPIRUN, needs_mpirun
from tests.runtime.test_tensor_parallel import BUILD, MAX_TOKENS, MODELS, PROMPTS, REPO, tp1_output_ids

METHODS = ("ar", "redrafter")

LEADER = """
import json, sys
from runtime import tp_worker
from runtime.loaded_engine import LoadedEngine
from runtime.llm_engine import LLMEngine
from runtime.config import RuntimeConfig
from runtime.sampling import SamplingParams

engine_dir, master, timeout, prompts, max_tokens, methods = sys.argv[1:]
tp_worker.LEADER_TIMEOUT = tp_worker.timedelta(seconds=float(timeout))
engine = LoadedEngine.load(engine_dir)
config, broadcast = tp_worker.start_leader(engine, RuntimeConfig(), master)
llm = LLMEngine(engine, config, broadcast)
ids = [engine.encode(p) for p in json.loads(prompts)]
params = [SamplingParams(max_tokens=int(max_tokens))] * len(ids)
outputs = {m: llm.generate(ids, params, m) for m in methods.split(",")}
llm.runner.shutdown()
print(json.dumps({m: [[r.output_ids, r.num_accepted] for r in results] for m, results in outputs.items()}))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def clean_env() -> dict[str, str]:
    """This environment without any MPI launcher's variables, so the leader is no MPI rank."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
    return env | {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def leader(engine_dir: Path, master: str, timeout: float = 120) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-c", LEADER, str(engine_dir), master, str(timeout), json.dumps(PROMPTS), str(MAX_TOKENS)]
    cmd.append(",".join(METHODS))
    return subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def followers(engine_dir: Path, master: str, processes: int) -> subprocess.Popen[str]:
    assert MPIRUN is not None
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(processes), sys.executable, "-m"]
    cmd += ["runtime.tp_worker", "--engine", str(engine_dir), "--master", master, "--timeout", "60"]
    return subprocess.Popen(cmd, cwd=REPO, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedEngine, Path]:
    """The demo target + its trained ReDrafter, for TP=1 (loaded) and TP=2 (a directory)."""
    out = tmp_path_factory.mktemp("tp-leader-engines")
    tp1, tp2 = (
        build_engine(
            MODELS / "demo-target", out / f"tp{n}", replace(BUILD, tp_size=n), drafter=MODELS / "demo-redrafter"
        )
        for n in (1, 2)
    )
    return LoadedEngine.load(tp1), tp2


@needs_mpirun
def test_leader_outside_mpi_with_tp_worker_equals_tp1(engines: tuple[LoadedEngine, Path]) -> None:
    engine, tp2 = engines
    master = f"127.0.0.1:{free_port()}"
    lead, follow = leader(tp2, master), followers(tp2, master, 1)
    try:
        lead_out, lead_err = lead.communicate(timeout=600)
        _, follow_err = follow.communicate(timeout=60)
    finally:
        for proc in (lead, follow):
            proc.kill()
    assert lead.returncode == 0, lead_err
    assert follow.returncode == 0, follow_err
    outputs = json.loads(lead_out)
    for method in METHODS:
        assert [ids for ids, _ in outputs[method]] == tp1_output_ids(engine, method), method
    assert sum(accepted for _, accepted in outputs["redrafter"]) > 0, "no draft was accepted: KV moves went untested"


@needs_mpirun
def test_wrong_number_of_followers_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = build_engine(tiny_checkpoint, tmp_path / "eng", BuildConfig(max_seq_len=64, max_input_len=32, tp_size=2))
    _, err = (proc := followers(out, f"127.0.0.1:{free_port()}", 2)).communicate(timeout=120)
    assert proc.returncode != 0
    assert "engine built with --tp-size 2 needs 1 follower process(es) (rank 0 is the server's), " in err
    assert "but mpirun started 2; run: mpirun -n 1 " in err


def test_leader_without_followers_times_out_naming_the_command(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = build_engine(tiny_checkpoint, tmp_path / "eng", BuildConfig(max_seq_len=64, max_input_len=32, tp_size=2))
    master = f"127.0.0.1:{free_port()}"
    _, err = (proc := leader(out, master, timeout=2)).communicate(timeout=120)
    assert proc.returncode != 0
    assert f"rank 0 could not meet its 1 follower rank(s) at {master} within 2 s" in err
    assert f"mpirun -n 1 python -m runtime.tp_worker --engine <engine dir> --master {master}" in err


def test_leader_needs_a_master_address(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = build_engine(tiny_checkpoint, tmp_path / "eng", BuildConfig(max_seq_len=64, max_input_len=32, tp_size=2))
    with pytest.raises(TensorParallelError, match=r"no `tp_master` address .* `python -m triton_repo.server`"):
        start_leader(LoadedEngine.load(out), RuntimeConfig(), "")

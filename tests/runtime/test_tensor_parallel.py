"""Tensor parallelism: the checkpoint splits into shards that concatenate back to it, and a
TP=2 engine launched with `mpirun -n 2` emits exactly the TP=1 engine's greedy tokens
(fp32) for every decoding method; a launch that does not match the engine fails clearly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers

from build.engine import BuildError, build_engine
from build.tp_shard import shard_tensors, split_dim
from model_defs.llama import LlamaConfig, expected_shapes
from runtime.engine_dir import BuildConfig, rank_file
from runtime.llm_engine import generate
from runtime.loaded_engine import LoadedEngine
from runtime.sampling import SamplingParams
from tests.host_tools import MPIRUN, needs_mpirun
from triton_repo.processes import LAUNCH_ID_ENV, launched_processes

REPO = Path(__file__).resolve().parents[2]
MODELS = REPO / "models"
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):", "import os\n", "x = "]
MAX_TOKENS = 24
BUILD = BuildConfig(max_batch_size=4, max_input_len=32, max_seq_len=96)


def launch(engine_dir: Path, *args: str, processes: int | None = 2) -> subprocess.CompletedProcess[str]:
    """`python -m runtime.generate` on `engine_dir`, under `mpirun -n processes` (None: plain)."""
    cmd = [sys.executable, "-m", "runtime.generate", "--engine", str(engine_dir), *args]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
    env |= {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    if processes is not None:
        assert MPIRUN is not None
        cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", str(processes), *cmd]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def tp2_outputs(engine_dir: Path, method: str) -> list[dict]:
    args = [a for p in PROMPTS for a in ("--prompt", p)]
    proc = launch(engine_dir, *args, "--json", "--method", method, "--max-tokens", str(MAX_TOKENS))
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def tp1_output_ids(engine: LoadedEngine, method: str) -> list[list[int]]:
    prompts = [engine.encode(p) for p in PROMPTS]
    results = generate(engine, prompts, [SamplingParams(max_tokens=MAX_TOKENS)] * len(prompts), method)
    return [r.output_ids for r in results]


# ---- sharding ---------------------------------------------------------------------------


def test_shards_concatenate_back_to_the_checkpoint() -> None:
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        attention_bias=True,
        mlp_bias=True,
    )
    torch.manual_seed(0)
    tensors = {name: torch.randn(shape) for name, shape in expected_shapes(cfg).items()}
    tensors["drafter.lm_head.0.weight"] = torch.randn(64, 16)
    shards = [shard_tensors(tensors, cfg, 2, rank) for rank in range(2)]
    expected = expected_shapes(cfg, 2)
    for shard in shards:
        assert {k: v.shape for k, v in shard.items() if k in expected} == expected
    for name, tensor in tensors.items():
        dim = split_dim(name)
        if dim is None:
            assert all(torch.equal(s[name], tensor) for s in shards), name
        else:
            assert torch.equal(torch.cat([s[name] for s in shards], dim), tensor), name
    layer = "model.layers.1."
    assert [
        split_dim(layer + n) for n in ("self_attn.q_proj.bias", "self_attn.o_proj.weight", "mlp.down_proj.bias")
    ] == [
        0,
        1,
        None,
    ]


def test_tp_size_must_divide_heads_and_intermediate(tiny_checkpoint: Path, tmp_path: Path) -> None:
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=384,
        intermediate_size=1024,
        num_hidden_layers=1,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
    )
    with pytest.raises(ValueError, match=r"tp_size 3 does not divide num_key_value_heads 2, intermediate_size 1024;"):
        shard_tensors({}, cfg, 3, 0)
    with pytest.raises(ValueError, match=r"tp_size 4 does not divide num_attention_heads 6, num_key_value_heads 2;"):
        shard_tensors({}, cfg, 4, 0)
    with pytest.raises(BuildError, match=r"config.json: tp_size 4 does not divide num_key_value_heads 2;"):
        build_engine(tiny_checkpoint, tmp_path / "eng", BuildConfig(max_seq_len=64, max_input_len=32, tp_size=4))
    assert not (tmp_path / "eng").exists()


def test_every_rank_file_loads_and_a_missing_one_is_named(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = build_engine(tiny_checkpoint, tmp_path / "eng", BuildConfig(max_seq_len=64, max_input_len=32, tp_size=2))
    for rank in range(2):
        model = LoadedEngine.load(out, rank=rank).model
        assert model.tp_size == 2 and model.model.layers[0].self_attn.num_kv_heads == 1
        assert model.new_kv_cache(4, 16).k[0].shape == (80, 1, model.config.head_dim)  # 4 blocks + 1 scratch
    (out / rank_file(1)).unlink()
    with pytest.raises(FileNotFoundError, match=r"rank1.safetensors: missing the weights of rank 1 .* --tp-size 2"):
        LoadedEngine.load(out, rank=1)


# ---- TP=2 under mpirun == TP=1 in-process ------------------------------------------------


@pytest.fixture(scope="module")
def demo_engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedEngine, Path]:
    """The demo target + its trained ReDrafter (so drafts get accepted and the accepted
    paths' KV moves are exercised on every rank), built for TP=1 (loaded) and TP=2."""
    out = tmp_path_factory.mktemp("tp-engines")
    tp1, tp2 = (
        build_engine(
            MODELS / "demo-target",
            out / f"tp{n}",
            replace(BUILD, tp_size=n),
            drafter=MODELS / "demo-redrafter",
        )
        for n in (1, 2)
    )
    return LoadedEngine.load(tp1), tp2


@pytest.fixture(scope="module")
def draft_lm_engines(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedEngine, Path]:
    """The demo target + its draft LM (which runs on rank 0 only, with its own cache)."""
    out = tmp_path_factory.mktemp("tp-draft-engines")
    tp1, tp2 = (
        build_engine(
            MODELS / "demo-target",
            out / f"tp{n}",
            replace(BUILD, tp_size=n),
            draft_model=MODELS / "demo-draft-lm",
        )
        for n in (1, 2)
    )
    return LoadedEngine.load(tp1), tp2


@needs_mpirun
@pytest.mark.parametrize(
    ("drafter", "method"), [("rnn", "ar"), ("rnn", "redrafter"), ("rnn", "rsd-s"), ("draft-lm", "rsd-c")]
)
def test_tp2_greedy_equals_tp1(drafter: str, method: str, request: pytest.FixtureRequest) -> None:
    engine, tp2 = request.getfixturevalue("demo_engines" if drafter == "rnn" else "draft_lm_engines")
    outputs = tp2_outputs(tp2, method)
    assert [o["output_ids"] for o in outputs] == tp1_output_ids(engine, method)
    if method != "ar":
        assert sum(o["num_accepted"] for o in outputs) > 0, "no draft was accepted: KV moves went untested"


@pytest.fixture(scope="module")
def biased_checkpoint(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint's architecture and tokenizer with q/k/v/o and MLP biases (column-
    parallel ones are split, row-parallel ones added once after the all-reduce). Weights at
    unit gain so that neither the biases nor the residual stream drown the rest."""
    out = tmp_path_factory.mktemp("tiny-llama-bias")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tiny_checkpoint / name, out / name)
    cfg = transformers.LlamaConfig.from_pretrained(tiny_checkpoint)
    cfg.attention_bias = cfg.mlp_bias = True
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.2)
            elif p.ndim == 2:
                p.normal_(0, p.shape[1] ** -0.5)
    model.save_pretrained(out)
    return out


@needs_mpirun
def test_tp2_with_biases_equals_tp1(biased_checkpoint: Path, tmp_path: Path) -> None:
    tp1 = LoadedEngine.load(
        build_engine(biased_checkpoint, tmp_path / "tp1", BuildConfig(max_seq_len=96, max_input_len=32))
    )
    tp2 = build_engine(biased_checkpoint, tmp_path / "tp2", BuildConfig(max_seq_len=96, max_input_len=32, tp_size=2))
    assert [o["output_ids"] for o in tp2_outputs(tp2, "ar")] == tp1_output_ids(tp1, "ar")


# ---- launches that do not match the engine -------------------------------------------------


def test_tp2_engine_without_mpirun_says_how_to_launch(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = build_engine(tiny_checkpoint, tmp_path / "eng", BuildConfig(max_seq_len=64, max_input_len=32, tp_size=2))
    proc = launch(out, "--prompt", "x", processes=None)
    assert proc.returncode == 2
    assert "engine built with --tp-size 2 but launched with 1 process; run: mpirun -n 2 " in proc.stderr


@needs_mpirun
def test_tp1_engine_under_mpirun_n2_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = build_engine(tiny_checkpoint, tmp_path / "eng", BuildConfig(max_seq_len=64, max_input_len=32))
    proc = launch(out, "--prompt", "x", processes=2)
    assert proc.returncode != 0
    assert "engine built with --tp-size 1 but launched with 2 processes" in proc.stderr


@needs_mpirun
def test_a_killed_rank_ends_the_mpirun_job_without_leftovers(demo_engines: tuple[LoadedEngine, Path]) -> None:
    """`mpirun -n 2 python -m runtime.generate`: SIGKILL of one rank while the job runs makes
    mpirun abort the other and exit non-zero within seconds: no hang, no process left."""
    assert MPIRUN is not None
    marker = f"specpipe-test-{os.getpid()}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI_", "PMIX_"))}
    env |= {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", LAUNCH_ID_ENV: marker}
    args = [a for p in PROMPTS * 8 for a in ("--prompt", p)]  # 32 requests: several seconds of steps
    cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, "-m", "runtime.generate"]
    job = subprocess.Popen(
        [*cmd, "--engine", str(demo_engines[1]), *args, "--max-tokens", "60", "--ignore-eos"],
        cwd=REPO,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )

    def ranks() -> list[int]:
        return sorted(
            p.pid for p in launched_processes(marker) if "runtime.generate" in p.cmdline and "mpirun" not in p.cmdline
        )

    try:
        deadline = time.monotonic() + 120
        while len(ranks()) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(ranks()) == 2, "the two ranks never started"
        time.sleep(3.0)  # loaded, and most likely inside the generation
        os.kill(ranks()[-1], signal.SIGKILL)
        killed = time.monotonic()
        _, stderr = job.communicate(timeout=60)
        assert job.returncode != 0 and time.monotonic() - killed < 30, stderr[-2000:]
    finally:
        if job.poll() is None:
            job.kill()
    assert not launched_processes(marker), "processes of the aborted job are still running"

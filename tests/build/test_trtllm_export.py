"""TensorRT-LLM ReDrafter checkpoint export from the real demo models: names and shapes against a table
transcribed from TensorRT-LLM's converters (tests/build/data), exact round trips, config and build command.
TensorRT-LLM itself is not installed here, so loading the checkpoint into `ReDrafterForLLaMALM` is not tested."""

from __future__ import annotations

import json
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from build.engine import BuildError
from build.trtllm_export import (
    ARCHITECTURE,
    BuildLimits,
    ReDrafterSettings,
    default_max_seq_len,
    export_checkpoint,
    main,
    trtllm_build_command,
)
from build.trtllm_weights import fuse_qkv, target_rank_tensors, unfuse_qkv, unsplit
from model_defs.checkpoint import load_llama_checkpoint, load_tensors, tensor_files

ROOT = Path(__file__).resolve().parents[2]
TARGET = ROOT / "models" / "demo-target"
DRAFTER = ROOT / "models" / "demo-redrafter"
TABLE = json.loads((Path(__file__).parent / "data" / "trtllm_redrafter_llama_weights.json").read_text())

pytestmark = pytest.mark.skipif(not (TARGET.is_dir() and DRAFTER.is_dir()), reason="demo models not present")


@pytest.fixture(scope="module")
def exports(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """tp 1 and tp 2 exports in float32, so that bf16 sources compare exactly."""
    base = tmp_path_factory.mktemp("trtllm")
    return {tp: export_checkpoint(TARGET, DRAFTER, base / f"tp{tp}", tp_size=tp, dtype="float32") for tp in (1, 2)}


@pytest.fixture(scope="module")
def source() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    _, target = load_llama_checkpoint(TARGET)
    drafter = load_tensors(tensor_files(DRAFTER))
    return {k: v.float() for k, v in target.items()}, {k: v.float() for k, v in drafter.items()}


def ranks(out: Path, tp: int) -> list[dict[str, torch.Tensor]]:
    return [load_file(str(out / f"rank{r}.safetensors")) for r in range(tp)]


def expand(patterns: dict[str, list[int]], layers: int, draft_layers: int) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for pattern, shape in patterns.items():
        if "{l}" in pattern:
            out |= {pattern.replace("{l}", str(i)): shape for i in range(layers)}
        elif "{i}" in pattern:
            out |= {pattern.replace("{i}", str(i)): shape for i in range(draft_layers)}
        else:
            out[pattern] = shape
    return out


@pytest.mark.parametrize("tp", [1, 2])
def test_names_and_shapes_match_trtllm_table(exports: dict[int, Path], tp: int) -> None:
    sym = TABLE["demo_model"]["symbols"]
    expected = expand(TABLE["demo_model"]["concrete_shapes"][str(tp)], sym["num_hidden_layers"], sym["N"])
    for rank in ranks(exports[tp], tp):
        assert {k: list(v.shape) for k, v in rank.items()} == expected
        assert all(v.dtype == torch.float32 for v in rank.values())


@pytest.mark.parametrize("tp", [1, 2])
def test_table_formulas_agree_with_concrete_shapes(tp: int) -> None:
    """The shape formulas (transcribed from TRT-LLM's sources) give the concrete demo shapes."""
    sym = dict(TABLE["demo_model"]["symbols"], T=tp)
    sym["KVr"] = max(sym["KV"] // tp, 1)
    for pattern, formula in TABLE["patterns"].items():
        shape = eval(formula, {}, sym)  # our own test data: arithmetic on the symbols above
        assert shape == TABLE["demo_model"]["concrete_shapes"][str(tp)][pattern], pattern


def test_qkv_unfuses_to_our_q_k_v(exports: dict[int, Path], source: tuple[dict, dict]) -> None:
    target, _ = source
    cfg, _ = load_llama_checkpoint(TARGET)
    for tp in (1, 2):
        shards = ranks(exports[tp], tp)
        for layer in range(cfg.num_hidden_layers):
            parts = [unfuse_qkv(s[f"transformer.layers.{layer}.attention.qkv.weight"], cfg, tp) for s in shards]
            for i, p in enumerate("qkv"):
                got = unsplit([part[i] for part in parts], dim=0)
                assert torch.equal(got, target[f"model.layers.{layer}.self_attn.{p}_proj.weight"]), (tp, layer, p)


def test_gate_up_mapping(exports: dict[int, Path], source: tuple[dict, dict]) -> None:
    """TRT-LLM's GatedMLP computes act(fc(x)) * gate(x): HF gate_proj -> mlp.fc, up_proj -> mlp.gate."""
    target, _ = source
    rank = ranks(exports[1], 1)[0]
    for layer in range(6):
        t, h = f"transformer.layers.{layer}.", f"model.layers.{layer}."
        assert torch.equal(rank[t + "mlp.fc.weight"], target[h + "mlp.gate_proj.weight"])
        assert torch.equal(rank[t + "mlp.gate.weight"], target[h + "mlp.up_proj.weight"])
        assert torch.equal(rank[t + "mlp.proj.weight"], target[h + "mlp.down_proj.weight"])
        assert torch.equal(rank[t + "post_layernorm.weight"], target[h + "post_attention_layernorm.weight"])


def test_tied_embedding_duplicated_into_lm_head(exports: dict[int, Path], source: tuple[dict, dict]) -> None:
    target, _ = source
    rank = ranks(exports[1], 1)[0]
    assert torch.equal(rank["lm_head.weight"], target["model.embed_tokens.weight"])
    assert torch.equal(rank["transformer.vocab_embedding.weight"], target["model.embed_tokens.weight"])


SPLIT_DIMS = [
    (r"transformer\.layers\.\d+\.attention\.dense\.weight", 1),
    (r"transformer\.layers\.\d+\.mlp\.proj\.weight", 1),
    (r"transformer\.layers\.\d+\.mlp\.(fc|gate)\.weight", 0),
    (r"lm_head\.weight", 0),
    (r"drafter\..*", 0),
]


def test_tp2_shards_concatenate_to_tp1(exports: dict[int, Path]) -> None:
    whole = ranks(exports[1], 1)[0]
    shards = ranks(exports[2], 2)
    cfg, _ = load_llama_checkpoint(TARGET)
    for name, tensor in whole.items():
        if name.endswith("attention.qkv.weight"):  # fused per rank: compare after un-fusing
            per_rank = [unfuse_qkv(s[name], cfg, 2) for s in shards]
            got = torch.cat([unsplit([p[i] for p in per_rank], 0) for i in range(3)])
        else:
            dim = next((d for pattern, d in SPLIT_DIMS if re.fullmatch(pattern, name)), None)
            got = shards[0][name] if dim is None else unsplit([s[name] for s in shards], dim)
            if dim is None:
                assert torch.equal(shards[1][name], tensor), name  # replicated
        assert torch.equal(got, tensor), name


def test_drafter_round_trip(exports: dict[int, Path], source: tuple[dict, dict]) -> None:
    _, drafter = source
    names = {
        "input_proj.weight": "drafter.input_proj.weight",
        "input_proj.bias": "drafter.input_proj.bias",
        "lm_head.0.linear.weight": "drafter.layers.0.linear.weight",
        "lm_head.0.linear.bias": "drafter.layers.0.linear.bias",
        "lm_head.1.linear.weight": "drafter.layers.1.linear.weight",
        "lm_head.1.linear.bias": "drafter.layers.1.linear.bias",
        "lm_head.2.weight": "drafter.lm_head.weight",
        "rnn_u.weight": "drafter.rnn_u.weight",
        "rnn_u.bias": "drafter.rnn_u.bias",
        "rnn_w.weight": "drafter.rnn_w.weight",
    }
    assert set(names) == set(drafter)
    for tp in (1, 2):
        shards = ranks(exports[tp], tp)
        for ours, theirs in names.items():
            assert torch.equal(unsplit([s[theirs] for s in shards], 0), drafter[ours]), (tp, ours)


def test_dtype_conversion() -> None:
    cfg, tensors = load_llama_checkpoint(TARGET)
    out = target_rank_tensors(tensors, cfg, 2, 1, torch.float16)
    assert {t.dtype for t in out.values()} == {torch.float16}


def test_config_json(exports: dict[int, Path]) -> None:
    cfg = json.loads((exports[2] / "config.json").read_text())
    assert cfg["architecture"] == ARCHITECTURE == "ReDrafterForLLaMALM"
    assert cfg["base_model_architecture"] == "LlamaForCausalLM"
    assert cfg["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    assert {k: v for k, v in cfg.items() if k.startswith("redrafter_")} == {
        "redrafter_num_layers": 2,
        "redrafter_hidden_size": 384,
        "redrafter_exit_dim": 384,
        "redrafter_is_rnn": True,
        "redrafter_num_beams": 4,
        "redrafter_draft_len_per_beam": 4,
        "redrafter_greedy_search": False,
    }
    expected = {
        "dtype": "float32",
        "vocab_size": 8192,
        "hidden_size": 384,
        "num_hidden_layers": 6,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_size": 64,
        "intermediate_size": 1024,
        "hidden_act": "silu",
        "position_embedding_type": "rope_gpt_neox",
        "max_position_embeddings": 1024,
        "norm_epsilon": 1e-5,
        "rotary_base": 10000.0,
        "rotary_scaling": None,
        "use_parallel_embedding": False,
        "tie_word_embeddings": True,
    }
    assert {k: cfg[k] for k in expected} == expected


def test_build_command() -> None:
    cmd = trtllm_build_command("ckpt", "eng", "bfloat16", BuildLimits(4, 256, 1024, 2048))
    assert "--max_draft_len" not in cmd
    flags = dict(zip(cmd[1::2], cmd[2::2], strict=True))
    assert cmd[0] == "trtllm-build"
    assert flags == {
        "--checkpoint_dir": "ckpt",
        "--output_dir": "eng",
        "--speculative_decoding_mode": "explicit_draft_tokens",
        "--gemm_plugin": "bfloat16",
        "--gpt_attention_plugin": "bfloat16",
        "--use_paged_context_fmha": "enable",
        "--remove_input_padding": "enable",
        "--kv_cache_type": "paged",
        "--max_batch_size": "4",
        "--max_input_len": "256",
        "--max_seq_len": "1024",
        "--max_num_tokens": "2048",
    }


def test_build_script(exports: dict[int, Path]) -> None:
    script = exports[1] / "build_engine.sh"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert 'ENGINE_DIR="${ENGINE_DIR:-$CHECKPOINT_DIR/engine}"' in text
    assert '--checkpoint_dir "$CHECKPOINT_DIR"' in text and "--max_draft_len" not in text


def test_tp_size_that_does_not_divide(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match=r"tp_size 4 does not divide num_attention_heads \(6\)"):
        export_checkpoint(TARGET, DRAFTER, tmp_path / "out", tp_size=4)
    assert not (tmp_path / "out").exists()  # validated before writing


def test_limits_checked(tmp_path: Path) -> None:
    with pytest.raises(BuildError, match="max_position_embeddings"):
        export_checkpoint(TARGET, DRAFTER, tmp_path / "out", limits=BuildLimits(max_seq_len=4096))


def test_max_seq_len_leaves_room_for_the_draft_tokens(exports: dict[int, Path], tmp_path: Path) -> None:
    """trtllm-build adds max_draft_len (4 beams x 4 tokens) to max_seq_len: the default stops 16 short of
    the demo model's 1024 positions, and 1024 itself is refused with the numbers and the fix."""
    assert ReDrafterSettings().max_draft_len == 16
    assert default_max_seq_len(1024, ReDrafterSettings(num_beams=2, draft_len_per_beam=3)) == 1018
    assert "--max_seq_len 1008" in (exports[1] / "build_engine.sh").read_text()
    message = (
        r"max_seq_len 1024 \+ max_draft_len 16 \(which trtllm-build adds: 4 beams x 4 tokens\) exceeds the "
        r"model's max_position_embeddings 1024: use --max-seq-len 1008 or less"
    )
    with pytest.raises(BuildError, match=message):
        export_checkpoint(TARGET, DRAFTER, tmp_path / "out", limits=BuildLimits(max_seq_len=1024))
    export_checkpoint(TARGET, DRAFTER, tmp_path / "ok", num_beams=2, limits=BuildLimits(max_seq_len=1016))


def test_cli_exports_the_checkpoint_script_and_triton_repository(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The CLI's defaults: max_seq_len derived (and said), and a Triton repository whose tokenizer
    models have their code (tests/triton_repo/test_trtllm_repository.py tests the repository itself)."""
    out = tmp_path / "export"
    assert main(["--checkpoint", str(TARGET), "--drafter", str(DRAFTER), "--output", str(out)]) == 0
    said = capsys.readouterr().out
    assert "max_seq_len 1008 = max_position_embeddings 1024 - max_draft_len 16" in said
    assert "--max_seq_len 1008" in (out / "build_engine.sh").read_text()
    for name in ("preprocessing", "postprocessing"):
        assert sorted(p.name for p in (out / "triton_repo" / name / "1").iterdir()) == [
            "model.py",
            "tokenizer_models.py",
        ]
    config = (out / "triton_repo" / "tensorrt_llm" / "config.pbtxt").read_text()
    assert f'string_value: "{(out / "engine").resolve()}"' in config
    assert f'key: "tokenizer_dir", value: {{ string_value: "{TARGET.resolve()}" }}' in config
    argv = ["--checkpoint", str(TARGET), "--drafter", str(DRAFTER), "--output", str(tmp_path / "x")]
    assert main([*argv, "--max-seq-len", "1020"]) == 2
    assert "use --max-seq-len 1008 or less" in capsys.readouterr().err


def test_cli_error_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--checkpoint", str(TARGET), "--drafter", str(DRAFTER), "--output", str(tmp_path / "o"), "--tp-size", "3"]
    assert main(argv) == 2
    assert "does not divide" in capsys.readouterr().err


def test_kv_heads_repeated_when_fewer_than_ranks() -> None:
    """TRT-LLM's `dup_kv_weight`: with 1 KV head and tp 2, each rank's fused QKV carries a copy of it."""
    cfg = replace(load_llama_checkpoint(TARGET)[0], num_key_value_heads=1)
    q, k, v = torch.randn(6 * 64, 384), torch.randn(64, 384), torch.randn(64, 384)
    for rank in range(2):
        rq, rk, rv = unfuse_qkv(fuse_qkv(q, k, v, cfg, 2, rank), cfg, 2)
        assert torch.equal(rq, q.chunk(2)[rank]) and torch.equal(rk, k) and torch.equal(rv, v)

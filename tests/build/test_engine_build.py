"""Engine builder: a good checkpoint becomes a loadable engine; every kind of bad input
fails with a message naming the file and tensor, and leaves no engine dir behind."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from build.engine import BuildError, build_engine, main
from model_defs.redrafter import ReDrafter, ReDrafterConfig
from runtime.engine_dir import BuildConfig
from runtime.llm_engine import LLMEngine
from runtime.loaded_engine import LoadedEngine

REPO = Path(__file__).resolve().parents[2]
SMALL = BuildConfig(max_batch_size=2, max_input_len=32, max_seq_len=64)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_weights(ckpt: Path, edit) -> None:  # type: ignore[no-untyped-def]
    path = ckpt / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def expect_failure(ckpt: Path, out: Path, *needles: str, tokenizer: Path | None = None) -> None:
    with pytest.raises(BuildError) as err:
        build_engine(ckpt, out, SMALL, tokenizer=tokenizer)
    for needle in needles:
        assert needle in str(err.value)
    assert not out.exists()
    assert not any(p.name.startswith(f".{out.name}.partial") for p in out.parent.iterdir())


def test_build_and_load_matches_transformers(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = build_engine(tiny_checkpoint, tmp_path / "eng", SMALL)
    files = ["config.json", "rank0.safetensors", "tokenizer.json", "tokenizer_config.json"]  # chat template's home
    assert sorted(p.name for p in out.iterdir()) == files
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["format_version"] == 1 and cfg["architecture"] == "LlamaForCausalLM"
    assert cfg["build"] == {
        "max_batch_size": 2,
        "max_input_len": 32,
        "max_seq_len": 64,
        "dtype": "float32",
        "tp_size": 1,
        "drafter_dtype": "float32",
        "drafter_head": "int8",
        "drafter_layers": "int8",
    }
    assert cfg["drafter"] is None
    engine = LoadedEngine.load(out)
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_checkpoint).eval()
    ids = torch.tensor([engine.encode("def add(a, b):")])
    with torch.no_grad():
        ours = engine.model(ids, torch.arange(ids.shape[1])[None]).logits
        assert (ours - hf(ids).logits).abs().max() <= 1e-4


def test_bfloat16_engine_stores_bfloat16(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = build_engine(
        tiny_checkpoint, tmp_path / "eng", BuildConfig(max_input_len=32, max_seq_len=64, dtype="bfloat16")
    )
    assert {t.dtype for t in load_file(str(out / "rank0.safetensors")).values()} == {torch.bfloat16}
    assert LoadedEngine.load(out).model.lm_head.weight.dtype == torch.bfloat16


def test_missing_directory(tmp_path: Path) -> None:
    expect_failure(tmp_path / "nope", tmp_path / "eng", str(tmp_path / "nope"), "not found")


def test_missing_tensor(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(tiny_checkpoint, tmp_path / "ckpt")
    edit_weights(ckpt, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    expect_failure(ckpt, tmp_path / "eng", "missing tensor 'model.layers.1.mlp.up_proj.weight'")


def test_extra_tensor(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(tiny_checkpoint, tmp_path / "ckpt")
    edit_weights(ckpt, lambda t: t.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(2, 2)}))
    expect_failure(ckpt, tmp_path / "eng", "model.safetensors", "unexpected tensor 'model.layers.2.mlp.up_proj.weight'")


def test_shape_mismatch(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(tiny_checkpoint, tmp_path / "ckpt")
    edit_weights(ckpt, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(32, 32)}))
    expect_failure(
        ckpt,
        tmp_path / "eng",
        "model.safetensors",
        "'model.layers.0.self_attn.k_proj.weight' has shape [32, 32]",
        "[16, 32]",
    )


def test_tokenizer_larger_than_vocab(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(tiny_checkpoint, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["vocab_size"] = 200  # the tokenizer has ~290 tokens
    (ckpt / "config.json").write_text(json.dumps(cfg))
    edit_weights(ckpt, lambda t: t.update({k: v[:200] for k, v in t.items() if v.shape[0] == 320}))
    expect_failure(ckpt, tmp_path / "eng", "tokenizer.json", "tokens but the model's vocab_size is 200")


def test_chat_template_that_does_not_compile(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(tiny_checkpoint, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    (ckpt / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": "{% for m in messages %}"}))
    expect_failure(ckpt, tmp_path / "eng", "tokenizer_config.json", "chat_template 'default' line 1")


def test_unsupported_architecture(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(tiny_checkpoint, tmp_path / "ckpt")
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral")
    (ckpt / "config.json").write_text(json.dumps(cfg))
    expect_failure(ckpt, tmp_path / "eng", "config.json", "unsupported architecture", "MistralForCausalLM")


def test_sharded_index_with_missing_shard(tiny_checkpoint: Path, tmp_path: Path) -> None:
    ckpt = copy_ckpt(tiny_checkpoint, tmp_path / "ckpt")
    names = list(load_file(str(ckpt / "model.safetensors")))
    index = {"weight_map": dict.fromkeys(names, "model-00001-of-00002.safetensors")}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    expect_failure(ckpt, tmp_path / "eng", "model-00001-of-00002.safetensors", "not found")


def test_existing_output_needs_force(tiny_checkpoint: Path, tmp_path: Path) -> None:
    out = build_engine(tiny_checkpoint, tmp_path / "eng", SMALL)
    with pytest.raises(BuildError, match="already exists"):
        build_engine(tiny_checkpoint, out, SMALL)
    assert build_engine(tiny_checkpoint, out, SMALL, force=True) == out


def test_cli_reports_errors_with_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--checkpoint", str(tmp_path / "nope"), "--output", str(tmp_path / "eng")]) == 2
    assert "checkpoint directory not found" in capsys.readouterr().err


def test_entry_point_wins_over_pypa_build(tmp_path: Path) -> None:
    """PyPA's `build` is installed in this environment (requirements.txt); from the
    repository root `python -m build.engine` must still be ours."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    pypa = subprocess.run(
        [sys.executable, "-c", "import build; print(build.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert pypa.returncode == 0 and "site-packages" in pypa.stdout, (
        "PyPA build must be installed for this test to mean anything"
    )
    ours = subprocess.run(
        [sys.executable, "-m", "build.engine", "--help"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert ours.returncode == 0 and "--checkpoint" in ours.stdout


def save_drafter(path: Path, vocab_size: int, hidden_size: int) -> Path:
    cfg = ReDrafterConfig(vocab_size=vocab_size, hidden_size=hidden_size, exit_dim=48, num_draft_layers=1, rnn=True)
    ReDrafter(cfg).save_pretrained(path)
    return path


def test_engine_with_drafter(tiny_checkpoint: Path, tmp_path: Path) -> None:
    drafter = save_drafter(tmp_path / "drafter", vocab_size=320, hidden_size=32)
    settings = {"beam_width": 3, "beam_length": 2}
    build = dataclasses.replace(SMALL, drafter_dtype="bfloat16")  # stored in its own dtype, not the target's
    out = build_engine(tiny_checkpoint, tmp_path / "eng", build, drafter=drafter, drafter_settings=settings)
    weights = load_file(str(out / "rank0.safetensors"))
    drafter_names = {k for k in weights if k.startswith("drafter.")}
    assert "drafter.rnn_w.weight" in drafter_names and "drafter.lm_head.1.weight" in drafter_names
    assert {weights[k].dtype for k in drafter_names} == {torch.bfloat16}
    assert {weights[k].dtype for k in weights.keys() - drafter_names} == {torch.float32}
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["drafter"]["kind"] == "redrafter" and cfg["drafter"]["settings"] == settings
    engine = LoadedEngine.load(out)
    assert engine.redrafter is not None and engine.redrafter.config.exit_dim == 48
    assert engine.redrafter.lm_head[-1].int8 is None  # a bf16 drafter keeps its head in bf16


def test_drafter_for_another_target_is_refused(tiny_checkpoint: Path, tmp_path: Path) -> None:
    drafter = save_drafter(tmp_path / "drafter", vocab_size=321, hidden_size=32)
    with pytest.raises(BuildError, match=r"drafter/config.json: drafter vocab_size 321 != target vocab_size 320"):
        build_engine(tiny_checkpoint, tmp_path / "eng", SMALL, drafter=drafter)
    assert not (tmp_path / "eng").exists()


def test_draft_model_engine_round_trips(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A draft LM (here the tiny checkpoint drafting for itself) is carried under the
    drafter prefix, loads back as a Llama with its own weights, and sets the default method."""
    build = BuildConfig(max_batch_size=2, max_input_len=32, max_seq_len=64, drafter_dtype="float32")
    out = build_engine(
        tiny_checkpoint, tmp_path / "eng", build, draft_model=tiny_checkpoint, drafter_settings={"method": "rsd-s"}
    )
    engine = LoadedEngine.load(out)
    assert engine.redrafter is None and engine.draft_model is not None
    assert engine.config.drafter is not None and engine.config.drafter.kind == "draft-lm"
    for (name, a), b in zip(engine.model.state_dict().items(), engine.draft_model.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)  # same checkpoint, same dtype
    assert LLMEngine(engine).default_method == "rsd-s"
    # the draft LM's head and layers run in int8 (the default --drafter-head, --drafter-layers);
    # the target's never do
    assert engine.draft_model.lm_head.int8 is not None and engine.model.lm_head.int8 is None
    draft_layer, target_layer = engine.draft_model.model.layers[0], engine.model.model.layers[0]
    assert (
        draft_layer.mlp.down_proj.int8 is not None
        and draft_layer.self_attn.qkv_stack is not None
        and draft_layer.self_attn.qkv_stack.int8
    )
    assert (
        target_layer.mlp.down_proj.int8 is None
        and target_layer.self_attn.qkv_stack is not None
        and not target_layer.self_attn.qkv_stack.int8
    )
    ids, positions = torch.tensor([[1, 2, 3]]), torch.arange(3)[None]
    with torch.no_grad():
        draft, target = engine.draft_model(ids, positions).logits, engine.model(ids, positions).logits
    assert 0 < (draft - target).abs().max() < 0.05 * target.abs().max()  # same weights: int8 rounding only
    out = build_engine(tiny_checkpoint, tmp_path / "eng2", dataclasses.replace(build, drafter_head="drafter-dtype"))
    assert LoadedEngine.load(out).draft_model is None  # no drafter: nothing to quantize
    kept = build_engine(
        tiny_checkpoint,
        tmp_path / "eng3",
        dataclasses.replace(build, drafter_head="drafter-dtype"),
        draft_model=tiny_checkpoint,
    )
    plain = LoadedEngine.load(kept)
    assert plain.draft_model is not None and plain.draft_model.lm_head.int8 is None
    assert plain.draft_model.model.layers[0].mlp.down_proj.int8 is not None  # the layers' own setting
    fp32 = build_engine(
        tiny_checkpoint,
        tmp_path / "eng4",
        dataclasses.replace(build, drafter_layers="drafter-dtype"),
        draft_model=tiny_checkpoint,
    )
    layers_kept = LoadedEngine.load(fp32).draft_model
    assert layers_kept is not None and layers_kept.lm_head.int8 is not None
    kept_layer = layers_kept.model.layers[0]
    assert kept_layer.mlp.down_proj.int8 is None
    assert kept_layer.mlp.gate_up_stack is not None and not kept_layer.mlp.gate_up_stack.int8  # the blocked fp32 stack
    with pytest.raises(ValueError, match="drafter_head 'int2' is not one of"):
        BuildConfig(drafter_head="int2")
    int4_layers = dataclasses.replace(build, drafter_layers="int4")
    four_dir = build_engine(tiny_checkpoint, tmp_path / "eng5", int4_layers, draft_model=tiny_checkpoint)
    four = LoadedEngine.load(four_dir).draft_model
    assert four is not None
    four_layer = four.model.layers[0]
    for copy in (four_layer.mlp.down_proj.int8, four_layer.self_attn.qkv_stack.packed):  # 4-bit values, int8 storage
        q = copy.packed.unpack()[0].int_repr()
        assert int(q.abs().max()) == 7
    assert int(four.lm_head.int8.packed.unpack()[0].int_repr().abs().max()) == 127  # the head follows drafter_head
    with pytest.raises(ValueError, match="drafter_layers 'int2' is not one of"):
        BuildConfig(drafter_layers="int2")


def test_draft_model_must_share_the_vocabulary(tiny_checkpoint: Path, tmp_path: Path) -> None:
    draft = copy_ckpt(tiny_checkpoint, tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps(config | {"vocab_size": 400}))
    tensors = load_file(str(draft / "model.safetensors"))
    tensors["model.embed_tokens.weight"], tensors["lm_head.weight"] = torch.zeros(400, 32), torch.zeros(400, 32)
    save_file(tensors, str(draft / "model.safetensors"))
    with pytest.raises(BuildError, match="draft model vocab_size 400 != target vocab_size 320"):
        build_engine(tiny_checkpoint, tmp_path / "eng", SMALL, draft_model=draft)
    with pytest.raises(BuildError, match="not both"):
        build_engine(tiny_checkpoint, tmp_path / "eng", SMALL, drafter=draft, draft_model=draft)

"""Oracle tests: our Llama equals transformers' `LlamaForCausalLM` on the same weights.

fp32, max abs error <= 1e-4 on logits, for a full prefill, token-by-token decoding
through our KV cache, and a forward with an explicit tree mask equal to the causal one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from model_defs.llama import LlamaForCausalLM, RMSNorm
from model_defs.rope import RopeConfig
from tests.paged import Chunk, PagedModel

TOL = 1e-4

CONFIGS = {
    "gqa-untied": dict(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False),
    "mha-tied": dict(num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True),
    "mqa-linear": dict(
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0},
    ),
    "gqa-llama3": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "gqa-yarn-bias": dict(
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
}


def make_hf_model(tmp_path: Path, name: str, shard: bool = False) -> tuple[transformers.LlamaForCausalLM, Path]:
    torch.manual_seed(sum(map(ord, name)))
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        **CONFIGS[name],
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF inits norms to 1 and biases to 0: perturb so every weight matters
        for p in hf.parameters():
            p.add_(0.05 * torch.randn_like(p))
    out = tmp_path / name
    hf.save_pretrained(out, max_shard_size="40KB" if shard else "5GB")
    return hf, out


def hf_logits(hf: transformers.LlamaForCausalLM, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
    return out.logits, out.hidden_states[-1]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_decode_and_mask_match_transformers(tmp_path: Path, name: str) -> None:
    hf, path = make_hf_model(tmp_path, name)
    ours = LlamaForCausalLM.from_pretrained(path)
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(21).expand(2, -1)
    ref_logits, ref_hidden = hf_logits(hf, ids)

    with torch.no_grad():
        full = ours(ids, positions)
        assert (full.logits - ref_logits).abs().max() <= TOL
        assert (full.hidden - ref_hidden).abs().max() <= TOL

        causal = torch.ones(21, 21, dtype=torch.bool).tril().expand(2, -1, -1)
        masked = ours(ids, positions, tree_mask=causal)
        assert (masked.logits - ref_logits).abs().max() <= TOL

        # token by token through the paged cache, both rows in one flat forward per step
        paged = PagedModel(ours, num_blocks=32, block_size=4)
        steps = []
        for t in range(21):
            outs = paged.forward([Chunk(f"r{b}", t, ids[b, t : t + 1], positions[b, t : t + 1]) for b in range(2)])
            steps.append(torch.stack([o.logits for o in outs]))
        assert (torch.cat(steps, dim=1) - ref_logits).abs().max() <= TOL

        # prefill a prefix through the cache, then a 5-token chunk with an explicit causal mask
        paged = PagedModel(ours, num_blocks=32, block_size=4)
        paged.forward([Chunk(f"r{b}", 0, ids[b, :16], positions[b, :16]) for b in range(2)])
        outs = paged.forward([Chunk(f"r{b}", 16, ids[b, 16:], positions[b, 16:], causal[b, :5, :5]) for b in range(2)])
        assert (torch.stack([o.logits for o in outs]) - ref_logits[:, 16:]).abs().max() <= TOL


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf, path = make_hf_model(tmp_path, "gqa-untied", shard=True)
    assert (path / "model.safetensors.index.json").is_file()
    ours = LlamaForCausalLM.from_pretrained(path)
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        assert (ours(ids, torch.arange(9)[None]).logits - hf_logits(hf, ids)[0]).abs().max() <= TOL


def test_logits_indices_select_positions(tmp_path: Path) -> None:
    _, path = make_hf_model(tmp_path, "mha-tied")
    ours = LlamaForCausalLM.from_pretrained(path)
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        full = ours(ids, torch.arange(7).expand(2, -1)).logits
        picked = ours(ids, torch.arange(7).expand(2, -1), logits_indices=torch.tensor([[6], [3]])).logits
    assert torch.allclose(picked[0, 0], full[0, 6], atol=1e-6)
    assert torch.allclose(picked[1, 0], full[1, 3], atol=1e-6)


def test_unsupported_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="dynamic"):
        RopeConfig.from_hf({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, head_dim=8)


@pytest.mark.parametrize("shape", [(1, 1, 384), (1, 6, 384), (3, 17, 256), (1, 256, 384)])
def test_fp32_rms_norm_is_bitwise_transformers_formula(shape: tuple[int, ...]) -> None:
    """An fp32 RMSNorm takes `F.rms_norm` (one op instead of five); on the CPU its output is
    bitwise `LlamaRMSNorm`'s formula, so the fast path changes no logit. A bf16 input keeps
    the formula itself (transformers multiplies by the weight after the cast)."""
    torch.manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1]))
    reference = transformers.models.llama.modeling_llama.LlamaRMSNorm(shape[-1], 1e-5)
    reference.load_state_dict(norm.state_dict())
    x = torch.randn(shape) * 3
    with torch.no_grad():
        assert torch.equal(norm(x), reference(x))
        norm.to(torch.bfloat16), reference.to(torch.bfloat16)
        assert torch.equal(norm(x.bfloat16()), reference(x.bfloat16()))

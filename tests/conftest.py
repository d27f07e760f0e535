"""Shared fixtures: small real checkpoints written by transformers itself; the test device
(`tests/device.py`, `SPECPIPE_TEST_DEVICE`) is checked before collection."""

from __future__ import annotations

import os

from tests.device import ON_CPU, TEST_DEVICE, check_test_device

# On the CPU, the Triton kernels (plugins/) run in Triton's interpreter, which executes them
# on CPU tensors with numpy: the only way they run at all without a GPU. On CUDA they must
# compile and run natively, so the interpreter stays off (check_test_device refuses it).
# `triton.jit` reads the variable when it decorates a kernel, i.e. when the kernel's module
# is imported: hence here, at the top of the root conftest, ahead of every import of torch or
# the project. setdefault: a TRITON_INTERPRET the caller set explicitly is kept.
if ON_CPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest
import torch
import transformers

from training.tokenizer import save_hf_tokenizer, train_tokenizer


def pytest_configure(config: pytest.Config) -> None:
    check_test_device()  # a bad or missing device stops the run here, with its reason
    if not ON_CPU:
        # fp32 stays fp32 on the GPU: the oracle tolerances (1e-4 on logits) and the greedy
        # token-for-token checks are for IEEE fp32 matmuls, not TF32's 10-bit mantissa
        # (cuBLAS matmuls default to off already; cuDNN convolutions default to on).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Where the load-aware policy runs compiled (`runtime/native_policy.py`, built by `make
    setup`), tests that replace one of its functions or methods are skipped: the compiled
    code calls its own. `tests/runtime/test_native_policy.py` runs them on the Python form."""
    from runtime import native_policy

    if not native_policy.active():
        return
    skip = pytest.mark.skip(reason=f"replaces a policy function; the policy runs compiled ({native_policy.ENV}=0)")
    for item in items:
        if item.get_closest_marker("python_policy"):
            item.add_marker(skip)


def pytest_report_header(config: pytest.Config) -> str:
    if ON_CPU:
        return f"test device: cpu (TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '')})"
    return f"test device: {TEST_DEVICE} ({torch.cuda.get_device_name(TEST_DEVICE)}), TF32 off"


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer GQA Llama saved by transformers, with a byte-level BPE tokenizer
    of 300 tokens (model vocab 320: padded, as real checkpoints often are)."""
    out = tmp_path_factory.mktemp("tiny-llama")
    tok = train_tokenizer(
        ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())\n"] * 50, vocab_size=300
    )
    save_hf_tokenizer(tok, out, model_max_length=128)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=320,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        bos_token_id=0,
        eos_token_id=0,
    )
    transformers.LlamaForCausalLM(cfg).save_pretrained(out)
    return out

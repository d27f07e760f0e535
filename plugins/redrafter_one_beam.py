"""`specpipe_cpu::redrafter_one_beam`: a one-beam ReDrafter search (greedy drafting, arXiv
2403.09919 §3.2 with W = 1) on a drafter whose linears run on fbgemm int8 copies (the CPU
default, `BuildConfig.drafter_layers` / `drafter_head`), in one C++ call
(`plugins/csrc/redrafter_one_beam_cpu.cpp`). Its reference is the Python search itself
(`runtime.proposers.beam_search.beam_search`, one beam, `with_dists=False`): the same ATen
ops in the same order, so the same beams, log-probs and scores bit for bit
(tests/plugins/test_redrafter_one_beam.py). What it saves is the Python between ~20 small
ops a level: a five-level search 1.70 -> 0.69 ms on the 2-core CPU, and one beam is what
load-aware speculation drafts on most batch-1 steps.

It applies to Apple's recurrent configuration (`rnn`, an input projection, residual blocks
with biases, a head without); `one_beam_search` returns None for anything else (another
configuration, fp32 or bf16 linears, a GPU, kernels off), and the Python search runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from model_defs.llama import Linear
from model_defs.redrafter import WARP_TOP_K, ReDrafter
from plugins import cpu_kernels


def _fake(h: Tensor, embed: Tensor, bonus: Tensor, length: int, k: int, *weights: object) -> tuple[Tensor, ...]:
    b = h.shape[0]
    return (h.new_empty((b, 1, length), dtype=torch.long), h.new_empty((b, 1, length)), h.new_empty((b, 1)))


def _int8(linear: nn.Module | None, bias: bool) -> object | None:
    """The int8 copy of `linear` if it is a `Linear` with one and has a bias exactly when `bias`."""
    if not isinstance(linear, Linear) or linear.int8 is None or (linear.bias is not None) != bias:
        return None
    return linear.int8


def one_beam_search(
    drafter: ReDrafter, embed: nn.Embedding, h_target: Tensor, bonus: Tensor, length: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """(drafted tokens `[B, 1, L]`, their log-probs `[B, 1, L]`, scores `[B, 1]`) of the one-beam
    search, or None where the op does not apply (module docstring)."""
    cfg = drafter.config
    if h_target.device.type != "cpu" or h_target.dtype != torch.float32 or embed.weight.dtype != torch.float32:
        return None
    if not cfg.rnn or drafter.input_proj is None or torch.is_grad_enabled():
        return None
    blocks: list[Any] = [getattr(block, "linear", None) for block in list(drafter.lm_head)[:-1]]  # ResBlocks
    weights = [
        _int8(drafter.rnn_w, False), _int8(drafter.rnn_u, True), _int8(drafter.input_proj, True),
        *(_int8(linear, True) for linear in blocks), _int8(drafter.lm_head[-1], False),
    ]  # fmt: skip
    if any(w is None for w in weights) or not cpu_kernels.load_with_fake("redrafter_one_beam", _fake):
        return None
    rnn_w, rnn_u, proj, *res, head = weights
    return torch.ops.specpipe_cpu.redrafter_one_beam(
        h_target.contiguous(), embed.weight, bonus, length, min(WARP_TOP_K, cfg.vocab_size),
        rnn_w, rnn_u, drafter.rnn_u.bias, proj, drafter.input_proj.bias,
        res, [linear.bias for linear in blocks], head,
    )  # fmt: skip

"""`specpipe_cpu::redrafter_beam_search`: ReDrafter's beam search (arXiv 2403.09919 §3.2)
over the warp's support, on a drafter whose linears run on int8 copies (the CPU default,
`BuildConfig.drafter_layers` / `drafter_head`) through `specpipe::int8_linear`'s kernel, in
one C++ call (`plugins/csrc/redrafter_beam_search_cpu.cpp`). Its reference is the Python search itself
(`runtime.proposers.beam_search.beam_search` with `with_dists=False`, what greedy
verification drafts with): the same arithmetic in the same order, so the same beams,
log-probs and scores bit for bit (tests/plugins/test_redrafter_beam_search.py). What it
saves is the Python between ~20-30 small ops a level, and then the ops themselves: a level
is its int8 products, two SiLUs and a log_softmax, the rest plain loops (five levels of one
beam on the 2-core CPU: Python 1.70 ms, ATen from C++ ~1.09, loops ~0.72-0.79; one beam is
what load-aware speculation drafts most at batch 1).

It applies to Apple's recurrent configuration (`rnn`, an input projection, residual blocks
with biases, a head without); `int8_beam_search` returns None for anything else (another
configuration, fp32 or bf16 linears, a GPU, autograd on, kernels off, a CPU where the int8
kernel is not vectorized and the copies run fbgemm's products), and the Python search runs.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor, nn

from model_defs.llama import Linear
from model_defs.redrafter import WARP_TOP_K, ReDrafter
from plugins import cpu_kernels
from plugins.int8_linear import Int8Weight


def _fake(h: Tensor, embed: Tensor, bonus: Tensor, width: int, length: int, *rest: object) -> tuple[Tensor, ...]:
    b = h.shape[0]
    return h.new_empty((b, width, length), dtype=torch.long), h.new_empty((b, width, length)), h.new_empty((b, width))


def _int8(linear: nn.Module | None, bias: bool) -> Int8Weight | None:
    """The kernel's int8 weights of `linear` if it is a `Linear` with an int8 copy that takes
    `specpipe::int8_linear`'s kernel (`plugins.cpu_linear.Int8Copy`) and has a bias exactly
    when `bias`."""
    if not isinstance(linear, Linear) or linear.int8 is None or (linear.bias is not None) != bias:
        return None
    return linear.int8.kernel


def int8_beam_search(
    drafter: ReDrafter, embed: nn.Embedding, h_target: Tensor, bonus: Tensor, width: int, length: int
) -> tuple[Tensor, Tensor, Tensor] | None:
    """(drafted tokens `[B, W, L]`, their log-probs `[B, W, L]`, scores `[B, W]`, best first) of
    the search over the warp's support, or None where the op does not apply (module docstring)."""
    cfg = drafter.config
    if h_target.device.type != "cpu" or h_target.dtype != torch.float32 or embed.weight.dtype != torch.float32:
        return None
    k = min(WARP_TOP_K, cfg.vocab_size)
    if torch.is_grad_enabled() or width > k:
        return None
    weights = _weight_arguments(drafter)
    if weights is None or not cpu_kernels.load_with_fake("redrafter_beam_search", _fake):
        return None
    return torch.ops.specpipe_cpu.redrafter_beam_search(
        h_target.contiguous(), embed.weight, bonus, width, length, k, *weights
    )


_ARGUMENTS: weakref.WeakKeyDictionary[ReDrafter, tuple[object, list[Any] | None]] = weakref.WeakKeyDictionary()
"""drafter -> (its head's int8 copy, the op's weight and bias arguments) (`_weight_arguments`)."""


def _weight_arguments(drafter: ReDrafter) -> list[Any] | None:
    """The op's weight and bias arguments for `drafter` (four lists of its int8 linears'
    weights, blocked weights, scales and sums, then the biases), or None where the op does
    not take it: built once per set of int8 copies (keyed by the head's copy, which a
    re-quantization replaces), where gathering them from the modules cost ~30 us a call
    (~5% of a one-beam search of five levels)."""
    head = drafter.lm_head[-1]
    copy = getattr(head, "int8", None)
    cached = _ARGUMENTS.get(drafter)
    if cached is not None and cached[0] is copy:
        return cached[1]
    arguments = None
    if drafter.config.rnn and drafter.input_proj is not None:
        blocks: list[Any] = [getattr(block, "linear", None) for block in list(drafter.lm_head)[:-1]]  # ResBlocks
        weights = [
            _int8(drafter.rnn_w, False), _int8(drafter.rnn_u, True), _int8(drafter.input_proj, True),
            *(_int8(linear, True) for linear in blocks), _int8(head, False),
        ]  # fmt: skip
        kernels = [w for w in weights if w is not None]
        if len(kernels) == len(weights):
            lists = [list(field) for field in zip(*kernels, strict=True)]  # weight, blocked, scale, sum
            arguments = [*lists, drafter.rnn_u.bias, drafter.input_proj.bias, [linear.bias for linear in blocks]]
    _ARGUMENTS[drafter] = (copy, arguments)
    return arguments

"""`specpipe_cpu::redrafter_beam_search` (`plugins/redrafter_beam_search.py`) against its
reference, the Python search over the warp's support (`beam_search` with the op switched
off): the same beams, log-probs and scores bit for bit, on int8 drafter weights (and a 4-bit
head, `--drafter-head int4`), for one beam and several, several batches and lengths; and it
stands aside (None: the Python search runs) wherever it does not apply."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from model_defs.llama import quantize_linears_int8
from model_defs.redrafter import ReDrafter, ReDrafterConfig
from plugins import cpu_kernels
from plugins.redrafter_beam_search import int8_beam_search
from runtime.proposers import beam_search as search

D, VOCAB = 16, 300

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels are not built")


def drafter(
    exit_dim: int = 24, rnn: bool = True, int8: bool = True, head_bits: int = 8
) -> tuple[ReDrafter, nn.Embedding]:
    torch.manual_seed(0)
    cfg = ReDrafterConfig(vocab_size=VOCAB, hidden_size=D, exit_dim=exit_dim, num_draft_layers=2, rnn=rnn)
    model, embed = ReDrafter(cfg).eval(), nn.Embedding(VOCAB, D)
    with torch.no_grad():  # logits spread enough that the top-K normaliser shows in every log-prob
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.5 / p.shape[-1] ** 0.5)
    if int8:
        quantize_linears_int8(model)
        assert model.lm_head[-1].quantize_int8(head_bits)
    return model, embed


@pytest.mark.parametrize(
    ("rows", "width", "length", "head_bits"),
    [(1, 1, 5, 8), (3, 1, 1, 8), (8, 1, 4, 8), (1, 2, 5, 8), (3, 4, 3, 8), (2, 8, 2, 8), (1, 1, 5, 4), (3, 4, 3, 4)],
)
@torch.inference_mode()
def test_the_op_is_the_python_search_bit_for_bit(
    rows: int, width: int, length: int, head_bits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, embed = drafter(head_bits=head_bits)
    h, bonus = torch.randn(rows, D), torch.randint(0, VOCAB, (rows,))
    fast = search.beam_search(model, embed, h, bonus, width, length, with_dists=False)
    assert int8_beam_search(model, embed, h, bonus, width, length) is not None  # the op ran
    monkeypatch.setattr(search, "int8_beam_search", lambda *args: None)
    reference = search.beam_search(model, embed, h, bonus, width, length, with_dists=False)
    assert fast.beams.shape == (rows, width, length + 1) and torch.equal(fast.beams, reference.beams)
    assert torch.equal(fast.log_probs, reference.log_probs) and torch.equal(fast.scores, reference.scores)
    assert fast.step_log_probs is None


@torch.inference_mode()
def test_it_stands_aside_where_it_does_not_apply() -> None:
    h, bonus = torch.randn(2, D), torch.tensor([1, 2])
    assert int8_beam_search(*drafter(int8=False), h, bonus, 2, 3) is None  # fp32 linears
    assert int8_beam_search(*drafter(rnn=False), h, bonus, 2, 3) is None  # no RNN
    assert int8_beam_search(*drafter(exit_dim=2 * D), h, bonus, 2, 3) is None  # no input projection
    assert int8_beam_search(*drafter(), h, bonus, 51, 3) is None  # wider than the warp's support
    with torch.enable_grad():
        assert int8_beam_search(*drafter(), h, bonus, 2, 3) is None
    assert int8_beam_search(*drafter(), h, bonus, 2, 3) is not None

"""On a GPU each token bucket's forward of up to `gpu_linear.MAX_ROWS` tokens is captured
twice, its linears on cuBLAS and as `plugins/gpu_linear.py` (per shape, cuBLAS or the
split-K Triton matmul), and the graph that replays faster is kept
(`runtime/cuda_graphs.py`), for the target and the draft LM alike. Whichever is kept, an
engine decodes what eager forwards decode: auto-regressive and speculative (sd, its draft
LM's levels replaying their own graphs), greedy outputs token for token."""

from __future__ import annotations

import pytest

from plugins import gpu_linear
from runtime import cuda_graphs
from runtime.config import RuntimeConfig
from runtime.llm_engine import LLMEngine
from runtime.sampling import SamplingParams
from tests.device import ON_CPU
from tests.runtime.test_draft_lm_cache import prompts, self_drafting_engine


def test_triton_is_kept_only_where_it_saves_its_share() -> None:
    """Near a tie cuBLAS stays (one engine should not flip kernels, and last bits, from
    start to start); where Triton was not timed (a failed capture, batch-invariant mode),
    cuBLAS."""
    saves = cuda_graphs.TRITON_SAVES
    assert cuda_graphs.faster_linears({"cublas": 1.0, "triton": 0.5}) == "triton"
    assert cuda_graphs.faster_linears({"cublas": 1.0, "triton": 1.0 - saves / 2}) == "cublas"
    assert cuda_graphs.faster_linears({"cublas": 1.0, "triton": 1.2}) == "cublas"
    assert cuda_graphs.faster_linears({"cublas": 1.0}) == "cublas"
    assert cuda_graphs.faster_linears({}) == "cublas"  # one alternative alone: not timed


@pytest.mark.skipif(ON_CPU, reason="CUDA graphs need a GPU (SPECPIPE_TEST_DEVICE=cuda)")
@pytest.mark.parametrize(
    ("saves", "kept"),
    [(-1e9, "triton"), (1.0, "cublas"), (cuda_graphs.TRITON_SAVES, None)],
    ids=["triton", "cublas", "timed"],
)
def test_graphs_of_either_linears_decode_what_eager_forwards_decode(
    saves: float, kept: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`saves` forces the choice (Triton whatever it costs, for every bucket and product
    shape; cuBLAS whatever it costs) or leaves it to the timing. Test of the test: the
    forced runs keep what they force, and the timed one timed both alternatives of every
    bucket of up to `MAX_ROWS` tokens (larger ones are cuBLAS's, untimed)."""
    monkeypatch.setattr(cuda_graphs, "TRITON_SAVES", saves)
    monkeypatch.setattr(gpu_linear, "_choices", {})
    if kept == "triton":
        monkeypatch.setattr(gpu_linear, "TRITON_SAVES", saves)
    engine = self_drafting_engine()
    params = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True) for _ in range(6)]
    outputs: dict[tuple[str, bool], list[list[int]]] = {}
    for graphs_on in (True, False):
        config = RuntimeConfig(max_batch_size=6, max_num_tokens=128, speculation="fixed", cuda_graphs=graphs_on)
        llm = LLMEngine(engine, config)
        for method in ("ar", "sd"):
            outputs[(method, graphs_on)] = [r.output_ids for r in llm.generate(prompts()[:6], params, method)]
        if graphs_on:
            for graphs in (llm.runner.graphs, llm.proposers["sd"].graphs):
                assert graphs is not None and set(graphs.linears) == set(graphs.buckets)
                small = {b for b in graphs.buckets if b <= gpu_linear.MAX_ROWS}
                assert set(graphs.replay_ms) == small  # every small bucket captured both ways
                assert all(set(ms) == {"cublas", "triton"} for ms in graphs.replay_ms.values())
                assert {graphs.linears[b] for b in set(graphs.buckets) - small} <= {"cublas"}
                if kept is not None:
                    assert {graphs.linears[b] for b in small} == {kept}
            if kept == "triton":  # every product shape of those buckets ran the Triton kernel
                assert gpu_linear._choices and None not in gpu_linear._choices.values()
    assert outputs[("ar", True)] == outputs[("ar", False)]
    assert outputs[("sd", True)] == outputs[("sd", False)] == outputs[("ar", False)]

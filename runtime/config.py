"""Serving-time settings and request checks, shared by the engine loop and the front ends
(`build/`, `triton_repo/`, the CLIs import this, not the loop)."""

from __future__ import annotations

from dataclasses import dataclass, field

from runtime.engine_dir import BuildConfig, EngineConfig
from runtime.kv_budget import KVBudget
from runtime.sampling import SamplingParams

SPECULATION_MODES = ("load-aware", "fixed")


@dataclass(frozen=True)
class RuntimeConfig:
    """Serving-time limits (TensorRT-LLM executor / vLLM engine-argument equivalents)."""

    max_batch_size: int | None = None
    """Most running requests; default (None): the engine's build limit."""
    max_num_tokens: int = 512
    """Most new tokens in one forward (prefill chunks + draft trees), the step's token budget."""
    max_draft_tokens: int = 64
    """Most drafted tokens a request may ask for per step (tree nodes besides the root)."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    kv: KVBudget = field(default_factory=KVBudget)
    """How much memory the KV cache gets."""
    max_queue_size: int = 256
    """Most waiting requests; more are refused at once (QueueFullError)."""
    speculation: str = "load-aware"
    """"load-aware": choose each request's tree size every step from running acceptance
    estimates and measured step costs, to maximise tokens per second (down to none, with
    bounded re-probing; `runtime/speculation_policy.py`); "fixed": always draft the
    request's own largest tree."""
    cuda_graphs: bool = True
    """On a GPU, replay captured target forwards (`runtime/cuda_graphs.py`); False = eager
    (vLLM's --enforce-eager)."""
    profile: bool = False
    """Synchronise the device at every step phase so `EngineCore.clock` attributes GPU time
    to the phase that launched it (`make profile`); costs a little speed on a GPU."""
    batch_invariant: bool = False
    """Target forwards whose per-token result does not depend on how many tokens share
    them (`LlamaForCausalLM.set_batch_invariant`), so bf16/fp16 speculative greedy output
    equals bf16/fp16 auto-regressive greedy output. Off by default: on the CPU it costs
    2.75x per 1-token forward (bf16 demo target)."""

    def batch_limit(self, build: BuildConfig) -> int:
        """Running requests this engine may hold: `max_batch_size`, or the build's limit."""
        limit = self.max_batch_size or build.max_batch_size
        if limit > build.max_batch_size:
            raise ValueError(
                f"max_batch_size {limit} > the engine's build limit {build.max_batch_size}; "
                "rebuild with a larger --max-batch-size"
            )
        return limit

    def __post_init__(self) -> None:
        if self.speculation not in SPECULATION_MODES:
            raise ValueError(f"speculation {self.speculation!r} is not one of {SPECULATION_MODES}")
        for name in ("max_num_tokens", "max_draft_tokens", "block_size", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_num_tokens <= self.max_draft_tokens:
            raise ValueError(
                f"max_num_tokens {self.max_num_tokens} must exceed max_draft_tokens {self.max_draft_tokens}: "
                "one full draft tree has to fit in a step"
            )


def check_request(config: EngineConfig, prompt: list[int], params: SamplingParams) -> None:
    """Reject requests the engine was not built for, with the limit and the fix (needs only
    the engine's config, so front ends can check before forwarding)."""
    build = config.build
    if not prompt:
        raise ValueError("empty prompt: give at least one token")
    if len(prompt) > build.max_input_len:
        raise ValueError(
            f"prompt has {len(prompt)} tokens > max_input_len {build.max_input_len}; "
            "rebuild with a larger --max-input-len"
        )
    if len(prompt) + params.max_tokens > build.max_seq_len:
        raise ValueError(
            f"prompt ({len(prompt)}) + max_tokens ({params.max_tokens}) > max_seq_len {build.max_seq_len}; "
            "lower max_tokens or rebuild with a larger --max-seq-len"
        )
    vocab = config.model["vocab_size"]
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"prompt token ids must be in [0, {vocab})")
    if any(t >= vocab for t in params.stop_token_ids):
        raise ValueError(f"stop token ids {list(params.stop_token_ids)} must be in [0, {vocab}) (the vocabulary)")
    if any(t >= vocab for word in params.bad_words for t in word):
        raise ValueError(f"bad_words token ids must be in [0, {vocab}) (the vocabulary)")

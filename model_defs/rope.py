"""Rotary position embeddings (RoPE) with the `rope_scaling` variants of HF `LlamaConfig`.

The inverse frequencies are computed exactly as `transformers.modeling_rope_utils` does
(same formulas, same fp32 arithmetic), because the target must match transformers to
1e-4 in fp32. Supported `rope_type`s: `default`, `linear`, `llama3`, `yarn`. `dynamic`
(NTK) and `longrope` change the frequencies with the *running* sequence length, which
would make cached keys depend on later tokens; they are refused with a clear error
rather than approximated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE settings, normalised from HF's `rope_theta` + `rope_scaling` (transformers 4)
    or `rope_parameters` (transformers 5)."""

    head_dim: int
    """Rotated dimension per head (Llama rotates the whole head)."""
    theta: float = 10000.0
    """Base wavelength."""
    rope_type: str = "default"
    """One of SUPPORTED_ROPE_TYPES."""
    params: dict[str, Any] = field(default_factory=dict)
    """Type-specific parameters (`factor`, `original_max_position_embeddings`, ...)."""

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_type {self.rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        needed = {
            "default": (),
            "linear": ("factor",),
            "llama3": (
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ),
            "yarn": ("factor", "original_max_position_embeddings"),
        }[self.rope_type]
        missing = [k for k in needed if self.params.get(k) is None]
        if missing:
            raise ValueError(f"rope_type {self.rope_type!r} needs {missing} in rope_scaling")

    @classmethod
    def from_hf(cls, hf: dict[str, Any], head_dim: int) -> RopeConfig:
        """Read RoPE settings from an HF config dict, old (`rope_scaling`) or new
        (`rope_parameters`) style."""
        params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = float(params.pop("rope_theta", hf.get("rope_theta", 10000.0)))
        rope_type = params.pop("rope_type", params.pop("type", "default"))
        return cls(head_dim=head_dim, theta=theta, rope_type=rope_type, params=params)

    def to_hf(self) -> dict[str, Any]:
        """Inverse of `from_hf`, in transformers-5 style (`rope_parameters`)."""
        return {"rope_parameters": {"rope_type": self.rope_type, "rope_theta": self.theta, **self.params}}


def _default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    # [dim // 2]; int64 arange then float, as transformers does.
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3_inv_freq(cfg: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling (transformers `_compute_llama3_parameters`)."""
    inv_freq = _default_inv_freq(cfg.theta, cfg.head_dim)
    factor = cfg.params["factor"]
    low_ff = cfg.params["low_freq_factor"]
    high_ff = cfg.params["high_freq_factor"]
    old_len = cfg.params["original_max_position_embeddings"]
    low_freq_wavelen = old_len / low_ff
    high_freq_wavelen = old_len / high_ff
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """YaRN (Peng et al. 2023) blend of interpolated and extrapolated frequencies plus the
    attention temperature `attention_factor` applied to cos/sin."""
    dim, base = cfg.head_dim, cfg.theta
    factor = cfg.params["factor"]
    orig_len = cfg.params["original_max_position_embeddings"]
    attention_factor = cfg.params.get("attention_factor")
    mscale, mscale_all_dim = cfg.params.get("mscale"), cfg.params.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = cfg.params.get("beta_fast") or 32
    beta_slow = cfg.params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig_len / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if cfg.params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp, as transformers does
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    extra_weight = 1 - ramp
    inv_freq = interpolation * (1 - extra_weight) + extrapolation * extra_weight
    return inv_freq, float(attention_factor)


def inv_freq_and_scale(cfg: RopeConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim // 2]` and the cos/sin scale for this RoPE variant."""
    if cfg.rope_type == "default":
        return _default_inv_freq(cfg.theta, cfg.head_dim), 1.0
    if cfg.rope_type == "linear":
        return _default_inv_freq(cfg.theta, cfg.head_dim) / cfg.params["factor"], 1.0
    if cfg.rope_type == "llama3":
        return _llama3_inv_freq(cfg), 1.0
    return _yarn_inv_freq(cfg)


class RotaryEmbedding(torch.nn.Module):
    """Produces cos/sin tables for arbitrary (per-token) positions.

    Positions are explicit rather than implied by the cache length because tree
    verification gives siblings the same position (context length + depth).
    """

    inv_freq: torch.Tensor

    def __init__(self, cfg: RopeConfig) -> None:
        super().__init__()
        inv_freq, self.scale = inv_freq_and_scale(cfg)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions `[B, T]` (int) -> cos, sin `[B, T, head_dim]` in `dtype`."""
        freqs = positions[..., None].float() * self.inv_freq.float()  # [B, T, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.scale).to(dtype), (emb.sin() * self.scale).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """HF/Llama "half rotation": (x1, x2) -> (-x2, x1) over the two halves of the head."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, H, T, D]`, cos/sin `[B, T, D]` -> rotated x `[B, H, T, D]`."""
    return x * cos[:, None] + rotate_half(x) * sin[:, None]

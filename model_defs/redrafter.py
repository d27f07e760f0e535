"""ReDrafter's recurrent drafter (Cheng et al. 2024, "Recurrent Drafter for Fast Speculative Decoding
in Large Language Models", arXiv 2403.09919, §3.1), architecture- and checkpoint-compatible with
Apple's reference `apple/ml-recurrent-drafter`:

- `recurrent_drafting/configuration_drafter.py` (`DrafterConfig`, the `config.json` keys),
- `recurrent_drafting/modeling_drafter.py` (`Drafter`, `ResBlock`, `maintain_logits`, `warp_logits`),

and with the tensor names NVIDIA TensorRT-LLM's `examples/redrafter/convert_checkpoint.py` reads.

The drafter conditions on the target's final-norm hidden state `h` (`LlamaOutput.hidden`) and on a
recurrent state `s` over the tokens drafted so far, embedded with the *target's* embedding table
(passed in, never owned here):

    s_0 = 0
    s_t = SiLU(rnn_w(E(x_t)) + rnn_u(s_{t-1}))      rnn=True  (rnn_w: no bias, rnn_u: bias)
    s_t = s_{t-1} + E(x_t)                          rnn=False (Apple's cumulative-sum variant)
    logits = lm_head(input_proj?(concat(h, s_t)))   lm_head = N x [x + SiLU(Linear(x))], Linear(exit_dim, V)

`input_proj` exists iff `exit_dim != 2 * hidden_size` (Apple has no config key for it). At
inference Apple then subtracts the row max and keeps the top 50 logits, setting the rest to
LOG_0 = -50000 (a finite "log 0"); see `warp_logits`.

TensorRT-LLM (`tensorrt_llm/models/redrafter/drafter.py`, `redrafter_helper.py`) reads the same
tensor names but, in the version read, drops the SiLU and the first step's `rnn_u` term and does
not warp; we follow Apple, whose code trained the published drafters.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from model_defs.checkpoint import SINGLE_FILE, load_checkpoint_dir
from model_defs.llama import Linear

MODEL_TYPE = "recurrent_drafting_drafter"
ARCHITECTURE = "Drafter"
LOG_0 = -50000.0
"""Apple's finite log(0): the logit of tokens outside the top-k (`modeling_drafter.py`)."""
WARP_TOP_K = 50
"""Apple's `warp_logits(top_k=50)`, applied to every drafter distribution at inference."""


@dataclass(frozen=True)
class ReDrafterConfig:
    """Drafter hyper-parameters, with Apple's `DrafterConfig` names (its `config.json` keys)."""

    vocab_size: int
    """Rows of the drafter head; equals the target's vocab (its embedding rows)."""
    hidden_size: int
    """Target hidden size: width of `h`, of the embeddings and of the RNN state."""
    exit_dim: int
    """Width of the residual blocks; `2 * hidden_size` means no `input_proj`."""
    num_draft_layers: int
    """Residual blocks `x + SiLU(Linear(x))` before the head."""
    rnn: bool
    """True: `s_t = SiLU(W E(x_t) + U s_{t-1} + b)`; False: `s_t = s_{t-1} + E(x_t)`."""
    num_lookback_tokens: int = -1
    """Carried by Apple's torch config (default -1) but unused by its model; kept for round trips."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Other `config.json` keys (`torch_dtype`, `transformers_version`, ...), kept verbatim."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "exit_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}; set it from the target model")
        if self.num_draft_layers < 0:
            raise ValueError(f"num_draft_layers must be >= 0 (residual blocks), got {self.num_draft_layers}")

    @property
    def has_input_proj(self) -> bool:
        """Apple creates `input_proj` exactly when the concat width differs from `exit_dim`."""
        return self.exit_dim != 2 * self.hidden_size

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ReDrafterConfig:
        """Build from Apple's `config.json` dict; unknown keys go to `extra`."""
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"model_type is {d['model_type']!r}; a ReDrafter drafter has {MODEL_TYPE!r}")
        missing = [k for k in ("vocab_size", "hidden_size", "exit_dim", "num_draft_layers") if k not in d]
        if missing:
            raise ValueError(f"missing keys {missing}; Apple's DrafterConfig writes all of them")
        known = {"vocab_size", "hidden_size", "exit_dim", "num_draft_layers", "rnn", "num_lookback_tokens"}
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            exit_dim=int(d["exit_dim"]),
            num_draft_layers=int(d["num_draft_layers"]),
            rnn=bool(d.get("rnn", False)),  # DrafterConfig's default
            num_lookback_tokens=int(d.get("num_lookback_tokens", -1)),
            extra={k: v for k, v in d.items() if k not in known | {"model_type", "architectures"}},
        )

    def to_json(self) -> dict[str, Any]:
        """Apple's `config.json` dict (the keys `Drafter.save_pretrained` writes)."""
        return {
            "architectures": [ARCHITECTURE],
            "exit_dim": self.exit_dim,
            "hidden_size": self.hidden_size,
            "model_type": MODEL_TYPE,
            "num_draft_layers": self.num_draft_layers,
            "num_lookback_tokens": self.num_lookback_tokens,
            "rnn": self.rnn,
            "vocab_size": self.vocab_size,
            **self.extra,
        }


def expected_shapes(cfg: ReDrafterConfig) -> dict[str, torch.Size]:
    """Tensor name -> shape of a complete drafter checkpoint (Apple's `Drafter.state_dict()` names)."""
    d, e, n = cfg.hidden_size, cfg.exit_dim, cfg.num_draft_layers
    shapes: dict[str, tuple[int, ...]] = {}
    if cfg.has_input_proj:
        shapes |= {"input_proj.weight": (e, 2 * d), "input_proj.bias": (e,)}
    for i in range(n):
        shapes |= {f"lm_head.{i}.linear.weight": (e, e), f"lm_head.{i}.linear.bias": (e,)}
    shapes[f"lm_head.{n}.weight"] = (cfg.vocab_size, e)
    if cfg.rnn:
        shapes |= {"rnn_u.weight": (d, d), "rnn_u.bias": (d,), "rnn_w.weight": (d, d)}
    return {k: torch.Size(v) for k, v in shapes.items()}


def warp_logits(logits: torch.Tensor, top_k: int = WARP_TOP_K) -> torch.Tensor:
    """Apple's inference-time drafter warp (`maintain_logits` then `warp_logits` in
    `modeling_drafter.py`): subtract the row max, then set every logit strictly below the k-th
    largest to LOG_0 (ties with the k-th are kept, as in HF `TopKLogitsWarper`). Training does
    not warp; beam search and draft log-probs see the warped distribution."""
    logits = logits - logits.amax(dim=-1, keepdim=True)
    k = min(top_k, logits.shape[-1])
    kth = torch.topk(logits, k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth, LOG_0)


class ResBlock(nn.Module):
    """`x + SiLU(Linear(x))` (Apple's `ResBlock`; the parameter lives at `.linear`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = Linear(dim, dim, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class ReDrafter(nn.Module):
    """The drafter. `init_state` / `step` run the recurrence, `logits` / `log_probs` read the next
    token's distribution; the target embedding `E` is applied by the caller and passed to `step`."""

    def __init__(self, cfg: ReDrafterConfig) -> None:
        super().__init__()
        self.config = cfg
        self.input_proj = Linear(2 * cfg.hidden_size, cfg.exit_dim, bias=True) if cfg.has_input_proj else None
        self.lm_head = nn.Sequential(
            *(ResBlock(cfg.exit_dim) for _ in range(cfg.num_draft_layers)),
            Linear(cfg.exit_dim, cfg.vocab_size, bias=False),
        )
        if cfg.rnn:
            self.rnn_u = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
            self.rnn_w = Linear(cfg.hidden_size, cfg.hidden_size, bias=False)

    @property
    def head_weight(self) -> torch.Tensor:
        """`[V, exit_dim]` vocabulary projection (`lm_head.{N}.weight`)."""
        head = self.lm_head[-1]
        assert isinstance(head, Linear)
        return head.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.head_weight.dtype

    def init_state(self, batch_shape: int | tuple[int, ...]) -> torch.Tensor:
        """`s_0 = 0`: zeros `[*batch_shape, D]` on the drafter's device and dtype."""
        shape = (batch_shape,) if isinstance(batch_shape, int) else tuple(batch_shape)
        w = self.head_weight
        return torch.zeros(*shape, self.config.hidden_size, dtype=w.dtype, device=w.device)

    def step(self, state: torch.Tensor, token_emb: torch.Tensor) -> torch.Tensor:
        """Consume one token: state `[..., D]`, target embedding of the token `[..., D]` -> `[..., D]`.
        The first call consumes the target's bonus token (the last verified one)."""
        token_emb = token_emb.to(state.dtype)
        if self.config.rnn:
            return F.silu(self.rnn_w(token_emb) + self.rnn_u(state))
        return state + token_emb

    def logits(self, h_target: torch.Tensor, state: torch.Tensor, warp: bool = True) -> torch.Tensor:
        """Next-token logits `[..., V]` (fp32, or the input dtype if wider) from the target hidden state
        `[..., D]` and the recurrent state `[..., D]`. `warp=False` gives the raw head output
        (what training scores); `warp=True` is Apple's inference distribution."""
        x = torch.cat([h_target.to(state.dtype), state], dim=-1)  # [..., 2D]
        if self.input_proj is not None:
            x = self.input_proj(x)  # [..., exit_dim]
        out = self.lm_head(x)
        out = out.to(torch.promote_types(out.dtype, torch.float32))
        return warp_logits(out) if warp else out

    def log_probs(self, h_target: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        """Warped draft log-distribution `[..., V]` (what beam search ranks and verification uses)."""
        return torch.log_softmax(self.logits(h_target, state), dim=-1)

    def forward(self, h_target: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        return self.logits(h_target, state)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> ReDrafter:
        """Load Apple's drafter directory (`config.json` + `model.safetensors`, or a sharded index);
        every missing, unexpected or mis-shaped tensor is reported with its file."""
        cfg, tensors = load_checkpoint_dir(path, ReDrafterConfig.from_json, expected_shapes)
        return cls.from_tensors(cfg, tensors, dtype)

    @classmethod
    def from_tensors(cls, cfg: ReDrafterConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> ReDrafter:
        """Build from an already validated name -> tensor dict (Apple's names)."""
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(tensors, strict=True, assign=True)
        return model.to(dtype).eval()

    def save_pretrained(self, path: str | Path) -> None:
        """Write `config.json` + `model.safetensors` with Apple's keys and tensor names, so Apple's
        `Drafter` (strict `load_state_dict`) and TensorRT-LLM's converter read it unchanged."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        config = self.config.to_json()
        # the dtype actually saved, under the key the source config used (transformers 4 wrote
        # `torch_dtype`, which transformers 5 still reads; 5 writes `dtype`)
        config["dtype" if "dtype" in config else "torch_dtype"] = str(self.dtype).removeprefix("torch.")
        (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        tensors = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})

"""Lyanna's drafter ("Make Every Draft Count"): a one-layer chain over the target's final
hidden state, a one-pass LM head, and a low-rank token-info logits bias collapsed into a
hot-token table for inference.

Drafter (§4). With `h_0` the target's final-norm hidden state at the last accepted token
(`LlamaOutput.hidden`) and `t_1` the bonus token the target sampled from it:

    x_1     = fuse(concat(h_0, E(t_1)))      fuse = Linear(2D -> D)   (first_token_fusion)
    x_1     = fuse(h_0)                      fuse = Linear(D -> D)    (ablation: no t_1)
    h_1     = norm(Layer(x_1))
    h_{i+1} = norm(Layer(h_i))               no token input after step 1
    logits  = lm_head(h_1..h_k)              ONE [B*k, D] x [D, V] matmul (§4.2)

- `E` and `lm_head` are the target's, frozen, passed in by the caller and never owned or
  saved here: the drafter's hidden states live in the target's output space, so the
  target's head reads them unchanged and the checkpoint holds only the small new parts.
- `fuse` is EAGLE's choice, a learnt Linear over the concatenation rather than a sum: it
  lets the layer weigh the context summary h_0 against the bonus token's identity per
  feature, for 2*D*D parameters (295K at D=384), nothing next to one decoder layer.
- `Layer` is one `DecoderLayer` of the target's shape (the very block the target stacks:
  RMSNorm, GQA attention with RoPE, SwiGLU), so it runs on whatever kernels the target
  runs on; `norm` is a trainable RMSNorm so h_i is on the scale of the target's
  final-norm state, which is what the frozen LM head expects.
- What the drafter attends to: its own chain only (x_1, h_1, ..., causal, RoPE positions
  1..k). The context enters through h_0, the target's final state, which already attended
  to the whole context. So there is no drafter KV cache over the context to keep in sync
  with the paged target cache (compaction, preemption, tensor parallelism all leave the
  drafter alone), only a tiny per-call KV of <= k entries; and the chain does not depend
  on the drafted tokens, so the hidden states and the one-pass logits are computed once
  per draft and rejected drafts are re-sampled from the same chain with no new drafter
  forward. EAGLE is the alternative: it caches drafter features for the whole context and
  feeds every drafted token back in, paying a context-long cache and a forward per
  drafted token for more context inside the drafter.

Token-info embedding (§5.1). Since the chain ignores the drafted tokens, which token was
just drafted enters the logits as an additive bias:

    E'(t) = RMSNorm_V(W_E[t] @ W1 @ W2)      W_E [V, n] the target's frozen embedding,
                                             W1 [n, d], W2 [d, V] trainable, RMSNorm over
                                             the V outputs with a trainable gain
    l'_i  = lm_head(h_i) + E'(t_prev)        t_prev: the token row i follows (the bonus
                                             token for row 1, the token drafted at depth
                                             i - 1 for row i)

E' is a learnt rank-d bigram correction on top of the chain's context-level prediction.
d = 64 by default: the bias lives in a rank-d subspace of the logits; 64 directions is
room for the strong local successor structure of code tokens (`(` -> `)`/`self`, `.` ->
attribute names) at a cost of 64*(n + V) = 549K parameters for n=384, V=8192 and a
[n x 64] + [64 x V] product per bias, far below the [D x V] LM head; at inference the rank
no longer matters at all (the table is [H, H] whatever d is), so d only trades training
cost and overfitting of rare bigrams against expressiveness; not tuned here.
The gain starts at
zero, so training starts from "no bias" and the bias grows only as far as it helps.

Hot-token table (§6.1). At inference E' is not recomputed: `collapse` evaluates E'(t) for
every hot token t and keeps only the hot columns, a dense [H, H] table indexed by
(previous token, next token); `HotTokenTable.bias` adds the row of a hot previous token to
the hot columns of a logits row and nothing otherwise (the bias is an approximation we
drop for the cold 1 - coverage of occurrences). H = 2048 of V = 8192 for the demo target
(`DEFAULT_HOT_TOKENS`): the 2048 most frequent tokens of the training split cover 87.7%
of its 3.05M token occurrences (89.9% of the held-out split; 80.7% of held-out bigrams
have both tokens hot), and the table is 2048^2 x 2 B = 8 MiB in bf16 against 128 MiB for
the dense 8192 x 8192 table. Doubling to 4096 buys 7 points of coverage (94.7%) for 4x the
memory (32 MiB); halving to 1024 loses 8 points (80.0%). The paper keeps 32K of >40K
vocabularies; a 25% slice suffices here because a code-only corpus is much more
concentrated. `hot_table_bytes` computes these sizes, the training script measures the
coverage and the checkpoint stores the hot ids (`hot_token_ids`) with it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from model_defs.checkpoint import SINGLE_FILE, load_checkpoint_dir
from model_defs.llama import Attend, DecoderLayer, Linear, LlamaConfig, RMSNorm, takes_cpu_copy
from model_defs.rope import RotaryEmbedding
from plugins.cpu_linear import int8_linear

if TYPE_CHECKING:
    from plugins.lyanna_chain import Int8Chain

MODEL_TYPE = "lyanna_drafter"
ARCHITECTURE = "LyannaDrafter"
DEFAULT_TOKEN_INFO_RANK = 64
"""d of the token-info embedding (see the module docstring)."""
DEFAULT_HOT_TOKENS = 2048
"""H for the demo target's 8192-token vocabulary (see the module docstring)."""


@dataclass(frozen=True)
class LyannaConfig:
    """Drafter hyper-parameters. The layer shape and RoPE are the target's."""

    vocab_size: int
    """Target vocabulary (rows of its embedding and LM head)."""
    hidden_size: int
    """Target width D."""
    intermediate_size: int
    """SwiGLU width of the drafter layer (the target's)."""
    num_attention_heads: int
    """Query heads of the drafter layer."""
    num_key_value_heads: int
    """KV heads of the drafter layer."""
    head_dim: int
    """Per-head width."""
    rms_norm_eps: float = 1e-6
    """RMSNorm epsilon (the target's)."""
    rope_theta: float = 10000.0
    """RoPE base (the target's)."""
    rope_scaling: dict[str, Any] | None = None
    """HF `rope_scaling` dict or None."""
    first_token_fusion: bool = True
    """Step 1 fuses h_0 with E(t_1); False: `fuse(h_0)` only (ablation)."""
    token_info_rank: int = DEFAULT_TOKEN_INFO_RANK
    """d of the token-info embedding E'; 0 = no token-info bias (ablation)."""
    num_hot_tokens: int = 0
    """H: hot tokens stored with the checkpoint (`hot_token_ids`); 0 = none."""
    hot_token_coverage: float | None = None
    """Fraction of training-corpus token occurrences the hot tokens cover."""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Other `config.json` keys, kept verbatim."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}; set it from the target model")
        if self.token_info_rank < 0 or self.num_hot_tokens < 0:
            raise ValueError("token_info_rank and num_hot_tokens must be >= 0")
        if self.num_hot_tokens > self.vocab_size:
            raise ValueError(f"num_hot_tokens {self.num_hot_tokens} > vocab_size {self.vocab_size}")
        _ = self.layer_config()  # validates heads and rope_scaling early

    @classmethod
    def from_target(cls, target: LlamaConfig, **kwargs: Any) -> LyannaConfig:
        """A drafter for `target`: its vocabulary, layer shape, norm epsilon and RoPE."""
        return cls(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            rope_scaling=target.rope_scaling,
            **kwargs,
        )

    def layer_config(self) -> LlamaConfig:
        """A one-layer `LlamaConfig` of the drafter's shape (builds the `DecoderLayer`)."""
        return LlamaConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
        )

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> LyannaConfig:
        """Build from a `config.json` dict; unknown keys go to `extra`."""
        if d.get("model_type", MODEL_TYPE) != MODEL_TYPE:
            raise ValueError(f"model_type is {d['model_type']!r}; a Lyanna drafter has {MODEL_TYPE!r}")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        required = {"vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "head_dim"}
        missing = sorted(required - d.keys())
        if missing:
            raise ValueError(f"missing keys {missing}")
        kwargs = {k: d[k] for k in known if k in d}
        kwargs.setdefault("num_key_value_heads", d["num_attention_heads"])
        return cls(**kwargs, extra={k: v for k, v in d.items() if k not in known | {"model_type", "architectures"}})

    def to_json(self) -> dict[str, Any]:
        """The `config.json` dict."""
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        return {"architectures": [ARCHITECTURE], "model_type": MODEL_TYPE, **d, **self.extra}


def expected_shapes(cfg: LyannaConfig) -> dict[str, torch.Size]:
    """Tensor name -> shape of a complete drafter checkpoint (target embedding / head excluded)."""
    d, inner = cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "fuse.weight": (d, 2 * d if cfg.first_token_fusion else d),
        "fuse.bias": (d,),
        "layer.input_layernorm.weight": (d,),
        "layer.post_attention_layernorm.weight": (d,),
        "layer.self_attn.q_proj.weight": (q, d),
        "layer.self_attn.k_proj.weight": (kv, d),
        "layer.self_attn.v_proj.weight": (kv, d),
        "layer.self_attn.o_proj.weight": (d, q),
        "layer.mlp.gate_proj.weight": (inner, d),
        "layer.mlp.up_proj.weight": (inner, d),
        "layer.mlp.down_proj.weight": (d, inner),
        "norm.weight": (d,),
    }
    if cfg.token_info_rank:
        r = cfg.token_info_rank
        shapes |= {
            "token_info.w1": (d, r),
            "token_info.w2": (r, cfg.vocab_size),
            "token_info.norm.weight": (cfg.vocab_size,),
        }
    shapes["hot_token_ids"] = (cfg.num_hot_tokens,)  # int64; empty when there are none
    return {k: torch.Size(v) for k, v in shapes.items()}


def embedding_weight(embed: nn.Embedding | torch.Tensor) -> torch.Tensor:
    """The `[V, n]` table of an `nn.Embedding` or the tensor itself."""
    return embed.weight if isinstance(embed, nn.Embedding) else embed


class TokenInfo(nn.Module):
    """`E'(t) = RMSNorm_V(W_E[t] @ W1 @ W2)`: a rank-d logits bias per previous token, over
    the target's frozen embedding `W_E` (passed in). See the module docstring."""

    def __init__(self, embed_dim: int, vocab_size: int, rank: int, eps: float) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(embed_dim, rank) / math.sqrt(embed_dim))
        self.w2 = nn.Parameter(torch.randn(rank, vocab_size) / math.sqrt(rank))
        self.norm = RMSNorm(vocab_size, eps)
        nn.init.zeros_(self.norm.weight)  # start as "no bias"

    def forward(self, prev_tokens: torch.Tensor, embed: nn.Embedding | torch.Tensor) -> torch.Tensor:
        """prev_tokens `[...]` -> bias `[..., V]` (fp32)."""
        e = F.embedding(prev_tokens, embedding_weight(embed))
        w1, w2 = self.w1.to(e.dtype), self.w2.to(e.dtype)
        return self.norm((e @ w1 @ w2).float()).float()


def hot_table_bytes(num_hot: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of a dense `[H, H]` hot-token table in `dtype`."""
    return num_hot * num_hot * torch.empty((), dtype=dtype).element_size()


class HotTokenTable(NamedTuple):
    """E' restricted to (hot previous token, hot next token) pairs (§6.1)."""

    hot_ids: torch.Tensor  # [H] vocabulary ids of the hot tokens
    hot_index: torch.Tensor  # [V] row/column of a token in `table`, -1 if not hot
    table: torch.Tensor  # [H, H] table[r, c] = E'(hot_ids[r])[hot_ids[c]]

    def bias(self, prev_tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """prev_tokens `[M]`, logits `[M, V]` -> logits with the table row of each hot previous
        token added to the hot columns; rows after a cold token are returned unchanged."""
        rows = self.hot_index[prev_tokens]  # [M]
        hit = (rows >= 0).nonzero().squeeze(-1)  # [M_hot]
        out = logits.clone()
        if hit.numel():
            add = self.table[rows[hit]].to(out.dtype)  # [M_hot, H]
            # one add per (row, hot column), as `out[hit[:, None], hot_ids] += add` but along
            # one dimension (the 2-D index_put cost ~0.2 ms a call at 2048 hot columns)
            if hit.numel() == out.shape[0]:
                out.index_add_(1, self.hot_ids, add)
            else:
                out[hit] = out[hit].index_add_(1, self.hot_ids, add)
        return out


@torch.no_grad()
def collapse(
    token_info: TokenInfo,
    embed: nn.Embedding | torch.Tensor,
    hot_ids: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    chunk: int = 512,
) -> HotTokenTable:
    """Evaluate E'(t) for every hot token (fp32, RMSNorm over all V outputs) and keep the hot
    columns: the `[H, H]` table in `dtype` plus the index maps."""
    weight = embedding_weight(embed)
    vocab = token_info.norm.weight.shape[0]
    hot_ids = hot_ids.to(device=weight.device, dtype=torch.long)
    rows = []
    for i in range(0, len(hot_ids), chunk):
        ids = hot_ids[i : i + chunk]
        rows.append(token_info(ids, weight.float())[:, hot_ids])
    hot_index = torch.full((vocab,), -1, dtype=torch.long, device=weight.device)
    hot_index[hot_ids] = torch.arange(len(hot_ids), device=weight.device)
    return HotTokenTable(hot_ids, hot_index, torch.cat(rows).to(dtype))


class ChainKV:
    """The per-call KV of the drafter's chain: each layer step appends its key/value and
    attends over everything appended so far (dense; the chain is k <= a few entries long).
    Called as `attend(layer, q, k, v)` exactly like `DenseAttention` / `PagedBatch`."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        # one new query per step; it sees every earlier entry and itself, so no mask
        gqa = q.shape[1] != self.k.shape[1]
        return F.scaled_dot_product_attention(q, self.k, self.v, enable_gqa=gqa)


class LyannaDrafter(nn.Module):
    """The drafter (see the module docstring). The target's embedding and LM head are
    arguments, never parameters."""

    hot_token_ids: torch.Tensor

    def __init__(self, cfg: LyannaConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.hidden_size
        self.fuse = Linear(2 * d if cfg.first_token_fusion else d, d, bias=True)
        self.layer = DecoderLayer(cfg.layer_config(), layer=0)
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.layer_config().rope)
        self.token_info = (
            TokenInfo(d, cfg.vocab_size, cfg.token_info_rank, cfg.rms_norm_eps) if cfg.token_info_rank else None
        )
        self.register_buffer("hot_token_ids", torch.zeros(cfg.num_hot_tokens, dtype=torch.long))
        self._ropes: dict[tuple[int, torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        """`_chain_rope`'s tables."""

    @property
    def dtype(self) -> torch.dtype:
        return self.fuse.weight.dtype

    def draft_chain(
        self,
        h0: torch.Tensor,
        t1: torch.Tensor,
        embed: nn.Embedding | torch.Tensor,
        k: int,
        fused: Int8Chain | None = None,
    ) -> torch.Tensor:
        """h0 `[B, D]` (target final-norm state at the last accepted token), t1 `[B]` (bonus
        token) -> the chain's hidden states h_1..h_k `[B, k, D]`: k sequential layer steps
        over a per-call KV, RoPE positions 1..k. `fused(x_1, cos, sin)`: the k steps in one
        call (`plugins.lyanna_chain.Int8Chain`, int8 layers on the CPU), the first input
        too where it holds the `fuse` linear (`Int8Chain.draft`); None: these modules."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        if fused is not None and not torch.is_grad_enabled():
            weight = embedding_weight(embed) if self.config.first_token_fusion else None
            if fused.drafts_from(h0, weight) and h0.dtype == self.dtype:  # the first input in the op too
                return fused.draft(h0, t1, weight, *self._chain_rope(k, self.dtype, h0.device))
        x = h0.to(self.dtype)
        if self.config.first_token_fusion:
            x = torch.cat([x, F.embedding(t1, embedding_weight(embed)).to(x.dtype)], dim=-1)
        x = self.fuse(x)[:, None]  # [B, 1, D]
        if fused is not None and not torch.is_grad_enabled():
            return fused(x[:, 0], *self._chain_rope(k, x.dtype, x.device))
        positions = torch.arange(1, k + 1, device=x.device).expand(x.shape[0], -1)
        cos, sin = self.rotary_emb(positions, x.dtype)
        attend = cast(Attend, ChainKV())  # DecoderLayer only calls attend(layer, q, k, v)
        states = []
        for i in range(k):
            x = self.norm(self.layer(x, cos[:, i : i + 1], sin[:, i : i + 1], attend))
            states.append(x)
        return torch.cat(states, dim=1)

    def _chain_rope(self, k: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[k, head_dim]` of positions 1..k, every chain's (the same rows
        `rotary_emb` gives each request), worked out once per (k, dtype, device): ~75 us of
        a batch-1 chain after a 48 MB read (2-core EPYC), for a constant."""
        key = (k, dtype, device)
        table = self._ropes.get(key)
        if table is None:
            cos, sin = self.rotary_emb(torch.arange(1, k + 1, device=device)[None], dtype)
            self._ropes[key] = table = (cos[0], sin[0])
        return table

    def forward(self, h0: torch.Tensor, t1: torch.Tensor, embed: nn.Embedding | torch.Tensor, k: int) -> torch.Tensor:
        return self.draft_chain(h0, t1, embed, k)

    @staticmethod
    def head_logits(hidden: torch.Tensor, lm_head: nn.Linear | torch.Tensor) -> torch.Tensor:
        """The one-pass LM head (§4.2): hidden `[B, k, D]` -> logits `[B, k, V]` (fp32) with one
        matmul over all k states, instead of one `[B, D] x [D, V]` per drafted token. An int8
        head (`LoadedEngine.lyanna_head`) goes to `int8_linear` straight, where `Linear.product`
        sends it (the same bits; the module call and the product's other checks cost ~25 us
        of ~100 after a 48 MB read)."""
        if (
            isinstance(lm_head, Linear)
            and lm_head.int8 is not None
            and lm_head.int8.kernel is not None
            and takes_cpu_copy(hidden)
        ):
            return int8_linear(hidden, lm_head.int8, lm_head.bias)
        if isinstance(lm_head, nn.Linear):  # the target's head (its CPU-blocked weight, if packed)
            return lm_head(hidden.to(lm_head.weight.dtype)).float()
        return F.linear(hidden.to(lm_head.dtype), lm_head).float()

    def token_bias(self, prev_tokens: torch.Tensor, embed: nn.Embedding | torch.Tensor) -> torch.Tensor:
        """E'(prev_tokens) `[..., V]` (fp32): the low-rank token-info bias (training, reference)."""
        if self.token_info is None:
            raise ValueError("this drafter was trained without the token-info embedding")
        return self.token_info(prev_tokens, embed)

    def hot_table(self, embed: nn.Embedding | torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> HotTokenTable:
        """The inference table over the checkpoint's hot tokens."""
        if self.token_info is None or not self.config.num_hot_tokens:
            raise ValueError("this drafter has no token-info embedding or no hot tokens")
        return collapse(self.token_info, embed, self.hot_token_ids, dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.float32) -> LyannaDrafter:
        """Load `config.json` + `model.safetensors`; every missing, unexpected or mis-shaped
        tensor is reported with its file."""
        cfg, tensors = load_checkpoint_dir(path, LyannaConfig.from_json, expected_shapes)
        return cls.from_tensors(cfg, tensors, dtype)

    @classmethod
    def from_tensors(cls, cfg: LyannaConfig, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> LyannaDrafter:
        """Build from an already validated name -> tensor dict (`expected_shapes` names)."""
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(tensors, strict=True, assign=True)
        model.rotary_emb = RotaryEmbedding(cfg.layer_config().rope)  # buffers are recomputed
        return model.to(dtype).eval()  # floating tensors only: hot_token_ids stays int64

    def save_pretrained(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> None:
        """Write `config.json` + `model.safetensors` (float tensors in `dtype`, hot ids int64)."""
        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        config = self.config.to_json() | {"dtype": str(dtype).removeprefix("torch.")}
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        tensors = {
            k: (v.to(dtype) if v.is_floating_point() else v).detach().contiguous().cpu()
            for k, v in self.state_dict().items()
        }
        save_file(tensors, str(out / SINGLE_FILE), metadata={"format": "pt"})

"""AttentionConfig: every dimension of the attention module, validated once.

Shape vocabulary used across the project:
    b   batch            h   heads            dh  head_dim = d_model // h
    lq  query length     lk  key/value length
    query (b, lq, query_dim)   key/value (b, lk, kv_dim)   output (b, lq, out_dim)
    attn_probs (b, h, lq, lk)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from attnserve.contract import MASK_FILL
from attnserve.ranges import WIDTH

# The seeds fill masked scores with -1e10 before the softmax (not -inf): a fully masked row
# then becomes a uniform distribution over its keys instead of NaN (attnserve.contract).
SEED_MASK_FILL = MASK_FILL


@dataclass(frozen=True)
class AttentionConfig:
    query_dim: int  # width of the query stream (seed 000: d_model; seed 002: input_dim)
    num_heads: int
    d_model: int | None = None  # projected width, num_heads * head_dim; defaults to query_dim
    kv_dim: int | None = None  # width of the key/value stream; defaults to query_dim
    out_dim: int | None = None  # width of the output; defaults to query_dim
    bias: bool = True
    dropout: float = 0.0  # applied to attn_probs in training only, never in export
    mask_fill: float = SEED_MASK_FILL

    def __post_init__(self) -> None:
        # Resolve the defaults once so every reader sees plain ints.
        for field in ("d_model", "kv_dim", "out_dim"):
            if getattr(self, field) is None:
                object.__setattr__(self, field, self.query_dim)
        for field in ("query_dim", "num_heads", "d_model", "kv_dim", "out_dim"):
            WIDTH.check(field, getattr(self, field))  # the server's range: it serves what export writes
        if self.d_model % self.num_heads != 0:
            raise ValueError(
                f"d_model {self.d_model} is not divisible by num_heads {self.num_heads}"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def weight_bytes(self) -> int:
        """The four projections' fp32 weights and biases (export.attention.MultiHeadAttention)."""
        d, bias = self.d_model, int(self.bias)
        return 4 * (d * (self.query_dim + 2 * self.kv_dim + self.out_dim) + bias * (3 * d + self.out_dim))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"head_dim": self.head_dim}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AttentionConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def replace(self, **changes: Any) -> AttentionConfig:
        return dataclasses.replace(self, **changes)


# The reference implementations' sizes (seed 000 and seed 002, docs/index.md): widths left out
# follow query_dim, also when a flag changes query_dim (AttentionConfig(**PRESET_ARGS[name] | overrides)).
PRESET_ARGS: dict[str, dict[str, Any]] = {
    # seed 000 MultiHeadAttention: d_model 512, 8 heads, dropout 0.1 (training only).
    "self_attention": {"query_dim": 512, "num_heads": 8, "dropout": 0.1},
    # seed 002 Multiheadattention(input_dim=32, heads=2, d_model=32): 256 queries over 77 keys.
    "cross_attention": {"query_dim": 32, "num_heads": 2, "d_model": 32},
}
PRESETS: dict[str, AttentionConfig] = {name: AttentionConfig(**args) for name, args in PRESET_ARGS.items()}

"""The attention module: one nn.Module that covers both reference implementations.

Seed 000 (`MultiHeadAttention`) is `AttentionConfig(query_dim=512, num_heads=8)`; seed 002
(`Multiheadattention`) is `AttentionConfig(query_dim=32, num_heads=2, d_model=32)`. Key/value
streams may have their own width (`kv_dim`), the output its own (`out_dim`).
"""

from __future__ import annotations

import math

import torch
from attnserve.export.config import AttentionConfig
from torch import Tensor, nn


def _is_exporting() -> bool:
    return torch.compiler.is_exporting() or torch.jit.is_tracing()


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over `num_heads` heads.

    forward(query, key, value, mask=None, key_mask=None) -> (output, attn_probs)
        query      (b, lq, query_dim)
        key, value (b, lk, kv_dim)
        mask       nonzero/True = attend, 0/False = masked; one of
                   (lq, lk), (b, lq, lk), or (b|1, h|1, lq|1, lk)
        key_mask   (b, lk), nonzero/True = a real key, 0/False = padding
        output     (b, lq, out_dim)
        attn_probs (b, h, lq, lk), before dropout (as in seed 000)
    Masked scores are filled with `config.mask_fill` (-1e10, as the seeds) before the softmax.
    """

    def __init__(self, config: AttentionConfig) -> None:
        super().__init__()
        self.config = config
        self.to_q = nn.Linear(config.query_dim, config.d_model, bias=config.bias)
        self.to_k = nn.Linear(config.kv_dim, config.d_model, bias=config.bias)
        self.to_v = nn.Linear(config.kv_dim, config.d_model, bias=config.bias)
        self.to_out = nn.Linear(config.d_model, config.out_dim, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def _split_heads(self, x: Tensor) -> Tensor:
        b, length, _ = x.shape  # batch, length, d_model
        x = x.view(b, length, self.config.num_heads, self.config.head_dim)  # (b, l, h, dh)
        return x.transpose(1, 2)  # (b, h, l, dh)

    def _merge_heads(self, x: Tensor) -> Tensor:
        b, _, length, _ = x.shape  # (b, h, l, dh)
        x = x.transpose(1, 2).contiguous()  # (b, l, h, dh)
        return x.view(b, length, self.config.d_model)  # (b, l, d_model)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None = None,
        key_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        if not _is_exporting():
            self._check_shapes(query, key, value, mask, key_mask)
        q = self._split_heads(self.to_q(query))  # (b, h, lq, dh)
        k = self._split_heads(self.to_k(key))  # (b, h, lk, dh)
        v = self._split_heads(self.to_v(value))  # (b, h, lk, dh)

        # Divide (not multiply by the reciprocal) so the rounding matches the seeds.
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.config.head_dim)  # (b, h, lq, lk)
        keep = _broadcastable_keep(mask, key_mask)
        if keep is not None:
            scores = scores.masked_fill(~keep, self.config.mask_fill)
        attn_probs = torch.softmax(scores, dim=-1)  # (b, h, lq, lk)

        attended = torch.matmul(self.dropout(attn_probs), v)  # (b, h, lq, dh)
        output = self.to_out(self._merge_heads(attended))  # (b, lq, out_dim)
        return output, attn_probs

    def _check_shapes(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        mask: Tensor | None,
        key_mask: Tensor | None,
    ) -> None:
        cfg = self.config
        inputs = (("query", query, cfg.query_dim), ("key", key, cfg.kv_dim), ("value", value, cfg.kv_dim))
        for name, tensor, width in inputs:
            if tensor.dim() != 3 or tensor.shape[-1] != width:
                raise ValueError(f"{name}: expected shape (batch, length, {width}), got {tuple(tensor.shape)}")
        b, lq, lk = query.shape[0], query.shape[1], key.shape[1]
        if key.shape[0] != b or value.shape[0] != b:
            raise ValueError(
                f"batch sizes disagree: query {b}, key {key.shape[0]}, value {value.shape[0]}"
            )
        if value.shape[1] != lk:
            raise ValueError(f"key and value lengths disagree: key {lk}, value {value.shape[1]}")
        if mask is not None:
            allowed = {2: (lq, lk), 3: (b, lq, lk), 4: (b, cfg.num_heads, lq, lk)}
            expected = allowed.get(mask.dim())
            ok = expected is not None and all(
                # A 4-D mask broadcasts over b, h and lq, as in seed 000: (b, 1, 1, lk) is a padding mask.
                got == want or (got == 1 and mask.dim() == 4 and axis < 3)
                for axis, (got, want) in enumerate(zip(mask.shape, expected, strict=True))
            )
            if not ok:
                raise ValueError(
                    f"mask: expected (lq, lk)={allowed[2]}, (b, lq, lk)={allowed[3]} or "
                    f"(b|1, h|1, lq|1, lk)={allowed[4]}, got {tuple(mask.shape)}"
                )
        if key_mask is not None and tuple(key_mask.shape) != (b, lk):
            raise ValueError(f"key_mask: expected (b, lk)={(b, lk)}, got {tuple(key_mask.shape)}")


def _broadcastable_keep(mask: Tensor | None, key_mask: Tensor | None) -> Tensor | None:
    """Both masks as one bool tensor that broadcasts against (b, h, lq, lk); True = attend."""
    keep = None
    if mask is not None:
        keep = mask if mask.dtype == torch.bool else mask != 0
        if keep.dim() == 2:  # (lq, lk)
            keep = keep[None, None]
        elif keep.dim() == 3:  # (b, lq, lk)
            keep = keep[:, None]
    if key_mask is not None:
        key_keep = key_mask if key_mask.dtype == torch.bool else key_mask != 0
        key_keep = key_keep[:, None, None, :]  # (b, 1, 1, lk)
        keep = key_keep if keep is None else keep & key_keep
    return keep

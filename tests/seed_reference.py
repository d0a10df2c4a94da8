"""Re-implementations of the two reference modules (seed 000, seed 002), kept to their names and math.

Seed 000 `MultiHeadAttention(d_model=512, n_heads=8, dropout=0.1)`: Wq/Wk/Wv/Wo, scores divided by
math.sqrt(d_key), masked_fill(mask == 0, -1e10), softmax, dropout on the probs, returns
(output, attn_probs). Seed 002 `Multiheadattention(input_dim, heads, d_model)`: to_q/to_k/to_v/to_out,
no mask, no dropout, returns output alone. The tests compare our module against these, so they are
written from those references, not from export/attention.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F


class Seed000MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int = 512, n_heads: int = 8, dropout: float = 0.1):
        super().__init__()
        assert d_model % n_heads == 0
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_key = d_model // n_heads
        self.Wq = nn.Linear(d_model, d_model)
        self.Wk = nn.Linear(d_model, d_model)
        self.Wv = nn.Linear(d_model, d_model)
        self.Wo = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Tensor | None = None):
        batch_size = key.size(0)
        Q = self.Wq(query)
        K = self.Wk(key)
        V = self.Wv(value)
        Q = Q.view(batch_size, -1, self.n_heads, self.d_key).permute(0, 2, 1, 3)
        K = K.view(batch_size, -1, self.n_heads, self.d_key).permute(0, 2, 1, 3)
        V = V.view(batch_size, -1, self.n_heads, self.d_key).permute(0, 2, 1, 3)
        scaled_dot_prod = torch.matmul(Q, K.permute(0, 1, 3, 2)) / math.sqrt(self.d_key)
        if mask is not None:
            scaled_dot_prod = scaled_dot_prod.masked_fill(mask == 0, -1e10)
        attn_probs = torch.softmax(scaled_dot_prod, dim=-1)
        A = torch.matmul(self.dropout(attn_probs), V)
        A = A.permute(0, 2, 1, 3).contiguous()
        A = A.view(batch_size, -1, self.n_heads * self.d_key)
        output = self.Wo(A)
        return output, attn_probs


class Seed002Multiheadattention(nn.Module):
    def __init__(self, input_dim: int, heads: int, d_model: int):
        super().__init__()
        self.d_model = d_model
        self.head_dim = self.d_model // heads
        self.heads_num = heads
        self.input_dim = input_dim
        self.to_q = nn.Linear(self.input_dim, self.d_model)
        self.to_k = nn.Linear(self.input_dim, self.d_model)
        self.to_v = nn.Linear(self.input_dim, self.d_model)
        self.to_out = nn.Linear(self.d_model, self.input_dim)

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        bs = q.shape[0]
        q = self.to_q(q).view(bs, -1, self.heads_num, self.head_dim).transpose(1, 2)
        k = self.to_k(k).view(bs, -1, self.heads_num, self.head_dim).transpose(1, 2)
        v = self.to_v(v).view(bs, -1, self.heads_num, self.head_dim).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.head_dim)
        scores = F.softmax(scores, dim=-1)
        out = torch.matmul(scores, v)
        out = out.transpose(1, 2).contiguous().view(bs, -1, self.d_model)
        out = self.to_out(out)
        return out


def trained_like_(module: nn.Module, seed: int, gain: float = 1.5) -> nn.Module:
    """Overwrite every parameter with seeded noise unlike nn.Linear's init: weights with
    std gain/sqrt(fan_in) (projections of std ~gain, so the softmax is peaked, not near uniform)
    and clearly nonzero biases, so a swapped or dropped projection changes the output visibly."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            std = gain / math.sqrt(param.shape[1]) if param.dim() == 2 else 0.1
            param.copy_(torch.randn(param.shape, generator=generator) * std)
    return module


def served_references(eager_modules: dict[str, nn.Module]) -> dict[str, nn.Module]:
    """What served answers are checked against: seed 000's own class carrying the served
    self_attention weights, and our cross_attention module (seed 002's math, tested elsewhere)."""
    ours = eager_modules["self_attention"]
    seed = Seed000MultiHeadAttention(d_model=512, n_heads=8, dropout=0.1)
    names = {"to_q": "Wq", "to_k": "Wk", "to_v": "Wv", "to_out": "Wo"}
    seed.load_state_dict({f"{names[k.split('.')[0]]}.{k.split('.')[1]}": v for k, v in ours.state_dict().items()})
    return {"self_attention": seed.eval(), "cross_attention": eager_modules["cross_attention"]}

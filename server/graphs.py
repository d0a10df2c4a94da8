"""Which of a version's graphs runs a batch, and how many attention scores that run holds.

A leaf (the contract only): the engine runs what `GraphSet.graph_for` chooses, the codec bounds a
request by what that graph holds (`scores_held`), and the batcher bounds a merged batch the same
way, so the three always agree. Nothing here imports ONNX Runtime or numpy.

Each run's inputs are masked in one of four ways (what the batcher's merge feeds):
    NO_MASK      query, key, value: every key attended
    KEY_PADDING  + key_padding_mask (B, Lk) int32: the same keys masked for every query row (a
                 request's mask whose rows are all alike, and the keys padding adds in a batch),
                 at least one key attended per row
    GENERAL      + mask (B, Lq, Lk) bool: anything else, fully masked rows included (the key
                 padding kernel adds -1e10 to a masked score instead of replacing it, so a fully
                 masked row is the seeds' uniform distribution only while every |score| < 512)
The graph, per run:
    attn_probs wanted                       -> all_outputs (model.onnx)
    NO_MASK, fused graph, long enough       -> fused (flash attention: no score matrix at all)
    KEY_PADDING, fused graph, long enough   -> fused_key_padding
    otherwise                               -> output_only (model_output_only.onnx)
"Long enough" is sqrt(Lq * Lk) >= the crossover length export measured (config.json), below
which the unfused graph was the faster one. A version without the fused graphs (an older export,
fp16) runs the unfused graphs exactly as before; one without the head-mask graphs cannot run HEADS
(`takes_head_masks`: the codec refuses such a request, naming the masks it takes).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from attnserve.contract import (
    ALL_OUTPUTS,
    FUSED,
    FUSED_KEY_PADDING,
    HEAD_MASK,
    HEAD_MASK_ALL_OUTPUTS,
    HEAD_MASK_KINDS,
    HEAD_MASK_OUTPUT_ONLY,
    KEY_PADDING_MASK,
    OUTPUT_ONLY,
)

NO_MASK, KEY_PADDING, GENERAL, HEADS = "none", "key_padding", "general", "heads"
MASKINGS = (NO_MASK, KEY_PADDING, GENERAL, HEADS)
# The fused graph each masking may run on.
_FUSED_FOR = {NO_MASK: FUSED, KEY_PADDING: FUSED_KEY_PADDING}
BYTES_PER_SCORE = 4  # fp32


def masking_of(feeds: Mapping[str, object]) -> str:
    """The masking of a run's feeds: a head_mask (B, H, Lq, Lk), a mask (B, Lq, Lk), a
    key_padding_mask (B, Lk), or none of them."""
    if HEAD_MASK in feeds:
        return HEADS
    if "mask" in feeds:
        return GENERAL
    if KEY_PADDING_MASK in feeds:
        return KEY_PADDING
    return NO_MASK


@dataclass(frozen=True)
class GraphSet:
    """The graphs a loaded version can run (all_outputs always) and the fused ones' crossovers.
    GraphSet() is a version without fused graphs (an older export, fp16, or a run_batch handed to
    the server without an Engine): every run holds its whole matrix."""

    kinds: frozenset[str] = frozenset({ALL_OUTPUTS, OUTPUT_ONLY})
    # fused kind -> the sqrt(Lq * Lk) from which it runs; a fused kind without one runs at every length
    crossover: Mapping[str, int] = field(default_factory=dict)

    def graph_for(self, masking: str, want_probs: bool, q_len: int, k_len: int) -> str:
        if masking not in MASKINGS:
            raise ValueError(f"masking must be one of {MASKINGS}, got {masking!r}")
        if masking == HEADS:
            if not self.takes_head_masks:
                raise ValueError("this version has no head-mask graphs (model_head_mask*.onnx): it cannot run a "
                                 "mask whose heads differ")
            return HEAD_MASK_ALL_OUTPUTS if want_probs else HEAD_MASK_OUTPUT_ONLY
        if want_probs:
            return ALL_OUTPUTS
        fused = _FUSED_FOR.get(masking)
        if fused in self.kinds and q_len * k_len >= self.crossover.get(fused, 0) ** 2:
            return fused
        return OUTPUT_ONLY if OUTPUT_ONLY in self.kinds else ALL_OUTPUTS

    @property
    def takes_head_masks(self) -> bool:
        """Whether a (B, H, Lq, Lk) mask whose heads differ can run (both head-mask graphs loaded)."""
        return all(kind in self.kinds for kind in HEAD_MASK_KINDS)

    def scores_held(self, rows: int, q_len: int, k_len: int, masking: str, want_probs: bool) -> int:
        """Attention scores per head that the run of (rows, Lq, Lk, masking, want_probs) holds at
        once, on the graph it takes: what the attention bound (one request in the codec, a merged
        batch in the batcher) counts, and what a memory estimate should count."""
        return scores_held(self.graph_for(masking, want_probs, q_len, k_len), rows, q_len, k_len)


UNFUSED = GraphSet()


def scores_held(kind: str, rows: int, q_len: int, k_len: int) -> int:
    """The one rule of what graph `kind` holds, per head: no scores on the flash path (ORT's
    MultiHeadAttention without a mask tiles them), all rows x Lq x Lk on every other graph (the
    key padding kernel, too, materializes its (B, H, Lq, Lk) probabilities)."""
    return 0 if kind == FUSED else rows * q_len * k_len


def attention_bytes(kind: str, batch: int, num_heads: int, q_len: int, k_len: int) -> int:
    """The B*H*Lq*Lk*4 bytes of scores graph `kind` holds for this request (0: flash attention)."""
    return scores_held(kind, batch, q_len, k_len) * num_heads * BYTES_PER_SCORE

// What a request's mask asks of a run, and which graph a run takes: the checks (request.cc) and
// the batch formation (batcher.cc) agree through these.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "types.h"

namespace attnserve {

// What a request's mask asks of the run (server.graphs' maskings, as tensors.Work finds them).
enum class Masking { kNone, kKeyPadding, kGeneral, kHeads };
// The graphs that hold an attention matrix, in codec.NATIVE_HELD_ORDER; kFused holds none.
enum Held : size_t { kHeadMaskAll = 0, kHeadMaskOutput, kAllOutputs, kOutputOnly, kFusedKeyPadding, kFused };

// server.graphs.GraphSet.graph_for: the graph a request alone runs on.
inline Held GraphFor(const ModelLimits::Graphs& g, Masking masking, bool want_probs, int64_t q_len, int64_t k_len) {
  if (masking == Masking::kHeads) return want_probs ? kHeadMaskAll : kHeadMaskOutput;
  if (want_probs) return kAllOutputs;
  const int64_t from = masking == Masking::kNone ? g.fused_from
                       : masking == Masking::kKeyPadding ? g.fused_key_padding_from : -1;
  if (from >= 0 && q_len * k_len >= from * from) return masking == Masking::kNone ? kFused : kFusedKeyPadding;
  return g.output_only ? kOutputOnly : kAllOutputs;
}

// tensors.Work's masking of a mask whose heads are alike (head 0 read): a fully masked row, or
// rows that differ, need the whole mask; rows alike that mask some key are key padding.
inline Masking MaskingOf(const uint8_t* mask, int64_t items, int64_t item_stride, int64_t q_len, int64_t k_len,
                         bool exact_k_len) {
  if (exact_k_len) return Masking::kGeneral;
  bool attends_all = true;
  for (int64_t item = 0; item < items; ++item) {
    const uint8_t* first = mask + item * item_stride;
    for (int64_t i = 1; i < q_len; ++i) {
      if (std::memcmp(first, first + i * k_len, static_cast<size_t>(k_len)) != 0) return Masking::kGeneral;
    }
    attends_all = attends_all && std::find(first, first + k_len, uint8_t{0}) == first + k_len;
  }
  return attends_all ? Masking::kNone : Masking::kKeyPadding;
}

// A queued request's masking (tensors.Work.masking), from what Parse kept of its mask.
inline Masking MaskingOf(const Pending& p) {
  if (p.heads_differ) return Masking::kHeads;
  if (p.mask != nullptr) return p.key_padding ? Masking::kKeyPadding : Masking::kGeneral;
  return Masking::kNone;
}

// tensors.batch_masking: the masking a merged run needs, KEY_PADDING once keys are padded.
inline Masking Merged(Masking a, Masking b, bool same_k_len) {
  if (a == Masking::kHeads || b == Masking::kHeads) return Masking::kHeads;
  if (a == Masking::kGeneral || b == Masking::kGeneral) return Masking::kGeneral;
  if (a == Masking::kKeyPadding || b == Masking::kKeyPadding || !same_k_len) return Masking::kKeyPadding;
  return Masking::kNone;
}

// graphs.scores_held: the scores per head a run holds on graph `g` (none on the flash path).
inline int64_t ScoresHeld(Held g, int64_t rows, int64_t q_len, int64_t k_len) { return g == kFused ? 0 : rows * q_len * k_len; }

}  // namespace attnserve

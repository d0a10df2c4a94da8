// The runner's side of the core (core.h): a batch formed in service order within its bounds, its
// requests merged and padded into the run's inputs, then its answers split out and settled.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>

#include "answer.h"
#include "core.h"
#include "masking.h"
#include "text.h"

namespace attnserve {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

std::unique_ptr<Batch> Core::Form(size_t index, Queue& queue) {
  const ModelLimits& m = queue.limits;
  auto batch = std::make_unique<Batch>();
  batch->model = index;
  int64_t useful = 0, exact_k = -1;
  // server.batcher's bounds on a merged run: its scores within the attention bound (per head), a
  // batch on the flash path stays on it, and its run's memory beyond its requests' own fits now.
  const int64_t max_scores = std::max<int64_t>(m.max_attention_bytes / (4 * std::max<int64_t>(m.num_heads, 1)), 1);
  const int64_t extra_free = budget_ ? budget_->Free() : 0;
  Masking masking = Masking::kNone;
  bool same_k_len = true;
  int64_t held = 0, shares = 0;
  // Service order (server.scheduling.PriorityQueue): by aged level, then arrival; one level: arrival.
  const size_t n = queue.pending.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  const bool one_level = std::all_of(queue.pending.begin(), queue.pending.end(),
                                     [&](const Pending& p) { return p.priority == queue.pending.front().priority; });
  if (!one_level) {
    std::vector<uint64_t> level(n);
    for (size_t i = 0; i < n; ++i) {  // one level better per aging_batches_ batches that passed it over
      const uint64_t gained = (queue.formed - queue.pending[i].since) / aging_batches_;
      level[i] = queue.pending[i].priority > gained + 1 ? queue.pending[i].priority - gained : 1;
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return level[a] < level[b]; });
  }
  std::vector<char> taken(n, 0);
  const auto now = Clock::now();
  for (size_t i : order) {
    Pending& p = queue.pending[i];
    if (p.deadline <= now) {  // expired, its timer not yet run: refused by NextBatch
      queue.expired.push_back(std::move(p));
      taken[i] = 1;
      continue;
    }
    if (!batch->items.empty()) {
      const int64_t rows = batch->rows + p.rows;
      const int64_t q = std::max(batch->q_len, p.q_len), k = std::max(batch->k_len, p.k_len);
      const double padded = 1.0 - static_cast<double>(useful + p.rows * p.q_len * p.k_len) /
                                      (static_cast<double>(rows) * q * k);
      const bool same_k = same_k_len && batch->k_len == p.k_len;
      const Masking merged = Merged(masking, MaskingOf(p), same_k);
      const bool probs = batch->want_probs || p.want_probs;
      const int64_t merged_held = ScoresHeld(GraphFor(m.graphs, merged, probs, q, k), rows, q, k);
      const bool fits = rows <= m.max_batch_size && padded <= m.max_padding_ratio && (exact_k < 0 || exact_k == k) &&
                        (!p.exact_k_len || p.k_len == k) && merged_held <= max_scores && (held > 0 || merged_held == 0) &&
                        (!budget_ || CostOf(queue, rows, q, k, 0, probs, merged == Masking::kHeads)[1] - shares -
                                             p.run_share <= extra_free);
      if (!fits) continue;
      masking = merged;
      same_k_len = same_k;
      held = merged_held;
    } else {
      masking = MaskingOf(p);
      held = ScoresHeld(GraphFor(m.graphs, masking, p.want_probs, p.q_len, p.k_len), p.rows, p.q_len, p.k_len);
    }
    shares += p.run_share;
    taken[i] = 1;
    batch->first_row.push_back(batch->rows);
    batch->rows += p.rows;
    batch->q_len = std::max(batch->q_len, p.q_len);
    batch->k_len = std::max(batch->k_len, p.k_len);
    useful += p.rows * p.q_len * p.k_len;
    if (p.exact_k_len) exact_k = p.k_len;
    batch->want_probs = batch->want_probs || p.want_probs;
    if (p.heads_differ) batch->mask_heads = m.num_heads;
    batch->items.push_back(std::move(p));
  }
  std::deque<Pending> kept;  // in arrival order still
  queue.queued_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    if (taken[i]) continue;
    queue.queued_bytes += queue.pending[i].input_bytes;
    kept.push_back(std::move(queue.pending[i]));
  }
  queue.pending.swap(kept);
  if (batch->items.empty()) return batch;  // every one had expired
  if (budget_ && batch->items.size() > 1) {  // the merged run's memory beyond its requests' own (fits: checked above)
    const int64_t needed = CostOf(queue, batch->rows, batch->q_len, batch->k_len, 0, batch->want_probs,
                                  masking == Masking::kHeads)[1] - shares;
    if (needed > 0 && budget_->TryTake(needed)) batch->extra = needed;
  }
  batch->padding_ratio = 1.0 - static_cast<double>(useful) / (static_cast<double>(batch->rows) * batch->q_len * batch->k_len);
  queue.formed++;
  batch->cancelled.assign(batch->items.size(), 0);
  queue.running.push_back(batch.get());
  return batch;
}

void Core::WaitForCompany(Queue& queue, std::unique_lock<std::mutex>& lock) {
  const ModelLimits& m = queue.limits;
  if (m.max_queue_delay_us <= 0) return;
  // The oldest request (pending is in arrival order) sets the deadline; a lone call on an idle model
  // sees nobody coming and goes at once.
  const TimePoint deadline = queue.pending.front().arrived + std::chrono::microseconds(m.max_queue_delay_us);
  while (!stopping_ && !queue.retired && !queue.pending.empty() && Clock::now() < deadline) {
    int64_t rows = 0;
    for (const auto& p : queue.pending) rows += p.rows;
    if (rows >= m.max_batch_size || (queue.running.empty() && Receiving() == 0)) return;
    queue.arrived.wait_until(lock, deadline);
  }
}

size_t Core::Queued(size_t index) {
  Queue& queue = At(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  return queue.pending.size();
}

namespace {

// One request's row into its batch row: `count` floats, then zeros up to the batch's `width` (padding).
void PadRow(float* to, const float* from, int64_t count, int64_t width) {
  std::memcpy(to, from, static_cast<size_t>(count) * 4);
  if (width > count) std::memset(to + count, 0, static_cast<size_t>(width - count) * 4);
}

}  // namespace

std::shared_ptr<Batch> Core::NextBatch(size_t index, int64_t timeout_ms) {
  Queue& queue = At(index);
  std::unique_ptr<Batch> batch;
  std::vector<Pending> expired;
  {
    std::unique_lock<std::mutex> lock(queue.mu);
    queue.arrived.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                           [&] { return stopping_ || queue.retired || !queue.pending.empty(); });
    if (stopping_ || queue.pending.empty()) return nullptr;
    WaitForCompany(queue, lock);
    if (stopping_ || queue.pending.empty()) return nullptr;
    batch = Form(index, queue);
    expired.swap(queue.expired);
  }
  for (auto& p : expired) {  // server.batcher's words, at batch formation
    Settle(p, &queue, Status(StatusCode::DEADLINE_EXCEEDED, "deadline passed after " +
                                 Seconds3(Clock::now() - p.arrived) + "s in the queue of model " +
                                 queue.limits.name + "; not computed"));
  }
  if (!expired.empty()) Left(static_cast<int64_t>(expired.size()));
  if (batch->items.empty()) return nullptr;
  const auto started = Clock::now();
  batch->id = ++batch_ids_;
  const ModelLimits& m = queue.limits;
  const int64_t rows = batch->rows, lq = batch->q_len, lk = batch->k_len;
  batch->query.resize(static_cast<size_t>(rows * lq * m.query_dim));  // uninitialized: every row written below
  batch->key.resize(static_cast<size_t>(rows * lk * m.kv_dim));
  batch->value.resize(static_cast<size_t>(rows * lk * m.kv_dim));
  // tensors.batch_masking: a head mask, else the whole mask if a request needs it (GENERAL), else a
  // key padding mask once a request has one or keys are padded.
  bool general = false, key_padding = false;
  for (const auto& p : batch->items) {
    general = general || (p.mask != nullptr && !p.key_padding);
    key_padding = key_padding || p.key_padding || p.k_len != lk;
  }
  const int64_t mh = batch->mask_heads;
  const bool need_mask = general || mh > 1;
  if (need_mask) {
    batch->mask.assign(static_cast<size_t>(rows * mh * lq * lk), 0);  // padding is masked
  } else if (key_padding) {
    batch->key_mask.assign(static_cast<size_t>(rows * lk), 0);  // padded keys are masked
  }
  for (size_t i = 0; i < batch->items.size(); ++i) {
    const Pending& p = batch->items[i];
    const int64_t r0 = batch->first_row[i];
    for (int64_t r = 0; r < p.rows; ++r) {
      PadRow(&batch->query[((r0 + r) * lq) * m.query_dim], p.query + r * p.q_len * m.query_dim,
             p.q_len * m.query_dim, lq * m.query_dim);
      PadRow(&batch->key[((r0 + r) * lk) * m.kv_dim], p.key + r * p.k_len * m.kv_dim, p.k_len * m.kv_dim,
             lk * m.kv_dim);
      PadRow(&batch->value[((r0 + r) * lk) * m.kv_dim], p.value + r * p.k_len * m.kv_dim, p.k_len * m.kv_dim,
             lk * m.kv_dim);
      if (!batch->key_mask.empty()) {  // the row's first query row says which keys it attends (all alike)
        int32_t* to = &batch->key_mask[(r0 + r) * lk];
        const uint8_t* from = p.mask != nullptr ? p.mask + r * p.mask_row_stride : nullptr;
        for (int64_t k = 0; k < p.k_len; ++k) to[k] = from != nullptr ? from[k] : 1;
      }
      if (!need_mask) continue;
      for (int64_t hh = 0; hh < mh; ++hh) {
        for (int64_t q = 0; q < p.q_len; ++q) {
          uint8_t* to = &batch->mask[(((r0 + r) * mh + hh) * lq + q) * lk];
          if (p.mask == nullptr) {
            std::memset(to, 1, static_cast<size_t>(p.k_len));
          } else {  // heads alike (head stride 0) read their first for every head
            std::memcpy(to, p.mask + r * p.mask_row_stride + hh * p.mask_head_stride + q * p.k_len,
                        static_cast<size_t>(p.k_len));
          }
        }
      }
    }
    const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(started - p.arrived).count();
    counters_.queue_ns += static_cast<uint64_t>(waited);
    batch->queue_s.push_back(static_cast<double>(waited) * 1e-9);
    if (p.note) {  // its record's queue wait and batch (the batch span links to it)
      p.note->queue_s = static_cast<double>(waited) * 1e-9;
      p.note->run_started = started;
      p.note->batch = batch->id;
    }
  }
  counters_.batches++;
  counters_.rows += static_cast<uint64_t>(rows);
  batch->formed = Clock::now();
  counters_.merge_ns += NanosSince(started);
  return batch;
}

void Core::GiveExtra(Batch& batch) {
  if (batch.extra > 0 && budget_) budget_->Give(batch.extra);
  batch.extra = 0;
}

void Core::Complete(Batch& batch, const float* output, const float* attn_probs) {
  if (batch.settled) return;
  batch.settled = true;
  GiveExtra(batch);
  Queue& queue = At(batch.model);
  {
    std::lock_guard<std::mutex> lock(queue.mu);
    batch.answering = true;  // a cancel from here on is the answered stage (Cancel)
  }
  auto started = Clock::now();
  counters_.python_ns += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(started - batch.formed).count());
  const ModelLimits& m = queue.limits;
  const int64_t lq = batch.q_len, lk = batch.k_len, h = m.num_heads, od = m.out_dim;
  std::vector<CallRecord> records;  // the batch's call records, handed over under one lock
  std::vector<CallRecord>* into = records_ ? &records : nullptr;
  for (size_t i = 0; i < batch.items.size(); ++i) {
    Pending& p = batch.items[i];
    const int64_t r0 = batch.first_row[i];
    if (Gone(batch, i, false)) {  // its client went away (counted then): nobody reads an answer
      if (batch.cancelled[i] != kLeft) Settle(p, &queue, Cancelled(), into);  // kLeft: Cancel answered it
      continue;
    }
    if (p.want_probs && attn_probs == nullptr) {
      Settle(p, &queue, Status(StatusCode::INTERNAL, "the run returned no attn_probs"), into);
      continue;
    }
    p.response->set_model_name(m.name);
    p.response->set_model_version(m.version);
    p.response->set_id(p.request->id());
    for (bool probs : p.order_probs) {
      if (probs) {
        const auto count = static_cast<size_t>(p.rows * h * p.q_len * p.k_len);
        OutputTo to(p.response, contract_.attn_probs, contract_.fp32, {p.rows, h, p.q_len, p.k_len}, p.raw, count);
        if (p.q_len == lq && p.k_len == lk) {  // unpadded: its rows are one block of the batch's
          to.Put(attn_probs + r0 * h * lq * lk, count);
        } else {
          for (int64_t r = 0; r < p.rows; ++r)
            for (int64_t hh = 0; hh < h; ++hh)
              for (int64_t q = 0; q < p.q_len; ++q)
                to.Put(attn_probs + (((r0 + r) * h + hh) * lq + q) * lk, static_cast<size_t>(p.k_len));
        }
      } else {
        const auto count = static_cast<size_t>(p.rows * p.q_len * od);
        OutputTo to(p.response, contract_.output, contract_.fp32, {p.rows, p.q_len, od}, p.raw, count);
        if (p.q_len == lq) {
          to.Put(output + r0 * lq * od, count);
        } else {
          for (int64_t r = 0; r < p.rows; ++r) to.Put(output + ((r0 + r) * lq) * od, static_cast<size_t>(p.q_len * od));
        }
      }
    }
    const auto finishing = Clock::now();
    counters_.split_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(finishing - started).count());
    batch.done_s.push_back(static_cast<double>(NanosSince(p.started)) * 1e-9);
    if (Gone(batch, i, true)) {  // went while its answer was encoded: the answered stage (Cancel counted it)
      batch.done_s.pop_back();
      Settle(p, &queue, Cancelled(), into);
      continue;
    }
    if (p.note) {  // merge, run and split, as this call saw its batch (the batcher's compute_s)
      p.note->run_ended = finishing;
      p.note->run_s = std::chrono::duration<double>(finishing - p.note->run_started).count();
      p.note->batch_requests = static_cast<int64_t>(batch.items.size());
    }
    Settle(p, &queue, Status::OK, into);  // its front may send the answer on this thread
    counters_.finish_ns += NanosSince(finishing);
    started = Clock::now();
  }
  if (into != nullptr) records_->Add(records);
  Unrun(batch);
  Left(static_cast<int64_t>(batch.items.size()));
}

bool Core::Gone(Batch& batch, size_t i, bool settle) {
  Queue& queue = At(batch.model);
  std::lock_guard<std::mutex> lock(queue.mu);
  if (batch.cancelled[i] == kGone || batch.cancelled[i] == kLeft) return true;
  if (settle) {
    batch.cancelled[i] = kSettled;  // a cancel from here on finds its call answered
    Pending& p = batch.items[i];
    if (p.answered_by != nullptr) p.answered_by->store(static_cast<int64_t>(batch.model));
  }
  return false;
}

void Core::Fail(Batch& batch, StatusCode code, const std::string& message) {
  if (batch.settled) return;
  batch.settled = true;
  GiveExtra(batch);
  Queue& queue = At(batch.model);
  const std::vector<char> cancelled = Unrun(batch);  // a stopped run ends here: all cancelled
  std::vector<CallRecord> records;
  std::vector<CallRecord>* into = records_ ? &records : nullptr;
  for (size_t i = 0; i < batch.items.size(); ++i) {
    if (cancelled[i] == kLeft) continue;  // answered CANCELLED by Cancel already
    Settle(batch.items[i], &queue, cancelled[i] ? Cancelled() : Status(code, message), into);
  }
  if (into != nullptr) records_->Add(records);
  Left(static_cast<int64_t>(batch.items.size()));
}

}  // namespace attnserve

// The memory budget's part in admission (core.h): what a request costs, its reservation taken now
// or waited for in the budget's one arrival order, and the wake that queues a parked call.
#include <algorithm>

#include "core.h"
#include "text.h"

namespace attnserve {

void Core::SetBudget(std::shared_ptr<SharedBudget> budget, const CostTerms& terms, double stream_share) {
  if (budget_) budget_->SetNativeWake(nullptr);
  budget_ = std::move(budget);
  if (budget_) budget_->SetNativeWake([this](int64_t ticket) { Granted(ticket); });
  cost_terms_ = terms;
  stream_share_bytes_ = budget_ ? static_cast<int64_t>(static_cast<double>(budget_->limit()) * stream_share) : 0;
}

std::array<int64_t, 3> Core::Cost(size_t index, int64_t rows, int64_t q_len, int64_t k_len, int64_t input_bytes,
                                   bool want_probs, bool heads_differ) const {
  return CostOf(*models_.at(index), rows, q_len, k_len, input_bytes, want_probs, heads_differ);
}

std::array<int64_t, 3> Core::CostOf(const Queue& queue, int64_t rows, int64_t q_len, int64_t k_len,
                                     int64_t input_bytes, bool want_probs, bool heads_differ) const {
  // costs.request_cost on the graph the engine takes for the batch: attn_probs asked -> all outputs;
  // heads differ -> the head-mask graphs; else output only (the fused graphs are given its figure).
  const ModelLimits& m = queue.limits;
  const CostTerms& t = cost_terms_;
  const int64_t d = queue.bounds.d_model > 0 ? queue.bounds.d_model : std::max({m.query_dim, m.kv_dim, m.out_dim});
  const int64_t mask_heads = heads_differ ? m.num_heads : 1;
  const int64_t scores = 4 * rows * m.num_heads * q_len * k_len;
  const int64_t mask = rows * mask_heads * q_len * k_len;
  const int64_t inputs = 4 * rows * (q_len * m.query_dim + 2 * k_len * m.kv_dim);
  const int64_t projections = 4 * rows * (q_len + 2 * k_len) * d;
  const int64_t outputs = 4 * rows * q_len * (d + m.out_dim);
  double working = t.scores * static_cast<double>(scores) + t.mask * static_cast<double>(mask) +
                   static_cast<double>(inputs) + static_cast<double>(projections) + static_cast<double>(outputs);
  if (want_probs) working += t.probs * static_cast<double>(scores);
  const int64_t run = static_cast<int64_t>(t.safety * working) +
                      (working >= static_cast<double>(t.slack_from_bytes) ? t.slack_bytes : 0);
  const int64_t answer = 4 * rows * q_len * m.out_dim + (want_probs ? scores : 0);
  return {t.input_copies * input_bytes, run, t.answer_copies * answer};
}

Status Core::Reserve(Queue& queue, Pending& p, bool* parked) {
  if (!budget_ || p.held == nullptr) return Status::OK;
  const auto cost = CostOf(queue, p.rows, p.q_len, p.k_len, p.input_bytes, p.want_probs, p.heads_differ);
  const int64_t total = cost[0] + cost[1] + cost[2];
  p.run_share = cost[1];
  // The batcher's words (server.batcher.Batcher.submit, memory.budget.MemoryBudget.reserve).
  const std::string what = "model " + queue.limits.name + ": this request (inputs " + Commas(cost[0]) + ", run " +
                           Commas(cost[1]) + ", answer " + Commas(cost[2]) + " bytes)";
  SharedBudget& budget = *budget_;
  if (total > budget.limit()) {
    budget.native_too_large++;
    return Invalid(what + " needs an estimated " + Commas(total) + " bytes of memory, over this server's budget of " +
                   Commas(budget.limit()) + " bytes (--memory-limit-bytes); send fewer rows or shorter sequences, " +
                   "or ask for `output` alone");
  }
  // A call with a deadline waits for room within it, in the one arrival order of both planes' waiters.
  const bool can_wait = p.deadline != kNever;
  const TimePoint deadline = p.deadline;
  int64_t ticket = 0;
  {
    std::lock_guard<std::mutex> lock(parked_mu_);  // a grant finds it parked: Granted takes parked_mu_
    ticket = budget.Take(total, cost[0], can_wait, true);
    if (ticket > 0) {
      budget.native_waits++;
      in_flight_++;
      parked_.emplace(ticket, Parked{std::move(p), &queue, total});
    }
  }
  if (ticket > 0) {
    *parked = true;
    Arm(deadline);
    return Status::OK;
  }
  if (ticket < 0) {
    budget.native_shed++;
    return Status(StatusCode::RESOURCE_EXHAUSTED,
                  "memory budget: " + Commas(budget.reserved() + budget.waiting()) + " of " + Commas(budget.limit()) +
                      " bytes in use (--memory-limit-bytes), " + std::to_string(budget.waiters()) +
                      " request(s) waiting; " + what + " needs " + Commas(total) + "; retry later" +
                      (can_wait ? "" : " (a request with a deadline waits within it)"));
  }
  *p.held = total;
  return Status::OK;
}

void Core::Granted(int64_t ticket) {
  Parked parked;
  bool retired = false;
  Status refusal;
  {
    std::lock_guard<std::mutex> lock(parked_mu_);  // held while it queues: a Cancel finds it parked or queued
    auto found = parked_.find(ticket);
    if (found == parked_.end()) return;  // cancelled, expired or stopped: whoever took it gives its bytes back
    parked = std::move(found->second);
    parked_.erase(found);
    *parked.p.held = parked.total;
    if (Enqueue(*parked.queue, parked.p, true, &retired, &refusal)) return;
  }
  GiveBack(parked.p);
  Left(1);
  if (retired) {  // a swap while it waited: admitted afresh on the version served now
    Admit(std::move(parked.p), true);
    return;
  }
  counters_.refused++;
  Settle(parked.p, parked.queue, refusal);
}

}  // namespace attnserve

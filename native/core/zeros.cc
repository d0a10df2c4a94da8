// The native floor (core.h, SetZeros): calls answered with zeros of the right shapes, no Python,
// to measure what the data plane costs without a model.
#include "answer.h"
#include "core.h"

namespace attnserve {

void Core::SetZerosHandoff() {
  if (handoff_thread_.joinable()) return;
  handoff_thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(handoff_mu_);
    for (;;) {
      handoff_cv_.wait(lock, [this] { return handoff_stop_ || !handoff_.empty(); });
      if (handoff_.empty()) return;  // stopping, and every call answered
      Handoff next = std::move(handoff_.front());
      handoff_.pop_front();
      lock.unlock();
      counters_.handed_off++;  // before its answer, which its client may read before this thread goes on
      AnswerZeros(next.p, *next.queue);
      lock.lock();
    }
  });
}

void Core::StopHandoff() {
  if (!handoff_thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(handoff_mu_);
    handoff_stop_ = true;
  }
  handoff_cv_.notify_one();
  handoff_thread_.join();
}

void Core::AnswerZeros(Pending& p, Queue& queue) {
  const ModelLimits& m = queue.limits;
  p.response->set_model_name(m.name);
  p.response->set_model_version(m.version);
  p.response->set_id(p.request->id());
  for (bool probs : p.order_probs) {
    const size_t count = static_cast<size_t>(probs ? p.rows * m.num_heads * p.q_len * p.k_len
                                                   : p.rows * p.q_len * m.out_dim);
    if (probs) {
      OutputTo(p.response, contract_.attn_probs, contract_.fp32, {p.rows, m.num_heads, p.q_len, p.k_len}, p.raw,
               count).Zeros(count);
    } else {
      OutputTo(p.response, contract_.output, contract_.fp32, {p.rows, p.q_len, m.out_dim}, p.raw, count).Zeros(count);
    }
  }
  Settle(p, &queue, Status::OK);
}

}  // namespace attnserve

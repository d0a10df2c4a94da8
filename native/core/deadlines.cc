// Deadlines (core.h): one timer thread refuses a queued or parked call once its deadline passes,
// and hands a stale receive slot on.
#include <algorithm>
#include <chrono>

#include "core.h"
#include "text.h"

namespace attnserve {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

void Core::StartTimer() {
  if (!timer_.joinable()) timer_ = std::thread([this] { Reap(); });
}

void Core::Arm(TimePoint deadline) {
  {
    std::lock_guard<std::mutex> lock(timer_mu_);
    if (deadline >= next_expiry_) return;  // the timer wakes by then already
    next_expiry_ = deadline;
  }
  timer_cv_.notify_one();
}

void Core::Reap() {
  std::unique_lock<std::mutex> lock(timer_mu_);
  while (!timer_stop_) {
    if (next_expiry_ == kNever) {
      timer_cv_.wait(lock);
    } else {
      timer_cv_.wait_until(lock, next_expiry_);
    }
    if (timer_stop_ || next_expiry_ == kNever || Clock::now() < next_expiry_) continue;
    next_expiry_ = kNever;  // what is admitted meanwhile arms it again
    lock.unlock();
    const TimePoint next = Expire();
    lock.lock();
    next_expiry_ = std::min(next_expiry_, next);
  }
}

TimePoint Core::Expire() {
  TimePoint next = kNever;
  for (auto& owned : models_) {
    Queue& queue = *owned;
    std::vector<Pending> expired;
    size_t still = 0;
    {
      std::lock_guard<std::mutex> lock(queue.mu);
      const auto now = Clock::now();
      for (auto it = queue.pending.begin(); it != queue.pending.end();) {
        if (it->deadline <= now) {
          queue.queued_bytes -= it->input_bytes;
          expired.push_back(std::move(*it));
          it = queue.pending.erase(it);
        } else {
          next = std::min(next, it->deadline);
          ++it;
        }
      }
      still = queue.pending.size();
    }
    for (auto& p : expired) {  // server.batcher's words, for its queue's timer
      Settle(p, &queue, Status(StatusCode::DEADLINE_EXCEEDED, "deadline passed after " +
                                   Seconds3(Clock::now() - p.arrived) + "s in the queue of model " + queue.limits.name +
                                   " (" + std::to_string(still) + " requests still queued); not computed"));
    }
    if (!expired.empty()) Left(static_cast<int64_t>(expired.size()));
  }
  // Calls waiting for memory past their deadline leave the budget's queue (server.batcher's words).
  std::vector<std::pair<int64_t, Parked>> late;
  {
    std::lock_guard<std::mutex> lock(parked_mu_);
    const auto now = Clock::now();
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (it->second.p.deadline <= now) {
        late.emplace_back(it->first, std::move(it->second));
        it = parked_.erase(it);
      } else {
        next = std::min(next, it->second.p.deadline);
        ++it;
      }
    }
  }
  for (auto& [ticket, parked] : late) {
    if (budget_->Leave(ticket)) {
      budget_->native_wait_timeouts++;
    } else {
      budget_->Give(parked.total);  // granted just as it expired
    }
    counters_.refused++;
    Settle(parked.p, parked.queue, Status(StatusCode::DEADLINE_EXCEEDED,
                                          "model " + parked.queue->limits.name +
                                              ": deadline passed while waiting for memory (" + Commas(parked.total) +
                                              " bytes); not computed"));
  }
  if (!late.empty()) Left(static_cast<int64_t>(late.size()));
  return std::min(next, ExpireReceiveSlots());
}

void Core::StopTimer() {
  {
    std::lock_guard<std::mutex> lock(timer_mu_);
    timer_stop_ = true;
  }
  timer_cv_.notify_all();
  if (timer_.joinable() && timer_.get_id() != std::this_thread::get_id()) timer_.join();
}

}  // namespace attnserve

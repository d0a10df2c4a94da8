// Admission (core.h): a checked call is refused, queued, or parked for memory; the drain, the
// arriving calls and the receive slots that bound the messages being received.
#include <algorithm>
#include <chrono>

#include "core.h"
#include "text.h"

namespace attnserve {

namespace {

using Clock = std::chrono::steady_clock;

}  // namespace

void Core::GiveBack(Pending& p) {
  if (p.held != nullptr && *p.held > 0) {  // never queued: its reservation goes back now
    budget_->Give(*p.held);
    *p.held = 0;
  }
}

void Core::Admit(Pending p, bool again) {
  const auto started = again ? p.started : Clock::now();
  const inference::ModelInferRequest& request = *p.request;
  if (!again) counters_.requests++;
  // A queue retired between the lookup and the queueing (a swap) sends the call to the new one.
  for (int attempt = 0;; ++attempt) {
    Queue* known = nullptr;
    Codes* codes = nullptr;
    Status status;
    {
      std::shared_lock<std::shared_mutex> routes(routes_mu_);
      status = Find(request, &known, &codes);
    }
    if (refusing_ && !p.admitted_early) {  // draining: never computed, retry elsewhere (the Python plane's words)
      counters_.refused++;
      Settle(p, codes, ShuttingDown());
      return;
    }
    if (!status.ok()) {
      counters_.refused++;
      Settle(p, codes, status);
      return;
    }
    Queue& queue = *known;
    Pending fresh;  // a retry checks afresh
    fresh.reply = p.reply;
    fresh.streamed = p.streamed;
    fresh.seq = p.seq;
    fresh.request = p.request;
    fresh.response = p.response;
    fresh.deadline = p.deadline;
    fresh.held = p.held;
    fresh.answered_by = p.answered_by;
    fresh.note = p.note;
    fresh.admitted_early = p.admitted_early;
    p = std::move(fresh);
    p.started = started;
    status = Check(queue, request, p);
    if (status.ok() && !zeros_) {  // the queue's bounds before memory, as server.batcher.Batcher.submit
      std::lock_guard<std::mutex> lock(queue.mu);
      status = QueueBounds(queue, p);
    }
    bool parked = false;
    if (status.ok() && !zeros_) status = Reserve(queue, p, &parked);
    if (parked) {  // waits for memory; Granted queues it
      counters_.check_ns += NanosSince(started);
      return;
    }
    if (!status.ok()) {
      counters_.refused++;
      Settle(p, &queue, status);
      return;
    }
    counters_.check_ns += NanosSince(started);
    if (zeros_) {
      p.arrived = Clock::now();
      if (handoff_thread_.joinable()) {
        {
          std::lock_guard<std::mutex> lock(handoff_mu_);
          handoff_.push_back({std::move(p), &queue});
        }
        handoff_cv_.notify_one();
        return;
      }
      AnswerZeros(p, queue);
      return;
    }
    bool retired = false;
    if (Enqueue(queue, p, false, &retired, &status)) return;
    GiveBack(p);  // the next queue reserves afresh
    if (retired && attempt < 8) continue;
    counters_.refused++;
    Settle(p, &queue, retired ? Status(StatusCode::UNAVAILABLE, "model " + queue.limits.name +
                                                                    " is changing versions; retry")
                              : status);
    return;
  }
}

bool Core::Enqueue(Queue& queue, Pending& p, bool granted, bool* retired, Status* refusal) {
  TimePoint deadline = kNever;
  {
    std::lock_guard<std::mutex> lock(queue.mu);
    if (queue.retired) {
      *retired = true;
      return false;
    }
    if (stopping_) {  // Stop has refused the queues: nothing takes this one any more
      *refusal = NotStarted(queue.limits.name);
      return false;
    }
    if (!granted) {
      if (Status bounds = QueueBounds(queue, p); !bounds.ok()) {
        *refusal = bounds;
        return false;
      }
    }
    if (p.deadline <= Clock::now()) {  // server.batcher's words
      *refusal = Status(StatusCode::DEADLINE_EXCEEDED, "model " + queue.limits.name +
                                                           ": the request's deadline passed before it was queued; "
                                                           "not computed");
      return false;
    }
    p.arrived = Clock::now();
    if (p.note) {  // admitted: the span's "admitted" event and its shape
      p.note->admitted = p.arrived;
      p.note->rows = p.rows;
      p.note->q_len = p.q_len;
      p.note->k_len = p.k_len;
    }
    p.since = queue.formed;
    deadline = p.deadline;
    queue.queued_bytes += p.input_bytes;
    queue.pending.push_back(std::move(p));
    if (!granted) in_flight_++;
  }
  queue.arrived.notify_one();
  if (deadline != kNever) Arm(deadline);
  return true;
}

Status Core::QueueBounds(const Queue& queue, const Pending& p) const {
  const ModelLimits& m = queue.limits;
  if (static_cast<int64_t>(queue.pending.size()) >= m.max_queue_size) {  // server.batcher's words
    return Status(StatusCode::RESOURCE_EXHAUSTED, "model " + m.name + ": " + std::to_string(queue.pending.size()) +
                                                      " requests queued (max_queue_size " +
                                                      std::to_string(m.max_queue_size) + "); retry later");
  }
  const int64_t most = queue.bounds.max_queued_bytes;
  if (most > 0 && !queue.pending.empty() && queue.queued_bytes + p.input_bytes > most) {  // server.batcher's words
    return Status(StatusCode::RESOURCE_EXHAUSTED, "model " + m.name + ": " + Commas(queue.queued_bytes) +
                                                      " input bytes queued; this request's " + Commas(p.input_bytes) +
                                                      " would pass max_queued_bytes " + Commas(most) + "; retry later");
  }
  return Status::OK;
}

void Core::Left(int64_t calls) {
  if (in_flight_.fetch_sub(calls) != calls) return;
  { std::lock_guard<std::mutex> lock(idle_mu_); }  // a waiter between its check and its wait is woken
  idle_.notify_all();
}

bool Core::WaitIdle(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(idle_mu_);
  return idle_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                        [&] { return in_flight_ <= 0 && Arriving() == 0; });
}

int64_t Core::Arriving() const {
  const TimePoint since = Clock::now() - std::chrono::duration_cast<Clock::duration>(arrival_timeout_);
  std::lock_guard<std::mutex> lock(arriving_mu_);
  int64_t count = 0;
  for (const auto& [call, arrival] : arriving_) count += arrival.came >= since;
  return count;
}

int64_t Core::Receiving() const {
  const TimePoint since = Clock::now() - std::chrono::duration_cast<Clock::duration>(arrival_timeout_);
  std::lock_guard<std::mutex> lock(arriving_mu_);
  int64_t count = 0;
  for (const auto& [call, arrival] : arriving_) count += !arrival.claimed && arrival.came >= since;
  return count;
}

bool Core::Arrived(const void* call, std::function<void(const Status&)> refuse) {
  std::lock_guard<std::mutex> lock(arriving_mu_);  // ordered with Halt's sweep: a call is either swept or admitted
  arriving_.emplace(call, Arrival{Clock::now(), false, std::move(refuse)});
  return !refusing_;
}

bool Core::Claim(const void* call) {
  std::lock_guard<std::mutex> lock(arriving_mu_);
  auto found = arriving_.find(call);
  if (found == arriving_.end()) return false;  // Halt refused it
  found->second.claimed = true;
  return true;
}

void Core::ArrivalDone(const void* call) {
  {
    std::lock_guard<std::mutex> lock(arriving_mu_);
    if (arriving_.erase(call) == 0) return;
  }
  { std::lock_guard<std::mutex> lock(idle_mu_); }  // a waiter between its check and its wait is woken
  idle_.notify_all();
}

void Core::Halt() {
  stopping_ = true;
  refusing_ = true;
  ready_ = false;
  std::vector<Queue*> queues;
  {
    std::shared_lock<std::shared_mutex> lock(models_mu_);
    for (auto& queue : models_) queues.push_back(queue.get());
  }
  for (Queue* queue : queues) {
    std::deque<Pending> refused;
    {
      std::lock_guard<std::mutex> lock(queue->mu);
      refused.swap(queue->pending);
      queue->queued_bytes = 0;
    }
    queue->arrived.notify_all();
    for (auto& p : refused) Settle(p, queue, NotStarted(queue->limits.name));
    if (!refused.empty()) Left(static_cast<int64_t>(refused.size()));
  }
  std::map<int64_t, Parked> waiting;  // calls waiting for memory: refused the same way
  {
    std::lock_guard<std::mutex> lock(parked_mu_);
    waiting.swap(parked_);
  }
  for (auto& [ticket, parked] : waiting) {
    if (!budget_->Leave(ticket)) budget_->Give(parked.total);
    Settle(parked.p, parked.queue, NotStarted(parked.queue->limits.name));
  }
  if (!waiting.empty()) Left(static_cast<int64_t>(waiting.size()));
  // Headers in, message not: refused, as a second signal refuses what has not started.
  std::vector<std::function<void(const Status&)>> arriving;
  {
    std::lock_guard<std::mutex> lock(arriving_mu_);
    for (auto it = arriving_.begin(); it != arriving_.end();) {
      if (it->second.claimed) {
        ++it;
        continue;
      }
      arriving.push_back(std::move(it->second.refuse));
      it = arriving_.erase(it);
    }
  }
  for (auto& refuse : arriving) {
    const Status status = Bounded(ShuttingDown());
    Count(static_cast<Codes*>(nullptr), status);
    refuse(status);
  }
  if (!arriving.empty()) {
    { std::lock_guard<std::mutex> lock(idle_mu_); }  // a waiter between its check and its wait is woken
    idle_.notify_all();
  }
}

namespace {
// server.gate.ReceiveSlots.STALE_S: a call that sent headers and then nothing gives its slot up.
constexpr auto kReceiveStale = std::chrono::seconds(10);
}  // namespace

bool Core::TakeReceiveSlot(const void* call, std::function<void()> start) {
  TimePoint oldest = kNever;
  {
    std::lock_guard<std::mutex> lock(receive_mu_);
    if (receive_slots_ <= 0) return true;
    if (receive_waiting_.empty() && static_cast<int64_t>(receiving_.size()) < receive_slots_) {
      receiving_[call] = Clock::now();
      return true;
    }
    receive_waiting_.emplace_back(call, std::move(start));
    receive_deferred_++;
    for (const auto& [holder, since] : receiving_) oldest = std::min(oldest, since);
  }
  if (oldest != kNever) Arm(oldest + kReceiveStale);  // the timer starts the line if the holders go stale
  return false;
}

bool Core::GiveReceiveSlot(const void* call) {
  std::vector<std::function<void()>> starts;
  bool was_waiting = false;
  {
    std::lock_guard<std::mutex> lock(receive_mu_);
    if (receive_slots_ <= 0) return false;
    for (auto it = receive_waiting_.begin(); it != receive_waiting_.end(); ++it) {
      if (it->first == call) {
        receive_waiting_.erase(it);
        was_waiting = true;
        break;
      }
    }
    if (receiving_.erase(call) == 0) return was_waiting;
    const auto now = Clock::now();
    while (!receive_waiting_.empty() && static_cast<int64_t>(receiving_.size()) < receive_slots_) {
      receiving_[receive_waiting_.front().first] = now;
      starts.push_back(std::move(receive_waiting_.front().second));
      receive_waiting_.pop_front();
    }
  }
  for (auto& start : starts) start();
  return was_waiting;
}

TimePoint Core::ExpireReceiveSlots() {
  std::vector<std::function<void()>> starts;
  TimePoint next = kNever;
  {
    std::lock_guard<std::mutex> lock(receive_mu_);
    if (receive_waiting_.empty()) return kNever;
    const auto now = Clock::now();
    for (auto it = receiving_.begin(); it != receiving_.end();) {
      it = it->second + kReceiveStale <= now ? receiving_.erase(it) : std::next(it);
    }
    while (!receive_waiting_.empty() && static_cast<int64_t>(receiving_.size()) < receive_slots_) {
      receiving_[receive_waiting_.front().first] = now;
      starts.push_back(std::move(receive_waiting_.front().second));
      receive_waiting_.pop_front();
    }
    if (!receive_waiting_.empty()) {
      for (const auto& [holder, since] : receiving_) next = std::min(next, since + kReceiveStale);
    }
  }
  for (auto& start : starts) start();
  return next;
}

std::array<int64_t, 3> Core::ReceiveFigures() {
  std::lock_guard<std::mutex> lock(receive_mu_);
  return {receive_slots_, static_cast<int64_t>(receiving_.size()), receive_deferred_};
}

}  // namespace attnserve

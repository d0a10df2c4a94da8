// Cancellation (core.h): a call whose client went away leaves its queue at once, or its running
// batch, whose run is stopped once every call in it is gone; counted by reason and stage.
#include <algorithm>
#include <chrono>

#include "core.h"
#include "text.h"

namespace attnserve {

namespace {

using Clock = std::chrono::steady_clock;

// A gRPC client cancels at its own deadline, which runs out before the server's: a cancel this
// close to it counts as the deadline (server.request_path's _DEADLINE_SLACK_S).
constexpr auto kDeadlineSlack = std::chrono::milliseconds(500);
enum CancelReason : size_t { kClient = 0, kDeadline = 1, kDisconnect = 2 };
enum CancelStage : size_t { kQueued = 0, kRunning = 1, kTerminated = 2, kAnswered = 3 };

size_t ReasonOf(TimePoint call_deadline, bool disconnected = false) {
  if (call_deadline != kNever && Clock::now() >= call_deadline - kDeadlineSlack) return kDeadline;
  return disconnected ? kDisconnect : kClient;
}

}  // namespace

bool Core::Cancel(const Reply* reply, TimePoint call_deadline, bool disconnected) {
  const size_t reason = ReasonOf(call_deadline, disconnected);
  auto mine = [&](const Pending& p) { return p.reply == reply; };
  std::vector<std::pair<int64_t, Parked>> waiting;  // waiting for memory: they leave the budget's queue
  std::vector<std::pair<Queue*, std::vector<Pending>>> left;
  std::vector<std::function<void()>> stops;
  std::vector<std::pair<Queue*, Pending>> left_running;  // unary calls of running batches, answered now
  bool found = false;
  {
    // Held while it looks: a parked call that is granted meanwhile moves to its queue under it.
    std::lock_guard<std::mutex> parked(parked_mu_);
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (mine(it->second.p)) {
        it->second.queue->cancels[reason * kCancelStages + kQueued]++;
        waiting.emplace_back(it->first, std::move(it->second));
        it = parked_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& owned : models_) {
      Queue& queue = *owned;
      std::vector<Pending> out;
      std::lock_guard<std::mutex> lock(queue.mu);
      for (auto it = queue.pending.begin(); it != queue.pending.end();) {
        if (mine(*it)) {
          queue.queued_bytes -= it->input_bytes;
          out.push_back(std::move(*it));
          it = queue.pending.erase(it);
        } else {
          ++it;
        }
      }
      for (Batch* batch : queue.running) {
        for (size_t i = 0; i < batch->items.size(); ++i) {
          if (!mine(batch->items[i])) continue;
          if (batch->cancelled[i] == kSettled && !batch->items[i].streamed) {  // answered, not yet sent
            queue.cancels[reason * kCancelStages + kAnswered]++;
            found = true;
            continue;
          }
          if (batch->cancelled[i] != kLive) continue;
          batch->cancelled[i] = kGone;
          found = true;
          if (batch->answering) {  // handed back: its answer is being encoded (Complete settles it CANCELLED)
            queue.cancels[reason * kCancelStages + kAnswered]++;
            continue;
          }
          const bool all = std::all_of(batch->cancelled.begin(), batch->cancelled.end(), [](char c) { return c != 0; });
          // The last one out stops the run (once); until then the batch computes for the others.
          const bool stops_it = all && !batch->stopped;
          if (stops_it) {
            batch->stopped = true;
            if (batch->on_stop) stops.push_back(batch->on_stop);
          }
          queue.cancels[reason * kCancelStages + (stops_it ? kTerminated : kRunning)]++;
          if (!batch->items[i].streamed) {  // answered CANCELLED now, as the Python plane's handler is; Complete skips it
            batch->cancelled[i] = kLeft;
            left_running.emplace_back(&queue, batch->items[i]);
          }
        }
      }
      queue.cancels[reason * kCancelStages + kQueued] += out.size();
      if (!out.empty()) left.emplace_back(&queue, std::move(out));
    }
  }
  for (auto& [ticket, parked] : waiting) {  // no lock held: a leave may grant others
    if (!budget_->Leave(ticket)) budget_->Give(parked.total);  // granted just as it went
    Settle(parked.p, parked.queue, Cancelled());
  }
  int64_t gone = static_cast<int64_t>(waiting.size());
  for (auto& [queue, out] : left) {
    for (auto& p : out) Settle(p, queue, Cancelled());
    gone += static_cast<int64_t>(out.size());
  }
  if (gone > 0) Left(gone);
  for (auto& [queue, p] : left_running) Settle(p, queue, Cancelled());  // still in flight: its batch's end counts it
  for (auto& stop : stops) stop();  // no lock held: it may take the GIL
  return found || gone > 0;
}

void Core::CancelAnswered(size_t index, TimePoint call_deadline) {
  models_.at(index)->cancels[ReasonOf(call_deadline) * kCancelStages + kAnswered]++;
}

void Core::OnStop(Batch& batch, std::function<void()> stop) {
  Queue& queue = *models_.at(batch.model);
  {
    std::lock_guard<std::mutex> lock(queue.mu);
    if (!batch.stopped) {
      batch.on_stop = std::move(stop);
      return;
    }
  }
  stop();  // every call left before the runner registered it
}

std::vector<char> Core::Unrun(Batch& batch) {
  Queue& queue = *models_.at(batch.model);
  std::lock_guard<std::mutex> lock(queue.mu);
  auto& running = queue.running;
  running.erase(std::remove(running.begin(), running.end(), &batch), running.end());
  std::vector<char> cancelled = batch.cancelled;
  cancelled.resize(batch.items.size(), 0);
  return cancelled;
}

std::array<uint64_t, kCancelReasons * kCancelStages> Core::Cancellations(size_t index) const {
  const Cancels& cancels = models_.at(index)->cancels;
  std::array<uint64_t, kCancelReasons * kCancelStages> out{};
  for (size_t i = 0; i < out.size(); ++i) out[i] = cancels[i].load();
  return out;
}

}  // namespace attnserve

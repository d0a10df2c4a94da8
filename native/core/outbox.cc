// Calls submitted whole and answered in bulk (outbox.h).
#include "outbox.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include "text.h"

namespace attnserve {

// A submitted call: it owns its request and response until it is answered.
struct Outbox::Call final : public Reply {
  Outbox* box = nullptr;
  uint64_t ticket = 0;
  inference::ModelInferRequest request;
  std::unique_ptr<inference::ModelInferResponse> response = std::make_unique<inference::ModelInferResponse>();
  int64_t reserved = 0;
  TimePoint deadline = kNever;
  std::shared_ptr<CallNote> note;
  void Answered(uint64_t, const Status& status) override { box->Answered(this, status); }
};

Outbox::Outbox(Core* core) : core_(core), wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

Outbox::~Outbox() {
  if (wake_fd_ >= 0) close(wake_fd_);
}

uint64_t Outbox::Submit(const Chunks& message, TimePoint deadline, bool figures) {
  auto call = std::make_shared<Call>();
  call->box = this;
  call->deadline = deadline;
  if (figures) {
    call->note = std::make_shared<CallNote>();
    call->note->recorded = false;  // the front writes its own access line and span
    call->note->started = std::chrono::steady_clock::now();
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    call->ticket = next_ticket_++;
    calls_[call->ticket] = call;
  }
  std::string why;
  if (!core_->Parse(message, &call->request, &why)) {
    const Status status = Bounded(Invalid(why));
    core_->Unparsed(status, nullptr);
    Answered(call.get(), status);
    return call->ticket;
  }
  // The front's gate admitted it already (admitted_early): a drain that began since serves it.
  core_->Submit(call.get(), &call->request, call->response.get(), deadline,
                core_->budget() != nullptr ? &call->reserved : nullptr, nullptr, call->note,
                /*admitted_early=*/true);
  return call->ticket;
}

bool Outbox::Cancel(uint64_t ticket, bool disconnected) {
  std::shared_ptr<Call> call;  // held while the core looks: an answer meanwhile cannot free it
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = calls_.find(ticket);
    if (found == calls_.end()) return false;  // answered already
    call = found->second;
  }
  return core_->Cancel(call.get(), call->deadline, disconnected);
}

void Outbox::Answered(Call* call, const Status& status) {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto found = calls_.find(call->ticket);
    if (found == calls_.end()) return;  // answered once already
    std::shared_ptr<Call> owned = std::move(found->second);
    calls_.erase(found);
    Answer answer;
    answer.ticket = call->ticket;
    answer.status = status;
    answer.reserved = call->reserved;
    answer.note = std::move(call->note);
    if (status.ok()) answer.response = std::move(call->response);
    wake = ready_.empty();
    ready_.push_back(std::move(answer));
    // `owned` (its request) goes here, outside the core's batch: Complete no longer reads it.
  }
  const uint64_t one = 1;
  if (wake && write(wake_fd_, &one, sizeof one) < 0) {
    // EAGAIN: the counter is full, and the front is woken anyway.
  }
}

std::vector<Outbox::Answer> Outbox::Take() {
  std::vector<Answer> out;
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t count = 0;
  while (read(wake_fd_, &count, sizeof count) > 0) {
  }
  out.swap(ready_);
  return out;
}

size_t Outbox::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return calls_.size();
}

}  // namespace attnserve

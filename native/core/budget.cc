// The memory budget counter (budget.h).
#include "budget.h"

#include <sys/eventfd.h>
#include <unistd.h>

namespace attnserve {

SharedBudget::SharedBudget(int64_t limit_bytes, int64_t room_bytes)
    : limit_(limit_bytes), room_(room_bytes), wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

SharedBudget::~SharedBudget() {
  if (wake_fd_ >= 0) close(wake_fd_);
}

bool SharedBudget::Fits(int64_t n, int64_t waiting) const {
  // MemoryBudget's rule: under the limit less the waiting room, or alone under the limit.
  return reserved_ + n <= limit_ - room_ || (reserved_ == 0 && n + waiting <= limit_);
}

bool SharedBudget::CanWait(int64_t n, int64_t first) const {
  // MemoryBudget._can_wait: its inputs fit the waiting room and every waiter could be admitted in turn.
  if (waiting_ + first > room_) return false;
  int64_t behind = first;  // inputs of the waiters after the one looked at
  if (n > limit_ - room_ && n > limit_) return false;
  for (auto it = waiters_.rbegin(); it != waiters_.rend(); ++it) {
    if (it->total > limit_ - room_ && it->total + behind > limit_) return false;
    behind += it->first;
  }
  return true;
}

int64_t SharedBudget::Take(int64_t n, int64_t first, bool wait, bool native) {
  std::lock_guard<std::mutex> lock(mu_);
  if (waiters_.empty() && Fits(n, waiting_)) {  // nobody jumps ahead of a waiter
    reserved_ += n;
    high_water_ = std::max(high_water_, reserved_);
    return 0;
  }
  first = std::min(first, n);
  if (!wait || !CanWait(n, first)) return -1;
  const int64_t ticket = next_ticket_++;
  waiters_.push_back(Waiter{ticket, n, first, native});
  waiting_ += first;
  return ticket;
}

void SharedBudget::Admit(std::vector<int64_t>* native, bool* python) {
  while (!waiters_.empty()) {
    const Waiter& head = waiters_.front();
    if (!Fits(head.total, waiting_ - head.first)) return;
    reserved_ += head.total;
    high_water_ = std::max(high_water_, reserved_);
    waiting_ -= head.first;
    if (head.native) {
      native->push_back(head.ticket);
    } else {
      granted_python_.push_back(head.ticket);
      *python = true;
    }
    waiters_.pop_front();
  }
}

void SharedBudget::Wake(const std::vector<int64_t>& native, bool python) {
  if (python && wake_fd_ >= 0) {
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof one) < 0) {
      // EAGAIN: the counter is full, and the event loop is woken anyway.
    }
  }
  if (native.empty()) return;
  std::function<void(int64_t)> wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    wake = native_wake_;
  }
  for (int64_t ticket : native)
    if (wake) wake(ticket);
}

bool SharedBudget::Leave(int64_t ticket) {
  std::vector<int64_t> native;
  bool python = false, left = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = waiters_.begin(); it != waiters_.end(); ++it) {
      if (it->ticket != ticket) continue;
      waiting_ -= it->first;
      waiters_.erase(it);
      left = true;
      Admit(&native, &python);  // the ones behind it may fit now
      break;
    }
  }
  Wake(native, python);
  return left;
}

void SharedBudget::Give(int64_t n) {
  std::vector<int64_t> native;
  bool python = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reserved_ -= n;
    Admit(&native, &python);
    if (reserved_ == 0 && waiters_.empty()) {  // emptied: after a large use, the event loop reclaims
      if (idle_after_ > 0 && high_water_ >= idle_after_) went_idle_ = python = true;
      high_water_ = 0;
    }
  }
  Wake(native, python);
}

void SharedBudget::SetIdleAfter(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  idle_after_ = bytes;
}

bool SharedBudget::WentIdle() {
  std::lock_guard<std::mutex> lock(mu_);
  const bool went = went_idle_;
  went_idle_ = false;
  return went;
}

std::vector<int64_t> SharedBudget::Granted() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  out.swap(granted_python_);
  return out;
}

void SharedBudget::SetNativeWake(std::function<void(int64_t)> wake) {
  std::lock_guard<std::mutex> lock(mu_);
  native_wake_ = std::move(wake);
}

int64_t SharedBudget::reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

int64_t SharedBudget::Free() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_.empty() ? std::max<int64_t>(limit_ - room_ - reserved_, 0) : 0;
}

int64_t SharedBudget::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_;
}

int64_t SharedBudget::waiters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(waiters_.size());
}

void SharedBudget::Drain() {
  uint64_t count = 0;
  while (wake_fd_ >= 0 && read(wake_fd_, &count, sizeof count) > 0) {
  }
}

}  // namespace attnserve

// The process's one memory budget counter: what every call reserves before it queues.
#pragma once

#include <atomic>
#include <cstdint>
#include <algorithm>
#include <deque>
#include <functional>
#include <mutex>
#include <vector>

namespace attnserve {

// The process's one memory budget counter (--memory-limit-bytes), shared by both planes: Python's
// server.memory.budget.MemoryBudget takes and gives back through it, native calls too. The rule is
// MemoryBudget's: a reservation fits under limit - room, or alone (nothing reserved) under limit.
// Its waiters, of both planes, queue here in one arrival order (nobody jumps ahead): a native one
// is woken through the plane's hook, Python's through wake_fd (Granted() then names them).
class SharedBudget {
 public:
  SharedBudget(int64_t limit_bytes, int64_t room_bytes);
  ~SharedBudget();
  // n bytes, `first` of them its inputs (counted while it waits): 0 taken now; > 0 a ticket, waiting
  // in arrival order (only if `wait` and there is room to wait, MemoryBudget._can_wait); -1 refused.
  int64_t Take(int64_t n, int64_t first, bool wait, bool native);
  bool TryTake(int64_t n) { return Take(n, 0, false, false) == 0; }
  // A waiter gives up: true when it left the queue, false when it was granted first (its bytes are
  // reserved: the caller gives them back).
  bool Leave(int64_t ticket);
  void Give(int64_t n);  // grants the waiters it makes room for, in order
  std::vector<int64_t> Granted();  // Python's waiters granted since the last call
  // Called with each native waiter's ticket once it is granted (no lock held; nullptr: none).
  void SetNativeWake(std::function<void(int64_t)> wake);
  int64_t reserved() const;
  int64_t limit() const { return limit_; }
  int64_t Free() const;  // what can be taken now without waiting: 0 while someone waits (MemoryBudget.free_bytes)
  int64_t waiting() const;  // inputs of the waiters, both planes
  int64_t waiters() const;
  int wake_fd() const { return wake_fd_; }  // readable once one of Python's waiters is granted
  void Drain();  // reads wake_fd empty
  // MemoryBudget.IDLE_AFTER_BYTES: a release that empties the budget after at least this much was
  // reserved (either plane) wakes the event loop, whose MemoryBudget then reclaims (WentIdle); 0: never.
  void SetIdleAfter(int64_t bytes);
  bool WentIdle();  // the budget emptied after a large use since the last call
  std::atomic<uint64_t> native_shed{0}, native_too_large{0}, native_waits{0}, native_wait_timeouts{0};

 private:
  struct Waiter {
    int64_t ticket, total, first;
    bool native;
  };
  bool Fits(int64_t n, int64_t waiting) const;     // mu_ held
  bool CanWait(int64_t n, int64_t first) const;    // mu_ held
  void Admit(std::vector<int64_t>* native, bool* python);  // mu_ held: grants from the head on
  void Wake(const std::vector<int64_t>& native, bool python);  // mu_ released

  const int64_t limit_, room_;
  mutable std::mutex mu_;
  int64_t reserved_ = 0, waiting_ = 0, next_ticket_ = 1;
  int64_t idle_after_ = 0, high_water_ = 0;  // SetIdleAfter; the most reserved since it was last empty
  bool went_idle_ = false;
  std::deque<Waiter> waiters_;
  std::vector<int64_t> granted_python_;
  std::function<void(int64_t)> native_wake_;
  int wake_fd_ = -1;
};

}  // namespace attnserve

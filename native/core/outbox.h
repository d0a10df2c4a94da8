// Calls submitted whole by a front that takes their answers in bulk (the REST front, on Python's
// event loop): each answer waits in a queue, and an eventfd turns readable when the queue stops
// being empty, so the front is woken once for all the answers ready, not once per call.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core.h"

namespace attnserve {

class Outbox {
 public:
  explicit Outbox(Core* core);
  ~Outbox();
  Outbox(const Outbox&) = delete;
  Outbox& operator=(const Outbox&) = delete;

  // One call: its message parsed and submitted (admitted by the front's own gate already); its
  // ticket, whose answer Take returns. figures: the call's queue wait, run and batch come back
  // with its answer (the front records the call itself).
  uint64_t Submit(const Chunks& message, TimePoint deadline, bool figures);
  // The call's client went away (disconnected: its connection ended): out of the core, as a gRPC
  // call whose client went away.
  bool Cancel(uint64_t ticket, bool disconnected);

  struct Call;
  // An answered call: its status, its response (OK), its budget reservation (given back by the
  // front once the answer is sent) and, when asked for, its figures.
  struct Answer {
    uint64_t ticket = 0;
    Status status;
    std::unique_ptr<inference::ModelInferResponse> response;
    int64_t reserved = 0;
    std::shared_ptr<CallNote> note;  // nullptr: no figures asked for
  };
  std::vector<Answer> Take();  // every answer ready, in the order they came; wake_fd read empty
  int wake_fd() const { return wake_fd_; }
  size_t pending() const;  // calls submitted and not yet answered

 private:
  void Answered(Call* call, const Status& status);

  Core* core_;
  mutable std::mutex mu_;
  uint64_t next_ticket_ = 1;
  std::map<uint64_t, std::shared_ptr<Call>> calls_;  // submitted, not yet answered
  std::vector<Answer> ready_;
  int wake_fd_ = -1;
};

}  // namespace attnserve

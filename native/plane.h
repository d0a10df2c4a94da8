// The process's native data plane as attnserve.server._native serves it: the core (core/) with
// its fronts, the gRPC front (grpc/) and the outbox the REST front submits through. Stop order:
// refuse, close the port, end the threads.
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "core.h"
#include "front.h"
#include "outbox.h"

namespace attnserve {

class Plane final : public Core {
 public:
  explicit Plane(Contract contract) : Core(std::move(contract)), front_(this), outbox_(this) {}
  ~Plane() override {
    if (front_.Serving()) Stop(0);  // halted but not stopped: its listener still closes
  }
  GrpcFront& front() { return front_; }
  Outbox& outbox() { return outbox_; }
  // Listens and serves (GrpcFront::Start); the deadlines' timer starts with it.
  int Start(const std::vector<std::string>& addresses, int max_message_bytes, int max_concurrent_streams) {
    const int port = front_.Start(addresses, max_message_bytes, max_concurrent_streams);
    if (port != 0) StartTimer();
    return port;
  }
  // Refuses what is queued (UNAVAILABLE), then GOAWAY and the listener closed; calls still computing
  // have grace_s to finish.
  void Stop(double grace_s) {
    Halt();
    if (front_.Serving()) {
      front_.Shutdown(grace_s);
      StopHandoff();
    }
    StopTimer();
  }

 private:
  GrpcFront front_;
  Outbox outbox_;
};

}  // namespace attnserve

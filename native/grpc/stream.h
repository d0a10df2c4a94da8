// ModelStreamInfer on the gRPC front: one stream's reads, submissions and ordered writes.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>

#include "front.h"

namespace attnserve {

// One ModelStreamInfer stream: reads requests as they come (up to the front's stream window in
// the core at once), submits each as ModelInfer does, and writes the answers in request order,
// one write at a time. A refused request is answered in the stream (error_message) and the
// stream goes on, as the Python plane does (server.service).
// Its messages are read as raw bytes and parsed here: one that does not parse ends the stream with
// INVALID_ARGUMENT after the answers before it (the Python plane's rule). Its reading also pauses
// while its answers hold more than its share of the memory budget (service._StreamHold's rule).
class StreamCall final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>, public Reply {
 public:
  // context: the relay's (its headers), and where a recorded stream takes its peer and trace headers.
  StreamCall(GrpcFront* front, TimePoint call_deadline, grpc::CallbackServerContext* context = nullptr);
  void OnReadDone(bool ok) override;
  void OnCancel() override;  // every request of it leaves the core (Core::Cancel)
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }
  // The core settled request `seq` (any thread): its answer, OK from its response, else the status.
  void Answered(uint64_t seq, const Status& status) override;

 private:
  struct Slot {
    std::unique_ptr<inference::ModelInferRequest> request;
    std::unique_ptr<inference::ModelInferResponse> response;
    std::unique_ptr<grpc::ByteBuffer> answer;  // set once answered: the encoded ModelStreamInferResponse
    int64_t reserved = 0;  // its budget reservation, given back once its answer is written or dropped
  };
  // With mu_ held: what to start now (a write, a read, the end), started after it is released.
  struct Next {
    grpc::ByteBuffer* write = nullptr;
    bool read = false, finish = false;
  };
  Next Step();
  void Run(const Next& next);
  bool Full() const;  // with mu_ held: this stream's answers hold its share of the budget
  void GiveBack(int64_t reserved);  // with mu_ held: a reservation whose answer is written or dropped

  // Request `seq` handed to the Python server as a ModelInfer call (GrpcFront::ToPython); its answer
  // takes its place in the stream's order.
  void ToPython(uint64_t seq, const grpc::ByteBuffer& message, inference::ModelInferResponse* response);

  GrpcFront* front_;
  Core* core_;
  grpc::CallbackServerContext* context_;
  std::map<uint64_t, std::shared_ptr<UnaryRelay>> relayed_;  // by seq, until answered (cancelled with the stream)
  TimePoint deadline_;  // the stream's gRPC deadline: each request's
  std::shared_ptr<const CallNote> headers_;  // recorded: each request's note starts from it
  std::mutex mu_;
  grpc::ByteBuffer incoming_;
  std::deque<Slot> slots_;  // in request order: the first is the next to write
  uint64_t first_seq_ = 0;  // slots_.front()'s seq
  std::unique_ptr<grpc::ByteBuffer> writing_;
  bool reading_ = true, reads_done_ = false, broken_ = false, finished_ = false;
  int64_t writing_reserved_ = 0;
  // service._StreamHold: requests read and not answered, bytes of answers held, the largest reservation.
  int64_t hold_in_flight_ = 0, held_bytes_ = 0, hold_cost_ = 0;
  grpc::Status end_ = grpc::Status::OK;  // a message that did not parse: the stream's final status
};

}  // namespace attnserve

// ModelStreamInfer on the gRPC front (stream.h).
#include "stream.h"

#include <algorithm>

#include "encode.h"
#include "text.h"

namespace attnserve {

StreamCall::StreamCall(GrpcFront* front, TimePoint call_deadline, grpc::CallbackServerContext* context)
    : front_(front), core_(front->core()), context_(context), deadline_(call_deadline) {
  if (context != nullptr && core_->records()) {
    headers_ = front_->Note(context, "ModelStreamInfer", 0);
    front_->HeadersLine("/inference.GRPCInferenceService/ModelStreamInfer");
  }
  StartRead(&incoming_);
}

void StreamCall::OnCancel() {
  std::map<uint64_t, std::shared_ptr<UnaryRelay>> relayed;
  {
    std::lock_guard<std::mutex> lock(mu_);
    broken_ = true;  // nobody reads the answers: those still owed are dropped as they come
    relayed = relayed_;
  }
  for (auto& [seq, relay] : relayed) relay->Cancel();
  core_->Cancel(this, deadline_);
  Next next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    next = Step();
  }
  Run(next);
}

void StreamCall::OnReadDone(bool ok) {
  if (!ok) {  // the client's half-close, or the stream is gone
    Next next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = false;
      reads_done_ = true;
      next = Step();
    }
    Run(next);
    return;
  }
  auto request = std::make_unique<inference::ModelInferRequest>();
  std::shared_ptr<CallNote> note;
  if (headers_) {  // this request's record: the stream's headers, its own start and size
    note = std::make_shared<CallNote>(*headers_);
    note->started = std::chrono::steady_clock::now();
    note->bytes_in = static_cast<int64_t>(incoming_.Length());
  }
  std::string why;
  const bool parsed = front_->Parse(incoming_, request.get(), &why);
  grpc::ByteBuffer message;
  message.Swap(&incoming_);  // kept for the Python server, if the request goes there
  if (!parsed) {  // the stream ends after the answers before it, as the Python plane's does
    const Status status = Bounded(Invalid(why));
    core_->Unparsed(status, note.get());
    Next next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = false;
      reads_done_ = true;
      end_ = ToGrpc(status);
      next = Step();
    }
    Run(next);
    return;
  }
  Pending p;
  p.reply = this;
  p.streamed = true;
  p.deadline = deadline_;
  p.note = std::move(note);
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot slot;
    slot.request = std::move(request);
    slot.response = std::make_unique<inference::ModelInferResponse>();
    p.request = slot.request.get();
    p.response = slot.response.get();
    p.seq = first_seq_ + slots_.size();
    slots_.push_back(std::move(slot));
    if (core_->budget()) p.held = &slots_.back().reserved;  // a deque's elements stay where they are
    hold_in_flight_++;
    reading_ = false;
  }
  if (context_ != nullptr && front_->upstream_ && front_->ToPython(*p.request)) {
    ToPython(p.seq, message, p.response);
  } else {
    core_->Submit(std::move(p));  // may answer at once (Answered takes mu_)
  }
  Next next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    next = Step();
  }
  Run(next);
}

void StreamCall::ToPython(uint64_t seq, const grpc::ByteBuffer& message, inference::ModelInferResponse* response) {
  auto relay = front_->upstream_->Unary(*context_, kModelInferMethod, message, "ModelStreamInfer");
  {
    std::lock_guard<std::mutex> lock(mu_);
    relayed_[seq] = relay;
  }
  // The stream ends only once every request is answered, so it outlives the relay.
  relay->Start([this, seq, response](const grpc::Status& status, const grpc::ByteBuffer& answer) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      relayed_.erase(seq);
    }
    Answered(seq, Bounded(status.ok() ? ReadAnswer(answer, response)
                                      : Status(static_cast<StatusCode>(status.error_code()), status.error_message())));
  });
}

void StreamCall::Answered(uint64_t seq, const Status& status) {
  Next next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& slot = slots_.at(static_cast<size_t>(seq - first_seq_));
    hold_in_flight_--;
    held_bytes_ += slot.reserved;  // held until written (service._StreamHold.answered)
    hold_cost_ = std::max(hold_cost_, slot.reserved);
    if (status.ok()) {
      slot.answer = std::make_unique<grpc::ByteBuffer>(EncodeStreamAnswer("", slot.response.get()));
    } else {  // the stream goes on: the request's own answer says what failed
      inference::ModelInferResponse named;
      named.set_model_name(slot.request->model_name());
      named.set_id(slot.request->id());
      slot.answer = std::make_unique<grpc::ByteBuffer>(EncodeStreamAnswer(
          std::string(CodeName(status.error_code())) + ": " + status.error_message(), &named));
    }
    slot.request.reset();  // its tensors are no longer needed
    slot.response.reset();
    next = Step();
  }
  Run(next);
}

void StreamCall::OnWriteDone(bool ok) {
  Next next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    writing_.reset();
    GiveBack(writing_reserved_);
    writing_reserved_ = 0;
    broken_ = broken_ || !ok;  // the client is gone: answers still owed are dropped as they come
    next = Step();
  }
  Run(next);
}

StreamCall::Next StreamCall::Step() {
  Next next;
  if (finished_) return next;
  while (!slots_.empty() && slots_.front().answer && (broken_ || !writing_)) {
    auto answer = std::move(slots_.front().answer);
    const int64_t reserved = slots_.front().reserved;
    slots_.pop_front();
    first_seq_++;
    if (broken_) {
      GiveBack(reserved);
      continue;
    }
    writing_ = std::move(answer);
    writing_reserved_ = reserved;
    next.write = writing_.get();
  }
  if (!reading_ && !reads_done_ && !broken_ && static_cast<int64_t>(slots_.size()) < front_->stream_window_ &&
      !Full()) {
    reading_ = true;
    next.read = true;
  }
  // Every request answered (the plane holds no pointer into this stream) and written: the end.
  if (slots_.empty() && !writing_ && (reads_done_ || broken_) && !reading_) {
    finished_ = true;
    next.finish = true;
  }
  return next;
}

void StreamCall::Run(const Next& next) {
  if (next.write != nullptr) StartWrite(next.write);
  if (next.read) StartRead(&incoming_);
  if (next.finish) Finish(end_);
}

bool StreamCall::Full() const {
  const int64_t share = core_->stream_share_bytes();
  if (share <= 0) return false;
  if (held_bytes_ > share) return true;
  if (hold_in_flight_ == 0) return false;
  // Until a reservation is known a request is read only when none is in flight (one always goes).
  return hold_cost_ == 0 || held_bytes_ + hold_in_flight_ * hold_cost_ > share;
}

void StreamCall::GiveBack(int64_t reserved) {
  if (reserved <= 0) return;
  held_bytes_ -= reserved;
  core_->budget()->Give(reserved);
}

}  // namespace attnserve

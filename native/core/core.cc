// The core's construction and its one way out: every call is counted, recorded and answered in
// Settle, once, whichever front it came from.
#include "core.h"

#include "log.h"
#include "text.h"

namespace attnserve {

Core::Core(Contract contract) : contract_(std::move(contract)) { BoundProtobufLog(); }

Core::~Core() {
  StopTimer();
  StopHandoff();
  if (budget_) budget_->SetNativeWake(nullptr);  // the budget may outlive the core (Python holds it)
}

void Core::Count(Codes* codes, const Status& status) {
  const auto code = static_cast<size_t>(status.error_code());
  (codes != nullptr ? *codes : unknown_codes_)[code < kCodes ? code : static_cast<size_t>(StatusCode::UNKNOWN)]++;
}

void Core::Settle(const Pending& p, Queue* queue, const Status& status, std::vector<CallRecord>* into) {
  Settle(p, queue != nullptr ? queue->codes : &unknown_codes_, status, into);
}

void Core::Settle(const Pending& p, Codes* codes, const Status& status, std::vector<CallRecord>* into) {
  Count(codes, status);
  if (p.note && p.note->recorded && records_) Record(p, status, into);  // before the answer: its request and response go with it
  p.reply->Answered(p.seq, Bounded(status));
}

void Core::Unparsed(const Status& status, const CallNote* note) {
  counters_.requests++;
  counters_.refused++;
  Count(static_cast<Codes*>(nullptr), status);
  if (note != nullptr && records_) {
    CallRecord r;
    r.traced = false;
    r.method = note->method;
    r.peer = note->peer;
    r.code = static_cast<int>(status.error_code());
    r.details = status.error_message().substr(0, 200);
    r.start_ns = records_->EpochNs(note->started);
    r.end_ns = records_->EpochNs(std::chrono::steady_clock::now());
    r.bytes_in = note->bytes_in;
    records_->Add(std::move(r));
  }
}

void Core::Submit(Reply* reply, const inference::ModelInferRequest* request, inference::ModelInferResponse* response,
                  TimePoint call_deadline, int64_t* held, std::atomic<int64_t>* answered_by,
                  std::shared_ptr<CallNote> note, bool admitted_early) {
  Pending p;
  p.admitted_early = admitted_early;
  p.answered_by = answered_by;
  p.note = std::move(note);
  p.deadline = call_deadline;
  p.reply = reply;
  p.held = held;
  p.request = request;
  p.response = response;
  Admit(std::move(p));
}

}  // namespace attnserve

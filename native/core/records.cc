// Call records of the native data plane (records.h): the bounded buffer, and the core's part,
// which turns each settled call into a record.
// docs/tracing.md, "The native data plane".
#include "records.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>

#include <google/protobuf/io/coded_stream.h>

#include "core.h"

namespace attnserve {

namespace {

using Clock = std::chrono::steady_clock;

int64_t OffsetNs() {
  const auto wall = std::chrono::system_clock::now().time_since_epoch();
  const auto steady = Clock::now().time_since_epoch();
  return std::chrono::duration_cast<std::chrono::nanoseconds>(wall - steady).count();
}

// The first kKeptChars characters of UTF-8 text (protobuf has checked it), and how many it has.
std::string Kept(const std::string& text, int64_t* chars) {
  size_t count = 0, cut = text.size();
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xc0) == 0x80) continue;  // a continuation byte
    if (count == kKeptChars) cut = std::min(cut, i);
    count++;
  }
  *chars = static_cast<int64_t>(count);
  return text.substr(0, cut);
}

}  // namespace

Records::Records(size_t capacity)
    : capacity_(capacity), offset_ns_(OffsetNs()), wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {
  held_.reserve(std::min<size_t>(capacity_, 1024));
}

Records::~Records() {
  if (wake_fd_ >= 0) close(wake_fd_);
}

int64_t Records::EpochNs(Clock::time_point t) const {
  if (t == Clock::time_point{}) return 0;
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count() + offset_ns_;
}

void Records::Wake() {
  const uint64_t one = 1;
  if (wake_fd_ >= 0 && write(wake_fd_, &one, sizeof one) < 0) {
    // EAGAIN: the counter is full, and the event loop is woken anyway.
  }
}

void Records::AddArrival(const std::string& method) {
  std::lock_guard<std::mutex> lock(mu_);
  if (held_.empty() && arrivals_.empty()) Wake();
  arrivals_[method]++;
}

std::vector<CallRecord> Records::TakeAll(std::map<std::string, uint64_t>* arrivals) {
  std::lock_guard<std::mutex> lock(mu_);
  arrivals->swap(arrivals_);
  arrivals_.clear();
  std::vector<CallRecord> out;
  uint64_t count = 0;
  while (wake_fd_ >= 0 && read(wake_fd_, &count, sizeof count) > 0) {
  }
  out.swap(held_);
  return out;
}

void Records::Add(CallRecord record) {
  std::lock_guard<std::mutex> lock(mu_);
  if (held_.size() >= capacity_) {
    dropped_++;
    return;
  }
  if (held_.empty() && arrivals_.empty()) Wake();
  held_.push_back(std::move(record));
}

void Records::Add(std::vector<CallRecord>& records) {
  if (records.empty()) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (held_.empty() && arrivals_.empty() && held_.size() < capacity_) Wake();
  for (auto& record : records) {
    if (held_.size() >= capacity_) {
      dropped_++;
      continue;
    }
    held_.push_back(std::move(record));
  }
  records.clear();
}

// -- the core's part ----------------------------------------------------------------------------

void Core::SetRecords(size_t capacity, bool arrivals) {
  records_ = capacity > 0 ? std::make_unique<Records>(capacity) : nullptr;
  arrivals_ = arrivals;
}

void Core::Record(const Pending& p, const Status& status, std::vector<CallRecord>* into) {
  const CallNote& note = *p.note;
  const inference::ModelInferRequest& request = *p.request;
  CallRecord r;
  r.method = note.method;
  r.peer = note.peer;
  r.traceparent = note.traceparent;
  r.tracestate = note.tracestate;
  r.model = Kept(request.model_name(), &r.model_chars);
  r.request_id = Kept(request.id(), &r.request_id_chars);
  r.code = static_cast<int>(status.error_code());
  r.details = status.error_message().substr(0, 200);  // a span's status, as server.tracing cuts it
  r.start_ns = records_->EpochNs(note.started);
  r.end_ns = records_->EpochNs(Clock::now());
  r.admitted_ns = records_->EpochNs(note.admitted);
  r.rows = note.rows;
  r.q_len = note.q_len;
  r.k_len = note.k_len;
  r.bytes_in = note.bytes_in;
  r.batch = note.batch;
  if (status.ok()) {
    r.version = Kept(p.response->model_version(), &r.version_chars);  // the version that computed it
    r.queue_s = note.queue_s;
    r.run_s = note.run_s;
    r.batch_requests = note.batch_requests;
    r.run_start_ns = records_->EpochNs(note.run_started);
    r.run_end_ns = records_->EpochNs(note.run_ended);
    const auto size = static_cast<int64_t>(p.response->ByteSizeLong());
    if (!p.streamed) {
      r.bytes_out = size;  // the message's size on the wire
    } else {  // the stream's message nests it (infer_response, field 2)
      r.bytes_out = 1 + static_cast<int64_t>(google::protobuf::io::CodedOutputStream::VarintSize64(
                            static_cast<uint64_t>(size))) + size;
    }
  } else {
    r.version = Kept(request.model_version(), &r.version_chars);  // as asked
  }
  if (into != nullptr) {
    into->push_back(std::move(r));
  } else {
    records_->Add(std::move(r));
  }
}

}  // namespace attnserve

// Call records of the native data plane: what each native call's access line and span need, kept
// here per call and handed to Python in bulk (server/native_records.py formats and exports them
// with server/tracing.py's one writer). Only when --access-log or tracing is on (Core::SetRecords).
// docs/tracing.md, "The native data plane".
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

namespace attnserve {

// What a recorded call keeps from its headers to its answer (the Pending's note; nullptr: not recorded).
struct CallNote {
  bool recorded = true;     // false: its figures only, for a front that records the call itself
  const char* method = "";  // "ModelInfer", "ModelStreamInfer": literals
  std::string peer, traceparent, tracestate;
  int64_t bytes_in = 0;
  std::chrono::steady_clock::time_point started, admitted, run_started, run_ended;
  int64_t rows = 0, q_len = 0, k_len = 0;  // once admitted
  double queue_s = -1, run_s = -1;         // once computed (OK only, as the Python plane's)
  int64_t batch_requests = 0;
  uint64_t batch = 0;  // the batch it ran in (Batch::id; 0: none)
};

// One finished call, in plain values; times on the epoch clock (ns), 0 where the stage was not reached.
struct CallRecord {
  bool traced = true;  // false: refused before the call had a request (parse, token): a line, no span
  std::string method, peer, model, version, request_id, traceparent, tracestate, details;
  // model, version and request_id are client text: kept to kKeptChars characters, with their full lengths.
  int64_t model_chars = 0, version_chars = 0, request_id_chars = 0;
  int code = 0;  // the gRPC status code
  int64_t start_ns = 0, end_ns = 0, admitted_ns = 0, run_start_ns = 0, run_end_ns = 0;
  double queue_s = -1, run_s = -1;
  int64_t batch_requests = 0, rows = 0, q_len = 0, k_len = 0, bytes_in = 0, bytes_out = 0;
  uint64_t batch = 0;
};

// Client text kept in a record, in characters: more than the access line shows (server/quoting.py's
// QUOTED_CHARS), so a record's size is bounded whatever the client sends.
constexpr size_t kKeptChars = 128;

// A bounded buffer of records, drained by the event loop when wake_fd turns readable (it is
// written when the buffer stops being empty). Full: further records are dropped and counted.
class Records {
 public:
  explicit Records(size_t capacity);
  ~Records();
  Records(const Records&) = delete;
  Records& operator=(const Records&) = delete;
  void Add(CallRecord record);
  void Add(std::vector<CallRecord>& records);  // one lock for a batch's calls
  // Arrivals (the gate's "rpc <method>" lines) are counts by method, beside the records: they take
  // none of the records' room. TakeAll takes both at once, so an arrival is written before its call's
  // line; wake_fd is read empty first.
  void AddArrival(const std::string& method);
  std::vector<CallRecord> TakeAll(std::map<std::string, uint64_t>* arrivals);
  int wake_fd() const { return wake_fd_; }
  uint64_t dropped() const { return dropped_.load(); }
  size_t capacity() const { return capacity_; }
  // The steady clock on the epoch clock OpenTelemetry needs (the offset is taken once).
  int64_t EpochNs(std::chrono::steady_clock::time_point t) const;

 private:
  void Wake();  // with mu_ held, the buffer having been empty
  const size_t capacity_;
  const int64_t offset_ns_;
  std::mutex mu_;
  std::vector<CallRecord> held_;
  std::map<std::string, uint64_t> arrivals_;  // by method: the plane's own methods, a fixed few
  std::atomic<uint64_t> dropped_{0};
  int wake_fd_ = -1;
};

}  // namespace attnserve

// A call's final status in the core's own terms: the gRPC canonical codes (the Open Inference
// Protocol's), which each front translates once (gRPC trailers, HTTP statuses).
#pragma once

#include <array>
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace attnserve {

enum class StatusCode : int {
  OK = 0,
  CANCELLED = 1,
  UNKNOWN = 2,
  INVALID_ARGUMENT = 3,
  DEADLINE_EXCEEDED = 4,
  NOT_FOUND = 5,
  ALREADY_EXISTS = 6,
  PERMISSION_DENIED = 7,
  RESOURCE_EXHAUSTED = 8,
  FAILED_PRECONDITION = 9,
  ABORTED = 10,
  OUT_OF_RANGE = 11,
  UNIMPLEMENTED = 12,
  INTERNAL = 13,
  UNAVAILABLE = 14,
  DATA_LOSS = 15,
  UNAUTHENTICATED = 16,
};

class Status {
 public:
  Status() = default;
  Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}
  bool ok() const { return code_ == StatusCode::OK; }
  StatusCode error_code() const { return code_; }
  const std::string& error_message() const { return message_; }
  static const Status OK;

 private:
  StatusCode code_ = StatusCode::OK;
  std::string message_;
};

inline const Status Status::OK{};

// Final statuses by code (0..16), read by Python at scrape time (attnserve_requests).
constexpr size_t kCodes = 17;
using Codes = std::array<std::atomic<uint64_t>, kCodes>;

// The code's canonical name ("INVALID_ARGUMENT"), as a stream's error_message starts.
const char* CodeName(StatusCode code);

}  // namespace attnserve

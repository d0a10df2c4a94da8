// protobuf's log, bounded (log.h).
#include "log.h"

#include <atomic>
#include <chrono>
#include <cstdio>
#include <mutex>
#include <string>

#include <google/protobuf/stubs/logging.h>

namespace attnserve {

namespace {

std::mutex mu;
std::chrono::steady_clock::time_point window_start;
int written = 0;
uint64_t left_out_in_window = 0;
std::atomic<uint64_t> left_out{0};

const char* LevelName(google::protobuf::LogLevel level) {
  switch (level) {
    case google::protobuf::LOGLEVEL_INFO: return "INFO";
    case google::protobuf::LOGLEVEL_WARNING: return "WARNING";
    case google::protobuf::LOGLEVEL_ERROR: return "ERROR";
    default: return "FATAL";
  }
}

void Bounded(google::protobuf::LogLevel level, const char* filename, int line, const std::string& message) {
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> lock(mu);
  if (now - window_start >= std::chrono::seconds(kProtobufWindowS)) {
    if (left_out_in_window > 0) {
      std::fprintf(stderr, "[libprotobuf] %llu more lines left out in the last %d s (at most %d per window)\n",
                   static_cast<unsigned long long>(left_out_in_window), kProtobufWindowS, kProtobufLinesPerWindow);
    }
    window_start = now;
    written = 0;
    left_out_in_window = 0;
  }
  if (written >= kProtobufLinesPerWindow && level != google::protobuf::LOGLEVEL_FATAL) {
    left_out_in_window++;
    left_out++;
    return;
  }
  written++;
  // Client text may be in it: cut, as every other line of client text is.
  std::fprintf(stderr, "[libprotobuf %s %s:%d] %.500s\n", LevelName(level), filename, line, message.c_str());
}

}  // namespace

void BoundProtobufLog() {
  static std::once_flag once;
  std::call_once(once, [] { google::protobuf::SetLogHandler(&Bounded); });
}

uint64_t ProtobufLinesLeftOut() { return left_out.load(); }

}  // namespace attnserve

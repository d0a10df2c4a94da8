// protobuf's own log lines, bounded: a hostile message can make the parser log once per bad
// string, and a flood of them must not flood the server's log (or its disk).
#pragma once

#include <cstdint>

namespace attnserve {

// Installs, once per process, a handler that writes at most kProtobufLinesPerWindow of protobuf's
// lines to stderr per kProtobufWindowS seconds, then one line saying how many it left out.
void BoundProtobufLog();
constexpr int kProtobufLinesPerWindow = 10;
constexpr int kProtobufWindowS = 60;
uint64_t ProtobufLinesLeftOut();  // so far, in this process

}  // namespace attnserve

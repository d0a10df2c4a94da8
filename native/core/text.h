// The core's words: every message a call is refused with, and the formatters they are written
// with (figures with commas, client text quoted and cut), in one place for every front.
#pragma once

#include <chrono>
#include <cstdint>
#include <initializer_list>
#include <string>

#include <google/protobuf/repeated_field.h>

#include "status.h"

namespace attnserve {

// 1234567 -> "1,234,567".
std::string Commas(int64_t n);
// Where the first `chars` characters of UTF-8 text end (its size if shorter), and how many it has.
size_t CharsEnd(const std::string& text, size_t chars, size_t* count = nullptr);
// A status whose details fit a grpc-message trailer (kMaxDetailsChars characters, then a note of the cut).
Status Bounded(const Status& status);
// Client text quoted and escaped, cut after `limit` characters (SIZE_MAX: uncut).
std::string Quoted(const std::string& text, size_t limit = 100);
// A str quoted and escaped, uncut, and a float as its shortest repr.
std::string PyRepr(const std::string& s);
std::string PyFloat(double v);
// Seconds with three decimals.
std::string Seconds3(std::chrono::steady_clock::duration d);

// Exact products of a hostile request's dimensions, and their figures.
using Wide = unsigned __int128;
constexpr Wide kWideMax = ~Wide{0};
inline Wide WideMul(Wide a, Wide b) { return a != 0 && b > kWideMax / a ? kWideMax : a * b; }
std::string Decimal(Wide n);
std::string WideCommas(Wide n);
Wide Product(const google::protobuf::RepeatedField<int64_t>& shape);  // of dims >= 0
std::string ListRepr(const google::protobuf::RepeatedField<int64_t>& shape);  // "[1, 2, 3]"
std::string QuotedShape(const google::protobuf::RepeatedField<int64_t>& shape);  // cut as Quoted cuts
std::string NamesRepr(std::initializer_list<const std::string*> names);  // "['query', 'key']"
// The mask shapes a model takes, with this request's sizes when `sized`.
std::string MaskShapes(int64_t heads, bool sized = false, int64_t b = 0, int64_t lq = 0, int64_t lk = 0);

// A list quoted item by item, built no further than the cut: a hostile list may be huge.
template <typename Items, typename Repr>
std::string QuotedList(const Items& items, Repr repr, size_t limit = 100) {
  std::string out = "[";
  size_t total = 1;
  bool first = true;
  for (const auto& item : items) {
    const std::string text = (first ? "" : ", ") + repr(item);
    first = false;
    total += text.size();
    if (out.size() <= limit) out += text;
  }
  out += "]";
  total += 1;
  if (total <= limit) return out;
  return out.substr(0, limit) + "... (cut: " + std::to_string(total - limit) + " more characters)";
}

// The messages shared by several files.
inline Status Invalid(const std::string& message) { return Status(StatusCode::INVALID_ARGUMENT, message); }
Status Cancelled();                            // the client went away
Status ShuttingDown();                         // refused by the drain: never computed
Status NotStarted(const std::string& model);   // queued, refused by the stop

}  // namespace attnserve

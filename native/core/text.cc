// The core's words (text.h): formatters and the messages shared by several files.
#include "text.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace attnserve {

// 1234567 -> "1,234,567", as Python's f"{n:,}" writes the figures of the Python plane's messages.
std::string Commas(int64_t n) {
  std::string digits = std::to_string(n < 0 ? -n : n), out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return n < 0 ? "-" + out : out;
}

// Client text in a status travels in a grpc-message trailer: a huge one gives the client
// RESOURCE_EXHAUSTED ("header too large") instead of ours. server/quoting.py's MAX_DETAILS_CHARS.
constexpr size_t kMaxDetailsChars = 1024;

// Where the first `chars` characters of UTF-8 text end (its size if shorter), and how many it has.
size_t CharsEnd(const std::string& text, size_t chars, size_t* count) {
  size_t seen = 0, end = text.size();
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xc0) == 0x80) continue;  // a continuation byte
    if (seen == chars && end == text.size()) end = i;
    ++seen;
  }
  if (count != nullptr) *count = seen;
  return end;
}

Status Bounded(const Status& status) {
  const std::string& details = status.error_message();
  if (details.size() <= kMaxDetailsChars) return status;
  size_t chars = 0;  // counted as Python's len() counts them, in characters
  const size_t end = CharsEnd(details, kMaxDetailsChars, &chars);
  if (chars <= kMaxDetailsChars) return status;
  return Status(status.error_code(), details.substr(0, end) + "... (cut: " +
                                         std::to_string(chars - kMaxDetailsChars) + " more characters)");
}

Status Cancelled() { return Status(StatusCode::CANCELLED, "the client went away"); }  // server.errors.CANCELLED
// A call refused by the drain: never computed, retry elsewhere (server.gate's words).
Status ShuttingDown() { return Status(StatusCode::UNAVAILABLE, "server is shutting down; retry on another replica"); }
// A queued call the stop refuses (server.batcher.Batcher.close's words).
Status NotStarted(const std::string& model) {
  return Status(StatusCode::UNAVAILABLE, "model " + model +
                                             ": shutting down, not started within the grace period; "
                                             "retry on another replica");
}

std::string Seconds3(std::chrono::steady_clock::duration d) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3f", std::chrono::duration<double>(d).count());
  return text;
}

// Python's repr() of a str (quotes, escapes) and of a float: the Python plane's words.
std::string PyRepr(const std::string& s) {
  const char quote = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, quote);
  for (unsigned char c : s) {
    if (c == '\\' || c == static_cast<unsigned char>(quote)) {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char hex[8];
      std::snprintf(hex, sizeof hex, "\\x%02x", c);
      out += hex;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + quote;
}

std::string PyFloat(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v < 0 ? "-inf" : "inf";
  char buf[64];
  auto end = std::to_chars(buf, buf + sizeof buf, v, std::chars_format::scientific).ptr;  // shortest digits
  std::string sci(buf, end);
  const size_t e = sci.find('e');
  const int exp = std::stoi(sci.substr(e + 1));
  std::string digits = sci.substr(0, e);
  const bool negative = digits[0] == '-';
  if (negative) digits.erase(0, 1);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  std::string out;
  if (exp < -4 || exp >= 16) {  // repr's switch to exponent notation
    out = digits.substr(0, 1) + (digits.size() > 1 ? "." + digits.substr(1) : "");
    char tail[16];
    std::snprintf(tail, sizeof tail, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += tail;
  } else if (exp < 0) {
    out = "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
  } else {
    if (digits.size() <= static_cast<size_t>(exp) + 1) digits += std::string(static_cast<size_t>(exp) + 1 - digits.size(), '0');
    out = digits.substr(0, static_cast<size_t>(exp) + 1) + "." +
          (digits.size() > static_cast<size_t>(exp) + 1 ? digits.substr(static_cast<size_t>(exp) + 1) : "0");
  }
  return negative ? "-" + out : out;
}

std::string Decimal(Wide n) {
  std::string out;
  do {
    out.insert(out.begin(), static_cast<char>('0' + static_cast<int>(n % 10)));
    n /= 10;
  } while (n != 0);
  return out;
}

std::string WideCommas(Wide n) {  // f"{n:,}"
  const std::string digits = Decimal(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

Wide Product(const google::protobuf::RepeatedField<int64_t>& shape) {  // math.prod of dims >= 0
  Wide n = 1;
  for (int64_t d : shape) n = WideMul(n, static_cast<Wide>(d));
  return n;
}

// Python's repr of a list of ints: "[1, 2, 3]".
std::string ListRepr(const google::protobuf::RepeatedField<int64_t>& shape) {
  std::string out = "[";
  for (int i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

std::string QuotedShape(const google::protobuf::RepeatedField<int64_t>& shape) {
  return QuotedList(shape, [](int64_t d) { return std::to_string(d); });
}

// Python's repr of a list of the contract's names: "['query', 'key']".
std::string NamesRepr(std::initializer_list<const std::string*> names) {
  std::string out = "[";
  for (const std::string* name : names) out += (out.size() > 1 ? ", " : "") + PyRepr(*name);
  return out + "]";
}

// codec._mask_shapes: the mask shapes a model takes, with this request's sizes when `sized`.
std::string MaskShapes(int64_t heads, bool sized, int64_t b, int64_t lq, int64_t lk) {
  const std::string h = std::to_string(heads);
  std::string forms[4] = {"[batch, q_len, k_len]", "[q_len, k_len]", "[batch, 1, q_len, k_len]",
                          "[batch, " + h + ", q_len, k_len]"};
  if (sized) {
    const std::string B = std::to_string(b), Q = std::to_string(lq), K = std::to_string(lk);
    forms[0] += " = [" + B + ", " + Q + ", " + K + "]";
    forms[1] += " = [" + Q + ", " + K + "]";
    forms[2] += " = [" + B + ", 1, " + Q + ", " + K + "]";
    forms[3] += " = [" + B + ", " + h + ", " + Q + ", " + K + "]";
  }
  return forms[0] + ", " + forms[1] + ", " + forms[2] + " or " + forms[3];
}

std::string Quoted(const std::string& text, size_t limit) {
  const bool has_single = text.find('\'') != std::string::npos, has_double = text.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::vector<std::string> chars;  // the repr's characters, each as UTF-8
  chars.emplace_back(1, quote);
  static const char* const kHex = "0123456789abcdef";
  auto hex = [&](unsigned value, int digits, char kind) {  // an escape is as many characters as it shows
    chars.emplace_back(1, '\\');
    chars.emplace_back(1, kind);
    for (int d = digits - 1; d >= 0; --d) chars.emplace_back(1, kHex[(value >> (4 * d)) & 0xf]);
  };
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    size_t n = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
    if (i + n > text.size()) n = text.size() - i;
    unsigned cp = n == 1 ? c : c & (0xff >> (n + 1));
    for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3f);
    if (c == '\\' || c == static_cast<unsigned char>(quote)) {
      chars.emplace_back(1, '\\');
      chars.emplace_back(1, static_cast<char>(c));
    } else if (c == '\n' || c == '\r' || c == '\t') {
      chars.emplace_back(1, '\\');
      chars.emplace_back(1, c == '\n' ? 'n' : c == '\r' ? 'r' : 't');
    } else if (cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp <= 0xa0) || cp == 0xad) {
      hex(cp, 2, 'x');  // not printable: str.isprintable()'s common cases
    } else if ((cp >= 0x2000 && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202f) || cp == 0xfeff) {
      hex(cp, 4, 'u');
    } else {
      chars.push_back(text.substr(i, n));
    }
    i += n;
  }
  chars.emplace_back(1, quote);
  std::string out;
  for (size_t i = 0; i < chars.size() && i < limit; ++i) out += chars[i];
  if (chars.size() > limit) out += "... (cut: " + std::to_string(chars.size() - limit) + " more characters)";
  return out;
}

const char* CodeName(StatusCode code) {
  static const char* const kNames[kCodes] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
      "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const auto index = static_cast<size_t>(code);
  return index < kCodes ? kNames[index] : "UNKNOWN";
}

}  // namespace attnserve

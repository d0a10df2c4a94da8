#include "plane.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <set>
#include <sstream>

#include <grpc/support/time.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>

namespace attnserve {

namespace {

using Clock = std::chrono::steady_clock;
using grpc::Status;
using grpc::StatusCode;

uint64_t NanosSince(Clock::time_point start) {
  return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - start).count());
}

Status Invalid(const std::string& message) { return Status(StatusCode::INVALID_ARGUMENT, message); }

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
size_t CharsEnd(const std::string& text, size_t chars, size_t* count = nullptr) {
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

// One input's bytes, wherever the request carries them.
struct Data {
  const char* bytes = nullptr;
  size_t size = 0;
};

// -- request control's helpers (docs/native-data-plane.md, "Request control") --------------------

// A gRPC client cancels at its own deadline, which runs out before the server's: a cancel this
// close to it counts as the deadline (server.request_path's _DEADLINE_SLACK_S).
constexpr auto kDeadlineSlack = std::chrono::milliseconds(500);
enum CancelReason : size_t { kClient = 0, kDeadline = 1 };
enum CancelStage : size_t { kQueued = 0, kRunning = 1, kTerminated = 2, kAnswered = 3 };
// Batch::cancelled[i]: 0 live, 1 cancelled, 2 settled by Complete (a cancel then is the answered stage),
// 3 cancelled and answered CANCELLED at once by Cancel (a unary call: its batch computes on without it).
constexpr char kLive = 0, kGone = 1, kSettled = 2, kLeft = 3;

Status Cancelled() { return Status(StatusCode::CANCELLED, "the client went away"); }  // server.errors.CANCELLED
// A call refused by the drain: never computed, retry elsewhere (server.gate's words).
Status ShuttingDown() { return Status(StatusCode::UNAVAILABLE, "server is shutting down; retry on another replica"); }
// A queued call the stop refuses (server.batcher.Batcher.close's words).
Status NotStarted(const std::string& model) {
  return Status(StatusCode::UNAVAILABLE, "model " + model +
                                             ": shutting down, not started within the grace period; "
                                             "retry on another replica");
}

// The call's gRPC deadline on the steady clock (kNever: none).
TimePoint CallDeadline(const grpc::CallbackServerContext* context) {
  const gpr_timespec raw = context->raw_deadline();
  const gpr_timespec left = gpr_time_sub(gpr_convert_clock_type(raw, GPR_CLOCK_MONOTONIC), gpr_now(GPR_CLOCK_MONOTONIC));
  if (gpr_time_cmp(raw, gpr_inf_future(raw.clock_type)) == 0 || left.tv_sec > (int64_t{1} << 32)) return kNever;
  return Clock::now() + std::chrono::seconds(left.tv_sec) + std::chrono::nanoseconds(left.tv_nsec);
}

// Seconds with three decimals, as the Python plane's f"{s:.3f}".
std::string Seconds3(Clock::duration d) {
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

// A schedule parameter as server.scheduling._parameter_int reads it: absent (false), an integer
// >= 0, or INVALID_ARGUMENT in the Python plane's words.
Status ParameterInt(const inference::ModelInferRequest& request, const std::string& name, uint64_t* value, bool* given) {
  const auto found = request.parameters().find(name);
  *given = found != request.parameters().end();
  if (!*given) return Status::OK;
  const inference::InferParameter& v = found->second;
  using P = inference::InferParameter;
  if (v.parameter_choice_case() == P::kUint64Param) {
    *value = v.uint64_param();
    return Status::OK;
  }
  if (v.parameter_choice_case() == P::kInt64Param) {
    if (v.int64_param() < 0) {
      return Invalid("parameter '" + name + "' must be >= 0, got " + std::to_string(v.int64_param()));
    }
    *value = static_cast<uint64_t>(v.int64_param());
    return Status::OK;
  }
  std::string got = "nothing";
  if (v.parameter_choice_case() == P::kBoolParam) got = std::string("bool_param ") + (v.bool_param() ? "True" : "False");
  if (v.parameter_choice_case() == P::kStringParam) got = "string_param " + PyRepr(v.string_param());
  if (v.parameter_choice_case() == P::kDoubleParam) got = "double_param " + PyFloat(v.double_param());
  return Invalid("parameter '" + name + "' must be an integer (int64_param or uint64_param; a JSON integer), got " + got);
}

// codec._check_contents_fields: typed contents in a field not the input's datatype's (bytes_contents,
// int64_contents, ... for FP32 or BOOL) are refused, the first in field order named, never ignored.
Status ForeignContents(const inference::ModelInferRequest::InferInputTensor& t, bool boolean) {
  const inference::InferTensorContents& c = t.contents();
  const char* own = boolean ? "bool_contents" : "fp32_contents";
  const std::pair<const char*, int> fields[] = {  // InferTensorContents' fields, by number
      {"bool_contents", c.bool_contents_size()},     {"int_contents", c.int_contents_size()},
      {"int64_contents", c.int64_contents_size()},   {"uint_contents", c.uint_contents_size()},
      {"uint64_contents", c.uint64_contents_size()}, {"fp32_contents", c.fp32_contents_size()},
      {"fp64_contents", c.fp64_contents_size()},     {"bytes_contents", c.bytes_contents_size()}};
  for (const auto& [name, size] : fields) {
    if (size > 0 && std::strcmp(name, own) != 0) {
      return Invalid("input " + PyRepr(t.name()) + ": contents." + name + " is not for datatype " + t.datatype() +
                     ": its values go in contents." + own + " or raw_input_contents");
    }
  }
  return Status::OK;
}

// -- the Python plane's words for a request that does not fit (server.codec.decode, server.parsing) --

using Wide = unsigned __int128;  // Python's integers: a hostile shape's products, exact
constexpr Wide kWideMax = ~Wide{0};

Wide WideMul(Wide a, Wide b) { return a != 0 && b > kWideMax / a ? kWideMax : a * b; }

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

// server.quoting.quoted of a list, built no further than the cut: a hostile list may be huge.
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
std::string MaskShapes(int64_t heads, bool sized = false, int64_t b = 0, int64_t lq = 0, int64_t lk = 0) {
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

// What a request's mask asks of the run (server.graphs' maskings, as tensors.Work finds them).
enum class Masking { kNone, kKeyPadding, kGeneral, kHeads };
// The graphs that hold an attention matrix, in codec.NATIVE_HELD_ORDER; kFused holds none.
enum Held : size_t { kHeadMaskAll = 0, kHeadMaskOutput, kAllOutputs, kOutputOnly, kFusedKeyPadding, kFused };

// server.graphs.GraphSet.graph_for: the graph a request alone runs on.
Held GraphFor(const ModelLimits::Graphs& g, Masking masking, bool want_probs, int64_t q_len, int64_t k_len) {
  if (masking == Masking::kHeads) return want_probs ? kHeadMaskAll : kHeadMaskOutput;
  if (want_probs) return kAllOutputs;
  const int64_t from = masking == Masking::kNone ? g.fused_from
                       : masking == Masking::kKeyPadding ? g.fused_key_padding_from : -1;
  if (from >= 0 && q_len * k_len >= from * from) return masking == Masking::kNone ? kFused : kFusedKeyPadding;
  return g.output_only ? kOutputOnly : kAllOutputs;
}

// tensors.Work's masking of a mask whose heads are alike (head 0 read): a fully masked row, or
// rows that differ, need the whole mask; rows alike that mask some key are key padding.
Masking MaskingOf(const uint8_t* mask, int64_t items, int64_t item_stride, int64_t q_len, int64_t k_len,
                  bool exact_k_len) {
  if (exact_k_len) return Masking::kGeneral;
  bool attends_all = true;
  for (int64_t item = 0; item < items; ++item) {
    const uint8_t* first = mask + item * item_stride;
    for (int64_t i = 1; i < q_len; ++i) {
      if (std::memcmp(first, first + i * k_len, static_cast<size_t>(k_len)) != 0) return Masking::kGeneral;
    }
    attends_all = attends_all && std::find(first, first + k_len, uint8_t{0}) == first + k_len;
  }
  return attends_all ? Masking::kNone : Masking::kKeyPadding;
}

// A queued request's masking (tensors.Work.masking), from what Parse kept of its mask.
Masking MaskingOf(const Pending& p) {
  if (p.heads_differ) return Masking::kHeads;
  if (p.mask != nullptr) return p.key_padding ? Masking::kKeyPadding : Masking::kGeneral;
  return Masking::kNone;
}

// tensors.batch_masking: the masking a merged run needs, KEY_PADDING once keys are padded.
Masking Merged(Masking a, Masking b, bool same_k_len) {
  if (a == Masking::kHeads || b == Masking::kHeads) return Masking::kHeads;
  if (a == Masking::kGeneral || b == Masking::kGeneral) return Masking::kGeneral;
  if (a == Masking::kKeyPadding || b == Masking::kKeyPadding || !same_k_len) return Masking::kKeyPadding;
  return Masking::kNone;
}

// graphs.scores_held: the scores per head a run holds on graph `g` (none on the flash path).
int64_t ScoresHeld(Held g, int64_t rows, int64_t q_len, int64_t k_len) { return g == kFused ? 0 : rows * q_len * k_len; }

// One step of server/proto's wire scan (wire.check_fields): false with its WireError's words.
bool ReadVarint(google::protobuf::io::CodedInputStream& in, uint64_t* value, std::string* why) {
  if (in.ReadVarint64(value)) return true;
  *why = "truncated or overlong varint";
  return false;
}

}  // namespace

Plane::~Plane() {
  if (server_) Stop(0);  // halted (Halt) but not stopped: its listener still closes
  StopTimer();
  StopHandoff();
  if (budget_) budget_->SetNativeWake(nullptr);  // the budget may outlive the plane (Python holds it)
}

size_t Plane::AddModel(const ModelLimits& limits) {
  auto queue = std::make_unique<Queue>();
  queue->limits = limits;
  std::unique_lock<std::shared_mutex> routes(routes_mu_);
  queue->codes = CodesOf(limits.name);
  size_t index;
  {
    std::unique_lock<std::shared_mutex> lock(models_mu_);
    models_.push_back(std::move(queue));
    index = models_.size() - 1;
  }
  Routing& route = routes_[limits.name];  // the name routes here until Python routes it (Route)
  if (route.versions.empty()) {
    route.codes = CodesOf(limits.name);
    int64_t number = 0;
    route.versions[std::all_of(limits.version.begin(), limits.version.end(), ::isdigit) && !limits.version.empty() &&
                           limits.version.size() < 18
                       ? (number = std::stoll(limits.version))
                       : 0] = index;
    route.not_loaded = " is not loaded (loaded: [" + limits.version + "])";
  }
  return index;
}

// -- model changes, pushed by Python (server.native's sync) ------------------------------------

Codes* Plane::CodesOf(const std::string& name) {
  auto& codes = codes_[name];
  if (!codes) codes = std::make_unique<Codes>();
  return codes.get();
}

Plane::Queue& Plane::At(size_t index) const {
  std::shared_lock<std::shared_mutex> lock(models_mu_);
  return *models_.at(index);
}

void Plane::Route(const std::string& name, const std::map<int64_t, size_t>& versions, int code,
                  const std::string& refusal, const std::string& not_loaded) {
  for (const auto& [version, index] : versions) At(index);  // each index exists (throws otherwise)
  std::unique_lock<std::shared_mutex> lock(routes_mu_);
  Routing& route = routes_[name];
  route.versions = versions;
  route.refusal = code == 0 ? Status::OK : Status(static_cast<StatusCode>(code), refusal);
  route.not_loaded = not_loaded;
  route.codes = CodesOf(name);
}

void Plane::Unroute(const std::string& name) {
  std::unique_lock<std::shared_mutex> lock(routes_mu_);
  routes_.erase(name);
}

void Plane::SetServing(const std::string& serving) {
  std::unique_lock<std::shared_mutex> lock(routes_mu_);
  serving_ = serving;
}

void Plane::Retire(size_t index) {
  Queue& queue = At(index);
  {
    // An Admit that found this queue holds routes_mu_ until it has queued: taking it here waits for it.
    std::unique_lock<std::shared_mutex> routes(routes_mu_);
    std::lock_guard<std::mutex> lock(queue.mu);
    queue.retired = true;
  }
  queue.arrived.notify_all();
}

bool Plane::Drained(size_t index) {
  Queue& queue = At(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  return queue.retired && queue.pending.empty();
}

Status Plane::Find(const inference::ModelInferRequest& request, Queue** queue, Codes** codes) const {
  const std::string& name = request.model_name();
  auto found = routes_.find(name);
  if (found == routes_.end()) return Status(StatusCode::NOT_FOUND, "unknown model " + Quoted(name) + serving_);
  const Routing& route = found->second;
  *codes = route.codes;
  if (!route.refusal.ok()) return route.refusal;
  const std::string& version = request.model_version();
  auto served = route.versions.end();
  if (version.empty() && !route.versions.empty()) {
    served = std::prev(route.versions.end());  // the highest, as the registry's default
  } else if (!version.empty() && version.size() < 18 && std::all_of(version.begin(), version.end(), ::isdigit)) {
    served = route.versions.find(std::stoll(version));  // "01" is version 1, as int() reads it
  }
  if (served == route.versions.end()) {
    return Status(StatusCode::NOT_FOUND, "model " + name + " version " + Quoted(version) + route.not_loaded);
  }
  *queue = &At(served->second);
  return Status::OK;
}

std::map<std::string, std::array<uint64_t, kCodes>> Plane::FinalCodesByName() const {
  std::map<std::string, std::array<uint64_t, kCodes>> out;
  std::shared_lock<std::shared_mutex> lock(routes_mu_);
  for (const auto& [name, codes] : codes_) {
    auto& counts = out[name];
    for (size_t i = 0; i < kCodes; ++i) counts[i] = (*codes)[i].load();
  }
  auto& unknown = out[""];  // no model has the name "" (a repository's names are directories)
  for (size_t i = 0; i < kCodes; ++i) unknown[i] += unknown_codes_[i].load();
  return out;
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

void Plane::SetAnswer(const std::string& method, const std::string& name, std::string bytes) {
  answers_[{method, name}] = std::move(bytes);
}

int Plane::Start(const std::vector<std::string>& addresses, int max_message_bytes, int max_concurrent_streams) {
  grpc::ServerBuilder builder;
  unbound_.clear();
  auto credentials = Credentials();
  if (!credentials || addresses.empty()) return 0;
  // gRPC binds them in this order when the server starts; one that fails leaves its port 0 and stops the start.
  std::vector<int> ports(addresses.size(), 0);
  for (size_t i = 0; i < addresses.size(); ++i) builder.AddListeningPort(addresses[i], credentials, &ports[i]);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, reuse_port_ ? 1 : 0);  // alone, a port in use is an error
  for (const auto& [name, value] : channel_args_) builder.AddChannelArgument(name, value);
  // Every method not served here; gRPC refuses a service with generic methods but no generic service.
  if (!upstream_) no_upstream_ = std::make_unique<grpc::CallbackGenericService>();  // answers UNIMPLEMENTED
  builder.RegisterCallbackGenericService(upstream_ ? static_cast<grpc::CallbackGenericService*>(upstream_.get())
                                                   : no_upstream_.get());
  builder.RegisterService(this);
  server_ = builder.BuildAndStart();
  const auto unbound = std::find_if(ports.begin(), ports.end(), [&](int p) { return p == 0 || p != ports[0]; });
  if (!server_ || unbound != ports.end()) {
    if (server_) server_->Shutdown();
    server_.reset();
    unbound_ = addresses[unbound != ports.end() ? unbound - ports.begin() : 0];
    return 0;
  }
  if (!timer_.joinable()) timer_ = std::thread([this] { Reap(); });
  return ports[0];
}

void Plane::Count(Queue* queue, const Status& status) {
  Count(queue != nullptr ? queue->codes : &unknown_codes_, status);
}

void Plane::Count(Codes* codes, const Status& status) {
  const auto code = static_cast<size_t>(status.error_code());
  (codes != nullptr ? *codes : unknown_codes_)[code < kCodes ? code : static_cast<size_t>(StatusCode::UNKNOWN)]++;
}

void Plane::Answer(grpc::ServerUnaryReactor* reactor, Queue* queue, const Status& status) {
  Count(queue, status);
  reactor->Finish(Bounded(status));
}

void Plane::Settle(const Pending& p, Queue* queue, const Status& status, std::vector<CallRecord>* into) {
  Settle(p, queue != nullptr ? queue->codes : &unknown_codes_, status, into);
}

void Plane::Settle(const Pending& p, Codes* codes, const Status& status, std::vector<CallRecord>* into) {
  Count(codes, status);
  if (p.note && records_) Record(p, status, into);  // before the answer: its request and response go with it
  if (p.stream == nullptr) {
    p.reactor->Finish(Bounded(status));
    return;
  }
  p.stream->Answered(p.seq, Bounded(status));
}

void Plane::Left(int64_t calls) {
  if (in_flight_.fetch_sub(calls) != calls) return;
  { std::lock_guard<std::mutex> lock(idle_mu_); }  // a waiter between its check and its wait is woken
  idle_.notify_all();
}

bool Plane::WaitIdle(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(idle_mu_);
  return idle_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                        [&] { return in_flight_ <= 0 && Arriving() == 0; });
}

int64_t Plane::Arriving() const {
  const TimePoint since = Clock::now() - std::chrono::duration_cast<Clock::duration>(arrival_timeout_);
  std::lock_guard<std::mutex> lock(arriving_mu_);
  int64_t count = 0;
  for (const auto& [call, arrival] : arriving_) count += arrival.came >= since;
  return count;
}

int64_t Plane::Receiving() const {
  const TimePoint since = Clock::now() - std::chrono::duration_cast<Clock::duration>(arrival_timeout_);
  std::lock_guard<std::mutex> lock(arriving_mu_);
  int64_t count = 0;
  for (const auto& [call, arrival] : arriving_) count += !arrival.claimed && arrival.came >= since;
  return count;
}

bool Plane::Arrived(const void* call, std::function<void(const Status&)> refuse) {
  std::lock_guard<std::mutex> lock(arriving_mu_);  // ordered with Halt's sweep: a call is either swept or admitted
  arriving_.emplace(call, Arrival{Clock::now(), false, std::move(refuse)});
  return !refusing_;
}

bool Plane::Claim(const void* call) {
  std::lock_guard<std::mutex> lock(arriving_mu_);
  auto found = arriving_.find(call);
  if (found == arriving_.end()) return false;  // Halt refused it
  found->second.claimed = true;
  return true;
}

void Plane::ArrivalDone(const void* call) {
  {
    std::lock_guard<std::mutex> lock(arriving_mu_);
    if (arriving_.erase(call) == 0) return;
  }
  { std::lock_guard<std::mutex> lock(idle_mu_); }  // a waiter between its check and its wait is woken
  idle_.notify_all();
}

void Plane::HeadersLine(const char* method) {  // the gate's arrival line, among the arrival counts (records.h)
  if (!records_ || !arrivals_) return;
  records_->AddArrival(method);
}

std::array<uint64_t, kCodes> Plane::FinalCodes(size_t index) const {
  std::shared_lock<std::shared_mutex> lock(models_mu_);
  const Codes& codes = index < models_.size() ? *models_[index]->codes : unknown_codes_;
  std::array<uint64_t, kCodes> out{};
  for (size_t i = 0; i < kCodes; ++i) out[i] = codes[i].load();
  return out;
}

void Plane::Stop(double grace_s) {
  Halt();
  if (server_) {
    // Batches being computed finish meanwhile (their runner threads call Complete).
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::microseconds(static_cast<int64_t>(grace_s * 1e6)));
    StopHandoff();
    server_.reset();
  }
  StopTimer();
}

void Plane::Halt() {
  stopping_ = true;
  refusing_ = true;
  ready_ = false;
  std::vector<Queue*> queues;
  {
    std::shared_lock<std::shared_mutex> lock(models_mu_);
    for (auto& queue : models_) queues.push_back(queue.get());
  }
  for (Queue* queue : queues) {
    std::deque<Pending> refused;
    {
      std::lock_guard<std::mutex> lock(queue->mu);
      refused.swap(queue->pending);
      queue->queued_bytes = 0;
    }
    queue->arrived.notify_all();
    for (auto& p : refused) Settle(p, queue, NotStarted(queue->limits.name));
    if (!refused.empty()) Left(static_cast<int64_t>(refused.size()));
  }
  std::map<int64_t, Parked> waiting;  // calls waiting for memory: refused the same way
  {
    std::lock_guard<std::mutex> lock(parked_mu_);
    waiting.swap(parked_);
  }
  for (auto& [ticket, parked] : waiting) {
    if (!budget_->Leave(ticket)) budget_->Give(parked.total);
    Settle(parked.p, parked.queue, NotStarted(parked.queue->limits.name));
  }
  if (!waiting.empty()) Left(static_cast<int64_t>(waiting.size()));
  // Headers in, message not: refused, as a second signal refuses what has not started.
  std::vector<std::function<void(const Status&)>> arriving;
  {
    std::lock_guard<std::mutex> lock(arriving_mu_);
    for (auto it = arriving_.begin(); it != arriving_.end();) {
      if (it->second.claimed) {
        ++it;
        continue;
      }
      arriving.push_back(std::move(it->second.refuse));
      it = arriving_.erase(it);
    }
  }
  for (auto& refuse : arriving) {
    const Status status = Bounded(ShuttingDown());
    Count(static_cast<Codes*>(nullptr), status);
    refuse(status);
  }
  if (!arriving.empty()) {
    { std::lock_guard<std::mutex> lock(idle_mu_); }  // a waiter between its check and its wait is woken
    idle_.notify_all();
  }
}

Status Plane::Check(const Queue& queue, const inference::ModelInferRequest& request, Pending& p) const {
  const ModelLimits& m = queue.limits;
  const Contract& c = contract_;
  // Triton's schedule policy (`priority`, `timeout`), read before any tensor, as the Python plane does.
  if (Status schedule = Schedule(m, request, p); !schedule.ok()) return schedule;
  // Then codec.decode's checks, in its order and words: names, shapes, outputs, the answer's size,
  // each tensor's contents, the mask's heads, the attention matrix of the graph that would run it.
  const std::string* names[4] = {&c.query, &c.key, &c.value, &c.mask};
  const int inputs = request.inputs_size();
  std::vector<int> slot_of(static_cast<size_t>(inputs));
  for (int i = 0; i < inputs; ++i) {
    const std::string& name = request.inputs(i).name();
    int slot = -1;
    for (int s = 0; s < 4; ++s)
      if (name == *names[s]) slot = s;
    if (slot < 0) {
      return Invalid("unknown input " + Quoted(name) + "; model " + m.name + " takes " +
                     NamesRepr({&c.query, &c.key, &c.value, &c.mask}));
    }
    slot_of[static_cast<size_t>(i)] = slot;
  }
  const inference::ModelInferRequest::InferInputTensor* tensors[4] = {nullptr, nullptr, nullptr, nullptr};
  const std::string* duplicate = nullptr;  // the first of the repeated names in sorted order
  for (int i = 0; i < inputs; ++i) {
    const int s = slot_of[static_cast<size_t>(i)];
    if (tensors[s] == nullptr) {
      tensors[s] = &request.inputs(i);
    } else if (duplicate == nullptr || *names[s] < *duplicate) {
      duplicate = names[s];
    }
  }
  if (duplicate != nullptr) return Invalid("input " + PyRepr(*duplicate) + " given more than once");
  for (int s = 0; s < 3; ++s) {
    if (tensors[s] == nullptr) {
      return Invalid("missing input " + PyRepr(*names[s]) + "; required: " + NamesRepr({&c.query, &c.key, &c.value}) +
                     ", optional: " + NamesRepr({&c.mask}));
    }
  }
  const bool raw = request.raw_input_contents_size() > 0;
  if (raw && request.raw_input_contents_size() != inputs) {
    return Invalid("raw_input_contents has " + std::to_string(request.raw_input_contents_size()) + " entries for " +
                   std::to_string(inputs) + " inputs");
  }
  // Shapes first: every check up to the contents is arithmetic on them, nothing is read yet.
  for (int i = 0; i < inputs; ++i) {
    const auto& t = request.inputs(i);
    const bool is_mask = slot_of[static_cast<size_t>(i)] == 3;
    const std::string& want = is_mask ? c.boolean : c.fp32;
    if (t.datatype() != want) {
      return Invalid("input " + PyRepr(t.name()) + ": expected datatype " + want + ", got " + Quoted(t.datatype()));
    }
    const int rank = t.shape_size();
    if (is_mask ? rank < 2 || rank > 4 : rank != 3) {
      return Invalid("input " + PyRepr(t.name()) + ": expected rank " +
                     (is_mask ? "2 or 3 or 4 (" + MaskShapes(m.num_heads) + ")" : std::string("3")) + ", got shape " +
                     QuotedShape(t.shape()));
    }
    for (int64_t d : t.shape()) {
      if (d < 0) return Invalid("input " + PyRepr(t.name()) + ": negative dimension in shape " + ListRepr(t.shape()));
    }
  }
  const auto& qs = tensors[0]->shape();
  const int64_t b = qs[0], lq = qs[1];
  const int64_t widths[3] = {m.query_dim, m.kv_dim, m.kv_dim};
  for (int s = 0; s < 3; ++s) {
    const auto& shape = tensors[s]->shape();
    if (shape[2] != widths[s]) {
      return Invalid("input " + PyRepr(*names[s]) + ": expected shape [batch, length, " + std::to_string(widths[s]) +
                     "], got " + ListRepr(shape));
    }
  }
  for (int s = 1; s < 3; ++s) {
    if (tensors[s]->shape(0) != b) {
      return Invalid("input " + PyRepr(*names[s]) + ": batch size " + std::to_string(tensors[s]->shape(0)) +
                     " disagrees with " + c.query + "'s " + std::to_string(b));
    }
  }
  const int64_t lk = tensors[1]->shape(1);
  if (tensors[2]->shape(1) != lk) {
    return Invalid("input " + PyRepr(c.value) + ": length " + std::to_string(tensors[2]->shape(1)) +
                   " disagrees with " + c.key + "'s " + std::to_string(lk));
  }
  if (tensors[3] != nullptr) {
    const auto& ms = tensors[3]->shape();
    const bool ok = (ms.size() == 2 && ms[0] == lq && ms[1] == lk) ||
                    (ms.size() == 3 && ms[0] == b && ms[1] == lq && ms[2] == lk) ||
                    (ms.size() == 4 && ms[0] == b && (ms[1] == 1 || ms[1] == m.num_heads) && ms[2] == lq &&
                     ms[3] == lk);
    if (!ok) {
      return Invalid("input " + PyRepr(c.mask) + ": expected shape " + MaskShapes(m.num_heads, true, b, lq, lk) +
                     ", got " + ListRepr(ms));
    }
  }
  if (b < 1 || lq < 1 || lk < 1) {
    return Invalid("batch, q_len and k_len must be >= 1, got " + std::to_string(b) + ", " + std::to_string(lq) + ", " +
                   std::to_string(lk));
  }
  if (lq > m.max_q_len) {
    return Invalid("input " + PyRepr(c.query) + ": length " + std::to_string(lq) + " exceeds this model's max_q_len " +
                   std::to_string(m.max_q_len));
  }
  if (lk > m.max_kv_len) {
    return Invalid("input " + PyRepr(c.key) + ": length " + std::to_string(lk) + " exceeds this model's max_kv_len " +
                   std::to_string(m.max_kv_len));
  }
  p.rows = b;
  p.q_len = lq;
  p.k_len = lk;
  p.raw = raw;
  if (request.outputs_size() == 0) {
    p.order_probs = {false, true};  // the protocol: no outputs named means all of them
  } else {
    for (const auto& o : request.outputs()) {
      if (o.name() == c.output) {
        p.order_probs.push_back(false);
      } else if (o.name() == c.attn_probs) {
        p.order_probs.push_back(true);
      } else {
        return Invalid("unknown output " + Quoted(o.name()) + "; model " + m.name + " has " +
                       NamesRepr({&c.output, &c.attn_probs}));
      }
    }
    // Each repeat would be answered in full: a small request could ask for any number of copies.
    if (request.outputs_size() > 2 || (request.outputs_size() == 2 && p.order_probs[0] == p.order_probs[1])) {
      return Invalid("output requested more than once: " +
                     QuotedList(request.outputs(), [](const auto& o) { return PyRepr(o.name()); }));
    }
  }
  p.want_output = std::find(p.order_probs.begin(), p.order_probs.end(), false) != p.order_probs.end();
  p.want_probs = std::find(p.order_probs.begin(), p.order_probs.end(), true) != p.order_probs.end();
  if (Status bound = Bound(queue, request, p); !bound.ok()) return bound;

  // The contents, tensor by tensor in the request's order.
  Data data[4];
  for (int i = 0; i < inputs; ++i) {
    const auto& t = request.inputs(i);
    const int s = slot_of[static_cast<size_t>(i)];
    const bool boolean = s == 3;
    const Wide count = Product(t.shape());
    if (t.has_contents()) {
      if (Status foreign = ForeignContents(t, boolean); !foreign.ok()) return foreign;
    }
    if (raw) {
      if (t.has_contents()) {
        return Invalid("input " + PyRepr(t.name()) + ": has typed contents and raw_input_contents; use one");
      }
      const std::string& bytes = request.raw_input_contents(i);
      const Wide needed = WideMul(count, boolean ? 1 : 4);
      if (static_cast<Wide>(bytes.size()) != needed) {
        return Invalid("input " + PyRepr(t.name()) + ": shape " + ListRepr(t.shape()) + " " + t.datatype() +
                       " needs " + Decimal(needed) + " bytes, raw_input_contents has " + std::to_string(bytes.size()));
      }
      if (boolean) {  // the protocol's BOOL is one byte, 1 = true, 0 = false: any other is not a BOOL
        const auto* octets = reinterpret_cast<const uint8_t*>(bytes.data());
        const auto* bad = std::find_if(octets, octets + bytes.size(), [](uint8_t v) { return v > 1; });
        if (bad != octets + bytes.size()) {
          char hex[8];
          std::snprintf(hex, sizeof hex, "0x%02X", *bad);
          return Invalid("input " + PyRepr(t.name()) + ": BOOL bytes must be 0 or 1; byte " +
                         std::to_string(bad - octets) + " is " + hex);
        }
      }
      data[s] = {bytes.data(), bytes.size()};
    } else {
      const size_t values = boolean ? static_cast<size_t>(t.contents().bool_contents_size())
                                    : static_cast<size_t>(t.contents().fp32_contents_size());
      if (static_cast<Wide>(values) != count) {
        return Invalid("input " + PyRepr(t.name()) + ": shape " + ListRepr(t.shape()) + " needs " + Decimal(count) +
                       " values in contents." + (boolean ? "bool_contents" : "fp32_contents") + ", got " +
                       std::to_string(values));
      }
      // Typed BOOL values are C++ bools: one byte each, 0 or 1.
      data[s] = boolean ? Data{reinterpret_cast<const char*>(t.contents().bool_contents().data()), values}
                        : Data{reinterpret_cast<const char*>(t.contents().fp32_contents().data()), values * 4};
    }
  }
  // Every size below is bounded by the message's bytes now.
  const size_t q_bytes = data[0].size, k_bytes = data[1].size;
  p.input_bytes = static_cast<int64_t>(q_bytes + 2 * k_bytes);
  p.query = reinterpret_cast<const float*>(data[0].bytes);
  p.key = reinterpret_cast<const float*>(data[1].bytes);
  p.value = reinterpret_cast<const float*>(data[2].bytes);
  Masking masking = Masking::kNone;
  if (tensors[3] != nullptr) {
    const auto& ms = tensors[3]->shape();
    const int64_t plane = lq * lk;
    const int64_t heads = ms.size() == 4 ? ms[1] : 1;
    p.mask_row_stride = ms.size() == 2 ? 0 : heads * plane;
    const size_t mask_bytes = data[3].size;
    // Work.mask_nbytes: as sent, or as a run copies it ((lq, lk) over the batch), whichever is more.
    p.input_bytes += std::max(static_cast<int64_t>(mask_bytes), b * plane);
    const auto* bytes = reinterpret_cast<const uint8_t*>(data[3].bytes);
    const int64_t items = ms.size() == 2 ? 1 : b;
    for (int64_t item = 0; item < items && heads > 1 && !p.heads_differ; ++item) {
      const uint8_t* first = bytes + item * p.mask_row_stride;
      for (int64_t h = 1; h < heads && !p.heads_differ; ++h) p.heads_differ = std::memcmp(first, first + h * plane, plane) != 0;
    }
    if (p.heads_differ && !m.head_masks) return Invalid(m.why_no_head_masks);
    p.mask_head_stride = p.heads_differ ? plane : 0;
    p.mask = bytes;
    // A query row that masks every key is uniform over the keys it sees: its keys are never padded.
    const int64_t planes = p.heads_differ ? heads : 1;
    for (int64_t item = 0; item < items && !p.exact_k_len; ++item) {
      for (int64_t h = 0; h < planes && !p.exact_k_len; ++h) {
        for (int64_t i = 0; i < lq && !p.exact_k_len; ++i) {
          const uint8_t* row = bytes + item * p.mask_row_stride + h * plane + i * lk;
          p.exact_k_len = std::find(row, row + lk, uint8_t{1}) == row + lk;
        }
      }
    }
    masking = p.heads_differ ? Masking::kHeads : MaskingOf(bytes, items, p.mask_row_stride, lq, lk, p.exact_k_len);
    p.key_padding = masking == Masking::kKeyPadding;
    if (masking == Masking::kNone) {  // masks nothing: run as without one (the batcher's merge drops it too)
      p.mask = nullptr;
      p.mask_row_stride = 0;
    }
  }
  // codec._check_attention_bytes: the matrix the graph that would run it alone holds.
  const Held graph = GraphFor(m.graphs, masking, p.want_probs, lq, lk);
  const Wide needed = graph == kFused ? 0 : WideMul(WideMul(WideMul(static_cast<Wide>(b), m.num_heads), lq), lk * 4);
  if (needed > static_cast<Wide>(m.max_attention_bytes)) {
    const auto& why = m.graphs.why_held;
    const std::string held = static_cast<size_t>(graph) < why.size() ? ": " + why[graph] : "";
    return Invalid("request needs a " + WideCommas(needed) + "-byte attention matrix (batch " + std::to_string(b) +
                   " x " + std::to_string(m.num_heads) + " heads x " + std::to_string(lq) + " x " + std::to_string(lk) +
                   " x 4" + held + "); the limit is " + Commas(m.max_attention_bytes) + " bytes" + m.graphs.flash_hint);
  }
  return Status::OK;
}

void Plane::SetGraphs(size_t index, const ModelLimits::Graphs& graphs) {
  Queue& queue = *models_.at(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  queue.limits.graphs = graphs;
}

namespace {

// One output tensor of the answer: its header, then its floats in order, appended to its
// raw_output_contents (never zero-filled first) or written into its fp32_contents.
class OutputTo {
 public:
  OutputTo(inference::ModelInferResponse* response, const std::string& name, const std::string& datatype,
           std::initializer_list<int64_t> shape, bool raw, size_t count) {
    auto* tensor = response->add_outputs();
    tensor->set_name(name);
    tensor->set_datatype(datatype);
    for (int64_t d : shape) tensor->add_shape(d);
    if (raw) {
      bytes_ = response->add_raw_output_contents();
      bytes_->reserve(count * 4);
      return;
    }
    auto* values = tensor->mutable_contents()->mutable_fp32_contents();
    values->Resize(static_cast<int>(count), 0.0f);
    at_ = values->mutable_data();
  }
  void Put(const float* from, size_t count) {
    if (bytes_ != nullptr) {
      bytes_->append(reinterpret_cast<const char*>(from), count * 4);
    } else {
      std::memcpy(at_, from, count * 4);
      at_ += count;
    }
  }
  void Zeros(size_t count) {
    if (bytes_ != nullptr) {
      bytes_->append(count * 4, '\0');
    } else {
      at_ += count;  // Resize wrote them
    }
  }

 private:
  std::string* bytes_ = nullptr;
  float* at_ = nullptr;
};

}  // namespace

void Plane::SetZerosHandoff() {
  if (handoff_thread_.joinable()) return;
  handoff_thread_ = std::thread([this] {
    std::unique_lock<std::mutex> lock(handoff_mu_);
    for (;;) {
      handoff_cv_.wait(lock, [this] { return handoff_stop_ || !handoff_.empty(); });
      if (handoff_.empty()) return;  // stopping, and every call answered
      Handoff next = std::move(handoff_.front());
      handoff_.pop_front();
      lock.unlock();
      counters_.handed_off++;  // before its answer, which its client may read before this thread goes on
      AnswerZeros(next.p, *next.queue);
      lock.lock();
    }
  });
}

void Plane::StopHandoff() {
  if (!handoff_thread_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(handoff_mu_);
    handoff_stop_ = true;
  }
  handoff_cv_.notify_one();
  handoff_thread_.join();
}

void Plane::AnswerZeros(Pending& p, Queue& queue) {
  const ModelLimits& m = queue.limits;
  p.response->set_model_name(m.name);
  p.response->set_model_version(m.version);
  p.response->set_id(p.request->id());
  for (bool probs : p.order_probs) {
    const size_t count = static_cast<size_t>(probs ? p.rows * m.num_heads * p.q_len * p.k_len
                                                   : p.rows * p.q_len * m.out_dim);
    if (probs) {
      OutputTo(p.response, contract_.attn_probs, contract_.fp32, {p.rows, m.num_heads, p.q_len, p.k_len}, p.raw,
               count).Zeros(count);
    } else {
      OutputTo(p.response, contract_.output, contract_.fp32, {p.rows, p.q_len, m.out_dim}, p.raw, count).Zeros(count);
    }
  }
  Settle(p, &queue, Status::OK);
}

namespace {

// The methods this service serves itself (natively, or through the rare RPCs' relay to the event loop).
const std::set<std::string> kServedHere = {"ServerLive",      "ServerReady",    "ModelReady",      "ServerMetadata",
                                           "ModelMetadata",   "ModelConfig",    "ModelStatistics", "RepositoryIndex",
                                           "ModelInfer",      "ModelStreamInfer"};
const std::string kModelInferMethod = "/inference.GRPCInferenceService/ModelInfer";
constexpr size_t kCopiedBelow = 4096;  // raw_output_contents shorter than this are copied into the answer's head

// The Python server's answer to a relayed ModelInfer request, into the call's typed response.
Status ReadAnswer(const grpc::ByteBuffer& answer, inference::ModelInferResponse* response) {
  grpc::ByteBuffer copy(answer);  // shares the slices; the reader takes a mutable buffer
  grpc::ProtoBufferReader reader(&copy);
  if (!reader.status().ok() || !response->ParseFromZeroCopyStream(&reader)) {
    return Status(StatusCode::INTERNAL, "the Python server's answer does not parse as a ModelInferResponse");
  }
  return Status::OK;
}

// A ModelInfer call whose request the plane parses itself (gRPC's generated handler answers bytes
// that do not parse UNIMPLEMENTED, without a message); it owns the parsed request until gRPC is done.
class InferCall final : public grpc::ServerUnaryReactor {
 public:
  InferCall(Plane* plane, TimePoint deadline) : plane_(plane), deadline_(deadline) {}
  inference::ModelInferRequest request;
  SharedBudget* budget = nullptr;
  int64_t reserved = 0;  // its budget reservation: given back once the answer is sent (or the call is gone)
  std::shared_ptr<UnaryRelay> relayed;  // handed to the Python server (Plane::ToPython)
  std::atomic<int64_t> answered_by{-1};  // the model index once its answer is handed to gRPC (Complete)
  void OnCancel() override {  // after the handler returned
    if (relayed) {
      relayed->Cancel();
      return;
    }
    const int64_t answered = answered_by.load();
    if (answered >= 0) {
      plane_->CancelAnswered(static_cast<size_t>(answered), deadline_);  // computed, gone before it was sent
    } else if (!plane_->Cancel(this, nullptr, deadline_) && answered_by.load() >= 0) {
      plane_->CancelAnswered(static_cast<size_t>(answered_by.load()), deadline_);  // answered meanwhile
    }
  }
  void OnDone() override {
    if (reserved > 0) budget->Give(reserved);
    delete this;
  }

 private:
  Plane* plane_;
  TimePoint deadline_;
};

// A ServerCallbackUnary that is no gRPC call: it binds an InferCall to the ReceivedCall that reads
// its message, so that the unary reactor's Finish answers through the streaming call.
class UnaryBinding final : public grpc::ServerCallbackUnary {
 public:
  using Finisher = std::function<void(grpc::Status)>;
  UnaryBinding(Finisher finish, std::function<void()> send_initial_metadata)
      : finish_(std::move(finish)), send_initial_metadata_(std::move(send_initial_metadata)) {}
  void Bind(grpc::ServerUnaryReactor* reactor) { BindReactor(reactor); }
  void Finish(grpc::Status s) override { finish_(std::move(s)); }
  void SendInitialMetadata() override { send_initial_metadata_(); }

 private:
  // gRPC's own bookkeeping of a call, unused: ReceivedCall forwards OnCancel and OnDone itself.
  grpc::internal::ServerReactor* reactor() override { return nullptr; }
  void CallOnDone() override {}
  Finisher finish_;
  std::function<void()> send_initial_metadata_;
};

// ModelInfer's call as gRPC runs it. The method is registered as streaming (Plane::Plane), so gRPC
// hands the call over at its headers and reads its one message only when asked: once a receive slot
// is free (server.gate's rule; until then HTTP/2 flow control holds the message back at the stream's
// window). The plane holds it from its headers on, for the drain (docs/native-data-plane.md, "Drain").
// It then serves as an InferCall (Plane::Infer), whose Finish writes the answer and ends the call.
class ReceivedCall final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ReceivedCall(Plane* plane, grpc::CallbackServerContext* context)
      : plane_(plane),
        context_(context),
        binding_([this](grpc::Status s) { Answer(std::move(s)); }, [this] { StartSendInitialMetadata(); }) {
    admitted_early_ = plane_->Arrived(this, [this](const grpc::Status& s) { Refused(s); });
    plane_->HeadersLine(kModelInferMethod.c_str());
    if (plane_->TakeReceiveSlot(this, [this] { Read(); })) Read();
  }
  void OnReadDone(bool ok) override {
    plane_->GiveReceiveSlot(this);
    if (!plane_->Claim(this)) return;  // Halt refused it while its message was on its way
    if (!ok) {  // the client half-closed without a message, or went away (server.gate's words)
      plane_->ArrivalDone(this);
      Finish(grpc::Status(StatusCode::INVALID_ARGUMENT, "the call sent no request message"));
      return;
    }
    grpc::ServerUnaryReactor* call = plane_->Infer(context_, &bytes_, &response_, admitted_early_);
    binding_.Bind(call);
    call_.store(call);
    plane_->ArrivalDone(this);  // after it is queued (in flight): a drain never sees it in neither
    if (cancelled_.load() && !cancel_told_.exchange(true)) call->OnCancel();  // it went while being admitted
  }
  void OnCancel() override {
    cancelled_.store(true);
    if (grpc::ServerUnaryReactor* call = call_.load()) {
      if (!cancel_told_.exchange(true)) call->OnCancel();
      return;
    }
    // Still waiting for a slot (never read), and not refused by Halt meanwhile: answered here.
    if (plane_->GiveReceiveSlot(this) && plane_->Claim(this)) {
      plane_->ArrivalDone(this);
      Finish(Cancelled());
    }
  }
  void OnDone() override {
    plane_->GiveReceiveSlot(this);  // nothing of it stays in the slots
    plane_->ArrivalDone(this);      // nor in the arriving calls
    if (grpc::ServerUnaryReactor* call = call_.load()) call->OnDone();
    delete this;
  }

 private:
  void Read() {  // its slot is free: its message is read, unless Halt has refused the call meanwhile
    std::lock_guard<std::mutex> lock(mu_);  // a read is never started after Halt's Finish
    if (!refused_) StartRead(&bytes_);
  }
  void Refused(const grpc::Status& s) {  // Halt: its headers came, its message has not
    {
      std::lock_guard<std::mutex> lock(mu_);
      refused_ = true;
    }
    plane_->GiveReceiveSlot(this);
    Finish(s);
  }
  void Answer(grpc::Status s) {
    if (s.ok()) {
      answer_ = EncodeAnswer(&response_);
      StartWriteAndFinish(&answer_, grpc::WriteOptions(), s);
    } else {
      Finish(std::move(s));
    }
  }
  Plane* plane_;
  grpc::CallbackServerContext* context_;
  UnaryBinding binding_;
  grpc::ByteBuffer bytes_;
  inference::ModelInferResponse response_;
  grpc::ByteBuffer answer_;  // response_, encoded (EncodeAnswer)
  std::atomic<grpc::ServerUnaryReactor*> call_{nullptr};
  std::atomic<bool> cancelled_{false}, cancel_told_{false};
  bool admitted_early_ = false;  // its headers came before the drain's refusal: served all the same
  std::mutex mu_;
  bool refused_ = false;  // Halt answered it (with mu_)
};

// A stream refused before it reads anything (its token, checked by the handler when calls are recorded).
class RefusedStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  explicit RefusedStream(const Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

// The answer's bytes as SerializeAsString writes them, without copying raw_output_contents again:
// those strings move into slices of their own, after the message's other fields (numbers 1-5).
grpc::ByteBuffer EncodeAnswer(inference::ModelInferResponse* response) {
  google::protobuf::RepeatedPtrField<std::string> contents;
  contents.Swap(response->mutable_raw_output_contents());  // the strings change hands, uncopied
  std::string head = response->SerializeAsString();
  std::vector<grpc::Slice> slices;
  slices.reserve(2 * static_cast<size_t>(contents.size()) + 1);
  for (std::string& bytes : contents) {
    head.push_back(static_cast<char>((inference::ModelInferResponse::kRawOutputContentsFieldNumber << 3) | 2));
    uint8_t size[10];
    const uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(bytes.size(), size);
    head.append(reinterpret_cast<const char*>(size), static_cast<size_t>(end - size));
    if (bytes.size() < kCopiedBelow) {  // a slice of its own costs more than a copy
      head += bytes;
      continue;
    }
    slices.emplace_back(head);
    head.clear();
    auto* owned = new std::string(std::move(bytes));
    slices.emplace_back(owned->data(), owned->size(), [](void* s) { delete static_cast<std::string*>(s); }, owned);
  }
  if (!head.empty() || slices.empty()) slices.emplace_back(head);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer EncodeStreamAnswer(const std::string& error_message, inference::ModelInferResponse* response) {
  grpc::ByteBuffer inner = EncodeAnswer(response);
  std::vector<grpc::Slice> slices;
  if (!inner.Dump(&slices).ok()) slices.clear();  // Dump fails only on a compressed buffer, which this is not
  std::string head;
  google::protobuf::io::StringOutputStream to(&head);
  {
    google::protobuf::io::CodedOutputStream out(&to);
    if (!error_message.empty()) {
      out.WriteTag(inference::ModelStreamInferResponse::kErrorMessageFieldNumber << 3 | 2);
      out.WriteVarint64(error_message.size());
      out.WriteString(error_message);
    }
    out.WriteTag(inference::ModelStreamInferResponse::kInferResponseFieldNumber << 3 | 2);
    out.WriteVarint64(inner.Length());
  }
  slices.insert(slices.begin(), grpc::Slice(head));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

Plane::Plane(Contract contract) : contract_(std::move(contract)) {
  // Methods served neither here nor through the rare RPCs' relay go to the generic service, which
  // hands them to the Python server (native/relay.h); without one gRPC answers them UNIMPLEMENTED.
  const auto* service = inference::ModelInferRequest::descriptor()->file()->FindServiceByName("GRPCInferenceService");
  for (int i = 0; i < service->method_count(); ++i) {
    if (kServedHere.count(service->method(i)->name()) == 0) MarkMethodGeneric(i);
  }
  // ModelInfer's request and answer as raw bytes (ReceivedCall), by the method's index in the proto.
  const int method = inference::ModelInferRequest::descriptor()
                         ->file()
                         ->FindServiceByName("GRPCInferenceService")
                         ->FindMethodByName("ModelInfer")
                         ->index();
  // Registered as streaming (MarkMethodStreamed sets the type; its handler is replaced at once), so
  // that gRPC reads a call's message only when the call asks for it (ReceivedCall: receive slots).
  MarkMethodStreamed(method,
                     new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                         [](grpc::CallbackServerContext*) { return nullptr; }));
  MarkMethodCallback(method,
                     new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                         [this](grpc::CallbackServerContext* context) { return new ReceivedCall(this, context); }));
  // ModelStreamInfer's requests as raw bytes too: one that does not parse ends the stream with a message.
  const int stream_method = inference::ModelInferRequest::descriptor()
                                ->file()
                                ->FindServiceByName("GRPCInferenceService")
                                ->FindMethodByName("ModelStreamInfer")
                                ->index();
  MarkMethodCallback(stream_method,
                     new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, grpc::ByteBuffer>(
                         [this](grpc::CallbackServerContext* context) -> grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer>* {
                           if (TokenDeferred() && !TokenAdmits(context)) {  // the processor let it through to us
                             RecordTokenRefusal(context, "ModelStreamInfer");
                             return new RefusedStream(Status(StatusCode::UNAUTHENTICATED, security_.refusal));
                           }
                           return new StreamCall(this, CallDeadline(context), context);
                         }));
}

grpc::ServerUnaryReactor* Plane::Infer(grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
                                       inference::ModelInferResponse* response, bool admitted_early) {
  const TimePoint deadline = CallDeadline(context);
  auto* call = new InferCall(this, deadline);
  if (TokenDeferred() && !TokenAdmits(context)) {  // the processor let it through to us
    RecordTokenRefusal(context, "ModelInfer", /*arrival=*/false);  // its headers line is written
    call->Finish(Status(StatusCode::UNAUTHENTICATED, security_.refusal));
    return call;
  }
  std::shared_ptr<CallNote> note;
  if (records_) note = Note(context, "ModelInfer", static_cast<int64_t>(bytes->Length()));
  std::string why;
  if (!Parse(*bytes, &call->request, &why)) {
    counters_.requests++;
    counters_.refused++;
    if (note) RecordUnparsed(*note, Bounded(Invalid(why)));
    Answer(call, nullptr, Invalid(why));
  } else if (upstream_ && ToPython(call->request)) {  // its message, as it came
    call->relayed = upstream_->Unary(*context, kModelInferMethod, *bytes);
    call->relayed->Start([call, response](const Status& status, const grpc::ByteBuffer& answer) {
      call->Finish(status.ok() ? ReadAnswer(answer, response) : status);
    });
  } else {
    call->budget = budget_.get();
    Admit(call, &call->request, response, deadline, budget_ ? &call->reserved : nullptr,
          &call->answered_by, std::move(note), admitted_early);
  }
  return call;
}

bool Plane::Parse(const grpc::ByteBuffer& bytes, inference::ModelInferRequest* request, std::string* why) const {
  const MessageBounds& bounds = message_bounds_;
  const int64_t size = static_cast<int64_t>(bytes.Length());
  const bool scanned = (bounds.prescan_min_bytes > 0 && size >= bounds.prescan_min_bytes) ||
                       (bounds.wire_min_bytes > 0 && size >= bounds.wire_min_bytes);
  if (scanned && !Prescan(bytes, why)) return false;
  grpc::ByteBuffer copy(bytes);  // shares the slices; the reader takes a mutable buffer
  grpc::ProtoBufferReader reader(&copy);
  if (!reader.status().ok() || !request->ParseFromZeroCopyStream(&reader)) {
    // protobuf's own words, as the Python plane's parse reports them (server.errors.MalformedMessage)
    *why = "the request message does not parse: DecodeError: Error parsing message with type '" +
           inference::ModelInferRequest::descriptor()->full_name() + "'";
    return false;
  }
  // server.parsing.bounded_infer_request: each `parameters` map, once parsed.
  const auto over = [&](size_t entries, const std::string& where) {
    if (bounds.max_parameters <= 0 || static_cast<int64_t>(entries) <= bounds.max_parameters) return false;
    *why = where + ": " + Commas(static_cast<int64_t>(entries)) + " `parameters` entries, over the limit of " +
           Commas(bounds.max_parameters);
    return true;
  };
  if (over(request->parameters_size(), "the inference request")) return false;
  for (const auto& t : request->inputs()) {  // the name's first 64 characters, as Python's name[:64]
    if (over(t.parameters_size(), "input " + Quoted(t.name().substr(0, CharsEnd(t.name(), 64)), SIZE_MAX))) return false;
  }
  for (const auto& t : request->outputs()) {
    if (over(t.parameters_size(), "output " + Quoted(t.name().substr(0, CharsEnd(t.name(), 64)), SIZE_MAX))) return false;
  }
  return true;
}

// proto/wire.check_fields and codec.parse_infer_request's scan, on a large message before protobuf
// parses it: its top-level records and the request's `parameters` bounded, then the bytes besides
// raw_input_contents against --max-typed-bytes. Their order and words; the scan stops at the first.
bool Plane::Prescan(const grpc::ByteBuffer& bytes, std::string* why) const {
  const MessageBounds& bounds = message_bounds_;
  const std::string what = "the inference request";
  grpc::ByteBuffer copy(bytes);
  grpc::ProtoBufferReader reader(&copy);
  google::protobuf::io::CodedInputStream in(&reader);
  in.SetTotalBytesLimit(INT_MAX);
  const int64_t size = static_cast<int64_t>(bytes.Length());
  const bool fields_bounded = bounds.prescan_min_bytes > 0 && size >= bounds.prescan_min_bytes;
  const uint64_t parameters = inference::ModelInferRequest::kParametersFieldNumber;
  const uint64_t raw_contents = inference::ModelInferRequest::kRawInputContentsFieldNumber;
  int64_t records = 0, entries = 0, entry_bytes = 0, raw_bytes = 0;
  std::string wire_error;
  while (in.CurrentPosition() < size) {
    if (++records > bounds.max_request_fields && bounds.max_request_fields > 0 && fields_bounded) {
      *why = what + " has more than " + Commas(bounds.max_request_fields) +
             " top-level fields (the limit); an inference request has a few";
      return false;
    }
    const int64_t start = in.CurrentPosition();
    uint64_t tag = 0, length = 0;
    if (!ReadVarint(in, &tag, &wire_error)) break;
    const uint64_t field = tag >> 3;
    const int wire_type = static_cast<int>(tag & 7);
    bool past_end = false;
    if (wire_type == 0) {
      if (!ReadVarint(in, &length, &wire_error)) break;
    } else if (wire_type == 2) {
      if (!ReadVarint(in, &length, &wire_error)) break;
      past_end = length > static_cast<uint64_t>(size - in.CurrentPosition());
      if (!past_end) in.Skip(static_cast<int>(length));
    } else if (wire_type == 1 || wire_type == 5) {
      const int64_t width = wire_type == 1 ? 8 : 4;
      past_end = width > size - in.CurrentPosition();
      if (!past_end) in.Skip(static_cast<int>(width));
    } else {
      wire_error = "wire type " + std::to_string(wire_type) + " (groups or invalid)";
      break;
    }
    if (past_end) {
      wire_error = "field " + std::to_string(field) + " runs past the end of the message";
      break;
    }
    const int64_t record = in.CurrentPosition() - start;
    if (field == raw_contents && wire_type == 2) raw_bytes += record;
    if (field != parameters || !fields_bounded) continue;
    ++entries;
    entry_bytes += record;
    if (bounds.max_parameters > 0 && entries > bounds.max_parameters) {
      *why = what + ": more than " + Commas(bounds.max_parameters) + " `parameters` entries (the limit is " +
             Commas(bounds.max_parameters) + ")";
      return false;
    }
    if (bounds.max_parameters_bytes > 0 && entry_bytes > bounds.max_parameters_bytes) {
      *why = what + ": `parameters` holds more than " + Commas(bounds.max_parameters_bytes) + " bytes (the limit is " +
             Commas(bounds.max_parameters_bytes) + ")";
      return false;
    }
  }
  if (!wire_error.empty()) {
    *why = "the request message does not parse: WireError: " + wire_error;
    return false;
  }
  const int64_t rest = size - raw_bytes;  // what protobuf would parse
  const bool typed_bounded = bounds.wire_min_bytes > 0 && size >= bounds.wire_min_bytes && bounds.max_typed_bytes > 0;
  if (typed_bounded && rest > bounds.max_typed_bytes + bounds.request_overhead_bytes) {
    *why = "typed contents: the request holds " + Commas(rest) + " bytes besides raw_input_contents, over the " +
           Commas(bounds.max_typed_bytes) + "-byte limit for typed contents (--max-typed-bytes); send the inputs as " +
           "raw_input_contents and the answer comes as raw_output_contents";
    return false;
  }
  return true;
}

// The one predicate for what the Python request path serves instead (docs/native-data-plane.md,
// "Per-request fallback"): shared memory, and every request while Python records calls.
bool Plane::ToPython(const inference::ModelInferRequest& request) const {
  if (fallback_all_) return true;
  for (const std::string& key : fallback_keys_) {
    for (const auto& input : request.inputs())
      if (input.parameters().count(key) != 0) return true;
    for (const auto& output : request.outputs())
      if (output.parameters().count(key) != 0) return true;
  }
  return false;
}

void Plane::Admit(grpc::ServerUnaryReactor* reactor, const inference::ModelInferRequest* request,
                  inference::ModelInferResponse* response, TimePoint call_deadline, int64_t* held,
                  std::atomic<int64_t>* answered_by, std::shared_ptr<CallNote> note, bool admitted_early) {
  Pending p;
  p.admitted_early = admitted_early;
  p.answered_by = answered_by;
  p.note = std::move(note);
  p.deadline = call_deadline;
  p.reactor = reactor;
  p.held = held;
  p.request = request;
  p.response = response;
  Admit(std::move(p));
}

void Plane::GiveBack(Pending& p) {
  if (p.held != nullptr && *p.held > 0) {  // never queued: its reservation goes back now
    budget_->Give(*p.held);
    *p.held = 0;
  }
}

void Plane::Admit(Pending p, bool again) {
  const auto started = again ? p.started : Clock::now();
  const inference::ModelInferRequest& request = *p.request;
  if (!again) counters_.requests++;
  // A queue retired between the lookup and the queueing (a swap) sends the call to the new one.
  for (int attempt = 0;; ++attempt) {
    Queue* known = nullptr;
    Codes* codes = nullptr;
    Status status;
    {
      std::shared_lock<std::shared_mutex> routes(routes_mu_);
      status = Find(request, &known, &codes);
    }
    if (refusing_ && !p.admitted_early) {  // draining: never computed, retry elsewhere (the Python plane's words)
      counters_.refused++;
      Settle(p, codes, ShuttingDown());
      return;
    }
    if (!status.ok()) {
      counters_.refused++;
      Settle(p, codes, status);
      return;
    }
    Queue& queue = *known;
    Pending fresh;  // a retry checks afresh
    fresh.reactor = p.reactor;
    fresh.stream = p.stream;
    fresh.seq = p.seq;
    fresh.request = p.request;
    fresh.response = p.response;
    fresh.deadline = p.deadline;
    fresh.held = p.held;
    fresh.answered_by = p.answered_by;
    fresh.note = p.note;
    fresh.admitted_early = p.admitted_early;
    p = std::move(fresh);
    p.started = started;
    status = Check(queue, request, p);
    if (status.ok() && !zeros_) {  // the queue's bounds before memory, as server.batcher.Batcher.submit
      std::lock_guard<std::mutex> lock(queue.mu);
      status = QueueBounds(queue, p);
    }
    bool parked = false;
    if (status.ok() && !zeros_) status = Reserve(queue, p, &parked);
    if (parked) {  // waits for memory; Granted queues it
      counters_.check_ns += NanosSince(started);
      return;
    }
    if (!status.ok()) {
      counters_.refused++;
      Settle(p, &queue, status);
      return;
    }
    counters_.check_ns += NanosSince(started);
    if (zeros_) {
      p.arrived = Clock::now();
      if (handoff_thread_.joinable()) {
        {
          std::lock_guard<std::mutex> lock(handoff_mu_);
          handoff_.push_back({std::move(p), &queue});
        }
        handoff_cv_.notify_one();
        return;
      }
      AnswerZeros(p, queue);
      return;
    }
    bool retired = false;
    if (Enqueue(queue, p, false, &retired, &status)) return;
    GiveBack(p);  // the next queue reserves afresh
    if (retired && attempt < 8) continue;
    counters_.refused++;
    Settle(p, &queue, retired ? Status(StatusCode::UNAVAILABLE, "model " + queue.limits.name +
                                                                    " is changing versions; retry")
                              : status);
    return;
  }
}

bool Plane::Enqueue(Queue& queue, Pending& p, bool granted, bool* retired, Status* refusal) {
  TimePoint deadline = kNever;
  {
    std::lock_guard<std::mutex> lock(queue.mu);
    if (queue.retired) {
      *retired = true;
      return false;
    }
    if (stopping_) {  // Stop has refused the queues: nothing takes this one any more
      *refusal = NotStarted(queue.limits.name);
      return false;
    }
    if (!granted) {
      if (Status bounds = QueueBounds(queue, p); !bounds.ok()) {
        *refusal = bounds;
        return false;
      }
    }
    if (p.deadline <= Clock::now()) {  // server.batcher's words
      *refusal = Status(StatusCode::DEADLINE_EXCEEDED, "model " + queue.limits.name +
                                                           ": the request's deadline passed before it was queued; "
                                                           "not computed");
      return false;
    }
    p.arrived = Clock::now();
    if (p.note) {  // admitted: the span's "admitted" event and its shape
      p.note->admitted = p.arrived;
      p.note->rows = p.rows;
      p.note->q_len = p.q_len;
      p.note->k_len = p.k_len;
    }
    p.since = queue.formed;
    deadline = p.deadline;
    queue.queued_bytes += p.input_bytes;
    queue.pending.push_back(std::move(p));
    if (!granted) in_flight_++;
  }
  queue.arrived.notify_one();
  if (deadline != kNever) Arm(deadline);
  return true;
}

namespace {

const char* CodeName(StatusCode code) {
  static const char* const kNames[kCodes] = {
      "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND", "ALREADY_EXISTS",
      "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION", "ABORTED", "OUT_OF_RANGE",
      "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS", "UNAUTHENTICATED"};
  const auto index = static_cast<size_t>(code);
  return index < kCodes ? kNames[index] : "UNKNOWN";
}

}  // namespace

StreamCall::StreamCall(Plane* plane, TimePoint call_deadline, grpc::CallbackServerContext* context)
    : plane_(plane), context_(context), deadline_(call_deadline) {
  if (context != nullptr && plane_->records_) {
    headers_ = plane_->Note(context, "ModelStreamInfer", 0);
    plane_->HeadersLine("/inference.GRPCInferenceService/ModelStreamInfer");
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
  plane_->Cancel(nullptr, this, deadline_);
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
  const bool parsed = plane_->Parse(incoming_, request.get(), &why);
  grpc::ByteBuffer message;
  message.Swap(&incoming_);  // kept for the Python server, if the request goes there
  if (!parsed) {  // the stream ends after the answers before it, as the Python plane's does
    plane_->counters_.requests++;
    plane_->counters_.refused++;
    const Status status = Bounded(Invalid(why));
    plane_->Count(static_cast<Codes*>(nullptr), status);
    if (note) plane_->RecordUnparsed(*note, status);
    Next next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      reading_ = false;
      reads_done_ = true;
      end_ = status;
      next = Step();
    }
    Run(next);
    return;
  }
  Pending p;
  p.stream = this;
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
    if (plane_->budget_) p.held = &slots_.back().reserved;  // a deque's elements stay where they are
    hold_in_flight_++;
    reading_ = false;
  }
  if (context_ != nullptr && plane_->upstream_ && plane_->ToPython(*p.request)) {
    ToPython(p.seq, message, p.response);
  } else {
    plane_->Admit(std::move(p));  // may answer at once (Answered takes mu_)
  }
  Next next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    next = Step();
  }
  Run(next);
}

void StreamCall::ToPython(uint64_t seq, const grpc::ByteBuffer& message, inference::ModelInferResponse* response) {
  auto relay = plane_->upstream_->Unary(*context_, kModelInferMethod, message, "ModelStreamInfer");
  {
    std::lock_guard<std::mutex> lock(mu_);
    relayed_[seq] = relay;
  }
  // The stream ends only once every request is answered, so it outlives the relay.
  relay->Start([this, seq, response](const Status& status, const grpc::ByteBuffer& answer) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      relayed_.erase(seq);
    }
    Answered(seq, Bounded(status.ok() ? ReadAnswer(answer, response) : status));
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
  if (!reading_ && !reads_done_ && !broken_ && static_cast<int64_t>(slots_.size()) < plane_->stream_window_ &&
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
  const int64_t share = plane_->stream_share_bytes_;
  if (share <= 0) return false;
  if (held_bytes_ > share) return true;
  if (hold_in_flight_ == 0) return false;
  // Until a reservation is known a request is read only when none is in flight (one always goes).
  return hold_cost_ == 0 || held_bytes_ + hold_in_flight_ * hold_cost_ > share;
}

void StreamCall::GiveBack(int64_t reserved) {
  if (reserved <= 0) return;
  held_bytes_ -= reserved;
  plane_->budget_->Give(reserved);
}

std::unique_ptr<Batch> Plane::Form(size_t index, Queue& queue) {
  const ModelLimits& m = queue.limits;
  auto batch = std::make_unique<Batch>();
  batch->model = index;
  int64_t useful = 0, exact_k = -1;
  // server.batcher's bounds on a merged run: its scores within the attention bound (per head), a
  // batch on the flash path stays on it, and its run's memory beyond its requests' own fits now.
  const int64_t max_scores = std::max<int64_t>(m.max_attention_bytes / (4 * std::max<int64_t>(m.num_heads, 1)), 1);
  const int64_t extra_free = budget_ ? budget_->Free() : 0;
  Masking masking = Masking::kNone;
  bool same_k_len = true;
  int64_t held = 0, shares = 0;
  // Service order (server.scheduling.PriorityQueue): by aged level, then arrival; one level: arrival.
  const size_t n = queue.pending.size();
  std::vector<size_t> order(n);
  std::iota(order.begin(), order.end(), size_t{0});
  const bool one_level = std::all_of(queue.pending.begin(), queue.pending.end(),
                                     [&](const Pending& p) { return p.priority == queue.pending.front().priority; });
  if (!one_level) {
    std::vector<uint64_t> level(n);
    for (size_t i = 0; i < n; ++i) {  // one level better per aging_batches_ batches that passed it over
      const uint64_t gained = (queue.formed - queue.pending[i].since) / aging_batches_;
      level[i] = queue.pending[i].priority > gained + 1 ? queue.pending[i].priority - gained : 1;
    }
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return level[a] < level[b]; });
  }
  std::vector<char> taken(n, 0);
  const auto now = Clock::now();
  for (size_t i : order) {
    Pending& p = queue.pending[i];
    if (p.deadline <= now) {  // expired, its timer not yet run: refused by NextBatch
      queue.expired.push_back(std::move(p));
      taken[i] = 1;
      continue;
    }
    if (!batch->items.empty()) {
      const int64_t rows = batch->rows + p.rows;
      const int64_t q = std::max(batch->q_len, p.q_len), k = std::max(batch->k_len, p.k_len);
      const double padded = 1.0 - static_cast<double>(useful + p.rows * p.q_len * p.k_len) /
                                      (static_cast<double>(rows) * q * k);
      const bool same_k = same_k_len && batch->k_len == p.k_len;
      const Masking merged = Merged(masking, MaskingOf(p), same_k);
      const bool probs = batch->want_probs || p.want_probs;
      const int64_t merged_held = ScoresHeld(GraphFor(m.graphs, merged, probs, q, k), rows, q, k);
      const bool fits = rows <= m.max_batch_size && padded <= m.max_padding_ratio && (exact_k < 0 || exact_k == k) &&
                        (!p.exact_k_len || p.k_len == k) && merged_held <= max_scores && (held > 0 || merged_held == 0) &&
                        (!budget_ || CostOf(queue, rows, q, k, 0, probs, merged == Masking::kHeads)[1] - shares -
                                             p.run_share <= extra_free);
      if (!fits) continue;
      masking = merged;
      same_k_len = same_k;
      held = merged_held;
    } else {
      masking = MaskingOf(p);
      held = ScoresHeld(GraphFor(m.graphs, masking, p.want_probs, p.q_len, p.k_len), p.rows, p.q_len, p.k_len);
    }
    shares += p.run_share;
    taken[i] = 1;
    batch->first_row.push_back(batch->rows);
    batch->rows += p.rows;
    batch->q_len = std::max(batch->q_len, p.q_len);
    batch->k_len = std::max(batch->k_len, p.k_len);
    useful += p.rows * p.q_len * p.k_len;
    if (p.exact_k_len) exact_k = p.k_len;
    batch->want_probs = batch->want_probs || p.want_probs;
    if (p.heads_differ) batch->mask_heads = m.num_heads;
    batch->items.push_back(std::move(p));
  }
  std::deque<Pending> kept;  // in arrival order still
  queue.queued_bytes = 0;
  for (size_t i = 0; i < n; ++i) {
    if (taken[i]) continue;
    queue.queued_bytes += queue.pending[i].input_bytes;
    kept.push_back(std::move(queue.pending[i]));
  }
  queue.pending.swap(kept);
  if (batch->items.empty()) return batch;  // every one had expired
  if (budget_ && batch->items.size() > 1) {  // the merged run's memory beyond its requests' own (fits: checked above)
    const int64_t needed = CostOf(queue, batch->rows, batch->q_len, batch->k_len, 0, batch->want_probs,
                                  masking == Masking::kHeads)[1] - shares;
    if (needed > 0 && budget_->TryTake(needed)) batch->extra = needed;
  }
  batch->padding_ratio = 1.0 - static_cast<double>(useful) / (static_cast<double>(batch->rows) * batch->q_len * batch->k_len);
  queue.formed++;
  batch->cancelled.assign(batch->items.size(), 0);
  queue.running.push_back(batch.get());
  return batch;
}

void Plane::WaitForCompany(Queue& queue, std::unique_lock<std::mutex>& lock) {
  const ModelLimits& m = queue.limits;
  if (m.max_queue_delay_us <= 0) return;
  // The oldest request (pending is in arrival order) sets the deadline; a lone call on an idle model
  // sees nobody coming and goes at once.
  const TimePoint deadline = queue.pending.front().arrived + std::chrono::microseconds(m.max_queue_delay_us);
  while (!stopping_ && !queue.retired && !queue.pending.empty() && Clock::now() < deadline) {
    int64_t rows = 0;
    for (const auto& p : queue.pending) rows += p.rows;
    if (rows >= m.max_batch_size || (queue.running.empty() && Receiving() == 0)) return;
    queue.arrived.wait_until(lock, deadline);
  }
}

size_t Plane::Queued(size_t index) {
  Queue& queue = At(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  return queue.pending.size();
}

namespace {

// One request's row into its batch row: `count` floats, then zeros up to the batch's `width` (padding).
void PadRow(float* to, const float* from, int64_t count, int64_t width) {
  std::memcpy(to, from, static_cast<size_t>(count) * 4);
  if (width > count) std::memset(to + count, 0, static_cast<size_t>(width - count) * 4);
}

}  // namespace

std::shared_ptr<Batch> Plane::NextBatch(size_t index, int64_t timeout_ms) {
  Queue& queue = At(index);
  std::unique_ptr<Batch> batch;
  std::vector<Pending> expired;
  {
    std::unique_lock<std::mutex> lock(queue.mu);
    queue.arrived.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                           [&] { return stopping_ || queue.retired || !queue.pending.empty(); });
    if (stopping_ || queue.pending.empty()) return nullptr;
    WaitForCompany(queue, lock);
    if (stopping_ || queue.pending.empty()) return nullptr;
    batch = Form(index, queue);
    expired.swap(queue.expired);
  }
  for (auto& p : expired) {  // server.batcher's words, at batch formation
    Settle(p, &queue, Status(StatusCode::DEADLINE_EXCEEDED, "deadline passed after " +
                                 Seconds3(Clock::now() - p.arrived) + "s in the queue of model " +
                                 queue.limits.name + "; not computed"));
  }
  if (!expired.empty()) Left(static_cast<int64_t>(expired.size()));
  if (batch->items.empty()) return nullptr;
  const auto started = Clock::now();
  batch->id = ++batch_ids_;
  const ModelLimits& m = queue.limits;
  const int64_t rows = batch->rows, lq = batch->q_len, lk = batch->k_len;
  batch->query.resize(static_cast<size_t>(rows * lq * m.query_dim));  // uninitialized: every row written below
  batch->key.resize(static_cast<size_t>(rows * lk * m.kv_dim));
  batch->value.resize(static_cast<size_t>(rows * lk * m.kv_dim));
  // tensors.batch_masking: a head mask, else the whole mask if a request needs it (GENERAL), else a
  // key padding mask once a request has one or keys are padded.
  bool general = false, key_padding = false;
  for (const auto& p : batch->items) {
    general = general || (p.mask != nullptr && !p.key_padding);
    key_padding = key_padding || p.key_padding || p.k_len != lk;
  }
  const int64_t mh = batch->mask_heads;
  const bool need_mask = general || mh > 1;
  if (need_mask) {
    batch->mask.assign(static_cast<size_t>(rows * mh * lq * lk), 0);  // padding is masked
  } else if (key_padding) {
    batch->key_mask.assign(static_cast<size_t>(rows * lk), 0);  // padded keys are masked
  }
  for (size_t i = 0; i < batch->items.size(); ++i) {
    const Pending& p = batch->items[i];
    const int64_t r0 = batch->first_row[i];
    for (int64_t r = 0; r < p.rows; ++r) {
      PadRow(&batch->query[((r0 + r) * lq) * m.query_dim], p.query + r * p.q_len * m.query_dim,
             p.q_len * m.query_dim, lq * m.query_dim);
      PadRow(&batch->key[((r0 + r) * lk) * m.kv_dim], p.key + r * p.k_len * m.kv_dim, p.k_len * m.kv_dim,
             lk * m.kv_dim);
      PadRow(&batch->value[((r0 + r) * lk) * m.kv_dim], p.value + r * p.k_len * m.kv_dim, p.k_len * m.kv_dim,
             lk * m.kv_dim);
      if (!batch->key_mask.empty()) {  // the row's first query row says which keys it attends (all alike)
        int32_t* to = &batch->key_mask[(r0 + r) * lk];
        const uint8_t* from = p.mask != nullptr ? p.mask + r * p.mask_row_stride : nullptr;
        for (int64_t k = 0; k < p.k_len; ++k) to[k] = from != nullptr ? from[k] : 1;
      }
      if (!need_mask) continue;
      for (int64_t hh = 0; hh < mh; ++hh) {
        for (int64_t q = 0; q < p.q_len; ++q) {
          uint8_t* to = &batch->mask[(((r0 + r) * mh + hh) * lq + q) * lk];
          if (p.mask == nullptr) {
            std::memset(to, 1, static_cast<size_t>(p.k_len));
          } else {  // heads alike (head stride 0) read their first for every head
            std::memcpy(to, p.mask + r * p.mask_row_stride + hh * p.mask_head_stride + q * p.k_len,
                        static_cast<size_t>(p.k_len));
          }
        }
      }
    }
    const auto waited = std::chrono::duration_cast<std::chrono::nanoseconds>(started - p.arrived).count();
    counters_.queue_ns += static_cast<uint64_t>(waited);
    batch->queue_s.push_back(static_cast<double>(waited) * 1e-9);
    if (p.note) {  // its record's queue wait and batch (the batch span links to it)
      p.note->queue_s = static_cast<double>(waited) * 1e-9;
      p.note->run_started = started;
      p.note->batch = batch->id;
    }
  }
  counters_.batches++;
  counters_.rows += static_cast<uint64_t>(rows);
  batch->formed = Clock::now();
  counters_.merge_ns += NanosSince(started);
  return batch;
}

void Plane::GiveExtra(Batch& batch) {
  if (batch.extra > 0 && budget_) budget_->Give(batch.extra);
  batch.extra = 0;
}

void Plane::Complete(Batch& batch, const float* output, const float* attn_probs) {
  if (batch.settled) return;
  batch.settled = true;
  GiveExtra(batch);
  Queue& queue = At(batch.model);
  {
    std::lock_guard<std::mutex> lock(queue.mu);
    batch.answering = true;  // a cancel from here on is the answered stage (Cancel)
  }
  auto started = Clock::now();
  counters_.python_ns += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(started - batch.formed).count());
  const ModelLimits& m = queue.limits;
  const int64_t lq = batch.q_len, lk = batch.k_len, h = m.num_heads, od = m.out_dim;
  std::vector<CallRecord> records;  // the batch's call records, handed over under one lock
  std::vector<CallRecord>* into = records_ ? &records : nullptr;
  for (size_t i = 0; i < batch.items.size(); ++i) {
    Pending& p = batch.items[i];
    const int64_t r0 = batch.first_row[i];
    if (Gone(batch, i, false)) {  // its client went away (counted then): nobody reads an answer
      if (batch.cancelled[i] != kLeft) Settle(p, &queue, Cancelled(), into);  // kLeft: Cancel answered it
      continue;
    }
    if (p.want_probs && attn_probs == nullptr) {
      Settle(p, &queue, Status(StatusCode::INTERNAL, "the run returned no attn_probs"), into);
      continue;
    }
    p.response->set_model_name(m.name);
    p.response->set_model_version(m.version);
    p.response->set_id(p.request->id());
    for (bool probs : p.order_probs) {
      if (probs) {
        const auto count = static_cast<size_t>(p.rows * h * p.q_len * p.k_len);
        OutputTo to(p.response, contract_.attn_probs, contract_.fp32, {p.rows, h, p.q_len, p.k_len}, p.raw, count);
        if (p.q_len == lq && p.k_len == lk) {  // unpadded: its rows are one block of the batch's
          to.Put(attn_probs + r0 * h * lq * lk, count);
        } else {
          for (int64_t r = 0; r < p.rows; ++r)
            for (int64_t hh = 0; hh < h; ++hh)
              for (int64_t q = 0; q < p.q_len; ++q)
                to.Put(attn_probs + (((r0 + r) * h + hh) * lq + q) * lk, static_cast<size_t>(p.k_len));
        }
      } else {
        const auto count = static_cast<size_t>(p.rows * p.q_len * od);
        OutputTo to(p.response, contract_.output, contract_.fp32, {p.rows, p.q_len, od}, p.raw, count);
        if (p.q_len == lq) {
          to.Put(output + r0 * lq * od, count);
        } else {
          for (int64_t r = 0; r < p.rows; ++r) to.Put(output + ((r0 + r) * lq) * od, static_cast<size_t>(p.q_len * od));
        }
      }
    }
    const auto finishing = Clock::now();
    counters_.split_ns += static_cast<uint64_t>(
        std::chrono::duration_cast<std::chrono::nanoseconds>(finishing - started).count());
    batch.done_s.push_back(static_cast<double>(NanosSince(p.started)) * 1e-9);
    if (Gone(batch, i, true)) {  // went while its answer was encoded: the answered stage (Cancel counted it)
      batch.done_s.pop_back();
      Settle(p, &queue, Cancelled(), into);
      continue;
    }
    if (p.note) {  // merge, run and split, as this call saw its batch (the batcher's compute_s)
      p.note->run_ended = finishing;
      p.note->run_s = std::chrono::duration<double>(finishing - p.note->run_started).count();
      p.note->batch_requests = static_cast<int64_t>(batch.items.size());
    }
    Settle(p, &queue, Status::OK, into);  // gRPC may send the answer on this thread
    counters_.finish_ns += NanosSince(finishing);
    started = Clock::now();
  }
  if (into != nullptr) records_->Add(records);
  Unrun(batch);
  Left(static_cast<int64_t>(batch.items.size()));
}

bool Plane::Gone(Batch& batch, size_t i, bool settle) {
  Queue& queue = At(batch.model);
  std::lock_guard<std::mutex> lock(queue.mu);
  if (batch.cancelled[i] == kGone || batch.cancelled[i] == kLeft) return true;
  if (settle) {
    batch.cancelled[i] = kSettled;  // a cancel from here on finds its call answered
    Pending& p = batch.items[i];
    if (p.answered_by != nullptr) p.answered_by->store(static_cast<int64_t>(batch.model));
  }
  return false;
}

void Plane::Fail(Batch& batch, StatusCode code, const std::string& message) {
  if (batch.settled) return;
  batch.settled = true;
  GiveExtra(batch);
  Queue& queue = At(batch.model);
  const std::vector<char> cancelled = Unrun(batch);  // a stopped run ends here: all cancelled
  std::vector<CallRecord> records;
  std::vector<CallRecord>* into = records_ ? &records : nullptr;
  for (size_t i = 0; i < batch.items.size(); ++i) {
    if (cancelled[i] == kLeft) continue;  // answered CANCELLED by Cancel already
    Settle(batch.items[i], &queue, cancelled[i] ? Cancelled() : Status(code, message), into);
  }
  if (into != nullptr) records_->Add(records);
  Left(static_cast<int64_t>(batch.items.size()));
}

// -- request control (docs/native-data-plane.md, "Request control") --------------------------------

void Plane::SetQueueDelay(size_t index, int64_t max_queue_delay_us) {
  Queue& queue = *models_.at(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  queue.limits.max_queue_delay_us = max_queue_delay_us;
}

void Plane::SetSchedule(size_t index, const ModelLimits::Schedule& schedule) {
  Queue& queue = *models_.at(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  queue.limits.schedule = schedule;
}

Status Plane::Schedule(const ModelLimits& m, const inference::ModelInferRequest& request, Pending& p) const {
  const ModelLimits::Schedule& policy = m.schedule;
  uint64_t priority = 0, asked = 0;
  bool given = false;
  if (Status status = ParameterInt(request, "priority", &priority, &given); !status.ok()) return status;
  if (!given || priority == 0) {
    priority = policy.default_priority_level;
  } else if (priority > policy.priority_levels) {
    return Invalid("parameter 'priority': this model has priority levels 1.." + std::to_string(policy.priority_levels) +
                   " (1 the highest, 0 its default " + std::to_string(policy.default_priority_level) + "), got " +
                   std::to_string(priority));
  }
  if (Status status = ParameterInt(request, "timeout", &asked, &given); !status.ok()) return status;
  if (asked > kMaxTimeoutUs - 1) {  // attnserve.ranges.QUEUE_TIMEOUT_US: past it a timeout would silently be none
    return Invalid("parameter 'timeout' must be an integer in 0.." + std::to_string(kMaxTimeoutUs - 1) +
                   " microseconds, got " + std::to_string(asked));
  }
  uint64_t timeout_us = policy.default_timeout_us;
  if (asked > 0 && policy.allow_timeout_override) {  // as Triton: it may shorten the model's, never lengthen it
    timeout_us = timeout_us == 0 ? asked : std::min(asked, timeout_us);
  }
  p.priority = priority;
  if (timeout_us > 0 && timeout_us < kMaxTimeoutUs) {
    p.deadline = std::min(p.deadline, Clock::now() + std::chrono::microseconds(static_cast<int64_t>(timeout_us)));
  }
  return Status::OK;
}

void Plane::Arm(TimePoint deadline) {
  {
    std::lock_guard<std::mutex> lock(timer_mu_);
    if (deadline >= next_expiry_) return;  // the timer wakes by then already
    next_expiry_ = deadline;
  }
  timer_cv_.notify_one();
}

void Plane::Reap() {
  std::unique_lock<std::mutex> lock(timer_mu_);
  while (!timer_stop_) {
    if (next_expiry_ == kNever) {
      timer_cv_.wait(lock);
    } else {
      timer_cv_.wait_until(lock, next_expiry_);
    }
    if (timer_stop_ || next_expiry_ == kNever || Clock::now() < next_expiry_) continue;
    next_expiry_ = kNever;  // what is admitted meanwhile arms it again
    lock.unlock();
    const TimePoint next = Expire();
    lock.lock();
    next_expiry_ = std::min(next_expiry_, next);
  }
}

TimePoint Plane::Expire() {
  TimePoint next = kNever;
  for (auto& owned : models_) {
    Queue& queue = *owned;
    std::vector<Pending> expired;
    size_t still = 0;
    {
      std::lock_guard<std::mutex> lock(queue.mu);
      const auto now = Clock::now();
      for (auto it = queue.pending.begin(); it != queue.pending.end();) {
        if (it->deadline <= now) {
          queue.queued_bytes -= it->input_bytes;
          expired.push_back(std::move(*it));
          it = queue.pending.erase(it);
        } else {
          next = std::min(next, it->deadline);
          ++it;
        }
      }
      still = queue.pending.size();
    }
    for (auto& p : expired) {  // server.batcher's words, for its queue's timer
      Settle(p, &queue, Status(StatusCode::DEADLINE_EXCEEDED, "deadline passed after " +
                                   Seconds3(Clock::now() - p.arrived) + "s in the queue of model " + queue.limits.name +
                                   " (" + std::to_string(still) + " requests still queued); not computed"));
    }
    if (!expired.empty()) Left(static_cast<int64_t>(expired.size()));
  }
  // Calls waiting for memory past their deadline leave the budget's queue (server.batcher's words).
  std::vector<std::pair<int64_t, Parked>> late;
  {
    std::lock_guard<std::mutex> lock(parked_mu_);
    const auto now = Clock::now();
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (it->second.p.deadline <= now) {
        late.emplace_back(it->first, std::move(it->second));
        it = parked_.erase(it);
      } else {
        next = std::min(next, it->second.p.deadline);
        ++it;
      }
    }
  }
  for (auto& [ticket, parked] : late) {
    if (budget_->Leave(ticket)) {
      budget_->native_wait_timeouts++;
    } else {
      budget_->Give(parked.total);  // granted just as it expired
    }
    counters_.refused++;
    Settle(parked.p, parked.queue, Status(StatusCode::DEADLINE_EXCEEDED,
                                          "model " + parked.queue->limits.name +
                                              ": deadline passed while waiting for memory (" + Commas(parked.total) +
                                              " bytes); not computed"));
  }
  if (!late.empty()) Left(static_cast<int64_t>(late.size()));
  return std::min(next, ExpireReceiveSlots());
}

void Plane::StopTimer() {
  {
    std::lock_guard<std::mutex> lock(timer_mu_);
    timer_stop_ = true;
  }
  timer_cv_.notify_all();
  if (timer_.joinable() && timer_.get_id() != std::this_thread::get_id()) timer_.join();
}

static size_t ReasonOf(TimePoint call_deadline) {
  return call_deadline != kNever && Clock::now() >= call_deadline - kDeadlineSlack ? kDeadline : kClient;
}

bool Plane::Cancel(grpc::ServerUnaryReactor* reactor, StreamCall* stream, TimePoint call_deadline) {
  const size_t reason = ReasonOf(call_deadline);
  auto mine = [&](const Pending& p) { return reactor != nullptr ? p.reactor == reactor : p.stream == stream; };
  std::vector<std::pair<int64_t, Parked>> waiting;  // waiting for memory: they leave the budget's queue
  std::vector<std::pair<Queue*, std::vector<Pending>>> left;
  std::vector<std::function<void()>> stops;
  std::vector<std::pair<Queue*, Pending>> left_running;  // unary calls of running batches, answered now
  bool found = false;
  {
    // Held while it looks: a parked call that is granted meanwhile moves to its queue under it.
    std::lock_guard<std::mutex> parked(parked_mu_);
    for (auto it = parked_.begin(); it != parked_.end();) {
      if (mine(it->second.p)) {
        it->second.queue->cancels[reason * kCancelStages + kQueued]++;
        waiting.emplace_back(it->first, std::move(it->second));
        it = parked_.erase(it);
      } else {
        ++it;
      }
    }
    for (auto& owned : models_) {
      Queue& queue = *owned;
      std::vector<Pending> out;
      std::lock_guard<std::mutex> lock(queue.mu);
      for (auto it = queue.pending.begin(); it != queue.pending.end();) {
        if (mine(*it)) {
          queue.queued_bytes -= it->input_bytes;
          out.push_back(std::move(*it));
          it = queue.pending.erase(it);
        } else {
          ++it;
        }
      }
      for (Batch* batch : queue.running) {
        for (size_t i = 0; i < batch->items.size(); ++i) {
          if (!mine(batch->items[i])) continue;
          if (batch->cancelled[i] == kSettled && reactor != nullptr) {  // answered, not yet sent
            queue.cancels[reason * kCancelStages + kAnswered]++;
            found = true;
            continue;
          }
          if (batch->cancelled[i] != kLive) continue;
          batch->cancelled[i] = kGone;
          found = true;
          if (batch->answering) {  // handed back: its answer is being encoded (Complete settles it CANCELLED)
            queue.cancels[reason * kCancelStages + kAnswered]++;
            continue;
          }
          const bool all = std::all_of(batch->cancelled.begin(), batch->cancelled.end(), [](char c) { return c != 0; });
          // The last one out stops the run (once); until then the batch computes for the others.
          const bool stops_it = all && !batch->stopped;
          if (stops_it) {
            batch->stopped = true;
            if (batch->on_stop) stops.push_back(batch->on_stop);
          }
          queue.cancels[reason * kCancelStages + (stops_it ? kTerminated : kRunning)]++;
          if (reactor != nullptr) {  // answered CANCELLED now, as the Python plane's handler is; Complete skips it
            batch->cancelled[i] = kLeft;
            left_running.emplace_back(&queue, batch->items[i]);
          }
        }
      }
      queue.cancels[reason * kCancelStages + kQueued] += out.size();
      if (!out.empty()) left.emplace_back(&queue, std::move(out));
    }
  }
  for (auto& [ticket, parked] : waiting) {  // no lock held: a leave may grant others
    if (!budget_->Leave(ticket)) budget_->Give(parked.total);  // granted just as it went
    Settle(parked.p, parked.queue, Cancelled());
  }
  int64_t gone = static_cast<int64_t>(waiting.size());
  for (auto& [queue, out] : left) {
    for (auto& p : out) Settle(p, queue, Cancelled());
    gone += static_cast<int64_t>(out.size());
  }
  if (gone > 0) Left(gone);
  for (auto& [queue, p] : left_running) Settle(p, queue, Cancelled());  // still in flight: its batch's end counts it
  for (auto& stop : stops) stop();  // no lock held: it may take the GIL
  return found || gone > 0;
}

void Plane::CancelAnswered(size_t index, TimePoint call_deadline) {
  models_.at(index)->cancels[ReasonOf(call_deadline) * kCancelStages + kAnswered]++;
}

void Plane::OnStop(Batch& batch, std::function<void()> stop) {
  Queue& queue = *models_.at(batch.model);
  {
    std::lock_guard<std::mutex> lock(queue.mu);
    if (!batch.stopped) {
      batch.on_stop = std::move(stop);
      return;
    }
  }
  stop();  // every call left before the runner registered it
}

std::vector<char> Plane::Unrun(Batch& batch) {
  Queue& queue = *models_.at(batch.model);
  std::lock_guard<std::mutex> lock(queue.mu);
  auto& running = queue.running;
  running.erase(std::remove(running.begin(), running.end(), &batch), running.end());
  std::vector<char> cancelled = batch.cancelled;
  cancelled.resize(batch.items.size(), 0);
  return cancelled;
}

std::array<uint64_t, kCancelReasons * kCancelStages> Plane::Cancellations(size_t index) const {
  const Cancels& cancels = models_.at(index)->cancels;
  std::array<uint64_t, kCancelReasons * kCancelStages> out{};
  for (size_t i = 0; i < out.size(); ++i) out[i] = cancels[i].load();
  return out;
}

grpc::ServerUnaryReactor* Plane::Table(grpc::CallbackServerContext* context, const std::string& method,
                                       const std::string& name, google::protobuf::Message* response) {
  auto* reactor = context->DefaultReactor();
  auto found = answers_.find({method, name});
  if (found == answers_.end() || !response->ParseFromString(found->second)) {
    reactor->Finish(Status(StatusCode::NOT_FOUND, method + ": unknown model '" + name + "'"));
  } else {
    reactor->Finish(Status::OK);
  }
  return reactor;
}

grpc::ServerUnaryReactor* Plane::ServerLive(grpc::CallbackServerContext* context, const inference::ServerLiveRequest*,
                                            inference::ServerLiveResponse* response) {
  response->set_live(true);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(Status::OK);
  return reactor;
}

namespace {

// A relayed call's answer: given once by Python (or, if Python drops it unanswered, UNAVAILABLE).
class Reply {
 public:
  Reply(grpc::ServerUnaryReactor* reactor, google::protobuf::Message* response) : reactor_(reactor), response_(response) {}
  ~Reply() { Give(static_cast<int>(StatusCode::UNAVAILABLE), "the server did not answer (it is stopping)", ""); }
  void Give(int code, const std::string& details, const std::string& bytes) {
    if (given_.exchange(true)) return;
    if (code == 0 && !response_->ParseFromString(bytes)) {
      reactor_->Finish(Status(StatusCode::INTERNAL, "the answer does not parse"));
    } else {
      reactor_->Finish(code == 0 ? Status::OK : Bounded(Status(static_cast<StatusCode>(code), details)));
    }
  }

 private:
  grpc::ServerUnaryReactor* reactor_;
  google::protobuf::Message* response_;
  std::atomic<bool> given_{false};
};

}  // namespace

template <class Request, class Response>
grpc::ServerUnaryReactor* Plane::Relayed(grpc::CallbackServerContext* context, const char* method,
                                         const Request& request, Response* response) {
  RecordArrival(method);  // the gate's line, as the Python port writes it for these
  auto* reactor = context->DefaultReactor();
  auto reply = std::make_shared<Reply>(reactor, response);
  try {
    relay_(method, request.SerializeAsString(),
           [reply](int code, const std::string& details, const std::string& bytes) { reply->Give(code, details, bytes); });
  } catch (const std::exception& err) {  // Python could not take it: the reply's end answers UNAVAILABLE
    reply->Give(static_cast<int>(StatusCode::UNAVAILABLE), std::string("the server could not answer: ") + err.what(), "");
  }
  return reactor;
}

grpc::ServerUnaryReactor* Plane::ServerReady(grpc::CallbackServerContext* context,
                                             const inference::ServerReadyRequest* request,
                                             inference::ServerReadyResponse* response) {
  if (relay_ && !stopping_) return Relayed(context, "ServerReady", *request, response);
  response->set_ready(ready_ && !stopping_);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* Plane::ModelReady(grpc::CallbackServerContext* context,
                                            const inference::ModelReadyRequest* request,
                                            inference::ModelReadyResponse* response) {
  if (relay_ && !stopping_) return Relayed(context, "ModelReady", *request, response);
  bool routed;
  {
    std::shared_lock<std::shared_mutex> lock(routes_mu_);
    auto found = routes_.find(request->name());
    routed = found != routes_.end() && found->second.refusal.ok() && !found->second.versions.empty();
  }
  response->set_ready(ready_ && !stopping_ && routed);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* Plane::ServerMetadata(grpc::CallbackServerContext* context,
                                                const inference::ServerMetadataRequest* request,
                                                inference::ServerMetadataResponse* response) {
  if (relay_) return Relayed(context, "ServerMetadata", *request, response);
  return Table(context, "ServerMetadata", "", response);
}

grpc::ServerUnaryReactor* Plane::ModelMetadata(grpc::CallbackServerContext* context,
                                               const inference::ModelMetadataRequest* request,
                                               inference::ModelMetadataResponse* response) {
  if (relay_) return Relayed(context, "ModelMetadata", *request, response);
  return Table(context, "ModelMetadata", request->name(), response);
}

grpc::ServerUnaryReactor* Plane::ModelConfig(grpc::CallbackServerContext* context,
                                             const inference::ModelConfigRequest* request,
                                             inference::ModelConfigResponse* response) {
  if (relay_) return Relayed(context, "ModelConfig", *request, response);
  return Table(context, "ModelConfig", request->name(), response);
}

grpc::ServerUnaryReactor* Plane::ModelStatistics(grpc::CallbackServerContext* context,
                                                 const inference::ModelStatisticsRequest* request,
                                                 inference::ModelStatisticsResponse* response) {
  if (relay_) return Relayed(context, "ModelStatistics", *request, response);
  return Table(context, "ModelStatistics", request->name(), response);
}

grpc::ServerUnaryReactor* Plane::RepositoryIndex(grpc::CallbackServerContext* context,
                                                 const inference::RepositoryIndexRequest* request,
                                                 inference::RepositoryIndexResponse* response) {
  if (relay_) return Relayed(context, "RepositoryIndex", *request, response);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(Status(StatusCode::UNIMPLEMENTED, "RepositoryIndex is served on the Python port"));
  return reactor;
}

// -- Receive slots (server.gate.ReceiveSlots' rule): ModelInfer messages received at once ----------

namespace {
// server.gate.ReceiveSlots.STALE_S: a call that sent headers and then nothing gives its slot up.
constexpr auto kReceiveStale = std::chrono::seconds(10);
}  // namespace

bool Plane::TakeReceiveSlot(const void* call, std::function<void()> start) {
  TimePoint oldest = kNever;
  {
    std::lock_guard<std::mutex> lock(receive_mu_);
    if (receive_slots_ <= 0) return true;
    if (receive_waiting_.empty() && static_cast<int64_t>(receiving_.size()) < receive_slots_) {
      receiving_[call] = Clock::now();
      return true;
    }
    receive_waiting_.emplace_back(call, std::move(start));
    receive_deferred_++;
    for (const auto& [holder, since] : receiving_) oldest = std::min(oldest, since);
  }
  if (oldest != kNever) Arm(oldest + kReceiveStale);  // the timer starts the line if the holders go stale
  return false;
}

bool Plane::GiveReceiveSlot(const void* call) {
  std::vector<std::function<void()>> starts;
  bool was_waiting = false;
  {
    std::lock_guard<std::mutex> lock(receive_mu_);
    if (receive_slots_ <= 0) return false;
    for (auto it = receive_waiting_.begin(); it != receive_waiting_.end(); ++it) {
      if (it->first == call) {
        receive_waiting_.erase(it);
        was_waiting = true;
        break;
      }
    }
    if (receiving_.erase(call) == 0) return was_waiting;
    const auto now = Clock::now();
    while (!receive_waiting_.empty() && static_cast<int64_t>(receiving_.size()) < receive_slots_) {
      receiving_[receive_waiting_.front().first] = now;
      starts.push_back(std::move(receive_waiting_.front().second));
      receive_waiting_.pop_front();
    }
  }
  for (auto& start : starts) start();
  return was_waiting;
}

TimePoint Plane::ExpireReceiveSlots() {
  std::vector<std::function<void()>> starts;
  TimePoint next = kNever;
  {
    std::lock_guard<std::mutex> lock(receive_mu_);
    if (receive_waiting_.empty()) return kNever;
    const auto now = Clock::now();
    for (auto it = receiving_.begin(); it != receiving_.end();) {
      it = it->second + kReceiveStale <= now ? receiving_.erase(it) : std::next(it);
    }
    while (!receive_waiting_.empty() && static_cast<int64_t>(receiving_.size()) < receive_slots_) {
      receiving_[receive_waiting_.front().first] = now;
      starts.push_back(std::move(receive_waiting_.front().second));
      receive_waiting_.pop_front();
    }
    if (!receive_waiting_.empty()) {
      for (const auto& [holder, since] : receiving_) next = std::min(next, since + kReceiveStale);
    }
  }
  for (auto& start : starts) start();
  return next;
}

std::array<int64_t, 3> Plane::ReceiveFigures() {
  std::lock_guard<std::mutex> lock(receive_mu_);
  return {receive_slots_, static_cast<int64_t>(receiving_.size()), receive_deferred_};
}

// -- Memory bounds (admission): the shared budget, the cost model, answer and typed sizes ---------

SharedBudget::SharedBudget(int64_t limit_bytes, int64_t room_bytes)
    : limit_(limit_bytes), room_(room_bytes), wake_fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

SharedBudget::~SharedBudget() {
  if (wake_fd_ >= 0) close(wake_fd_);
}

bool SharedBudget::Fits(int64_t n, int64_t waiting) const {
  // MemoryBudget's rule: under the limit less the waiting room, or alone under the limit.
  return reserved_ + n <= limit_ - room_ || (reserved_ == 0 && n + waiting <= limit_);
}

bool SharedBudget::CanWait(int64_t n, int64_t first) const {
  // MemoryBudget._can_wait: its inputs fit the waiting room and every waiter could be admitted in turn.
  if (waiting_ + first > room_) return false;
  int64_t behind = first;  // inputs of the waiters after the one looked at
  if (n > limit_ - room_ && n > limit_) return false;
  for (auto it = waiters_.rbegin(); it != waiters_.rend(); ++it) {
    if (it->total > limit_ - room_ && it->total + behind > limit_) return false;
    behind += it->first;
  }
  return true;
}

int64_t SharedBudget::Take(int64_t n, int64_t first, bool wait, bool native) {
  std::lock_guard<std::mutex> lock(mu_);
  if (waiters_.empty() && Fits(n, waiting_)) {  // nobody jumps ahead of a waiter
    reserved_ += n;
    high_water_ = std::max(high_water_, reserved_);
    return 0;
  }
  first = std::min(first, n);
  if (!wait || !CanWait(n, first)) return -1;
  const int64_t ticket = next_ticket_++;
  waiters_.push_back(Waiter{ticket, n, first, native});
  waiting_ += first;
  return ticket;
}

void SharedBudget::Admit(std::vector<int64_t>* native, bool* python) {
  while (!waiters_.empty()) {
    const Waiter& head = waiters_.front();
    if (!Fits(head.total, waiting_ - head.first)) return;
    reserved_ += head.total;
    high_water_ = std::max(high_water_, reserved_);
    waiting_ -= head.first;
    if (head.native) {
      native->push_back(head.ticket);
    } else {
      granted_python_.push_back(head.ticket);
      *python = true;
    }
    waiters_.pop_front();
  }
}

void SharedBudget::Wake(const std::vector<int64_t>& native, bool python) {
  if (python && wake_fd_ >= 0) {
    const uint64_t one = 1;
    if (write(wake_fd_, &one, sizeof one) < 0) {
      // EAGAIN: the counter is full, and the event loop is woken anyway.
    }
  }
  if (native.empty()) return;
  std::function<void(int64_t)> wake;
  {
    std::lock_guard<std::mutex> lock(mu_);
    wake = native_wake_;
  }
  for (int64_t ticket : native)
    if (wake) wake(ticket);
}

bool SharedBudget::Leave(int64_t ticket) {
  std::vector<int64_t> native;
  bool python = false, left = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = waiters_.begin(); it != waiters_.end(); ++it) {
      if (it->ticket != ticket) continue;
      waiting_ -= it->first;
      waiters_.erase(it);
      left = true;
      Admit(&native, &python);  // the ones behind it may fit now
      break;
    }
  }
  Wake(native, python);
  return left;
}

void SharedBudget::Give(int64_t n) {
  std::vector<int64_t> native;
  bool python = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    reserved_ -= n;
    Admit(&native, &python);
    if (reserved_ == 0 && waiters_.empty()) {  // emptied: after a large use, the event loop reclaims
      if (idle_after_ > 0 && high_water_ >= idle_after_) went_idle_ = python = true;
      high_water_ = 0;
    }
  }
  Wake(native, python);
}

void SharedBudget::SetIdleAfter(int64_t bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  idle_after_ = bytes;
}

bool SharedBudget::WentIdle() {
  std::lock_guard<std::mutex> lock(mu_);
  const bool went = went_idle_;
  went_idle_ = false;
  return went;
}

std::vector<int64_t> SharedBudget::Granted() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<int64_t> out;
  out.swap(granted_python_);
  return out;
}

void SharedBudget::SetNativeWake(std::function<void(int64_t)> wake) {
  std::lock_guard<std::mutex> lock(mu_);
  native_wake_ = std::move(wake);
}

int64_t SharedBudget::reserved() const {
  std::lock_guard<std::mutex> lock(mu_);
  return reserved_;
}

int64_t SharedBudget::Free() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiters_.empty() ? std::max<int64_t>(limit_ - room_ - reserved_, 0) : 0;
}

int64_t SharedBudget::waiting() const {
  std::lock_guard<std::mutex> lock(mu_);
  return waiting_;
}

int64_t SharedBudget::waiters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int64_t>(waiters_.size());
}

void SharedBudget::Drain() {
  uint64_t count = 0;
  while (wake_fd_ >= 0 && read(wake_fd_, &count, sizeof count) > 0) {
  }
}

void Plane::SetBudget(std::shared_ptr<SharedBudget> budget, const CostTerms& terms, double stream_share) {
  if (budget_) budget_->SetNativeWake(nullptr);
  budget_ = std::move(budget);
  if (budget_) budget_->SetNativeWake([this](int64_t ticket) { Granted(ticket); });
  cost_terms_ = terms;
  stream_share_bytes_ = budget_ ? static_cast<int64_t>(static_cast<double>(budget_->limit()) * stream_share) : 0;
}

std::array<int64_t, 3> Plane::Cost(size_t index, int64_t rows, int64_t q_len, int64_t k_len, int64_t input_bytes,
                                   bool want_probs, bool heads_differ) const {
  return CostOf(*models_.at(index), rows, q_len, k_len, input_bytes, want_probs, heads_differ);
}

std::array<int64_t, 3> Plane::CostOf(const Queue& queue, int64_t rows, int64_t q_len, int64_t k_len,
                                     int64_t input_bytes, bool want_probs, bool heads_differ) const {
  // costs.request_cost on the graph the engine takes for the batch: attn_probs asked -> all outputs;
  // heads differ -> the head-mask graphs; else output only (the fused graphs are given its figure).
  const ModelLimits& m = queue.limits;
  const CostTerms& t = cost_terms_;
  const int64_t d = queue.bounds.d_model > 0 ? queue.bounds.d_model : std::max({m.query_dim, m.kv_dim, m.out_dim});
  const int64_t mask_heads = heads_differ ? m.num_heads : 1;
  const int64_t scores = 4 * rows * m.num_heads * q_len * k_len;
  const int64_t mask = rows * mask_heads * q_len * k_len;
  const int64_t inputs = 4 * rows * (q_len * m.query_dim + 2 * k_len * m.kv_dim);
  const int64_t projections = 4 * rows * (q_len + 2 * k_len) * d;
  const int64_t outputs = 4 * rows * q_len * (d + m.out_dim);
  double working = t.scores * static_cast<double>(scores) + t.mask * static_cast<double>(mask) +
                   static_cast<double>(inputs) + static_cast<double>(projections) + static_cast<double>(outputs);
  if (want_probs) working += t.probs * static_cast<double>(scores);
  const int64_t run = static_cast<int64_t>(t.safety * working) +
                      (working >= static_cast<double>(t.slack_from_bytes) ? t.slack_bytes : 0);
  const int64_t answer = 4 * rows * q_len * m.out_dim + (want_probs ? scores : 0);
  return {t.input_copies * input_bytes, run, t.answer_copies * answer};
}

Status Plane::Bound(const Queue& queue, const inference::ModelInferRequest& request, const Pending& p) const {
  const ModelBounds& b = queue.bounds;
  const ModelLimits& m = queue.limits;
  // Shapes checked, contents not yet: a hostile batch size makes these products huge (exact here).
  const Wide rows_q = WideMul(static_cast<Wide>(p.rows), static_cast<Wide>(p.q_len));
  const Wide sizes[2] = {WideMul(WideMul(rows_q, static_cast<Wide>(m.out_dim)), 4),
                         WideMul(WideMul(WideMul(rows_q, static_cast<Wide>(m.num_heads)), static_cast<Wide>(p.k_len)), 4)};
  const std::string* names[2] = {&contract_.output, &contract_.attn_probs};
  Wide needed = 0;
  std::string parts;
  for (bool probs : p.order_probs) {
    needed += sizes[probs];
    parts += (parts.empty() ? "" : " + ") + *names[probs] + " " + WideCommas(sizes[probs]);
  }
  if (b.max_response_bytes > 0) {  // codec._check_response_size
    const Wide total = needed + request.id().size() + request.model_name().size() +
                       static_cast<Wide>(b.response_overhead_bytes);
    if (total > static_cast<Wide>(b.max_response_bytes)) {
      return Invalid("the response would need " + WideCommas(total) + " bytes (" + parts + " bytes of tensors), over the " +
                     Commas(b.max_response_bytes) + "-byte message limit (--max-message-bytes); ask for fewer rows, " +
                     "shorter sequences, or only the outputs you need");
    }
  }
  if (b.max_typed_bytes > 0 && !p.raw) {  // codec._check_typed_size
    Wide inputs = 0;
    for (const auto& t : request.inputs()) inputs += WideMul(Product(t.shape()), t.name() == contract_.mask ? 1 : 4);
    const std::pair<const char*, Wide> held[2] = {{"its inputs", inputs}, {"its answer", needed}};
    for (const auto& [what, nbytes] : held) {
      if (nbytes > static_cast<Wide>(b.max_typed_bytes)) {
        return Invalid(std::string("typed contents: ") + what + " would hold " + WideCommas(nbytes) +
                       " bytes of tensors as typed contents, over the " + Commas(b.max_typed_bytes) +
                       "-byte limit for typed contents (--max-typed-bytes); send the inputs as raw_input_contents "
                       "and the answer comes as raw_output_contents");
      }
    }
  }
  return Status::OK;
}

Status Plane::Reserve(Queue& queue, Pending& p, bool* parked) {
  if (!budget_ || p.held == nullptr) return Status::OK;
  const auto cost = CostOf(queue, p.rows, p.q_len, p.k_len, p.input_bytes, p.want_probs, p.heads_differ);
  const int64_t total = cost[0] + cost[1] + cost[2];
  p.run_share = cost[1];
  // The batcher's words (server.batcher.Batcher.submit, memory.budget.MemoryBudget.reserve).
  const std::string what = "model " + queue.limits.name + ": this request (inputs " + Commas(cost[0]) + ", run " +
                           Commas(cost[1]) + ", answer " + Commas(cost[2]) + " bytes)";
  SharedBudget& budget = *budget_;
  if (total > budget.limit()) {
    budget.native_too_large++;
    return Invalid(what + " needs an estimated " + Commas(total) + " bytes of memory, over this server's budget of " +
                   Commas(budget.limit()) + " bytes (--memory-limit-bytes); send fewer rows or shorter sequences, " +
                   "or ask for `output` alone");
  }
  // A call with a deadline waits for room within it, in the one arrival order of both planes' waiters.
  const bool can_wait = p.deadline != kNever;
  const TimePoint deadline = p.deadline;
  int64_t ticket = 0;
  {
    std::lock_guard<std::mutex> lock(parked_mu_);  // a grant finds it parked: Granted takes parked_mu_
    ticket = budget.Take(total, cost[0], can_wait, true);
    if (ticket > 0) {
      budget.native_waits++;
      in_flight_++;
      parked_.emplace(ticket, Parked{std::move(p), &queue, total});
    }
  }
  if (ticket > 0) {
    *parked = true;
    Arm(deadline);
    return Status::OK;
  }
  if (ticket < 0) {
    budget.native_shed++;
    return Status(StatusCode::RESOURCE_EXHAUSTED,
                  "memory budget: " + Commas(budget.reserved() + budget.waiting()) + " of " + Commas(budget.limit()) +
                      " bytes in use (--memory-limit-bytes), " + std::to_string(budget.waiters()) +
                      " request(s) waiting; " + what + " needs " + Commas(total) + "; retry later" +
                      (can_wait ? "" : " (a request with a deadline waits within it)"));
  }
  *p.held = total;
  return Status::OK;
}

void Plane::Granted(int64_t ticket) {
  Parked parked;
  bool retired = false;
  Status refusal;
  {
    std::lock_guard<std::mutex> lock(parked_mu_);  // held while it queues: a Cancel finds it parked or queued
    auto found = parked_.find(ticket);
    if (found == parked_.end()) return;  // cancelled, expired or stopped: whoever took it gives its bytes back
    parked = std::move(found->second);
    parked_.erase(found);
    *parked.p.held = parked.total;
    if (Enqueue(*parked.queue, parked.p, true, &retired, &refusal)) return;
  }
  GiveBack(parked.p);
  Left(1);
  if (retired) {  // a swap while it waited: admitted afresh on the version served now
    Admit(std::move(parked.p), true);
    return;
  }
  counters_.refused++;
  Settle(parked.p, parked.queue, refusal);
}

Status Plane::QueueBounds(const Queue& queue, const Pending& p) const {
  const ModelLimits& m = queue.limits;
  if (static_cast<int64_t>(queue.pending.size()) >= m.max_queue_size) {  // server.batcher's words
    return Status(StatusCode::RESOURCE_EXHAUSTED, "model " + m.name + ": " + std::to_string(queue.pending.size()) +
                                                      " requests queued (max_queue_size " +
                                                      std::to_string(m.max_queue_size) + "); retry later");
  }
  const int64_t most = queue.bounds.max_queued_bytes;
  if (most > 0 && !queue.pending.empty() && queue.queued_bytes + p.input_bytes > most) {  // server.batcher's words
    return Status(StatusCode::RESOURCE_EXHAUSTED, "model " + m.name + ": " + Commas(queue.queued_bytes) +
                                                      " input bytes queued; this request's " + Commas(p.input_bytes) +
                                                      " would pass max_queued_bytes " + Commas(most) + "; retry later");
  }
  return Status::OK;
}

}  // namespace attnserve

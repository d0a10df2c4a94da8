#include "plane.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <set>
#include <sstream>

#include <grpc/support/time.h>
#include <grpcpp/resource_quota.h>
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

Status Bounded(const Status& status) {
  const std::string& details = status.error_message();
  if (details.size() <= kMaxDetailsChars) return status;
  return Status(status.error_code(), details.substr(0, kMaxDetailsChars) + "... (cut: " +
                                         std::to_string(details.size() - kMaxDetailsChars) + " more characters)");
}

// At most this many dims are written out: a hostile shape may have millions.
constexpr int kShapeDimsShown = 8;

std::string ShapeText(const google::protobuf::RepeatedField<int64_t>& shape) {
  std::ostringstream out;
  out << "(";
  for (int i = 0; i < shape.size() && i < kShapeDimsShown; ++i) out << (i ? ", " : "") << shape[i];
  if (shape.size() > kShapeDimsShown) out << ", ... " << shape.size() << " dims";
  out << (shape.size() == 1 ? ",)" : ")");
  return out.str();
}

// Product of the dims, or -1 if any is < 1 or the product overflows.
int64_t Elements(const google::protobuf::RepeatedField<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d < 1 || __builtin_mul_overflow(n, d, &n)) return -1;
  }
  return n;
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
// Longer timeouts are as good as none, and stay clear of the clock's overflow.
constexpr uint64_t kMaxTimeoutUs = uint64_t{1} << 50;
enum CancelReason : size_t { kClient = 0, kDeadline = 1 };
enum CancelStage : size_t { kQueued = 0, kRunning = 1, kTerminated = 2, kAnswered = 3 };
// Batch::cancelled[i]: 0 live, 1 cancelled, 2 settled by Complete (a cancel then is the answered stage).
constexpr char kLive = 0, kGone = 1, kSettled = 2;

Status Cancelled() { return Status(StatusCode::CANCELLED, "the client went away"); }  // server.errors.CANCELLED

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

}  // namespace

Plane::~Plane() {
  if (server_ && !stopping_) Stop(0);
  StopTimer();
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

std::string Quoted(const std::string& text) {
  constexpr size_t kLimit = 100;  // server/quoting.py's QUOTED_CHARS, in characters
  const bool has_single = text.find('\'') != std::string::npos, has_double = text.find('"') != std::string::npos;
  const char quote = has_single && !has_double ? '"' : '\'';
  std::vector<std::string> chars;  // the repr's characters, each as UTF-8
  chars.emplace_back(1, quote);
  static const char* const kHex = "0123456789abcdef";
  auto hex = [&](unsigned value, int digits, char kind) {
    std::string out = {'\\', kind};
    for (int d = digits - 1; d >= 0; --d) out += kHex[(value >> (4 * d)) & 0xf];
    chars.push_back(out);
  };
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    size_t n = c < 0x80 ? 1 : c < 0xe0 ? 2 : c < 0xf0 ? 3 : 4;
    if (i + n > text.size()) n = text.size() - i;
    unsigned cp = n == 1 ? c : c & (0xff >> (n + 1));
    for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3f);
    if (c == '\\' || c == static_cast<unsigned char>(quote)) {
      chars.push_back(std::string{'\\', static_cast<char>(c)});
    } else if (c == '\n' || c == '\r' || c == '\t') {
      chars.push_back(std::string{'\\', c == '\n' ? 'n' : c == '\r' ? 'r' : 't'});
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
  for (size_t i = 0; i < chars.size() && i < kLimit; ++i) out += chars[i];
  if (chars.size() > kLimit) out += "... (cut: " + std::to_string(chars.size() - kLimit) + " more characters)";
  return out;
}

void Plane::SetAnswer(const std::string& method, const std::string& name, std::string bytes) {
  answers_[{method, name}] = std::move(bytes);
}

int Plane::Start(const std::string& address, int max_message_bytes, int max_concurrent_streams) {
  grpc::ServerBuilder builder;
  int port = 0;
  auto credentials = Credentials();
  if (!credentials) return 0;
  builder.AddListeningPort(address, credentials, &port);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(max_message_bytes);
  builder.AddChannelArgument(GRPC_ARG_MAX_CONCURRENT_STREAMS, max_concurrent_streams);
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, reuse_port_ ? 1 : 0);  // alone, a port in use is an error
  for (const auto& [name, value] : channel_args_) builder.AddChannelArgument(name, value);
  // Every method not served here; gRPC refuses a service with generic methods but no generic service.
  if (!upstream_) no_upstream_ = std::make_unique<grpc::CallbackGenericService>();  // answers UNIMPLEMENTED
  builder.RegisterCallbackGenericService(upstream_ ? static_cast<grpc::CallbackGenericService*>(upstream_.get())
                                                   : no_upstream_.get());
  if (receive_quota_bytes_ > 0) {
    // The callback API hands a message over only once it is whole, so bytes being received cannot
    // be counted per call (server.gate's slots): gRPC's own memory quota bounds the transport.
    builder.SetResourceQuota(grpc::ResourceQuota("attnserve-native-receive").Resize(
        static_cast<size_t>(receive_quota_bytes_)));
  }
  builder.RegisterService(this);
  server_ = builder.BuildAndStart();
  if (!server_ || port == 0) {
    server_.reset();
    return 0;
  }
  if (!timer_.joinable()) timer_ = std::thread([this] { Reap(); });
  return port;
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
  return idle_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return in_flight_ <= 0; });
}

std::array<uint64_t, kCodes> Plane::FinalCodes(size_t index) const {
  std::shared_lock<std::shared_mutex> lock(models_mu_);
  const Codes& codes = index < models_.size() ? *models_[index]->codes : unknown_codes_;
  std::array<uint64_t, kCodes> out{};
  for (size_t i = 0; i < kCodes; ++i) out[i] = codes[i].load();
  return out;
}

void Plane::Stop(double grace_s) {
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
    for (auto& p : refused) Settle(p, queue, Status(StatusCode::UNAVAILABLE, "the server is stopping; not computed"));
    if (!refused.empty()) Left(static_cast<int64_t>(refused.size()));
  }
  std::map<int64_t, Parked> waiting;  // calls waiting for memory: refused the same way
  {
    std::lock_guard<std::mutex> lock(parked_mu_);
    waiting.swap(parked_);
  }
  for (auto& [ticket, parked] : waiting) {
    if (!budget_->Leave(ticket)) budget_->Give(parked.total);
    Settle(parked.p, parked.queue, Status(StatusCode::UNAVAILABLE, "the server is stopping; not computed"));
  }
  if (!waiting.empty()) Left(static_cast<int64_t>(waiting.size()));
  if (server_) {
    // Batches being computed finish meanwhile (their runner threads call Complete).
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::microseconds(static_cast<int64_t>(grace_s * 1e6)));
    server_.reset();
  }
  StopTimer();
}

Status Plane::Check(const Queue& queue, const inference::ModelInferRequest& request, Pending& p) const {
  const ModelLimits& m = queue.limits;
  const Contract& c = contract_;
  // Triton's schedule policy (`priority`, `timeout`), read before any tensor, as the Python plane does.
  if (Status schedule = Schedule(m, request, p); !schedule.ok()) return schedule;
  const bool raw = request.raw_input_contents_size() > 0;
  if (raw && request.raw_input_contents_size() != request.inputs_size()) {
    return Invalid("raw_input_contents holds " + std::to_string(request.raw_input_contents_size()) +
                   " tensors for " + std::to_string(request.inputs_size()) + " inputs; expected one per input");
  }
  const inference::ModelInferRequest::InferInputTensor* tensors[4] = {nullptr, nullptr, nullptr, nullptr};
  Data data[4];
  const std::string* names[4] = {&c.query, &c.key, &c.value, &c.mask};
  for (int i = 0; i < request.inputs_size(); ++i) {
    const auto& t = request.inputs(i);
    int slot = -1;
    for (int s = 0; s < 4; ++s)
      if (t.name() == *names[s]) slot = s;
    if (slot < 0) {
      return Invalid("unexpected input '" + t.name() + "'; model " + m.name + " takes " + c.query + ", " + c.key +
                     ", " + c.value + " and optionally " + c.mask);
    }
    if (tensors[slot] != nullptr) return Invalid("input '" + t.name() + "' given twice");
    const std::string& want = slot == 3 ? c.boolean : c.fp32;
    if (t.datatype() != want) {
      return Invalid("input '" + t.name() + "': expected datatype " + want + ", got '" + t.datatype() + "'");
    }
    tensors[slot] = &t;
    if (raw) {
      if (t.has_contents()) return Invalid("input '" + t.name() + "': contents given besides raw_input_contents");
      const std::string& bytes = request.raw_input_contents(i);
      data[slot] = {bytes.data(), bytes.size()};
    } else if (slot == 3) {
      const auto& values = t.contents().bool_contents();
      data[slot] = {reinterpret_cast<const char*>(values.data()), static_cast<size_t>(values.size())};
    } else {
      const auto& values = t.contents().fp32_contents();
      data[slot] = {reinterpret_cast<const char*>(values.data()), static_cast<size_t>(values.size()) * 4};
    }
  }
  for (int s = 0; s < 3; ++s) {
    if (tensors[s] == nullptr) return Invalid("missing input '" + *names[s] + "'");
  }
  const auto& qs = tensors[0]->shape();
  const auto& ks = tensors[1]->shape();
  const auto& vs = tensors[2]->shape();
  if (qs.size() != 3 || Elements(qs) < 0 || qs[2] != m.query_dim) {
    return Invalid(c.query + ": expected shape (batch, q_len, " + std::to_string(m.query_dim) + "), got " +
                   ShapeText(qs));
  }
  p.rows = qs[0];
  p.q_len = qs[1];
  if (ks.size() != 3 || Elements(ks) < 0 || ks[0] != p.rows || ks[2] != m.kv_dim) {
    return Invalid(c.key + ": expected shape (" + std::to_string(p.rows) + ", k_len, " + std::to_string(m.kv_dim) +
                   "), got " + ShapeText(ks));
  }
  p.k_len = ks[1];
  if (vs.size() != 3 || vs[0] != ks[0] || vs[1] != ks[1] || vs[2] != ks[2]) {
    return Invalid(c.value + ": expected the key's shape " + ShapeText(ks) + ", got " + ShapeText(vs));
  }
  if (p.q_len > m.max_q_len) {
    return Invalid(c.query + ": q_len " + std::to_string(p.q_len) + " is over the limit " + std::to_string(m.max_q_len));
  }
  if (p.k_len > m.max_kv_len) {
    return Invalid(c.key + ": k_len " + std::to_string(p.k_len) + " is over the limit " + std::to_string(m.max_kv_len));
  }
  int64_t row_heads = 0, scores = 0;
  if (__builtin_mul_overflow(p.rows, m.num_heads, &row_heads) ||
      __builtin_mul_overflow(row_heads, p.q_len * p.k_len, &scores) || scores > m.max_attention_bytes / 4) {
    return Invalid("the attention matrix (" + std::to_string(p.rows) + ", " + std::to_string(m.num_heads) + ", " +
                   std::to_string(p.q_len) + ", " + std::to_string(p.k_len) + ") is over " +
                   std::to_string(m.max_attention_bytes) + " bytes (--max-attention-bytes)");
  }
  const size_t q_bytes = static_cast<size_t>(Elements(qs)) * 4, k_bytes = static_cast<size_t>(Elements(ks)) * 4;
  const size_t want_bytes[3] = {q_bytes, k_bytes, k_bytes};
  for (int s = 0; s < 3; ++s) {
    if (data[s].size != want_bytes[s]) {
      return Invalid("input '" + *names[s] + "': shape " + ShapeText(tensors[s]->shape()) + " needs " +
                     std::to_string(want_bytes[s]) + " bytes of FP32, got " + std::to_string(data[s].size));
    }
  }
  p.input_bytes = static_cast<int64_t>(q_bytes + 2 * k_bytes);
  p.query = reinterpret_cast<const float*>(data[0].bytes);
  p.key = reinterpret_cast<const float*>(data[1].bytes);
  p.value = reinterpret_cast<const float*>(data[2].bytes);
  if (tensors[3] != nullptr) {
    const auto& ms = tensors[3]->shape();
    const int64_t plane = p.q_len * p.k_len;
    int64_t heads = 1;
    bool ok = false;
    if (ms.size() == 2) {
      ok = ms[0] == p.q_len && ms[1] == p.k_len;
      p.mask_row_stride = 0;
    } else if (ms.size() == 3) {
      ok = ms[0] == p.rows && ms[1] == p.q_len && ms[2] == p.k_len;
      p.mask_row_stride = plane;
    } else if (ms.size() == 4) {
      heads = ms[1];
      ok = ms[0] == p.rows && (heads == 1 || heads == m.num_heads) && ms[2] == p.q_len && ms[3] == p.k_len;
      p.mask_row_stride = heads * plane;
    }
    if (!ok) {
      return Invalid(c.mask + ": expected shape (" + std::to_string(p.rows) + ", " + std::to_string(p.q_len) + ", " +
                     std::to_string(p.k_len) + "), (q_len, k_len), (batch, 1, q_len, k_len) or (batch, " +
                     std::to_string(m.num_heads) + ", q_len, k_len), got " + ShapeText(ms));
    }
    const size_t mask_bytes = static_cast<size_t>(Elements(ms));
    // Work.mask_nbytes: as sent, or as a run copies it ((lq, lk) over the batch), whichever is more.
    p.input_bytes += std::max(static_cast<int64_t>(mask_bytes), p.rows * plane);
    if (data[3].size != mask_bytes) {
      return Invalid("input '" + c.mask + "': shape " + ShapeText(ms) + " needs " + std::to_string(mask_bytes) +
                     " bytes of BOOL, got " + std::to_string(data[3].size));
    }
    const auto* bytes = reinterpret_cast<const uint8_t*>(data[3].bytes);
    for (size_t i = 0; i < mask_bytes; ++i) {
      if (bytes[i] > 1) return Invalid("input '" + c.mask + "': a BOOL byte is 0 or 1, got " + std::to_string(bytes[i]) +
                                       " at " + std::to_string(i));
    }
    const int64_t items = ms.size() == 2 ? 1 : p.rows;
    for (int64_t b = 0; b < items && heads > 1 && !p.heads_differ; ++b) {
      const uint8_t* first = bytes + b * p.mask_row_stride;
      for (int64_t h = 1; h < heads && !p.heads_differ; ++h) p.heads_differ = std::memcmp(first, first + h * plane, plane) != 0;
    }
    if (p.heads_differ && !m.head_masks) return Invalid(m.why_no_head_masks);
    p.mask_head_stride = p.heads_differ ? plane : 0;
    p.mask = bytes;
    // A query row that masks every key is uniform over the keys it sees: its keys are never padded.
    const int64_t planes = p.heads_differ ? heads : 1;
    for (int64_t b = 0; b < items && !p.exact_k_len; ++b) {
      for (int64_t h = 0; h < planes && !p.exact_k_len; ++h) {
        for (int64_t i = 0; i < p.q_len && !p.exact_k_len; ++i) {
          const uint8_t* row = bytes + b * p.mask_row_stride + h * plane + i * p.k_len;
          p.exact_k_len = std::find(row, row + p.k_len, uint8_t{1}) == row + p.k_len;
        }
      }
    }
  }
  p.raw = raw;
  if (request.outputs_size() == 0) {
    p.order_probs = {false, true};
  } else {
    p.want_output = p.want_probs = false;
    for (const auto& o : request.outputs()) {
      if (o.name() == c.output) {
        p.order_probs.push_back(false);
        p.want_output = true;
      } else if (o.name() == c.attn_probs) {
        p.order_probs.push_back(true);
        p.want_probs = true;
      } else {
        return Invalid("unknown output '" + o.name() + "'; model " + m.name + " answers " + c.output + " and " +
                       c.attn_probs);
      }
    }
    // Each repeat would be answered in full: a small request could ask for any number of copies.
    if (request.outputs_size() > 2 || (request.outputs_size() == 2 && p.order_probs[0] == p.order_probs[1])) {
      return Invalid("an output is requested more than once (" + std::to_string(request.outputs_size()) +
                     " outputs named); each of " + c.output + " and " + c.attn_probs + " at most once");
    }
  }
  p.want_probs = std::find(p.order_probs.begin(), p.order_probs.end(), true) != p.order_probs.end();
  return Status::OK;
}

namespace {

// Adds one output tensor's header to the answer and returns where its `count` floats go.
float* AddOutput(inference::ModelInferResponse* response, const std::string& name, const std::string& datatype,
                 std::initializer_list<int64_t> shape, bool raw, size_t count) {
  auto* tensor = response->add_outputs();
  tensor->set_name(name);
  tensor->set_datatype(datatype);
  for (int64_t d : shape) tensor->add_shape(d);
  if (raw) {
    std::string* bytes = response->add_raw_output_contents();
    bytes->resize(count * 4);
    return reinterpret_cast<float*>(bytes->data());
  }
  auto* values = tensor->mutable_contents()->mutable_fp32_contents();
  values->Resize(static_cast<int>(count), 0.0f);
  return values->mutable_data();
}

}  // namespace

void Plane::AnswerZeros(Pending& p, Queue& queue) {
  const ModelLimits& m = queue.limits;
  p.response->set_model_name(m.name);
  p.response->set_model_version(m.version);
  p.response->set_id(p.request->id());
  for (bool probs : p.order_probs) {
    if (probs) {
      AddOutput(p.response, contract_.attn_probs, contract_.fp32, {p.rows, m.num_heads, p.q_len, p.k_len}, p.raw,
                static_cast<size_t>(p.rows * m.num_heads * p.q_len * p.k_len));
    } else {
      AddOutput(p.response, contract_.output, contract_.fp32, {p.rows, p.q_len, m.out_dim}, p.raw,
                static_cast<size_t>(p.rows * p.q_len * m.out_dim));
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

// A stream refused before it reads anything (its token, checked by the handler when calls are recorded).
class RefusedStream final : public grpc::ServerBidiReactor<grpc::ByteBuffer, inference::ModelStreamInferResponse> {
 public:
  explicit RefusedStream(const Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

Plane::Plane(Contract contract) : contract_(std::move(contract)) {
  // Methods served neither here nor through the rare RPCs' relay go to the generic service, which
  // hands them to the Python server (native/relay.h); without one gRPC answers them UNIMPLEMENTED.
  const auto* service = inference::ModelInferRequest::descriptor()->file()->FindServiceByName("GRPCInferenceService");
  for (int i = 0; i < service->method_count(); ++i) {
    if (kServedHere.count(service->method(i)->name()) == 0) MarkMethodGeneric(i);
  }
  // ModelInfer's request as raw bytes (the response stays typed), by the method's index in the proto.
  const int method = inference::ModelInferRequest::descriptor()
                         ->file()
                         ->FindServiceByName("GRPCInferenceService")
                         ->FindMethodByName("ModelInfer")
                         ->index();
  MarkMethodCallback(
      method, new grpc::internal::CallbackUnaryHandler<grpc::ByteBuffer, inference::ModelInferResponse>(
                  [this](grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
                         inference::ModelInferResponse* response) {
                    const TimePoint deadline = CallDeadline(context);
                    auto* call = new InferCall(this, deadline);
                    if (TokenDeferred() && !TokenAdmits(context)) {  // the processor let it through to us
                      RecordTokenRefusal(context, "ModelInfer");
                      call->Finish(Status(StatusCode::UNAUTHENTICATED, security_.refusal));
                      return call;
                    }
                    std::shared_ptr<CallNote> note;
                    if (records_) note = Note(context, "ModelInfer", static_cast<int64_t>(bytes->Length()));
                    std::string why;
                    if (!Parse(*bytes, &call->request, &why)) {
                      counters_.requests++;
                      counters_.refused++;
                      RecordArrival("ModelInfer");
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
                            &call->answered_by, std::move(note));
                    }
                    return call;
                  }));
  // ModelStreamInfer's requests as raw bytes too: one that does not parse ends the stream with a message.
  const int stream_method = inference::ModelInferRequest::descriptor()
                                ->file()
                                ->FindServiceByName("GRPCInferenceService")
                                ->FindMethodByName("ModelStreamInfer")
                                ->index();
  MarkMethodCallback(stream_method,
                     new grpc::internal::CallbackBidiHandler<grpc::ByteBuffer, inference::ModelStreamInferResponse>(
                         [this](grpc::CallbackServerContext* context) -> grpc::ServerBidiReactor<grpc::ByteBuffer, inference::ModelStreamInferResponse>* {
                           if (TokenDeferred() && !TokenAdmits(context)) {  // the processor let it through to us
                             RecordTokenRefusal(context, "ModelStreamInfer");
                             return new RefusedStream(Status(StatusCode::UNAUTHENTICATED, security_.refusal));
                           }
                           RecordArrival("ModelStreamInfer");
                           return new StreamCall(this, CallDeadline(context), context);
                         }));
}

bool Plane::Parse(const grpc::ByteBuffer& bytes, inference::ModelInferRequest* request, std::string* why) {
  grpc::ByteBuffer copy(bytes);  // shares the slices; the reader takes a mutable buffer
  grpc::ProtoBufferReader reader(&copy);
  if (!reader.status().ok() || !request->ParseFromZeroCopyStream(&reader)) {
    *why = "the request message does not parse as a ModelInferRequest (" + std::to_string(bytes.Length()) + " bytes)";
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
                  std::atomic<int64_t>* answered_by, std::shared_ptr<CallNote> note) {
  Pending p;
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
    const bool refusing = refusing_;
    // The gate's arrival line, written once the drain's refusal was read, as the gate writes it.
    if (!again && attempt == 0 && p.stream == nullptr && p.note) RecordArrival(p.note->method);
    if (refusing) {  // draining: never computed, retry elsewhere (the Python plane's words)
      counters_.refused++;
      Settle(p, codes, Status(StatusCode::UNAVAILABLE, "server is shutting down; retry on another replica"));
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
    p = std::move(fresh);
    p.started = started;
    status = Check(queue, request, p);
    if (status.ok()) status = Bound(queue, request, p);
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
      *refusal = Status(StatusCode::UNAVAILABLE, "the server is stopping; not computed");
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
  if (context != nullptr && plane_->records_) headers_ = plane_->Note(context, "ModelStreamInfer", 0);
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
  const bool parsed = Plane::Parse(incoming_, request.get(), &why);
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
  auto relay = plane_->upstream_->Unary(*context_, kModelInferMethod, message);
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
    slot.answer = std::make_unique<inference::ModelStreamInferResponse>();
    if (status.ok()) {
      slot.answer->mutable_infer_response()->Swap(slot.response.get());
    } else {  // the stream goes on: the request's own answer says what failed
      slot.answer->set_error_message(std::string(CodeName(status.error_code())) + ": " + status.error_message());
      slot.answer->mutable_infer_response()->set_model_name(slot.request->model_name());
      slot.answer->mutable_infer_response()->set_id(slot.request->id());
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
      const bool fits = rows <= m.max_batch_size && padded <= m.max_padding_ratio && (exact_k < 0 || exact_k == k) &&
                        (!p.exact_k_len || p.k_len == k);
      if (!fits) continue;
    }
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
  batch->padding_ratio = 1.0 - static_cast<double>(useful) / (static_cast<double>(batch->rows) * batch->q_len * batch->k_len);
  queue.formed++;
  batch->cancelled.assign(batch->items.size(), 0);
  queue.running.push_back(batch.get());
  return batch;
}

size_t Plane::Queued(size_t index) {
  Queue& queue = At(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  return queue.pending.size();
}

std::shared_ptr<Batch> Plane::NextBatch(size_t index, int64_t timeout_ms) {
  Queue& queue = At(index);
  std::unique_ptr<Batch> batch;
  std::vector<Pending> expired;
  {
    std::unique_lock<std::mutex> lock(queue.mu);
    queue.arrived.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                           [&] { return stopping_ || queue.retired || !queue.pending.empty(); });
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
  batch->query.assign(static_cast<size_t>(rows * lq * m.query_dim), 0.0f);  // padding: zeros
  batch->key.assign(static_cast<size_t>(rows * lk * m.kv_dim), 0.0f);
  batch->value.assign(static_cast<size_t>(rows * lk * m.kv_dim), 0.0f);
  bool need_mask = false;
  for (const auto& p : batch->items) need_mask = need_mask || p.mask != nullptr || p.k_len != lk;
  const int64_t mh = batch->mask_heads;
  if (need_mask) batch->mask.assign(static_cast<size_t>(rows * mh * lq * lk), 0);  // padding is masked
  for (size_t i = 0; i < batch->items.size(); ++i) {
    const Pending& p = batch->items[i];
    const int64_t r0 = batch->first_row[i];
    for (int64_t r = 0; r < p.rows; ++r) {
      std::memcpy(&batch->query[((r0 + r) * lq) * m.query_dim], p.query + r * p.q_len * m.query_dim,
                  static_cast<size_t>(p.q_len * m.query_dim) * 4);
      std::memcpy(&batch->key[((r0 + r) * lk) * m.kv_dim], p.key + r * p.k_len * m.kv_dim,
                  static_cast<size_t>(p.k_len * m.kv_dim) * 4);
      std::memcpy(&batch->value[((r0 + r) * lk) * m.kv_dim], p.value + r * p.k_len * m.kv_dim,
                  static_cast<size_t>(p.k_len * m.kv_dim) * 4);
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

void Plane::Complete(Batch& batch, const float* output, const float* attn_probs) {
  if (batch.settled) return;
  batch.settled = true;
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
      Settle(p, &queue, Cancelled(), into);
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
        float* to = AddOutput(p.response, contract_.attn_probs, contract_.fp32, {p.rows, h, p.q_len, p.k_len}, p.raw,
                              static_cast<size_t>(p.rows * h * p.q_len * p.k_len));
        for (int64_t r = 0; r < p.rows; ++r)
          for (int64_t hh = 0; hh < h; ++hh)
            for (int64_t q = 0; q < p.q_len; ++q, to += p.k_len)
              std::memcpy(to, attn_probs + (((r0 + r) * h + hh) * lq + q) * lk, static_cast<size_t>(p.k_len) * 4);
      } else {
        float* to = AddOutput(p.response, contract_.output, contract_.fp32, {p.rows, p.q_len, od}, p.raw,
                              static_cast<size_t>(p.rows * p.q_len * od));
        for (int64_t r = 0; r < p.rows; ++r, to += p.q_len * od)
          std::memcpy(to, output + ((r0 + r) * lq) * od, static_cast<size_t>(p.q_len * od) * 4);
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
  if (batch.cancelled[i] == kGone) return true;
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
  Queue& queue = At(batch.model);
  const std::vector<char> cancelled = Unrun(batch);  // a stopped run ends here: all cancelled
  std::vector<CallRecord> records;
  std::vector<CallRecord>* into = records_ ? &records : nullptr;
  for (size_t i = 0; i < batch.items.size(); ++i)
    Settle(batch.items[i], &queue, cancelled[i] ? Cancelled() : Status(code, message), into);
  if (into != nullptr) records_->Add(records);
  Left(static_cast<int64_t>(batch.items.size()));
}

// -- request control (docs/native-data-plane.md, "Request control") --------------------------------

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
  return next;
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
  }
  Wake(native, python);
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
  // Check has bounded the shapes by --max-attention-bytes: these products cannot overflow.
  const int64_t sizes[2] = {4 * p.rows * p.q_len * m.out_dim, 4 * p.rows * m.num_heads * p.q_len * p.k_len};
  const std::string* names[2] = {&contract_.output, &contract_.attn_probs};
  int64_t needed = 0;
  std::string parts;
  for (bool probs : p.order_probs) {
    needed += sizes[probs];
    parts += (parts.empty() ? "" : " + ") + *names[probs] + " " + Commas(sizes[probs]);
  }
  if (b.max_response_bytes > 0) {  // codec._check_response_size
    const int64_t total = needed + static_cast<int64_t>(request.id().size() + request.model_name().size()) +
                          b.response_overhead_bytes;
    if (total > b.max_response_bytes) {
      return Invalid("the response would need " + Commas(total) + " bytes (" + parts + " bytes of tensors), over the " +
                     Commas(b.max_response_bytes) + "-byte message limit (--max-message-bytes); ask for fewer rows, " +
                     "shorter sequences, or only the outputs you need");
    }
  }
  if (b.max_typed_bytes > 0 && !p.raw) {  // codec._check_typed_size
    int64_t inputs = 4 * p.rows * (p.q_len * m.query_dim + 2 * p.k_len * m.kv_dim);
    for (const auto& t : request.inputs())
      if (t.name() == contract_.mask) inputs += Elements(t.shape());
    const std::pair<const char*, int64_t> held[2] = {{"its inputs", inputs}, {"its answer", needed}};
    for (const auto& [what, nbytes] : held) {
      if (nbytes > b.max_typed_bytes) {
        return Invalid(std::string("typed contents: ") + what + " would hold " + Commas(nbytes) +
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

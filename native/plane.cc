#include "plane.h"

#include <algorithm>
#include <cstring>
#include <sstream>

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

}  // namespace

Plane::~Plane() {
  if (server_ && !stopping_) Stop(0);
}

size_t Plane::AddModel(const ModelLimits& limits) {
  auto queue = std::make_unique<Queue>();
  queue->limits = limits;
  models_.push_back(std::move(queue));
  by_name_[limits.name] = models_.size() - 1;
  return models_.size() - 1;
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
  builder.RegisterService(this);
  server_ = builder.BuildAndStart();
  if (!server_ || port == 0) {
    server_.reset();
    return 0;
  }
  return port;
}

void Plane::Count(Queue* queue, const Status& status) {
  const auto code = static_cast<size_t>(status.error_code());
  (queue != nullptr ? queue->codes : unknown_codes_)[code < kCodes ? code : static_cast<size_t>(StatusCode::UNKNOWN)]++;
}

void Plane::Answer(grpc::ServerUnaryReactor* reactor, Queue* queue, const Status& status) {
  Count(queue, status);
  reactor->Finish(Bounded(status));
}

void Plane::Settle(const Pending& p, Queue* queue, const Status& status) {
  if (p.stream == nullptr) {
    Answer(p.reactor, queue, status);
    return;
  }
  Count(queue, status);
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
  const Codes& codes = index < models_.size() ? models_[index]->codes : unknown_codes_;
  std::array<uint64_t, kCodes> out{};
  for (size_t i = 0; i < kCodes; ++i) out[i] = codes[i].load();
  return out;
}

void Plane::Stop(double grace_s) {
  stopping_ = true;
  refusing_ = true;
  ready_ = false;
  for (auto& queue : models_) {
    std::deque<Pending> refused;
    {
      std::lock_guard<std::mutex> lock(queue->mu);
      refused.swap(queue->pending);
    }
    queue->arrived.notify_all();
    for (auto& p : refused) Settle(p, queue.get(), Status(StatusCode::UNAVAILABLE, "the server is stopping; not computed"));
    if (!refused.empty()) Left(static_cast<int64_t>(refused.size()));
  }
  if (server_) {
    // Batches being computed finish meanwhile (their runner threads call Complete).
    server_->Shutdown(std::chrono::system_clock::now() +
                      std::chrono::microseconds(static_cast<int64_t>(grace_s * 1e6)));
    server_.reset();
  }
}

Status Plane::Check(const Queue& queue, const inference::ModelInferRequest& request, Pending& p) const {
  const ModelLimits& m = queue.limits;
  const Contract& c = contract_;
  if (!request.model_version().empty() && request.model_version() != m.version) {
    return Status(StatusCode::NOT_FOUND, "model " + m.name + " has no version '" + request.model_version() +
                                              "'; serving version " + m.version);
  }
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

// A ModelInfer call whose request the plane parses itself (gRPC's generated handler answers bytes
// that do not parse UNIMPLEMENTED, without a message); it owns the parsed request until gRPC is done.
class InferCall final : public grpc::ServerUnaryReactor {
 public:
  inference::ModelInferRequest request;
  void OnDone() override { delete this; }
};

}  // namespace

Plane::Plane(Contract contract) : contract_(std::move(contract)) {
  // ModelInfer's request as raw bytes (the response stays typed), by the method's index in the proto.
  const int method = inference::ModelInferRequest::descriptor()
                         ->file()
                         ->FindServiceByName("GRPCInferenceService")
                         ->FindMethodByName("ModelInfer")
                         ->index();
  MarkMethodCallback(
      method, new grpc::internal::CallbackUnaryHandler<grpc::ByteBuffer, inference::ModelInferResponse>(
                  [this](grpc::CallbackServerContext*, const grpc::ByteBuffer* bytes,
                         inference::ModelInferResponse* response) {
                    auto* call = new InferCall;
                    std::string why;
                    if (!Parse(*bytes, &call->request, &why)) {
                      counters_.requests++;
                      counters_.refused++;
                      Answer(call, nullptr, Invalid(why));
                    } else {
                      Admit(call, &call->request, response);
                    }
                    return call;
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

void Plane::Admit(grpc::ServerUnaryReactor* reactor, const inference::ModelInferRequest* request,
                  inference::ModelInferResponse* response) {
  Pending p;
  p.reactor = reactor;
  p.request = request;
  p.response = response;
  Admit(std::move(p));
}

void Plane::Admit(Pending p) {
  const auto started = Clock::now();
  const inference::ModelInferRequest& request = *p.request;
  counters_.requests++;
  auto found = by_name_.find(request.model_name());
  Queue* known = found == by_name_.end() ? nullptr : models_[found->second].get();
  if (refusing_) {  // draining: never computed, retry elsewhere (the Python plane's words)
    counters_.refused++;
    Settle(p, known, Status(StatusCode::UNAVAILABLE, "server is shutting down; retry on another replica"));
    return;
  }
  if (known == nullptr) {
    counters_.refused++;
    Settle(p, nullptr, Status(StatusCode::NOT_FOUND, "unknown model '" + request.model_name() + "'"));
    return;
  }
  Queue& queue = *known;
  Status status = Check(queue, request, p);
  if (!status.ok()) {
    counters_.refused++;
    Settle(p, &queue, status);
    return;
  }
  p.started = started;
  p.arrived = Clock::now();
  counters_.check_ns += NanosSince(started);
  if (zeros_) {
    AnswerZeros(p, queue);
    return;
  }
  {
    std::unique_lock<std::mutex> lock(queue.mu);
    if (static_cast<int64_t>(queue.pending.size()) >= queue.limits.max_queue_size) {
      lock.unlock();
      counters_.refused++;
      Settle(p, &queue, Status(StatusCode::RESOURCE_EXHAUSTED,
                               "model " + queue.limits.name + "'s queue is full (" +
                                   std::to_string(queue.limits.max_queue_size) + " requests, --max-queue-size)"));
      return;
    }
    queue.pending.push_back(std::move(p));
    in_flight_++;
  }
  queue.arrived.notify_one();
}

grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>* Plane::ModelStreamInfer(
    grpc::CallbackServerContext*) {
  return new StreamCall(this);  // deletes itself in OnDone
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

StreamCall::StreamCall(Plane* plane) : plane_(plane) { StartRead(&incoming_); }

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
  Pending p;
  p.stream = this;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot slot;
    slot.request = std::make_unique<inference::ModelInferRequest>();
    slot.request->Swap(&incoming_);
    slot.response = std::make_unique<inference::ModelInferResponse>();
    p.request = slot.request.get();
    p.response = slot.response.get();
    p.seq = first_seq_ + slots_.size();
    slots_.push_back(std::move(slot));
    reading_ = false;
  }
  plane_->Admit(std::move(p));  // may answer at once (Answered takes mu_)
  Next next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    next = Step();
  }
  Run(next);
}

void StreamCall::Answered(uint64_t seq, const Status& status) {
  Next next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Slot& slot = slots_.at(static_cast<size_t>(seq - first_seq_));
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
    slots_.pop_front();
    first_seq_++;
    if (broken_) continue;
    writing_ = std::move(answer);
    next.write = writing_.get();
  }
  if (!reading_ && !reads_done_ && !broken_ && static_cast<int64_t>(slots_.size()) < plane_->stream_window_) {
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
  if (next.finish) Finish(Status::OK);
}

std::unique_ptr<Batch> Plane::Form(size_t index, Queue& queue) {
  const ModelLimits& m = queue.limits;
  auto batch = std::make_unique<Batch>();
  batch->model = index;
  std::deque<Pending> kept;
  int64_t useful = 0, exact_k = -1;
  while (!queue.pending.empty()) {
    Pending p = std::move(queue.pending.front());
    queue.pending.pop_front();
    if (!batch->items.empty()) {
      const int64_t rows = batch->rows + p.rows;
      const int64_t q = std::max(batch->q_len, p.q_len), k = std::max(batch->k_len, p.k_len);
      const double padded = 1.0 - static_cast<double>(useful + p.rows * p.q_len * p.k_len) /
                                      (static_cast<double>(rows) * q * k);
      const bool fits = rows <= m.max_batch_size && padded <= m.max_padding_ratio && (exact_k < 0 || exact_k == k) &&
                        (!p.exact_k_len || p.k_len == k);
      if (!fits) {
        kept.push_back(std::move(p));
        continue;
      }
    }
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
  batch->padding_ratio = 1.0 - static_cast<double>(useful) / (static_cast<double>(batch->rows) * batch->q_len * batch->k_len);
  queue.pending.swap(kept);
  return batch;
}

size_t Plane::Queued(size_t index) {
  Queue& queue = *models_.at(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  return queue.pending.size();
}

std::shared_ptr<Batch> Plane::NextBatch(size_t index, int64_t timeout_ms) {
  Queue& queue = *models_.at(index);
  std::unique_ptr<Batch> batch;
  {
    std::unique_lock<std::mutex> lock(queue.mu);
    queue.arrived.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                           [&] { return stopping_ || !queue.pending.empty(); });
    if (stopping_ || queue.pending.empty()) return nullptr;
    batch = Form(index, queue);
  }
  const auto started = Clock::now();
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
  auto started = Clock::now();
  counters_.python_ns += static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(started - batch.formed).count());
  const ModelLimits& m = models_.at(batch.model)->limits;
  const int64_t lq = batch.q_len, lk = batch.k_len, h = m.num_heads, od = m.out_dim;
  for (size_t i = 0; i < batch.items.size(); ++i) {
    Pending& p = batch.items[i];
    const int64_t r0 = batch.first_row[i];
    if (p.want_probs && attn_probs == nullptr) {
      Settle(p, models_.at(batch.model).get(), Status(StatusCode::INTERNAL, "the run returned no attn_probs"));
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
    Settle(p, models_.at(batch.model).get(), Status::OK);  // gRPC may send the answer on this thread
    counters_.finish_ns += NanosSince(finishing);
    started = Clock::now();
  }
  Left(static_cast<int64_t>(batch.items.size()));
}

void Plane::Fail(Batch& batch, StatusCode code, const std::string& message) {
  if (batch.settled) return;
  batch.settled = true;
  for (auto& p : batch.items) Settle(p, models_.at(batch.model).get(), Status(code, message));
  Left(static_cast<int64_t>(batch.items.size()));
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

grpc::ServerUnaryReactor* Plane::ServerReady(grpc::CallbackServerContext* context, const inference::ServerReadyRequest*,
                                             inference::ServerReadyResponse* response) {
  response->set_ready(ready_ && !stopping_);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* Plane::ModelReady(grpc::CallbackServerContext* context,
                                            const inference::ModelReadyRequest* request,
                                            inference::ModelReadyResponse* response) {
  response->set_ready(ready_ && !stopping_ && by_name_.count(request->name()) > 0);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* Plane::ServerMetadata(grpc::CallbackServerContext* context,
                                                const inference::ServerMetadataRequest*,
                                                inference::ServerMetadataResponse* response) {
  return Table(context, "ServerMetadata", "", response);
}

grpc::ServerUnaryReactor* Plane::ModelMetadata(grpc::CallbackServerContext* context,
                                               const inference::ModelMetadataRequest* request,
                                               inference::ModelMetadataResponse* response) {
  return Table(context, "ModelMetadata", request->name(), response);
}

grpc::ServerUnaryReactor* Plane::ModelConfig(grpc::CallbackServerContext* context,
                                             const inference::ModelConfigRequest* request,
                                             inference::ModelConfigResponse* response) {
  return Table(context, "ModelConfig", request->name(), response);
}

grpc::ServerUnaryReactor* Plane::ModelStatistics(grpc::CallbackServerContext* context,
                                                 const inference::ModelStatisticsRequest* request,
                                                 inference::ModelStatisticsResponse* response) {
  return Table(context, "ModelStatistics", request->name(), response);
}

}  // namespace attnserve

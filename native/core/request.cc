// A request (core.h): its parse from the bytes as they came, with the message bounds, then the
// contract checks, the schedule's parameters and the answer's size, in one order and one set of words.
#include <algorithm>
#include <climits>
#include <cstdio>
#include <cstring>
#include <memory>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>

#include "core.h"
#include "masking.h"
#include "text.h"

namespace attnserve {

namespace {

using Clock = std::chrono::steady_clock;

// A message's pieces read as one stream, without copying them.
class ChunksInput {
 public:
  explicit ChunksInput(const Chunks& chunks) {
    parts_.reserve(chunks.size());
    for (std::string_view chunk : chunks) {
      parts_.push_back(std::make_unique<google::protobuf::io::ArrayInputStream>(chunk.data(), static_cast<int>(chunk.size())));
      streams_.push_back(parts_.back().get());
    }
    all_ = std::make_unique<google::protobuf::io::ConcatenatingInputStream>(streams_.data(),
                                                                            static_cast<int>(streams_.size()));
  }
  google::protobuf::io::ZeroCopyInputStream* stream() { return all_.get(); }

 private:
  std::vector<std::unique_ptr<google::protobuf::io::ArrayInputStream>> parts_;
  std::vector<google::protobuf::io::ZeroCopyInputStream*> streams_;
  std::unique_ptr<google::protobuf::io::ConcatenatingInputStream> all_;
};

// One input's bytes, wherever the request carries them.
struct Data {
  const char* bytes = nullptr;
  size_t size = 0;
};

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

// One step of server/proto's wire scan (wire.check_fields): false with its WireError's words.
bool ReadVarint(google::protobuf::io::CodedInputStream& in, uint64_t* value, std::string* why) {
  if (in.ReadVarint64(value)) return true;
  *why = "truncated or overlong varint";
  return false;
}

}  // namespace

bool Core::Parse(const Chunks& bytes, inference::ModelInferRequest* request, std::string* why) const {
  const MessageBounds& bounds = message_bounds_;
  int64_t size = 0;
  for (std::string_view chunk : bytes) size += static_cast<int64_t>(chunk.size());
  const bool scanned = (bounds.prescan_min_bytes > 0 && size >= bounds.prescan_min_bytes) ||
                       (bounds.wire_min_bytes > 0 && size >= bounds.wire_min_bytes);
  if (scanned && !Prescan(bytes, size, why)) return false;
  ChunksInput input(bytes);
  if (!request->ParseFromZeroCopyStream(input.stream())) {
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
bool Core::Prescan(const Chunks& bytes, int64_t size, std::string* why) const {
  const MessageBounds& bounds = message_bounds_;
  const std::string what = "the inference request";
  ChunksInput input(bytes);
  google::protobuf::io::CodedInputStream in(input.stream());
  in.SetTotalBytesLimit(INT_MAX);
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

Status Core::Check(const Queue& queue, const inference::ModelInferRequest& request, Pending& p) const {
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

Status Core::Schedule(const ModelLimits& m, const inference::ModelInferRequest& request, Pending& p) const {
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

Status Core::Bound(const Queue& queue, const inference::ModelInferRequest& request, const Pending& p) const {
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

}  // namespace attnserve

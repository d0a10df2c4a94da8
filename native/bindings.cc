// attnserve.server._native: the native data plane's few coarse calls, for server/native.py.
#include <algorithm>
#include <chrono>
#include <optional>
#include <string>

#include <grpc/grpc.h>
#include <grpc/support/alloc.h>
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "encode.h"
#include "log.h"
#include "plane.h"

namespace py = pybind11;
using attnserve::Batch;
using attnserve::Contract;
using attnserve::ModelLimits;
using attnserve::CostTerms;
using attnserve::MessageBounds;
using attnserve::ModelBounds;
using attnserve::Plane;
using attnserve::RelayDone;
using attnserve::SharedBudget;

namespace {

// A numpy view of a buffer the batch owns; `self` (the Python Batch) keeps it alive.
template <typename T, typename A>
py::array View(py::object self, std::vector<T, A>& buffer, std::vector<py::ssize_t> shape, const char* dtype) {
  return py::array(py::dtype(dtype), shape, {}, buffer.data(), self);
}

// A call record as server.native_records.RECORD_FIELDS reads it; client text as bytes.
py::tuple RecordTuple(const attnserve::CallRecord& r) {
  return py::make_tuple(r.traced, r.method, py::bytes(r.peer), py::bytes(r.model), py::bytes(r.version),
                        py::bytes(r.request_id), py::bytes(r.traceparent), py::bytes(r.tracestate), r.code,
                        py::bytes(r.details), r.start_ns, r.end_ns, r.admitted_ns, r.run_start_ns, r.run_end_ns,
                        r.queue_s, r.run_s, r.batch_requests, r.rows, r.q_len, r.k_len, r.bytes_in, r.bytes_out,
                        r.batch, r.model_chars, r.version_chars, r.request_id_chars);
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "The native data plane: a C++ gRPC listener for ModelInfer handing Python one call per batch.";
  m.attr("MAX_TIMEOUT_US") = attnserve::kMaxTimeoutUs;
  m.def("protobuf_lines_left_out", &attnserve::ProtobufLinesLeftOut,
        "protobuf's log lines left out so far (at most a few per minute are written: core/log.h)");
  // The plane's gRPC core's channelz, named as grpcio's cygrpc names its own: server.handover.CoreCalls
  // reads either (the plane's core is not grpcio's).
  auto channelz = [](char* json) {
    std::string out(json != nullptr ? json : "{}");
    gpr_free(json);
    return py::bytes(out);
  };
  m.def("encode_answer", [](py::bytes message, std::optional<std::string> stream_error) {
    inference::ModelInferResponse response;
    if (!response.ParseFromString(std::string(message))) throw py::value_error("not a ModelInferResponse");
    grpc::ByteBuffer encoded = stream_error ? attnserve::EncodeStreamAnswer(*stream_error, &response)
                                            : attnserve::EncodeAnswer(&response);
    std::vector<grpc::Slice> slices;
    if (!encoded.Dump(&slices).ok()) throw std::runtime_error("the encoded answer did not read back");
    std::string bytes;
    py::list sizes;
    for (const grpc::Slice& slice : slices) {
      bytes.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
      sizes.append(slice.size());
    }
    return py::make_tuple(py::bytes(bytes), sizes);
  }, py::arg("message"), py::arg("stream_error") = py::none(),
     "(bytes, slice sizes): a ModelInferResponse as the plane sends it (EncodeAnswer), or with stream_error "
     "(\"\": none) in a ModelStreamInferResponse (EncodeStreamAnswer)");
  m.def("channelz_get_servers", [channelz](intptr_t start) { return channelz(grpc_channelz_get_servers(start)); });
  m.def("channelz_get_server", [channelz](intptr_t id) { return channelz(grpc_channelz_get_server(id)); });

  py::class_<Batch, std::shared_ptr<Batch>>(m, "Batch")
      .def_property_readonly("model", [](const Batch& b) { return b.model; })
      .def_property_readonly("requests", [](const Batch& b) { return b.items.size(); })
      .def_property_readonly("rows", [](const Batch& b) { return b.rows; })
      .def_property_readonly("q_len", [](const Batch& b) { return b.q_len; })
      .def_property_readonly("k_len", [](const Batch& b) { return b.k_len; })
      .def_property_readonly("want_probs", [](const Batch& b) { return b.want_probs; })
      .def_property_readonly("id", [](const Batch& b) { return b.id; }, "its calls' records name it (records.h)")
      .def_property_readonly("masking", [](const Batch& b) {
        if (!b.key_mask.empty()) return 1;
        if (b.mask.empty()) return 0;
        return b.mask_heads > 1 ? 3 : 2;
      }, "0 no mask, 1 a key padding mask, 2 a whole mask, 3 a head mask (server.native_records.MASKINGS)")
      .def_property_readonly("padding_ratio", [](const Batch& b) { return b.padding_ratio; })
      .def_property_readonly("queue_s", [](const Batch& b) { return b.queue_s; }, "each request's wait in the queue")
      .def_property_readonly("done_s", [](const Batch& b) { return b.done_s; },
                             "each answered request's time in the server, once complete")
      .def("feeds", [](py::object self, py::ssize_t query_dim, py::ssize_t kv_dim) {
        Batch& b = self.cast<Batch&>();
        py::dict feeds;
        feeds["query"] = View(self, b.query, {b.rows, b.q_len, query_dim}, "float32");
        feeds["key"] = View(self, b.key, {b.rows, b.k_len, kv_dim}, "float32");
        feeds["value"] = View(self, b.value, {b.rows, b.k_len, kv_dim}, "float32");
        if (!b.mask.empty() && b.mask_heads > 1) {
          feeds["head_mask"] = View(self, b.mask, {b.rows, b.mask_heads, b.q_len, b.k_len}, "bool");
        } else if (!b.mask.empty()) {
          feeds["mask"] = View(self, b.mask, {b.rows, b.q_len, b.k_len}, "bool");
        } else if (!b.key_mask.empty()) {
          feeds["key_padding_mask"] = View(self, b.key_mask, {b.rows, b.k_len}, "int32");
        }
        return feeds;
      }, "query, key, value and the least mask the batch needs (tensors.merge's): key_padding_mask when its "
         "masks are key padding or its keys are padded, mask when a request's mask is more, head_mask when "
         "some request's heads differ: views, no copies");

  py::class_<SharedBudget, std::shared_ptr<SharedBudget>>(
      m, "Budget", "The process's one memory budget counter, shared by both planes (server.memory.budget)")
      .def(py::init<int64_t, int64_t>(), py::arg("limit_bytes"), py::arg("room_bytes"))
      .def("take", [](SharedBudget& b, int64_t nbytes, int64_t first, bool wait) {
        return b.Take(nbytes, first, wait, false);
      }, py::arg("nbytes"), py::arg("first"), py::arg("wait"), py::call_guard<py::gil_scoped_release>(),
         "0: taken now; > 0: a ticket, waiting in the one arrival order of both planes; -1: refused")
      .def("leave", &SharedBudget::Leave, py::arg("ticket"), py::call_guard<py::gil_scoped_release>(),
           "a waiter gives up: True if it left the queue, False if it was granted first (give its bytes back)")
      .def("give", &SharedBudget::Give, py::arg("nbytes"), py::call_guard<py::gil_scoped_release>(),
           "bytes back; the waiters it makes room for are granted in order")
      .def("granted", &SharedBudget::Granted, "tickets of Python's waiters granted since the last call")
      .def("reserved", &SharedBudget::reserved, "bytes reserved now, both planes")
      .def("waiting_bytes", &SharedBudget::waiting, "inputs of the waiters now, both planes")
      .def("waiters", &SharedBudget::waiters, "waiters now, both planes")
      .def("wake_fd", &SharedBudget::wake_fd, "readable once one of Python's waiters is granted")
      .def("drain", &SharedBudget::Drain)
      .def("set_idle_after", &SharedBudget::SetIdleAfter, py::arg("nbytes"),
           "a release that empties the budget after this much was reserved wakes the event loop (went_idle)")
      .def("went_idle", &SharedBudget::WentIdle, "the budget emptied after a large use since the last call")
      .def("native_shed", [](const SharedBudget& b) { return b.native_shed.load(); })
      .def("native_too_large", [](const SharedBudget& b) { return b.native_too_large.load(); })
      .def("native_waits", [](const SharedBudget& b) { return b.native_waits.load(); })
      .def("native_wait_timeouts", [](const SharedBudget& b) { return b.native_wait_timeouts.load(); });

  py::class_<Plane>(m, "Plane")
      .def(py::init([](py::dict names) {
        auto get = [&](const char* key) { return names[key].cast<std::string>(); };
        return std::make_unique<Plane>(Contract{get("query"), get("key"), get("value"), get("mask"), get("output"),
                                                get("attn_probs"), get("fp32"), get("bool")});
      }), py::arg("names"))
      .def("add_model", [](Plane& p, const std::string& name, const std::string& version, int64_t query_dim,
                           int64_t kv_dim, int64_t out_dim, int64_t num_heads, int64_t max_batch_size,
                           int64_t max_q_len, int64_t max_kv_len, int64_t max_attention_bytes,
                           int64_t max_queue_size, double max_padding_ratio, const std::string& why_no_head_masks) {
        ModelLimits l;
        l.name = name;
        l.version = version;
        l.query_dim = query_dim;
        l.kv_dim = kv_dim;
        l.out_dim = out_dim;
        l.num_heads = num_heads;
        l.max_batch_size = max_batch_size;
        l.max_q_len = max_q_len;
        l.max_kv_len = max_kv_len;
        l.max_attention_bytes = max_attention_bytes;
        l.max_queue_size = max_queue_size;
        l.max_padding_ratio = max_padding_ratio;
        l.head_masks = why_no_head_masks.empty();
        l.why_no_head_masks = why_no_head_masks;
        return p.AddModel(l);
      }, py::arg("name"), py::arg("version"), py::arg("query_dim"), py::arg("kv_dim"), py::arg("out_dim"),
         py::arg("num_heads"), py::arg("max_batch_size"), py::arg("max_q_len"), py::arg("max_kv_len"),
         py::arg("max_attention_bytes"), py::arg("max_queue_size"), py::arg("max_padding_ratio"),
         py::arg("why_no_head_masks") = "", "why_no_head_masks: empty when the head-mask graphs serve masks whose heads differ")
      .def("set_answer", [](Plane& p, const std::string& method, const std::string& name, py::bytes data) {
        p.front().SetAnswer(method, name, std::string(data));
      })
      .def("route", &Plane::Route, py::arg("name"), py::arg("versions"), py::arg("code"), py::arg("refusal"),
           py::arg("not_loaded"), py::call_guard<py::gil_scoped_release>(),
           "the versions of `name` served now (version -> model index), or code != 0: every call refused so")
      .def("unroute", &Plane::Unroute, py::call_guard<py::gil_scoped_release>(), "a name no model has any more")
      .def("set_serving", &Plane::SetServing, py::call_guard<py::gil_scoped_release>(),
           "what completes \"unknown model 'X'\"")
      .def("retire", &Plane::Retire, py::call_guard<py::gil_scoped_release>(),
           "no call reaches model `index` any more; what is queued there still runs")
      .def("drained", &Plane::Drained, "retired and nothing queued: its runner may end")
      .def("set_relay", [](Plane& p, py::function relay) {
        // Held by gRPC's threads; let go of (and called) with the GIL taken.
        auto held = std::shared_ptr<py::function>(new py::function(std::move(relay)), [](py::function* f) {
          py::gil_scoped_acquire gil;
          delete f;
        });
        p.front().SetRelay([held](const std::string& method, const std::string& request, RelayDone done) {
          py::gil_scoped_acquire gil;
          py::cpp_function reply([done](int code, const std::string& details, py::bytes response) {
            std::string bytes(response);
            py::gil_scoped_release release;
            done(code, details, bytes);
          });
          try {
            (*held)(method, py::bytes(request), reply);
          } catch (py::error_already_set& err) {
            throw std::runtime_error(err.what());
          }
        });
      }, "relay(method, request bytes, reply): the rare RPCs; reply(code, details, response bytes) once, any thread")
      .def("final_codes_by_name", [](const Plane& p) {
        std::map<std::string, std::vector<uint64_t>> out;
        for (const auto& [name, codes] : p.FinalCodesByName()) out[name] = {codes.begin(), codes.end()};
        return out;
      }, "calls finished by model name, by gRPC status code (lists of 17)")
      .def("set_zeros", &Plane::SetZeros)
      .def("set_zeros_handoff", &Plane::SetZerosHandoff)
      .def("set_budget", [](Plane& p, std::shared_ptr<SharedBudget> budget, py::dict terms, double stream_share) {
        CostTerms t;
        t.safety = terms["safety"].cast<double>();
        t.scores = terms["scores"].cast<double>();
        t.probs = terms["probs"].cast<double>();
        t.mask = terms["mask"].cast<double>();
        t.slack_from_bytes = terms["slack_from_bytes"].cast<int64_t>();
        t.slack_bytes = terms["slack_bytes"].cast<int64_t>();
        t.input_copies = terms["input_copies"].cast<int64_t>();
        t.answer_copies = terms["answer_copies"].cast<int64_t>();
        p.SetBudget(std::move(budget), t, stream_share);
      }, py::arg("budget"), py::arg("terms"), py::arg("stream_share"),
         "the shared budget, server.memory.costs' figures (native_cost_terms) and a stream's share of the budget")
      .def("set_model_bounds", [](Plane& p, size_t index, int64_t d_model, int64_t max_response_bytes,
                                  int64_t max_typed_bytes, int64_t response_overhead_bytes, int64_t max_queued_bytes) {
        if (index >= p.Models()) throw py::index_error("no such model");
        p.SetModelBounds(index, ModelBounds{d_model, max_response_bytes, max_typed_bytes, response_overhead_bytes,
                                            max_queued_bytes});
      }, py::arg("index"), py::arg("d_model"), py::arg("max_response_bytes"), py::arg("max_typed_bytes"),
         py::arg("response_overhead_bytes"), py::arg("max_queued_bytes") = 0,
         "answer, typed-contents and queued-bytes bounds of model `index` (0: none)")
      .def("set_message_bounds", [](Plane& p, int64_t max_parameters, int64_t max_parameters_bytes,
                                    int64_t max_request_fields, int64_t prescan_min_bytes, int64_t wire_min_bytes,
                                    int64_t max_typed_bytes, int64_t request_overhead_bytes) {
        p.SetMessageBounds(MessageBounds{max_parameters, max_parameters_bytes, max_request_fields, prescan_min_bytes,
                                         wire_min_bytes, max_typed_bytes, request_overhead_bytes});
      }, py::arg("max_parameters"), py::arg("max_parameters_bytes"), py::arg("max_request_fields"),
         py::arg("prescan_min_bytes"), py::arg("wire_min_bytes"), py::arg("max_typed_bytes"),
         py::arg("request_overhead_bytes"),
         "server.parsing's and codec's bounds on an inference message as it is parsed (0: none); before start")
      .def("set_graphs", [](Plane& p, size_t index, int64_t fused_from, int64_t fused_key_padding_from,
                            bool output_only, std::vector<std::string> why_held, const std::string& flash_hint) {
        if (index >= p.Models()) throw py::index_error("no such model");
        p.SetGraphs(index, ModelLimits::Graphs{fused_from, fused_key_padding_from, output_only, std::move(why_held),
                                               flash_hint});
      }, py::arg("index"), py::arg("fused_from"), py::arg("fused_key_padding_from"), py::arg("output_only"),
         py::arg("why_held"), py::arg("flash_hint"),
         "the graphs of model `index` for its attention bound (codec.native_graph_terms)")
      .def("cost", [](const Plane& p, size_t index, int64_t rows, int64_t q_len, int64_t k_len, int64_t input_bytes,
                      bool want_probs, bool heads_differ) {
        if (index >= p.Models()) throw py::index_error("no such model");
        auto c = p.Cost(index, rows, q_len, k_len, input_bytes, want_probs, heads_differ);
        return py::make_tuple(c[0], c[1], c[2]);
      }, "(inputs, run, answer) bytes a request reserves: costs.request_cost's figures")
      .def("set_receive_slots", &Plane::SetReceiveSlots,
           "ModelInfer messages received at once (server.gate.ReceiveSlots; 0: any), before start")
      .def("receive_figures", [](Plane& p) {
        auto f = p.ReceiveFigures();
        return py::make_tuple(f[0], f[1], f[2]);
      }, "(slots, messages being received now, calls whose message waited for a slot)")
      .def("set_stream_window", [](Plane& p, int64_t window) { p.front().SetStreamWindow(window); },
           "requests of one ModelStreamInfer stream in the plane at once; reading pauses beyond it")
      .def("set_security", [](Plane& p, py::bytes cert_chain, py::bytes private_key, py::bytes client_ca,
                              py::bytes token, const std::string& refusal) {
        p.front().SetSecurity(attnserve::Security{std::string(cert_chain), std::string(private_key), std::string(client_ca),
                                          std::string(token), refusal});
      }, py::arg("cert_chain"), py::arg("private_key"), py::arg("client_ca"), py::arg("token"), py::arg("refusal"),
         "TLS (PEM; empty: plaintext), mutual TLS (client_ca), the bearer token (empty: none) and its refusal; before start")
      .def("set_reuse_port", [](Plane& p, bool reuse) { p.front().SetReusePort(reuse); }, "worker processes share the port (SO_REUSEPORT); before start")
      .def("set_open_prefixes", [](Plane& p, std::vector<std::string> prefixes) { p.front().SetOpenPrefixes(std::move(prefixes)); }, "methods that need no token (after set_security)")
      .def("set_upstream", [](Plane& p, const std::string& target) { p.front().SetUpstream(target); }, py::arg("target"),
           "relay every method not served here to the Python server at target (unix:PATH); before start")
      .def("set_channel_args", [](Plane& p, std::vector<std::pair<std::string, int>> args) { p.front().SetChannelArgs(std::move(args)); }, "the Python server's gRPC arguments [(name, int)]; before start")
      .def("set_fallback", [](Plane& p, bool all, std::vector<std::string> keys) { p.front().SetFallback(all, std::move(keys)); },
           py::arg("all"), py::arg("keys"),
           "ModelInfer requests relayed to Python as they are: all, or those with one of these parameters")
      .def("token_refusals", [](Plane& p) { return p.front().TokenRefusals(); }, "calls refused for their token so far, and the latest's method")
      // Call records (records.h): the access log's and the spans' figures, drained in bulk.
      .def("set_records", &Plane::SetRecords, py::arg("capacity"), py::arg("arrivals") = false,
           "keep a record of each call, up to `capacity` undrained (0: none), and of each arrival "
           "(arrivals: the gate's lines); before start")
      .def("records_fd", [](const Plane& p) { return p.records() ? p.records()->wake_fd() : -1; },
           "readable once records wait to be taken (-1: not recording)")
      .def("records_dropped", [](const Plane& p) { return p.records() ? p.records()->dropped() : uint64_t{0}; },
           "records dropped so far because the buffer was full")
      // The outbox (core/outbox.h): the REST front's calls, submitted whole, answered in bulk.
      .def("submit", [](Plane& p, py::bytes message, std::optional<double> timeout_s, bool figures) {
        char* data = nullptr;
        Py_ssize_t size = 0;
        if (PyBytes_AsStringAndSize(message.ptr(), &data, &size) != 0) throw py::error_already_set();
        attnserve::TimePoint deadline = attnserve::kNever;
        if (timeout_s && *timeout_s < 1e9) {  // beyond: as good as none
          deadline = std::chrono::steady_clock::now() +
                     std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                         std::chrono::duration<double>(std::max(*timeout_s, 0.0)));
        }
        py::gil_scoped_release release;  // `message` stays referenced by this frame
        return p.outbox().Submit({std::string_view(data, static_cast<size_t>(size))}, deadline, figures);
      }, py::arg("message"), py::arg("timeout_s") = py::none(), py::arg("figures") = false,
         "parse and submit a serialized ModelInferRequest: its ticket; the answer comes through take_answers")
      .def("cancel_submitted", [](Plane& p, uint64_t ticket, bool disconnected) {
        return p.outbox().Cancel(ticket, disconnected);
      }, py::arg("ticket"), py::arg("disconnected") = false, py::call_guard<py::gil_scoped_release>(),
         "its client went away (disconnected: its connection ended): out of the core")
      .def("answers_fd", [](Plane& p) { return p.outbox().wake_fd(); }, "readable once answers wait to be taken")
      .def("submitted", [](Plane& p) { return p.outbox().pending(); }, "calls submitted and not yet answered")
      .def("take_answers", [](Plane& p) {
        std::vector<attnserve::Outbox::Answer> taken;
        {
          py::gil_scoped_release release;
          taken = p.outbox().Take();
        }
        const attnserve::Records* records = p.records();
        auto epoch = [records](std::chrono::steady_clock::time_point t) { return records ? records->EpochNs(t) : 0; };
        py::list out;
        for (auto& a : taken) {
          py::object head = py::none();
          py::list raw;
          if (a.response) {
            google::protobuf::RepeatedPtrField<std::string> contents;
            contents.Swap(a.response->mutable_raw_output_contents());  // the bytes change hands, uncopied
            head = py::bytes(a.response->SerializeAsString());
            for (std::string& bytes : contents) {
              auto* owned = new std::string(std::move(bytes));
              py::capsule free(owned, [](void* s) { delete static_cast<std::string*>(s); });
              raw.append(py::memoryview(py::array_t<uint8_t>({static_cast<py::ssize_t>(owned->size())}, {1},
                                                             reinterpret_cast<const uint8_t*>(owned->data()), free)));
            }
          }
          py::object figures = py::none();
          if (a.note && a.note->rows > 0) {
            const attnserve::CallNote& n = *a.note;
            figures = py::make_tuple(epoch(n.admitted), n.rows, n.q_len, n.k_len, n.queue_s, n.run_s, n.batch_requests,
                                     n.batch, epoch(n.run_ended));
          }
          out.append(py::make_tuple(a.ticket, static_cast<int>(a.status.error_code()), py::bytes(a.status.error_message()), head,
                                    raw, a.reserved, figures));
        }
        return out;
      }, "[(ticket, code, details (bytes), response without its raw outputs (None unless OK), raw outputs, reserved bytes, "
         "figures: (admitted_ns, rows, q_len, k_len, queue_s, run_s, batch_requests, batch, run_end_ns) or None)]")
      .def("take_arrivals_and_records", [](Plane& p) {
        py::dict arrivals;
        py::list out;
        if (!p.records()) return py::make_tuple(arrivals, out);
        std::map<std::string, uint64_t> counted;
        std::vector<attnserve::CallRecord> taken;
        {
          py::gil_scoped_release release;
          taken = p.records()->TakeAll(&counted);
        }
        for (const auto& [method, count] : counted) arrivals[py::str(method)] = count;
        for (const auto& r : taken) out.append(RecordTuple(r));
        return py::make_tuple(arrivals, out);
      }, "({method: arrivals}, records) held now: the arrivals' lines go before the records'")
      .def("start", &Plane::Start, py::call_guard<py::gil_scoped_release>(),
           "listen on every address (one port) and serve: the port, or 0 (unbound() says which failed)")
      .def("unbound", [](Plane& p) { return p.front().Unbound(); }, "the address the last start could not bind (empty: its credentials)")
      .def("next_batch", &Plane::NextBatch, py::call_guard<py::gil_scoped_release>(),
           "the next batch of model `index` (blocks up to timeout_ms), or None")
      .def("complete", [](Plane& p, Batch& batch, py::array_t<float, py::array::c_style> output,
                          std::optional<py::array_t<float, py::array::c_style>> attn_probs) {
        const ModelLimits& m = p.model(batch.model);
        if (output.size() != batch.rows * batch.q_len * m.out_dim) throw py::value_error("output has the wrong size");
        if (attn_probs && attn_probs->size() != batch.rows * m.num_heads * batch.q_len * batch.k_len)
          throw py::value_error("attn_probs has the wrong size");
        const float* out = output.data();
        const float* probs = attn_probs ? attn_probs->data() : nullptr;
        py::gil_scoped_release release;  // the arrays stay referenced by this frame
        p.Complete(batch, out, probs);
      })
      .def("fail", [](Plane& p, Batch& batch, const std::string& message) {
        py::gil_scoped_release release;
        p.Fail(batch, attnserve::StatusCode::INTERNAL, message);
      })
      .def("in_flight", &Plane::InFlight, "calls queued or computing, every model")
      .def("queued", &Plane::Queued, "requests waiting for model `index`")
      .def("stop", &Plane::Stop, py::call_guard<py::gil_scoped_release>())
      .def("halt", &Plane::Halt, py::call_guard<py::gil_scoped_release>(),
           "what is queued or arriving refused UNAVAILABLE, no batch formed any more; running ones finish")
      .def("set_ready", &Plane::SetReady, "ServerReady and ModelReady answer this (false from a drain's start)")
      .def("refuse", &Plane::Refuse, "new ModelInfer calls refused UNAVAILABLE; queued and computing ones go on")
      .def("wait_idle", &Plane::WaitIdle, py::call_guard<py::gil_scoped_release>(),
           "blocks up to timeout_ms until no call is queued, computing or arriving; whether none is")
      .def("arriving", &Plane::Arriving, "ModelInfer calls whose headers came and whose message has not")
      .def("set_arrival_timeout", &Plane::SetArrivalTimeout,
           "an arriving call counts for a drain this long after its headers (lifecycle.Arrivals.TIMEOUT_S)")
      .def("final_codes", [](const Plane& p, size_t index) {
        if (index > p.Models()) throw py::index_error("no such model");
        auto codes = p.FinalCodes(index);
        return std::vector<uint64_t>(codes.begin(), codes.end());
      }, "calls of model `index` finished, by gRPC status code (a list of 17); index == models: unknown models")
      .def("models", &Plane::Models)
      // Request control (docs/native-data-plane.md, "Request control").
      .def("set_schedule", [](Plane& p, size_t index, uint64_t priority_levels, uint64_t default_priority_level,
                              uint64_t default_timeout_us, bool allow_timeout_override) {
        if (index >= p.Models()) throw py::index_error("no such model");
        p.SetSchedule(index, ModelLimits::Schedule{priority_levels, default_priority_level, default_timeout_us,
                                                   allow_timeout_override});
      }, py::arg("index"), py::arg("priority_levels"), py::arg("default_priority_level"),
         py::arg("default_timeout_us"), py::arg("allow_timeout_override"),
         "model `index`'s schedule policy (server.scheduling.QueuePolicy's numbers)")
      .def("set_queue_delay", [](Plane& p, size_t index, int64_t max_queue_delay_us) {
        if (index >= p.Models()) throw py::index_error("no such model");
        p.SetQueueDelay(index, max_queue_delay_us);
      }, py::arg("index"), py::arg("max_queue_delay_us"),
         "how long model `index`'s partial batch may wait for company that is coming (the batcher's max_queue_delay_s)")
      .def("set_priority_aging", &Plane::SetPriorityAging,
           "a queued request gains one level per this many batches formed without it (--priority-aging-batches)")
      .def("on_stop", [](Plane& p, Batch& batch, py::object stop) {
        // The callable is released under the GIL, whichever thread drops the last reference.
        std::shared_ptr<py::object> held(new py::object(std::move(stop)), [](py::object* o) {
          py::gil_scoped_acquire gil;
          delete o;
        });
        p.OnStop(batch, [held] {
          py::gil_scoped_acquire gil;  // a gRPC thread's, rarely: once per stopped run
          try {
            (*held)();
          } catch (py::error_already_set& err) {
            err.discard_as_unraisable("attnserve.server._native: a batch's stop");
          }
        });
      }, "stop() is called once every call of the batch is cancelled (at once if they are), from a gRPC thread "
         "holding the GIL")
      .def("cancellations", [](const Plane& p, size_t index) {
        if (index >= p.Models()) throw py::index_error("no such model");
        auto counts = p.Cancellations(index);
        return std::vector<uint64_t>(counts.begin(), counts.end());
      }, "cancelled calls of model `index`: (client, deadline, disconnect) x (queued, running, terminated, answered), "
         "a list of 12")
      .def("counters", [](const Plane& p) {
        const auto& c = p.counters();
        py::dict d;
        d["requests"] = c.requests.load();
        d["refused"] = c.refused.load();
        d["batches"] = c.batches.load();
        d["rows"] = c.rows.load();
        d["check_ns"] = c.check_ns.load();
        d["queue_ns"] = c.queue_ns.load();
        d["merge_ns"] = c.merge_ns.load();
        d["python_ns"] = c.python_ns.load();
        d["split_ns"] = c.split_ns.load();
        d["finish_ns"] = c.finish_ns.load();
        d["handed_off"] = c.handed_off.load();
        return d;
      });
}

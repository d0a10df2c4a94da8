// The native data plane (prototype): a gRPC callback server for ModelInfer that parses and
// checks requests, queues them per model, forms padded batches and hands each batch to Python
// once; Python computes and hands the outputs back, which are split and encoded here.
// docs/native-data-plane.md says how it is built, flagged and measured.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "inference.grpc.pb.h"

namespace attnserve {

// The tensor contract's names and datatypes, handed over from attnserve.contract (never re-derived).
struct Contract {
  std::string query, key, value, mask;   // input names
  std::string output, attn_probs;        // output names
  std::string fp32, boolean;             // datatypes: "FP32", "BOOL"
};

// One model version's numbers, from its ModelSpec and the server's config.
struct ModelLimits {
  std::string name;
  std::string version;  // as answered in model_version
  int64_t query_dim = 0, kv_dim = 0, out_dim = 0, num_heads = 0;
  int64_t max_batch_size = 1, max_q_len = 1, max_kv_len = 1;
  int64_t max_attention_bytes = 0, max_queue_size = 1;
  double max_padding_ratio = 0.5;
  // Masks whose heads differ run on the head-mask graphs; without them they are refused with this.
  bool head_masks = false;
  std::string why_no_head_masks;
};

// The native port's TLS and token (native/security.cc), from server.security's checked files.
struct Security {
  std::string cert_chain, private_key;  // PEM; empty: plaintext
  std::string client_ca;                // PEM roots; set: client certificates required (mutual TLS)
  std::string token;                    // set: every call needs `authorization: Bearer <token>`
  std::string refusal;                  // what a refused caller is told, with UNAUTHENTICATED
};

// Calls refused for their token, read by Python to log them as the Python plane does.
class Refusals {
 public:
  void Note(std::string_view method);
  std::pair<uint64_t, std::string> Read();  // refused so far, the latest's method

 private:
  std::mutex mu_;
  uint64_t count_ = 0;
  std::string latest_;
};

// Final statuses by gRPC code (0..16), read by Python at scrape time (attnserve_requests).
constexpr size_t kCodes = 17;
using Codes = std::array<std::atomic<uint64_t>, kCodes>;

class StreamCall;

// A checked request waiting in its model's queue; the request and response belong to gRPC's call
// (ModelInfer) or to its stream's slot (ModelStreamInfer).
struct Pending {
  grpc::ServerUnaryReactor* reactor = nullptr;  // ModelInfer's call, or nullptr: the stream's
  StreamCall* stream = nullptr;                 // ModelStreamInfer's stream
  uint64_t seq = 0;                             // the request's place in its stream
  const inference::ModelInferRequest* request = nullptr;
  inference::ModelInferResponse* response = nullptr;
  int64_t rows = 0, q_len = 0, k_len = 0;
  const float* query = nullptr;  // (rows, q_len, query_dim), possibly unaligned: read with memcpy
  const float* key = nullptr;
  const float* value = nullptr;
  const uint8_t* mask = nullptr;  // bool bytes, 0 or 1; nullptr: attend every key
  int64_t mask_row_stride = 0;    // bytes between batch items (0: one (q_len, k_len) mask for all)
  int64_t mask_head_stride = 0;   // bytes between heads (0: heads alike, the first read for all)
  bool heads_differ = false;      // a (b, h, lq, lk) mask whose heads differ: the batch takes a head mask
  bool raw = true;                // answer in raw_output_contents
  bool want_output = true, want_probs = true;
  std::vector<bool> order_probs;  // the requested outputs in order: true = attn_probs
  bool exact_k_len = false;       // a query row masks all its keys: never pad its keys
  std::chrono::steady_clock::time_point started, arrived;  // the handler's start; queued
};

// A formed batch: its requests and their merged, padded inputs, owned here, viewed by numpy.
struct Batch {
  size_t model = 0;
  std::vector<Pending> items;
  std::vector<int64_t> first_row;  // each item's first row in the batch
  int64_t rows = 0, q_len = 0, k_len = 0;
  bool want_probs = false;
  std::vector<float> query, key, value;  // (rows, q_len, query_dim), (rows, k_len, kv_dim) x2
  std::vector<uint8_t> mask;             // (rows, mask_heads, q_len, k_len) bool, empty: no mask needed
  int64_t mask_heads = 1;                // > 1: a head mask (some request's heads differ)
  double padding_ratio = 0.0;            // padded share of the (rows, q_len, k_len) scores
  std::vector<double> queue_s;           // each request's wait in the queue (seconds)
  std::vector<double> done_s;            // each answered request's time in the server (seconds), once complete
  std::chrono::steady_clock::time_point formed;
  bool settled = false;
};

// Counters of where time goes (nanoseconds, counts), read by Python at any time.
struct Counters {
  std::atomic<uint64_t> requests{0}, refused{0}, batches{0}, rows{0};
  std::atomic<uint64_t> check_ns{0}, queue_ns{0}, merge_ns{0}, python_ns{0}, split_ns{0}, finish_ns{0};
};

class Plane final : public inference::GRPCInferenceService::CallbackService {
 public:
  explicit Plane(Contract contract);  // ModelInfer's handler: raw bytes, parsed by Parse, then Admit
  ~Plane() override;

  size_t AddModel(const ModelLimits& limits);
  // Serialized answers of the rare RPCs, by method and model name ("" for server-wide ones).
  void SetAnswer(const std::string& method, const std::string& name, std::string bytes);
  void SetZeros(bool zeros) { zeros_ = zeros; }  // the native floor: answer zeros, no Python
  // Requests of one ModelStreamInfer stream in the plane at once; reading pauses beyond it.
  void SetStreamWindow(int64_t window) { stream_window_ = window > 0 ? window : 1; }
  void SetSecurity(Security security) { security_ = std::move(security); }  // before Start
  // Worker processes share the port (SO_REUSEPORT); alone, a port in use is an error.
  void SetReusePort(bool reuse) { reuse_port_ = reuse; }
  std::pair<uint64_t, std::string> TokenRefusals() { return refusals_.Read(); }
  int Start(const std::string& address, int max_message_bytes, int max_concurrent_streams);
  // Blocks up to timeout_ms for a batch of model `index`; nullptr on timeout or once stopping.
  std::shared_ptr<Batch> NextBatch(size_t index, int64_t timeout_ms);
  // output (rows, q_len, out_dim), attn_probs (rows, heads, q_len, k_len) or nullptr: contiguous.
  void Complete(Batch& batch, const float* output, const float* attn_probs);
  void Fail(Batch& batch, grpc::StatusCode code, const std::string& message);
  // Draining (docs/native-data-plane.md, "Drain"): readiness off, then new calls refused
  // (UNAVAILABLE) while queued and computing ones finish; WaitIdle blocks until none is left.
  void SetReady(bool ready) { ready_ = ready; }
  void Refuse() { refusing_ = true; }
  bool WaitIdle(int64_t timeout_ms);
  // Refuses what is still queued (UNAVAILABLE), then GOAWAY and the listener closed; calls still
  // computing have grace_s to finish.
  void Stop(double grace_s);
  // Final statuses of model `index`'s calls by code; index == models: calls naming no known model.
  std::array<uint64_t, kCodes> FinalCodes(size_t index) const;
  size_t Models() const { return models_.size(); }
  const Counters& counters() const { return counters_; }
  size_t Queued(size_t index);  // requests waiting for model `index`
  int64_t InFlight() const { return in_flight_; }  // calls queued or computing, every model
  const ModelLimits& model(size_t index) const { return models_.at(index)->limits; }

  grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse>* ModelStreamInfer(
      grpc::CallbackServerContext* context) override;
  // Bytes that do not parse are refused with `why` (INVALID_ARGUMENT), as the Python plane does.
  static bool Parse(const grpc::ByteBuffer& bytes, inference::ModelInferRequest* request, std::string* why);
  // Checks one parsed ModelInfer call and queues it (or answers it, when it is refused or in zeros
  // mode); the request and response must outlive the call. The handler and the fuzzer's entry point.
  void Admit(grpc::ServerUnaryReactor* reactor, const inference::ModelInferRequest* request,
             inference::ModelInferResponse* response);
  grpc::ServerUnaryReactor* ServerLive(grpc::CallbackServerContext* context,
                                       const inference::ServerLiveRequest* request,
                                       inference::ServerLiveResponse* response) override;
  grpc::ServerUnaryReactor* ServerReady(grpc::CallbackServerContext* context,
                                        const inference::ServerReadyRequest* request,
                                        inference::ServerReadyResponse* response) override;
  grpc::ServerUnaryReactor* ModelReady(grpc::CallbackServerContext* context,
                                       const inference::ModelReadyRequest* request,
                                       inference::ModelReadyResponse* response) override;
  grpc::ServerUnaryReactor* ServerMetadata(grpc::CallbackServerContext* context,
                                           const inference::ServerMetadataRequest* request,
                                           inference::ServerMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelMetadata(grpc::CallbackServerContext* context,
                                          const inference::ModelMetadataRequest* request,
                                          inference::ModelMetadataResponse* response) override;
  grpc::ServerUnaryReactor* ModelConfig(grpc::CallbackServerContext* context,
                                        const inference::ModelConfigRequest* request,
                                        inference::ModelConfigResponse* response) override;
  grpc::ServerUnaryReactor* ModelStatistics(grpc::CallbackServerContext* context,
                                            const inference::ModelStatisticsRequest* request,
                                            inference::ModelStatisticsResponse* response) override;

 private:
  friend class StreamCall;
  struct Queue {
    ModelLimits limits;
    std::mutex mu;
    std::condition_variable arrived;
    std::deque<Pending> pending;
    Codes codes{};
  };

  grpc::Status Check(const Queue& queue, const inference::ModelInferRequest& request, Pending& p) const;
  void AnswerZeros(Pending& p, Queue& queue);
  // Every call ends here: counted by code (per model; nullptr: no known model), then finished.
  void Answer(grpc::ServerUnaryReactor* reactor, Queue* queue, const grpc::Status& status);
  void Settle(const Pending& p, Queue* queue, const grpc::Status& status);  // Answer, or its stream's answer
  void Count(Queue* queue, const grpc::Status& status);
  // A ModelInfer request, from a call or a stream: checked, then queued or answered at once.
  void Admit(Pending p);
  void Left(int64_t calls);  // calls out of the queue and the run: in_flight_ down, WaitIdle told
  grpc::ServerUnaryReactor* Table(grpc::CallbackServerContext* context, const std::string& method,
                                  const std::string& name, google::protobuf::Message* response);
  std::unique_ptr<Batch> Form(size_t index, Queue& queue);  // with queue.mu held
  std::shared_ptr<grpc::ServerCredentials> Credentials();  // native/security.cc; nullptr: unusable

  Contract contract_;
  std::vector<std::unique_ptr<Queue>> models_;
  std::map<std::string, size_t> by_name_;
  std::map<std::pair<std::string, std::string>, std::string> answers_;
  std::unique_ptr<grpc::Server> server_;
  std::atomic<bool> stopping_{false}, refusing_{false}, ready_{true};
  std::atomic<int64_t> in_flight_{0};
  std::mutex idle_mu_;
  std::condition_variable idle_;
  Codes unknown_codes_{};
  bool zeros_ = false;
  int64_t stream_window_ = 64;
  Counters counters_;
  Security security_;
  bool reuse_port_ = false;
  Refusals refusals_;
};

// One ModelStreamInfer stream: reads requests as they come (up to the plane's stream window in
// the plane at once), admits each as ModelInfer does, and writes the answers in request order,
// one write at a time. A refused request is answered in the stream (error_message) and the
// stream goes on, as the Python plane does (server.service).
class StreamCall final
    : public grpc::ServerBidiReactor<inference::ModelInferRequest, inference::ModelStreamInferResponse> {
 public:
  explicit StreamCall(Plane* plane);
  void OnReadDone(bool ok) override;
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }
  // The plane settled request `seq` (any thread): its answer, OK from its response, else the status.
  void Answered(uint64_t seq, const grpc::Status& status);

 private:
  struct Slot {
    std::unique_ptr<inference::ModelInferRequest> request;
    std::unique_ptr<inference::ModelInferResponse> response;
    std::unique_ptr<inference::ModelStreamInferResponse> answer;  // set once answered
  };
  // With mu_ held: what to start now (a write, a read, the end), started after it is released.
  struct Next {
    inference::ModelStreamInferResponse* write = nullptr;
    bool read = false, finish = false;
  };
  Next Step();
  void Run(const Next& next);

  Plane* plane_;
  std::mutex mu_;
  inference::ModelInferRequest incoming_;
  std::deque<Slot> slots_;  // in request order: the first is the next to write
  uint64_t first_seq_ = 0;  // slots_.front()'s seq
  std::unique_ptr<inference::ModelStreamInferResponse> writing_;
  bool reading_ = true, reads_done_ = false, broken_ = false, finished_ = false;
};

}  // namespace attnserve

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
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <string_view>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "inference.grpc.pb.h"
#include "relay.h"
#include "records.h"

namespace attnserve {

// Longer timeouts are as good as none, and stay clear of the clock's overflow; the config layer's
// ranges stop every wait below it (attnserve.ranges.MAX_WAIT_US, tied by a test).
constexpr uint64_t kMaxTimeoutUs = uint64_t{1} << 50;

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
  // The batcher's max_queue_delay_s: how long a partial batch may wait for company that is coming
  // (another batch of it runs, or calls are being received); 0: never waits.
  int64_t max_queue_delay_us = 0;
  double max_padding_ratio = 0.5;
  // Masks whose heads differ run on the head-mask graphs; without them they are refused with this.
  bool head_masks = false;
  std::string why_no_head_masks;
  // The graphs a request may run alone, for the attention bound (server.graphs.GraphSet, set_graphs):
  // the fused graphs' crossovers (sqrt(Lq*Lk) from which they run; -1: not loaded), whether the
  // unfused output-only graph is loaded, and codec's words for what each holding graph holds.
  struct Graphs {
    int64_t fused_from = -1, fused_key_padding_from = -1;
    bool output_only = true;
    std::vector<std::string> why_held;  // by Plane's Held order (codec.NATIVE_HELD_ORDER)
    std::string flash_hint;             // codec's hint where flash attention is loaded
  } graphs;
  // The schedule policy (server.scheduling.QueuePolicy from its config.json; Plane::SetSchedule).
  struct Schedule {
    uint64_t priority_levels = 2, default_priority_level = 1;  // level 1 the highest
    uint64_t default_timeout_us = 0;                           // 0: no queue timeout
    bool allow_timeout_override = true;                        // a request's `timeout` may shorten it
  } schedule;
};

// server.memory.costs' figures (costs.native_cost_terms()): never written out again in C++.
struct CostTerms {
  double safety = 1.1, scores = 3.5, probs = 0.5, mask = 2.0;
  int64_t slack_from_bytes = 0, slack_bytes = 0;
  int64_t input_copies = 2, answer_copies = 2;
};

// One model version's numbers for the memory bounds (set_model_bounds; 0: not bounded).
struct ModelBounds {
  int64_t d_model = 0;
  int64_t max_response_bytes = 0;  // --max-message-bytes: an answer larger is refused before it is built
  int64_t max_typed_bytes = 0;     // --max-typed-bytes: typed inputs or answer larger are refused
  int64_t response_overhead_bytes = 4096;  // codec._RESPONSE_OVERHEAD_BYTES
  int64_t max_queued_bytes = 0;  // --max-queued-bytes: input bytes queued beyond it are refused (0: none)
};

// server.parsing's and codec's bounds on an inference message before and as it is parsed
// (set_message_bounds, from their constants and --max-typed-bytes; 0: not bounded).
struct MessageBounds {
  int64_t max_parameters = 0;        // entries of one `parameters` map (the request's, an input's, an output's)
  int64_t max_parameters_bytes = 0;  // wire bytes of the request's own, in a message scanned before its parse
  int64_t max_request_fields = 0;    // top-level records of a message scanned before its parse
  int64_t prescan_min_bytes = 0;     // from this size a message is scanned before it is parsed
  int64_t wire_min_bytes = 0;        // codec.WIRE_MIN_BYTES: from this size typed bytes are counted before the parse
  int64_t max_typed_bytes = 0;       // --max-typed-bytes: bytes besides raw contents, with the room below
  int64_t request_overhead_bytes = 0;  // codec._REQUEST_OVERHEAD_BYTES: names, shapes, datatypes
};

// The process's one memory budget counter (--memory-limit-bytes), shared by both planes: Python's
// server.memory.budget.MemoryBudget takes and gives back through it, native calls too. The rule is
// MemoryBudget's: a reservation fits under limit - room, or alone (nothing reserved) under limit.
// Its waiters, of both planes, queue here in one arrival order (nobody jumps ahead): a native one
// is woken through the plane's hook, Python's through wake_fd (Granted() then names them).
class SharedBudget {
 public:
  SharedBudget(int64_t limit_bytes, int64_t room_bytes);
  ~SharedBudget();
  // n bytes, `first` of them its inputs (counted while it waits): 0 taken now; > 0 a ticket, waiting
  // in arrival order (only if `wait` and there is room to wait, MemoryBudget._can_wait); -1 refused.
  int64_t Take(int64_t n, int64_t first, bool wait, bool native);
  bool TryTake(int64_t n) { return Take(n, 0, false, false) == 0; }
  // A waiter gives up: true when it left the queue, false when it was granted first (its bytes are
  // reserved: the caller gives them back).
  bool Leave(int64_t ticket);
  void Give(int64_t n);  // grants the waiters it makes room for, in order
  std::vector<int64_t> Granted();  // Python's waiters granted since the last call
  // Called with each native waiter's ticket once it is granted (no lock held; nullptr: none).
  void SetNativeWake(std::function<void(int64_t)> wake);
  int64_t reserved() const;
  int64_t limit() const { return limit_; }
  int64_t Free() const;  // what can be taken now without waiting: 0 while someone waits (MemoryBudget.free_bytes)
  int64_t waiting() const;  // inputs of the waiters, both planes
  int64_t waiters() const;
  int wake_fd() const { return wake_fd_; }  // readable once one of Python's waiters is granted
  void Drain();  // reads wake_fd empty
  // MemoryBudget.IDLE_AFTER_BYTES: a release that empties the budget after at least this much was
  // reserved (either plane) wakes the event loop, whose MemoryBudget then reclaims (WentIdle); 0: never.
  void SetIdleAfter(int64_t bytes);
  bool WentIdle();  // the budget emptied after a large use since the last call
  std::atomic<uint64_t> native_shed{0}, native_too_large{0}, native_waits{0}, native_wait_timeouts{0};

 private:
  struct Waiter {
    int64_t ticket, total, first;
    bool native;
  };
  bool Fits(int64_t n, int64_t waiting) const;     // mu_ held
  bool CanWait(int64_t n, int64_t first) const;    // mu_ held
  void Admit(std::vector<int64_t>* native, bool* python);  // mu_ held: grants from the head on
  void Wake(const std::vector<int64_t>& native, bool python);  // mu_ released

  const int64_t limit_, room_;
  mutable std::mutex mu_;
  int64_t reserved_ = 0, waiting_ = 0, next_ticket_ = 1;
  int64_t idle_after_ = 0, high_water_ = 0;  // SetIdleAfter; the most reserved since it was last empty
  bool went_idle_ = false;
  std::deque<Waiter> waiters_;
  std::vector<int64_t> granted_python_;
  std::function<void(int64_t)> native_wake_;
  int wake_fd_ = -1;
};

// The native port's TLS and token (native/security.cc), from server.security's checked files.
struct Security {
  std::string cert_chain, private_key;  // PEM; empty: plaintext
  std::string client_ca;                // PEM roots; set: client certificates required (mutual TLS)
  std::string token;                    // set: every call needs `authorization: Bearer <token>`
  std::string refusal;                  // what a refused caller is told, with UNAUTHENTICATED
  std::vector<std::string> open_prefixes;  // methods that need no token (health, reflection: server.security.OPEN)
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

// Cancelled calls by why x where (attnserve_cancelled_requests_total's reason and stage), in this
// order: (client, deadline) x (queued, running, terminated, answered); Plane::Cancellations reads them.
constexpr size_t kCancelReasons = 2, kCancelStages = 4;
using Cancels = std::array<std::atomic<uint64_t>, kCancelReasons * kCancelStages>;
using TimePoint = std::chrono::steady_clock::time_point;
constexpr TimePoint kNever = TimePoint::max();

class StreamCall;

// A rare RPC handed to Python (docs/native-data-plane.md, "Model changes and the rare RPCs"):
// A ModelInfer answer's bytes, as response->SerializeAsString() writes them, with its
// raw_output_contents moved into slices of their own, which gRPC sends without another copy.
grpc::ByteBuffer EncodeAnswer(inference::ModelInferResponse* response);
// The same answer in a stream, as a ModelStreamInferResponse (its error_message, when not empty).
grpc::ByteBuffer EncodeStreamAnswer(const std::string& error_message, inference::ModelInferResponse* response);

// done(code, details, response bytes) is called once, from any thread; dropped uncalled, the
// call is answered UNAVAILABLE.
using RelayDone = std::function<void(int code, const std::string& details, const std::string& response)>;
using Relay = std::function<void(const std::string& method, const std::string& request, RelayDone done)>;

// Client text quoted as Python's repr() quotes it, cut as server/quoting.py's quoted() cuts it.
// limit: server/quoting.py's QUOTED_CHARS (SIZE_MAX: Python's repr() uncut).
std::string Quoted(const std::string& text, size_t limit = 100);

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
  bool key_padding = false;       // its query rows mask the same keys, each attends one: a key padding mask
  bool raw = true;                // answer in raw_output_contents
  bool want_output = true, want_probs = true;
  std::vector<bool> order_probs;  // the requested outputs in order: true = attn_probs
  bool exact_k_len = false;       // a query row masks all its keys: never pad its keys
  int64_t input_bytes = 0;        // its tensors' bytes (Work.nbytes): the cost's inputs
  int64_t run_share = 0;          // the run of it alone, in its budget reservation (the batcher's run_share)
  int64_t* held = nullptr;        // where its budget reservation is kept until the answer is sent
  std::atomic<int64_t>* answered_by = nullptr;  // its call's: the model index once answered OK (the answered stage)
  std::chrono::steady_clock::time_point started, arrived;  // the handler's start; queued
  // The schedule (docs/server.md, "Priorities and queue timeouts"): refused unrun once `deadline`
  // (the earlier of the call's and its `timeout`) passes while queued; served by aged level.
  TimePoint deadline = kNever;
  uint64_t priority = 1;
  uint64_t since = 0;  // its queue's batches formed when it arrived: how long it was passed over
  std::shared_ptr<CallNote> note;  // its access line's and span's figures (records.h); nullptr: not recorded
  bool admitted_early = false;  // its headers came before the drain refused new calls: served all the same
};

// An allocator whose resize leaves new elements uninitialized (value-initialized when given a
// value): the merge writes every element of a batch's inputs, so zeroing them first is a wasted pass.
template <typename T>
struct Uninitialized : std::allocator<T> {
  template <typename U>
  struct rebind {
    using other = Uninitialized<U>;
  };
  Uninitialized() = default;
  template <typename U>
  Uninitialized(const Uninitialized<U>&) noexcept {}
  template <typename U, typename... Args>
  void construct(U* at, Args&&... args) {
    if constexpr (sizeof...(Args) == 0) {
      ::new (static_cast<void*>(at)) U;
    } else {
      ::new (static_cast<void*>(at)) U(std::forward<Args>(args)...);
    }
  }
};
using Floats = std::vector<float, Uninitialized<float>>;

// A formed batch: its requests and their merged, padded inputs, owned here, viewed by numpy.
struct Batch {
  size_t model = 0;
  uint64_t id = 0;  // the plane's count of batches formed: its calls' records name it (the batch span)
  std::vector<Pending> items;
  std::vector<int64_t> first_row;  // each item's first row in the batch
  int64_t rows = 0, q_len = 0, k_len = 0;
  bool want_probs = false;
  Floats query, key, value;              // (rows, q_len, query_dim), (rows, k_len, kv_dim) x2
  std::vector<uint8_t> mask;             // (rows, mask_heads, q_len, k_len) bool, empty: no mask needed
  int64_t mask_heads = 1;                // > 1: a head mask (some request's heads differ)
  // (rows, k_len), 1 = a real key: a batch whose masks are key padding (or none) and whose keys are
  // padded, or that has such a mask (tensors.merge's KEY_PADDING); then `mask` is empty.
  std::vector<int32_t> key_mask;
  double padding_ratio = 0.0;            // padded share of the (rows, q_len, k_len) scores
  std::vector<double> queue_s;           // each request's wait in the queue (seconds)
  std::vector<double> done_s;            // each answered request's time in the server (seconds), once complete
  std::chrono::steady_clock::time_point formed;
  bool settled = false;
  // Cancellation, under its model's queue lock: which items' clients went away while it ran, and
  // once all had, the run's stop (the runner's RunStop, Plane::OnStop) called once.
  std::vector<char> cancelled;
  bool stopped = false;
  std::function<void()> on_stop;
  bool answering = false;  // handed back by its run: its answers are being encoded (Complete)
  int64_t extra = 0;       // budget bytes its merged run takes beyond its requests' own, until it is settled
};

// Counters of where time goes (nanoseconds, counts), read by Python at any time.
struct Counters {
  std::atomic<uint64_t> requests{0}, refused{0}, batches{0}, rows{0};
  std::atomic<uint64_t> check_ns{0}, queue_ns{0}, merge_ns{0}, python_ns{0}, split_ns{0}, finish_ns{0};
  std::atomic<uint64_t> handed_off{0};  // the floor's calls answered from its own thread (SetZerosHandoff)
};

class Plane final : public inference::GRPCInferenceService::CallbackService {
 public:
  explicit Plane(Contract contract);  // ModelInfer's handler: raw bytes, parsed by Parse, then Admit
  ~Plane() override;

  // A queue (and its runner's batches) for one model version; the name routes to it unless
  // Python routes the name itself (Route).
  size_t AddModel(const ModelLimits& limits);
  // Model changes, pushed by Python on every change of its registry, in one step each: the
  // versions of `name` served now (version -> queue index), or a refusal for every call naming
  // it (`code` != 0: not ready: unloaded, failed, warming), and what completes "model NAME
  // version 'V'" for a version not served. `serving` completes "unknown model 'X'".
  void Route(const std::string& name, const std::map<int64_t, size_t>& versions, int code,
             const std::string& refusal, const std::string& not_loaded);
  void Unroute(const std::string& name);  // a name the registry does not know
  void SetServing(const std::string& serving);
  // No call reaches queue `index` any more (route it away first); what is queued there runs.
  void Retire(size_t index);
  bool Drained(size_t index);  // retired and nothing queued: its runner may end
  // The rare RPCs (ready, metadata, config, statistics, index) answered by Python, live.
  void SetRelay(Relay relay) { relay_ = std::move(relay); }
  // Serialized answers of the rare RPCs, by method and model name ("" for server-wide ones).
  void SetAnswer(const std::string& method, const std::string& name, std::string bytes);
  void SetZeros(bool zeros) { zeros_ = zeros; }  // the native floor: answer zeros, no Python
  // The native floor answers from one thread of its own, as the runner threads do (bench.native_floor --handoff).
  void SetZerosHandoff();
  // The memory bounds (admission, docs/native-data-plane.md "Memory bounds"): the shared budget,
  // the cost model's figures and a stream's share of the budget (service.STREAM_BUDGET_SHARE).
  void SetBudget(std::shared_ptr<SharedBudget> budget, const CostTerms& terms, double stream_share);
  void SetModelBounds(size_t index, const ModelBounds& bounds) { models_.at(index)->bounds = bounds; }
  // A request's cost (costs.request_cost): inputs, run, answer bytes.
  std::array<int64_t, 3> Cost(size_t index, int64_t rows, int64_t q_len, int64_t k_len, int64_t input_bytes,
                              bool want_probs, bool heads_differ) const;
  SharedBudget* budget() const { return budget_.get(); }
  // Call records (records.h) for the access log and spans: kept up to `capacity` (0: none kept, the
  // default, and no call pays for them); before Start.
  void SetRecords(size_t capacity, bool arrivals = false);  // arrivals: the gate's "rpc <method>" lines too
  Records* records() const { return records_.get(); }
  int64_t stream_share_bytes() const { return stream_share_bytes_; }
  // Requests of one ModelStreamInfer stream in the plane at once; reading pauses beyond it.
  void SetStreamWindow(int64_t window) { stream_window_ = window > 0 ? window : 1; }
  void SetSecurity(Security security) { security_ = std::move(security); }  // before Start
  void SetOpenPrefixes(std::vector<std::string> prefixes) { security_.open_prefixes = std::move(prefixes); }
  // One port (native/relay.h): every other method, and the requests ToPython picks, go to the
  // Python server listening on `target` (a private Unix socket); set before Start.
  void SetUpstream(const std::string& target) { upstream_ = std::make_unique<Upstream>(target); }
  // The Python server's own channel arguments (keepalive, connection age, pings), before Start.
  void SetChannelArgs(std::vector<std::pair<std::string, int>> args) { channel_args_ = std::move(args); }
  // Which ModelInfer requests go to the Python request path as they are: every one (`all`: calls are
  // recorded there), or those with a parameter named in `keys` on an input or output (shared memory).
  void SetFallback(bool all, std::vector<std::string> keys) {
    fallback_all_ = all;
    fallback_keys_ = std::move(keys);
  }
  bool ToPython(const inference::ModelInferRequest& request) const;
  Upstream* upstream() const { return upstream_.get(); }
  // Worker processes share the port (SO_REUSEPORT); alone, a port in use is an error.
  void SetReusePort(bool reuse) { reuse_port_ = reuse; }
  std::pair<uint64_t, std::string> TokenRefusals() { return refusals_.Read(); }
  // Listens on every address ("host:port", all one port; 0 only with one address) and serves; the
  // port, or 0 with Unbound() naming the address that could not be bound (empty: the credentials).
  int Start(const std::vector<std::string>& addresses, int max_message_bytes, int max_concurrent_streams);
  const std::string& Unbound() const { return unbound_; }
  // server.gate.ReceiveSlots on the native port (--max-receiving-bytes / --max-message-bytes): ModelInfer
  // messages received at once, at most `slots` (0: any); set before Start. A call whose slot waits is
  // held back by HTTP/2 flow control (its message is not read: ReceivedCall in plane.cc).
  void SetReceiveSlots(int64_t slots) { receive_slots_ = slots; }
  // A ModelInfer call whose headers came: true when it may read its message now; else `start` is
  // called once (from any thread, no lock held) when a slot is free for it, or the oldest went stale.
  bool TakeReceiveSlot(const void* call, std::function<void()> start);
  // Its message is read, or the call went away: its slot goes to the next waiting call. True when
  // the call was still waiting (never started: it leaves the line).
  bool GiveReceiveSlot(const void* call);
  // attnserve_receive_*: slots (0: any), messages being received now, calls whose message waited.
  std::array<int64_t, 3> ReceiveFigures();
  // ModelInfer's handler once its message is read: parsed, then admitted, refused or relayed.
  // admitted_early: its headers came before Refuse (a drain serves it).
  grpc::ServerUnaryReactor* Infer(grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
                                  inference::ModelInferResponse* response, bool admitted_early = false);
  // A ModelInfer call from its headers to its message (docs/native-data-plane.md, "Drain"): whether the
  // drain admits it (not refusing yet). Until Claim, Halt may refuse it through `refuse` (once, from
  // Halt's thread, no plane lock held), having counted the status.
  bool Arrived(const void* call, std::function<void(const grpc::Status&)> refuse);
  bool Claim(const void* call);       // its message came (or it went away): false once Halt has refused it
  void ArrivalDone(const void* call);  // answered or in the plane: no longer arriving
  // With --access-log, a ModelInfer or ModelStreamInfer call's headers count among the arrivals
  // (records.h), written as the Python plane's "rpc METHOD" line (server.gate).
  void HeadersLine(const char* method);
  // Blocks up to timeout_ms for a batch of model `index`; nullptr on timeout, once stopping, or when
  // every queued call had expired (refused DEADLINE_EXCEEDED here).
  std::shared_ptr<Batch> NextBatch(size_t index, int64_t timeout_ms);
  // output (rows, q_len, out_dim), attn_probs (rows, heads, q_len, k_len) or nullptr: contiguous.
  void Complete(Batch& batch, const float* output, const float* attn_probs);
  void Fail(Batch& batch, grpc::StatusCode code, const std::string& message);
  // Draining (docs/native-data-plane.md, "Drain"): readiness off, then new calls refused
  // (UNAVAILABLE) while queued and computing ones finish; WaitIdle blocks until none is left.
  void SetReady(bool ready) { ready_ = ready; }
  void Refuse() { refusing_ = true; }
  bool WaitIdle(int64_t timeout_ms);  // arriving calls included
  // ModelInfer calls whose headers came and whose message has not (lifecycle.Arrivals): a drain
  // waits for them as for queued ones, for `timeout_s` from their headers (a message that never
  // comes is forgotten then); Halt refuses those still arriving.
  void SetArrivalTimeout(double timeout_s) { arrival_timeout_ = std::chrono::duration<double>(timeout_s); }
  int64_t Arriving() const;  // arriving within the timeout
  int64_t Receiving() const;  // of those, the ones whose message has not been read yet
  // Refuses what is still queued (UNAVAILABLE), then GOAWAY and the listener closed; calls still
  // computing have grace_s to finish.
  void Stop(double grace_s);
  // Stop's first half, at once (a second signal, the grace period over): what has not started is
  // refused, no batch is formed any more; running ones finish. Stop calls it too.
  void Halt();
  // Final statuses of model `index`'s calls by code; index == models: calls naming no known model.
  std::array<uint64_t, kCodes> FinalCodes(size_t index) const;
  // Final statuses by model name (every version's calls and the refusals naming it); "": no known model.
  std::map<std::string, std::array<uint64_t, kCodes>> FinalCodesByName() const;
  size_t Models() const {
    std::shared_lock<std::shared_mutex> lock(models_mu_);
    return models_.size();
  }
  const Counters& counters() const { return counters_; }
  size_t Queued(size_t index);  // requests waiting for model `index`
  int64_t InFlight() const { return in_flight_; }  // calls queued or computing, every model
  const ModelLimits& model(size_t index) const { return At(index).limits; }

  // Request control (docs/native-data-plane.md, "Request control"): schedule policy per model,
  // aging in batches (--priority-aging-batches), cancellation of a call or a whole stream.
  void SetSchedule(size_t index, const ModelLimits::Schedule& schedule);
  void SetQueueDelay(size_t index, int64_t max_queue_delay_us);
  void SetPriorityAging(uint64_t batches) { aging_batches_ = batches > 0 ? batches : 1; }
  // A call's client went away (OnCancel): out of its queue now, or marked in its running batch,
  // whose stop is called once every call in it is gone. call_deadline: its gRPC deadline (the reason).
  // Whether it found the call in the plane.
  bool Cancel(grpc::ServerUnaryReactor* reactor, StreamCall* stream, TimePoint call_deadline);
  // A call answered OK whose client went away before the answer was sent (the `answered` stage).
  void CancelAnswered(size_t index, TimePoint call_deadline);
  // The runner's way to stop `batch`'s run: called once every call in it is cancelled (now if so).
  void OnStop(Batch& batch, std::function<void()> stop);
  std::array<uint64_t, kCancelReasons * kCancelStages> Cancellations(size_t index) const;

  // Bytes that do not parse, or whose `parameters` are over the bounds, are refused with `why`
  // (INVALID_ARGUMENT), in server.parsing's order and words.
  bool Parse(const grpc::ByteBuffer& bytes, inference::ModelInferRequest* request, std::string* why) const;
  bool Prescan(const grpc::ByteBuffer& bytes, std::string* why) const;  // a large message's, before its parse
  void SetMessageBounds(const MessageBounds& bounds) { message_bounds_ = bounds; }  // before Start
  void SetGraphs(size_t index, const ModelLimits::Graphs& graphs);
  // Checks one parsed ModelInfer call and queues it (or answers it, when it is refused or in zeros
  // mode); the request and response must outlive the call. The handler and the fuzzer's entry point.
  // held: where the call keeps its budget reservation until its answer is sent (nullptr: none taken).
  // admitted_early: its headers came before Refuse (a drain serves it).
  void Admit(grpc::ServerUnaryReactor* reactor, const inference::ModelInferRequest* request,
             inference::ModelInferResponse* response, TimePoint call_deadline = kNever,
             int64_t* held = nullptr, std::atomic<int64_t>* answered_by = nullptr,
             std::shared_ptr<CallNote> note = nullptr, bool admitted_early = false);
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
  grpc::ServerUnaryReactor* RepositoryIndex(grpc::CallbackServerContext* context,
                                            const inference::RepositoryIndexRequest* request,
                                            inference::RepositoryIndexResponse* response) override;

 private:
  friend class StreamCall;
  struct Queue {
    ModelLimits limits;
    std::mutex mu;
    std::condition_variable arrived;
    std::deque<Pending> pending;  // in arrival order; Form takes them in service order
    Codes* codes = nullptr;  // its model name's (codes_), shared by the name's versions
    bool retired = false;    // no route leads here any more (with mu held)
    std::vector<Batch*> running;  // formed, not yet settled: where a cancelled call may be
    uint64_t formed = 0;          // batches formed that took requests (aging)
    Cancels cancels{};
    std::vector<Pending> expired;  // found expired by Form, refused by NextBatch once unlocked
    ModelBounds bounds;
    int64_t queued_bytes = 0;  // input bytes of `pending` (--max-queued-bytes)
  };
  // A call waiting for memory (Reserve): its ticket in the shared budget's queue keys it in parked_.
  struct Parked {
    Pending p;
    Queue* queue = nullptr;
    int64_t total = 0;
  };
  // One model name as the Python plane serves it now.
  struct Routing {
    std::map<int64_t, size_t> versions;  // served: version -> queue index
    grpc::Status refusal;                // not OK: every call naming it gets this
    std::string not_loaded;              // completes "model NAME version 'V'"
    Codes* codes = nullptr;
  };

  std::array<int64_t, 3> CostOf(const Queue& queue, int64_t rows, int64_t q_len, int64_t k_len, int64_t input_bytes,
                                bool want_probs, bool heads_differ) const;
  grpc::Status Check(const Queue& queue, const inference::ModelInferRequest& request, Pending& p) const;
  void AnswerZeros(Pending& p, Queue& queue);
  // The answer against --max-message-bytes, typed contents against --max-typed-bytes (codec's
  // words), called by Check where codec.decode checks them: before any tensor's contents.
  grpc::Status Bound(const Queue& queue, const inference::ModelInferRequest& request, const Pending& p) const;
  // Takes p's reservation now, or parks p (moved into parked_, *parked) until the budget grants it
  // (Granted) within its deadline; else the batcher's words.
  grpc::Status Reserve(Queue& queue, Pending& p, bool* parked);
  void Granted(int64_t ticket);  // the budget's wake: a parked call's reservation is taken; it queues
  // The queue's bounds before a call waits for memory or queues (server.batcher.Batcher.submit's
  // order): --max-queue-size, then --max-queued-bytes. queue.mu held.
  grpc::Status QueueBounds(const Queue& queue, const Pending& p) const;
  // Queues p (its reservation taken): false with *refusal, or *retired when its queue was retired.
  // granted: it waited for memory (in flight already; its queue's bounds are not checked again).
  bool Enqueue(Queue& queue, Pending& p, bool granted, bool* retired, grpc::Status* refusal);
  // Every call ends here: counted by code (per model; nullptr: no known model), then finished.
  void Answer(grpc::ServerUnaryReactor* reactor, Queue* queue, const grpc::Status& status);
  // Answer, or its stream's answer; a recorded call's record goes to `into` (nullptr: the buffer).
  void Settle(const Pending& p, Queue* queue, const grpc::Status& status, std::vector<CallRecord>* into = nullptr);
  void Settle(const Pending& p, Codes* codes, const grpc::Status& status, std::vector<CallRecord>* into = nullptr);
  // Call records (records.cc): a call's note from its headers; a settled call's record; a refusal's
  // before any request parsed.
  std::shared_ptr<CallNote> Note(const grpc::CallbackServerContext* context, const char* method,
                                 int64_t bytes_in) const;
  void Record(const Pending& p, const grpc::Status& status, std::vector<CallRecord>* into);
  void RecordUnparsed(const CallNote& note, const grpc::Status& status);
  void RecordArrival(const char* method);  // the gate's arrival line of a ModelInfer call or a stream
  // With records on, the token of ModelInfer and ModelStreamInfer is checked here (security.cc), where
  // the call has its peer for the access line, instead of in the core's processor.
  bool TokenDeferred() const { return records_ != nullptr && !security_.token.empty(); }
  bool TokenAdmits(const grpc::CallbackServerContext* context) const;
  void RecordTokenRefusal(const grpc::CallbackServerContext* context, const char* method, bool arrival = true);
  void Count(Queue* queue, const grpc::Status& status);
  void Count(Codes* codes, const grpc::Status& status);
  Queue& At(size_t index) const;  // queues are added while serving: looked up under models_mu_
  Codes* CodesOf(const std::string& name);  // with routes_mu_ held exclusively
  // The queue serving the request's model and version now (routes_mu_ held), or Python's refusal.
  grpc::Status Find(const inference::ModelInferRequest& request, Queue** queue, Codes** codes) const;
  template <class Request, class Response>
  grpc::ServerUnaryReactor* Relayed(grpc::CallbackServerContext* context, const char* method, const Request& request,
                                    Response* response);
  // A ModelInfer request, from a call or a stream: checked, then queued or answered at once.
  void GiveBack(Pending& p);  // a call refused before it queued: its budget reservation, back at once
  void Admit(Pending p, bool again = false);  // again: re-admitted (counted once)
  void Left(int64_t calls);  // calls out of the queue and the run: in_flight_ down, WaitIdle told
  grpc::ServerUnaryReactor* Table(grpc::CallbackServerContext* context, const std::string& method,
                                  const std::string& name, google::protobuf::Message* response);
  // server.batcher's _wait_for_company: a partial batch waits while company is coming, at most until its
  // oldest request has waited max_queue_delay_us; with queue.mu held (by `lock`).
  void WaitForCompany(Queue& queue, std::unique_lock<std::mutex>& lock);
  std::unique_ptr<Batch> Form(size_t index, Queue& queue);  // with queue.mu held
  void GiveExtra(Batch& batch);  // its run's memory beyond its requests' own, back to the budget
  // Request control's private parts: the parameters read at admission, the timer thread that
  // refuses a queued call once its deadline passes, and a running batch's end.
  grpc::Status Schedule(const ModelLimits& m, const inference::ModelInferRequest& request, Pending& p) const;
  void Arm(TimePoint deadline);  // the timer wakes by `deadline`
  void Reap();                   // the timer thread
  TimePoint Expire();            // refuses what has expired; the next deadline still queued
  void StopTimer();
  std::vector<char> Unrun(Batch& batch);
  // Under its queue's lock: whether item i's call was cancelled; settle: else it is marked answered.
  bool Gone(Batch& batch, size_t i, bool settle);  // out of its queue's running list; which items were cancelled
  std::shared_ptr<grpc::ServerCredentials> Credentials();  // native/security.cc; nullptr: unusable

  Contract contract_;
  std::vector<std::unique_ptr<Queue>> models_;
  mutable std::shared_mutex models_mu_;
  std::map<std::string, Routing> routes_;
  std::map<std::string, std::unique_ptr<Codes>> codes_;  // by model name, never erased (names Python knew)
  std::string serving_;
  mutable std::shared_mutex routes_mu_;  // Admit holds it shared from lookup to queueing
  Relay relay_;
  std::map<std::pair<std::string, std::string>, std::string> answers_;
  std::unique_ptr<grpc::Server> server_;
  std::atomic<bool> stopping_{false}, refusing_{false}, ready_{true};
  std::atomic<int64_t> in_flight_{0};
  std::mutex idle_mu_;
  std::condition_variable idle_;
  Codes unknown_codes_{};
  bool zeros_ = false;
  struct Handoff {
    Pending p;
    Queue* queue;
  };
  std::mutex handoff_mu_;
  std::condition_variable handoff_cv_;
  std::deque<Handoff> handoff_;
  bool handoff_stop_ = false;
  std::thread handoff_thread_;
  void StopHandoff();
  int64_t stream_window_ = 64;
  MessageBounds message_bounds_;
  std::shared_ptr<SharedBudget> budget_;
  CostTerms cost_terms_;
  int64_t stream_share_bytes_ = 0;  // 0: no budget, streams bounded by the window alone
  // The receive slots (SetReceiveSlots): who holds one since when, who waits in arrival order.
  TimePoint ExpireReceiveSlots();  // stale holders forgotten, waiters started; when the next goes stale
  std::mutex receive_mu_;
  int64_t receive_slots_ = 0;
  std::map<const void*, TimePoint> receiving_;
  std::deque<std::pair<const void*, std::function<void()>>> receive_waiting_;
  int64_t receive_deferred_ = 0;
  // Arriving ModelInfer calls (Arrived): since when, whether claimed, how Halt refuses them.
  struct Arrival {
    TimePoint came;
    bool claimed = false;  // its message came: the call is being handled, Halt leaves it
    std::function<void(const grpc::Status&)> refuse;
  };
  mutable std::mutex arriving_mu_;  // after idle_mu_ and a queue's mu (WaitForCompany)
  std::map<const void*, Arrival> arriving_;
  std::chrono::duration<double> arrival_timeout_{10.0};
  Counters counters_;
  uint64_t aging_batches_ = 4;
  std::thread timer_;
  std::mutex timer_mu_;
  std::condition_variable timer_cv_;
  TimePoint next_expiry_ = kNever;
  bool timer_stop_ = false;
  Security security_;
  bool reuse_port_ = false;
  std::string unbound_;  // the address Start could not bind
  Refusals refusals_;
  std::unique_ptr<Upstream> upstream_;
  std::unique_ptr<grpc::CallbackGenericService> no_upstream_;  // without upstream_: UNIMPLEMENTED, as gRPC answers
  std::vector<std::pair<std::string, int>> channel_args_;
  bool fallback_all_ = false;
  std::vector<std::string> fallback_keys_;
  std::mutex parked_mu_;  // before any queue's mu
  std::map<int64_t, Parked> parked_;
  std::unique_ptr<Records> records_;  // nullptr: nothing recorded (neither --access-log nor tracing)
  bool arrivals_ = false;             // records_ also gets each call's arrival (--access-log)
  std::atomic<uint64_t> batch_ids_{0};
};

// One ModelStreamInfer stream: reads requests as they come (up to the plane's stream window in
// the plane at once), admits each as ModelInfer does, and writes the answers in request order,
// one write at a time. A refused request is answered in the stream (error_message) and the
// stream goes on, as the Python plane does (server.service).
// Its messages are read as raw bytes and parsed here: one that does not parse ends the stream with
// INVALID_ARGUMENT after the answers before it (the Python plane's rule). Its reading also pauses
// while its answers hold more than its share of the memory budget (service._StreamHold's rule).
class StreamCall final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // context: the relay's (its headers), and where a recorded stream takes its peer and trace headers.
  StreamCall(Plane* plane, TimePoint call_deadline, grpc::CallbackServerContext* context = nullptr);
  void OnReadDone(bool ok) override;
  void OnCancel() override;  // every request of it leaves the plane (Plane::Cancel)
  void OnWriteDone(bool ok) override;
  void OnDone() override { delete this; }
  // The plane settled request `seq` (any thread): its answer, OK from its response, else the status.
  void Answered(uint64_t seq, const grpc::Status& status);

 private:
  struct Slot {
    std::unique_ptr<inference::ModelInferRequest> request;
    std::unique_ptr<inference::ModelInferResponse> response;
    std::unique_ptr<grpc::ByteBuffer> answer;  // set once answered: the encoded ModelStreamInferResponse
    int64_t reserved = 0;  // its budget reservation, given back once its answer is written or dropped
  };
  // With mu_ held: what to start now (a write, a read, the end), started after it is released.
  struct Next {
    grpc::ByteBuffer* write = nullptr;
    bool read = false, finish = false;
  };
  Next Step();
  void Run(const Next& next);
  bool Full() const;  // with mu_ held: this stream's answers hold its share of the budget
  void GiveBack(int64_t reserved);  // with mu_ held: a reservation whose answer is written or dropped

  // Request `seq` handed to the Python server as a ModelInfer call (Plane::ToPython); its answer
  // takes its place in the stream's order.
  void ToPython(uint64_t seq, const grpc::ByteBuffer& message, inference::ModelInferResponse* response);

  Plane* plane_;
  grpc::CallbackServerContext* context_;
  std::map<uint64_t, std::shared_ptr<UnaryRelay>> relayed_;  // by seq, until answered (cancelled with the stream)
  TimePoint deadline_;  // the stream's gRPC deadline: each request's
  std::shared_ptr<const CallNote> headers_;  // recorded: each request's note starts from it
  std::mutex mu_;
  grpc::ByteBuffer incoming_;
  std::deque<Slot> slots_;  // in request order: the first is the next to write
  uint64_t first_seq_ = 0;  // slots_.front()'s seq
  std::unique_ptr<grpc::ByteBuffer> writing_;
  bool reading_ = true, reads_done_ = false, broken_ = false, finished_ = false;
  int64_t writing_reserved_ = 0;
  // service._StreamHold: requests read and not answered, bytes of answers held, the largest reservation.
  int64_t hold_in_flight_ = 0, held_bytes_ = 0, hold_cost_ = 0;
  grpc::Status end_ = grpc::Status::OK;  // a message that did not parse: the stream's final status
};

}  // namespace attnserve

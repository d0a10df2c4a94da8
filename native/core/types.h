// The core's data: a model version's numbers, a checked request waiting in its queue, a formed
// batch, and the counters read by Python. Nothing here knows a transport.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "inference.pb.h"
#include "records.h"
#include "status.h"

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
    std::vector<std::string> why_held;  // by masking.h's Held order (codec.NATIVE_HELD_ORDER)
    std::string flash_hint;             // codec's hint where flash attention is loaded
  } graphs;
  // The schedule policy (server.scheduling.QueuePolicy from its config.json; Core::SetSchedule).
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

using TimePoint = std::chrono::steady_clock::time_point;
constexpr TimePoint kNever = TimePoint::max();

// Nanoseconds since `start`, for the counters of where time goes.
inline uint64_t NanosSince(TimePoint start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count());
}

// Cancelled calls by why x where (attnserve_cancelled_requests_total's reason and stage), in this
// order: (client, deadline, disconnect) x (queued, running, terminated, answered); Core::Cancellations
// reads them. disconnect: a REST client's connection ended (HTTP has no cancel of its own).
constexpr size_t kCancelReasons = 3, kCancelStages = 4;
using Cancels = std::array<std::atomic<uint64_t>, kCancelReasons * kCancelStages>;

// Batch::cancelled[i]: 0 live, 1 cancelled, 2 settled by Complete (a cancel then is the answered stage),
// 3 cancelled and answered CANCELLED at once by Cancel (a unary call: its batch computes on without it).
constexpr char kLive = 0, kGone = 1, kSettled = 2, kLeft = 3;

// Where a call's answer goes: the front that took the call implements it. Answered is called once
// per request (seq: the request's place in its stream, 0 for a unary call), from any thread, with
// the request's response filled when the status is OK.
class Reply {
 public:
  virtual void Answered(uint64_t seq, const Status& status) = 0;

 protected:
  ~Reply() = default;
};

// A checked request waiting in its model's queue; the request and response belong to the front's
// call (a unary call's, or its stream's slot).
struct Pending {
  Reply* reply = nullptr;  // where its answer goes
  uint64_t seq = 0;        // the request's place in its stream (reply->Answered's seq)
  bool streamed = false;   // one request of a stream: the stream goes on without it when it is cancelled
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
  // The schedule (docs/scheduling.md, "Priorities and queue timeouts"): refused unrun once `deadline`
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
  // once all had, the run's stop (the runner's RunStop, Core::OnStop) called once.
  std::vector<char> cancelled;  // kLive, kGone, kSettled or kLeft each
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

}  // namespace attnserve

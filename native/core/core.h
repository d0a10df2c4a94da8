// The native data plane's core: one queue per model version, fed by every front and drained by
// Python's runners once per batch. It parses and checks a request, admits it (drain, receive slots,
// the memory budget), queues it by priority with its deadline, forms padded batches, splits the
// answers and settles each call once through its front's Reply. It knows no transport.
// docs/design.md, "The native core and its seam", lists the calls below and what crosses them.
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "budget.h"
#include "records.h"
#include "status.h"
#include "types.h"

namespace attnserve {

// A message as it came, in the pieces the front holds it in (no copy is made to parse it).
using Chunks = std::vector<std::string_view>;

class Core {
 public:
  explicit Core(Contract contract);
  virtual ~Core();
  Core(const Core&) = delete;
  Core& operator=(const Core&) = delete;

  // -- models and routes (routes.cc), pushed by Python on every change of its registry ------------
  // A queue (and its runner's batches) for one model version; the name routes to it until Python
  // routes the name itself (Route).
  size_t AddModel(const ModelLimits& limits);
  // The versions of `name` served now (version -> queue index), or a refusal for every call naming
  // it (`code` != 0: not ready: unloaded, failed, warming), and what completes "model NAME version
  // 'V'" for a version not served. `serving` completes "unknown model 'X'".
  void Route(const std::string& name, const std::map<int64_t, size_t>& versions, int code,
             const std::string& refusal, const std::string& not_loaded);
  void Unroute(const std::string& name);  // a name the registry does not know
  void SetServing(const std::string& serving);
  // No call reaches queue `index` any more (route it away first); what is queued there runs.
  void Retire(size_t index);
  bool Drained(size_t index);  // retired and nothing queued: its runner may end
  bool Routable(const std::string& name) const;  // served now by some version (ModelReady)
  void SetModelBounds(size_t index, const ModelBounds& bounds) { At(index).bounds = bounds; }
  void SetGraphs(size_t index, const ModelLimits::Graphs& graphs);
  void SetSchedule(size_t index, const ModelLimits::Schedule& schedule);
  void SetQueueDelay(size_t index, int64_t max_queue_delay_us);
  void SetPriorityAging(uint64_t batches) { aging_batches_ = batches > 0 ? batches : 1; }
  size_t Models() const {
    std::shared_lock<std::shared_mutex> lock(models_mu_);
    return models_.size();
  }
  const ModelLimits& model(size_t index) const { return At(index).limits; }

  // -- a request (request.cc): bytes that do not parse, or whose `parameters` are over the bounds,
  // are refused with `why` (INVALID_ARGUMENT) -------------------------------------------------------
  bool Parse(const Chunks& bytes, inference::ModelInferRequest* request, std::string* why) const;
  void SetMessageBounds(const MessageBounds& bounds) { message_bounds_ = bounds; }  // before serving
  // A message its front could not parse: counted, recorded and settled by the front itself.
  void Unparsed(const Status& status, const CallNote* note);

  // -- submit (admission.cc): a parsed call is checked and queued, or answered at once -------------
  // The request and response must outlive the call; held: where the call keeps its budget
  // reservation until its answer is sent (nullptr: none taken); admitted_early: its headers came
  // before Refuse (a drain serves it). The fronts' entry point, and the fuzzer's.
  void Submit(Reply* reply, const inference::ModelInferRequest* request, inference::ModelInferResponse* response,
              TimePoint call_deadline = kNever, int64_t* held = nullptr,
              std::atomic<int64_t>* answered_by = nullptr, std::shared_ptr<CallNote> note = nullptr,
              bool admitted_early = false);
  // One request of a stream (p.reply, p.seq, p.streamed set by the front).
  void Submit(Pending p) { Admit(std::move(p)); }

  // -- the drain and the arriving calls (admission.cc) ---------------------------------------------
  // Draining: readiness off, then new calls refused (UNAVAILABLE) while queued and computing ones
  // finish; WaitIdle blocks until none is left, arriving calls included.
  void SetReady(bool ready) { ready_ = ready; }
  bool Ready() const { return ready_ && !stopping_; }
  bool Stopping() const { return stopping_; }
  void Refuse() { refusing_ = true; }
  bool WaitIdle(int64_t timeout_ms);
  // A call whose headers came and whose message has not: a drain waits for it as for a queued one,
  // for the arrival timeout from its headers; Halt refuses it through `refuse` (once, from Halt's
  // thread, no core lock held) until Claim. Arrived says whether the drain admits it.
  bool Arrived(const void* call, std::function<void(const Status&)> refuse);
  bool Claim(const void* call);        // its message came (or it went away): false once Halt refused it
  void ArrivalDone(const void* call);  // answered or in the core: no longer arriving
  void SetArrivalTimeout(double timeout_s) { arrival_timeout_ = std::chrono::duration<double>(timeout_s); }
  int64_t Arriving() const;   // arriving within the timeout
  int64_t Receiving() const;  // of those, the ones whose message has not been read yet
  // Receive slots: messages received at once, at most `slots` (0: any); set before serving. A call
  // whose headers came may read its message when TakeReceiveSlot says so, else `start` is called
  // once (any thread, no lock held) when a slot is free for it or the oldest holder went stale.
  void SetReceiveSlots(int64_t slots) { receive_slots_ = slots; }
  bool TakeReceiveSlot(const void* call, std::function<void()> start);
  // Its message is read, or the call went away: its slot goes to the next waiting call. True when
  // the call was still waiting (never started: it leaves the line).
  bool GiveReceiveSlot(const void* call);
  std::array<int64_t, 3> ReceiveFigures();  // slots (0: any), being received now, calls that waited
  // Refuses what is queued, parked or arriving (UNAVAILABLE) and forms no batch any more; running
  // ones finish. A second signal, or the grace period's end.
  void Halt();

  // -- the memory budget (admission.cc) ------------------------------------------------------------
  // The shared budget, the cost model's figures and a stream's share of the budget.
  void SetBudget(std::shared_ptr<SharedBudget> budget, const CostTerms& terms, double stream_share);
  SharedBudget* budget() const { return budget_.get(); }
  int64_t stream_share_bytes() const { return stream_share_bytes_; }
  // A request's cost (costs.request_cost): inputs, run, answer bytes.
  std::array<int64_t, 3> Cost(size_t index, int64_t rows, int64_t q_len, int64_t k_len, int64_t input_bytes,
                              bool want_probs, bool heads_differ) const;

  // -- the runner's side (batcher.cc) ---------------------------------------------------------------
  // Blocks up to timeout_ms for a batch of model `index`; nullptr on timeout, once stopping, or when
  // every queued call had expired (refused DEADLINE_EXCEEDED here).
  std::shared_ptr<Batch> NextBatch(size_t index, int64_t timeout_ms);
  // output (rows, q_len, out_dim), attn_probs (rows, heads, q_len, k_len) or nullptr: contiguous.
  void Complete(Batch& batch, const float* output, const float* attn_probs);
  void Fail(Batch& batch, StatusCode code, const std::string& message);
  size_t Queued(size_t index);  // requests waiting for model `index`
  int64_t InFlight() const { return in_flight_; }  // calls queued or computing, every model

  // -- cancellation (cancel.cc) ---------------------------------------------------------------------
  // A call's client went away: out of its queue now, or marked in its running batch, whose stop is
  // called once every call in it is gone. call_deadline: its deadline (the reason, near it);
  // disconnected: its connection ended (else its client cancelled). Whether it found the call (every
  // request of a stream's Reply).
  bool Cancel(const Reply* reply, TimePoint call_deadline, bool disconnected = false);
  // A call answered OK whose client went away before the answer was sent (the `answered` stage).
  void CancelAnswered(size_t index, TimePoint call_deadline);
  // The runner's way to stop `batch`'s run: called once every call in it is cancelled (now if so).
  void OnStop(Batch& batch, std::function<void()> stop);
  std::array<uint64_t, kCancelReasons * kCancelStages> Cancellations(size_t index) const;

  // -- deadlines (deadlines.cc): the timer thread, started once serving -----------------------------
  void StartTimer();
  void StopTimer();

  // -- counters and records (routes.cc, records.cc) ---------------------------------------------------
  // Final statuses of model `index`'s calls by code; index == models: calls naming no known model.
  std::array<uint64_t, kCodes> FinalCodes(size_t index) const;
  // Final statuses by model name (every version's calls and the refusals naming it); "": no known model.
  std::map<std::string, std::array<uint64_t, kCodes>> FinalCodesByName() const;
  const Counters& counters() const { return counters_; }
  // A status counted for no known model (a call refused before it named one).
  void CountUnknown(const Status& status) { Count(static_cast<Codes*>(nullptr), status); }
  // Call records for the access log and spans: kept up to `capacity` (0: none kept, the default, and
  // no call pays for them); arrivals: each call's arrival counts too. Before serving.
  void SetRecords(size_t capacity, bool arrivals = false);
  Records* records() const { return records_.get(); }
  bool records_arrivals() const { return arrivals_; }

  // -- the native floor (zeros.cc): answers zeros of the right shapes, no Python -----------------
  void SetZeros(bool zeros) { zeros_ = zeros; }
  void SetZerosHandoff();  // from one thread of its own, as the runner threads do
  void StopHandoff();

 private:
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
    Status refusal;                      // not OK: every call naming it gets this
    std::string not_loaded;              // completes "model NAME version 'V'"
    Codes* codes = nullptr;
  };

  // routes.cc
  Queue& At(size_t index) const;  // queues are added while serving: looked up under models_mu_
  Codes* CodesOf(const std::string& name);  // with routes_mu_ held exclusively
  // The queue serving the request's model and version now (routes_mu_ held), or the refusal.
  Status Find(const inference::ModelInferRequest& request, Queue** queue, Codes** codes) const;
  void Count(Codes* codes, const Status& status);
  // Every call ends here: counted by code (per model; nullptr: no known model), recorded, answered;
  // a recorded call's record goes to `into` (nullptr: the buffer).
  void Settle(const Pending& p, Queue* queue, const Status& status, std::vector<CallRecord>* into = nullptr);
  void Settle(const Pending& p, Codes* codes, const Status& status, std::vector<CallRecord>* into = nullptr);

  // request.cc: the contract checks, the schedule's parameters, the answer's and typed bounds.
  bool Prescan(const Chunks& bytes, int64_t size, std::string* why) const;  // a large message's, before its parse
  Status Check(const Queue& queue, const inference::ModelInferRequest& request, Pending& p) const;
  Status Schedule(const ModelLimits& m, const inference::ModelInferRequest& request, Pending& p) const;
  Status Bound(const Queue& queue, const inference::ModelInferRequest& request, const Pending& p) const;

  // admission.cc
  void Admit(Pending p, bool again = false);  // again: re-admitted (counted once)
  void GiveBack(Pending& p);  // a call refused before it queued: its budget reservation, back at once
  // The queue's bounds before a call waits for memory or queues: --max-queue-size, then
  // --max-queued-bytes. queue.mu held.
  Status QueueBounds(const Queue& queue, const Pending& p) const;
  // Queues p (its reservation taken): false with *refusal, or *retired when its queue was retired.
  // granted: it waited for memory (in flight already; its queue's bounds are not checked again).
  bool Enqueue(Queue& queue, Pending& p, bool granted, bool* retired, Status* refusal);
  // Takes p's reservation now, or parks p (moved into parked_, *parked) until the budget grants it
  // (Granted) within its deadline; else the batcher's words.
  Status Reserve(Queue& queue, Pending& p, bool* parked);
  void Granted(int64_t ticket);  // the budget's wake: a parked call's reservation is taken; it queues
  std::array<int64_t, 3> CostOf(const Queue& queue, int64_t rows, int64_t q_len, int64_t k_len, int64_t input_bytes,
                                bool want_probs, bool heads_differ) const;
  void Left(int64_t calls);  // calls out of the queue and the run: in_flight_ down, WaitIdle told
  TimePoint ExpireReceiveSlots();  // stale holders forgotten, waiters started; when the next goes stale

  // batcher.cc
  // A partial batch waits while company is coming, at most until its oldest request has waited
  // max_queue_delay_us; with queue.mu held (by `lock`).
  void WaitForCompany(Queue& queue, std::unique_lock<std::mutex>& lock);
  std::unique_ptr<Batch> Form(size_t index, Queue& queue);  // with queue.mu held
  void GiveExtra(Batch& batch);  // its run's memory beyond its requests' own, back to the budget
  // Under its queue's lock: whether item i's call was cancelled; settle: else it is marked answered.
  bool Gone(Batch& batch, size_t i, bool settle);

  // cancel.cc
  std::vector<char> Unrun(Batch& batch);  // out of its queue's running list; which items were cancelled

  // deadlines.cc: the timer thread refuses a queued or parked call once its deadline passes.
  void Arm(TimePoint deadline);  // the timer wakes by `deadline`
  void Reap();                   // the timer thread
  TimePoint Expire();            // refuses what has expired; the next deadline still queued

  // records.cc
  void Record(const Pending& p, const Status& status, std::vector<CallRecord>* into);

  // zeros.cc
  void AnswerZeros(Pending& p, Queue& queue);

  Contract contract_;
  std::vector<std::unique_ptr<Queue>> models_;
  mutable std::shared_mutex models_mu_;
  std::map<std::string, Routing> routes_;
  std::map<std::string, std::unique_ptr<Codes>> codes_;  // by model name, never erased (names Python knew)
  std::string serving_;
  mutable std::shared_mutex routes_mu_;  // Admit holds it shared from lookup to queueing
  std::atomic<bool> stopping_{false}, refusing_{false}, ready_{true};
  std::atomic<int64_t> in_flight_{0};
  std::mutex idle_mu_;
  std::condition_variable idle_;
  Codes unknown_codes_{};
  MessageBounds message_bounds_;
  std::shared_ptr<SharedBudget> budget_;
  CostTerms cost_terms_;
  int64_t stream_share_bytes_ = 0;  // 0: no budget, streams bounded by the window alone
  std::mutex parked_mu_;  // before any queue's mu
  std::map<int64_t, Parked> parked_;
  // The receive slots: who holds one since when, who waits in arrival order.
  std::mutex receive_mu_;
  int64_t receive_slots_ = 0;
  std::map<const void*, TimePoint> receiving_;
  std::deque<std::pair<const void*, std::function<void()>>> receive_waiting_;
  int64_t receive_deferred_ = 0;
  // Arriving calls (Arrived): since when, whether claimed, how Halt refuses them.
  struct Arrival {
    TimePoint came;
    bool claimed = false;  // its message came: the call is being handled, Halt leaves it
    std::function<void(const Status&)> refuse;
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
  std::unique_ptr<Records> records_;  // nullptr: nothing recorded (neither --access-log nor tracing)
  bool arrivals_ = false;             // records_ also gets each call's arrival (--access-log)
  std::atomic<uint64_t> batch_ids_{0};
  // The native floor (zeros.cc).
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
};

}  // namespace attnserve

// The gRPC front (front.h): ModelInfer's calls from their headers to their answer, the server's
// start and stop, and what a call's headers give its record.
#include "front.h"

#include <algorithm>
#include <set>

#include <grpc/support/time.h>

#include "encode.h"
#include "stream.h"
#include "text.h"

namespace attnserve {

namespace {

using Clock = std::chrono::steady_clock;

// The call's gRPC deadline on the steady clock (kNever: none).
TimePoint CallDeadline(const grpc::CallbackServerContext* context) {
  const gpr_timespec raw = context->raw_deadline();
  const gpr_timespec left = gpr_time_sub(gpr_convert_clock_type(raw, GPR_CLOCK_MONOTONIC), gpr_now(GPR_CLOCK_MONOTONIC));
  if (gpr_time_cmp(raw, gpr_inf_future(raw.clock_type)) == 0 || left.tv_sec > (int64_t{1} << 32)) return kNever;
  return Clock::now() + std::chrono::seconds(left.tv_sec) + std::chrono::nanoseconds(left.tv_nsec);
}

std::string MetadataValue(const std::multimap<grpc::string_ref, grpc::string_ref>& metadata, const char* key) {
  auto found = metadata.find(key);
  if (found == metadata.end()) return {};
  constexpr size_t kMaxHeaderChars = 512;  // client text: a traceparent is 55 characters
  return std::string(found->second.data(), std::min(found->second.size(), kMaxHeaderChars));
}

// The methods this service serves itself (natively, or through the rare RPCs' relay to the event loop).
const std::set<std::string> kServedHere = {"ServerLive",      "ServerReady",    "ModelReady",      "ServerMetadata",
                                           "ModelMetadata",   "ModelConfig",    "ModelStatistics", "RepositoryIndex",
                                           "ModelInfer",      "ModelStreamInfer"};

// A ModelInfer call whose request the core parses (gRPC's generated handler answers bytes that do
// not parse UNIMPLEMENTED, without a message); it owns the parsed request until gRPC is done.
class InferCall final : public grpc::ServerUnaryReactor, public Reply {
 public:
  InferCall(Core* core, TimePoint deadline) : core_(core), deadline_(deadline) {}
  void Answered(uint64_t, const Status& status) override { Finish(ToGrpc(status)); }
  inference::ModelInferRequest request;
  SharedBudget* budget = nullptr;
  int64_t reserved = 0;  // its budget reservation: given back once the answer is sent (or the call is gone)
  std::shared_ptr<UnaryRelay> relayed;  // handed to the Python server (GrpcFront::ToPython)
  std::atomic<int64_t> answered_by{-1};  // the model index once its answer is handed to gRPC (Complete)
  void OnCancel() override {  // after the handler returned
    if (relayed) {
      relayed->Cancel();
      return;
    }
    const int64_t answered = answered_by.load();
    if (answered >= 0) {
      core_->CancelAnswered(static_cast<size_t>(answered), deadline_);  // computed, gone before it was sent
    } else if (!core_->Cancel(this, deadline_) && answered_by.load() >= 0) {
      core_->CancelAnswered(static_cast<size_t>(answered_by.load()), deadline_);  // answered meanwhile
    }
  }
  void OnDone() override {
    if (reserved > 0) budget->Give(reserved);
    delete this;
  }

 private:
  Core* core_;
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

// ModelInfer's call as gRPC runs it. The method is registered as streaming (GrpcFront::GrpcFront), so gRPC
// hands the call over at its headers and reads its one message only when asked: once a receive slot
// is free (server.gate's rule; until then HTTP/2 flow control holds the message back at the stream's
// window). The plane holds it from its headers on, for the drain (docs/native-data-plane.md, "Drain").
// It then serves as an InferCall (GrpcFront::Infer), whose Finish writes the answer and ends the call.
class ReceivedCall final : public grpc::ServerBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  ReceivedCall(GrpcFront* front, grpc::CallbackServerContext* context)
      : front_(front),
        core_(front->core()),
        context_(context),
        binding_([this](grpc::Status s) { Answer(std::move(s)); }, [this] { StartSendInitialMetadata(); }) {
    admitted_early_ = core_->Arrived(this, [this](const Status& s) { Refused(ToGrpc(s)); });
    front_->HeadersLine(kModelInferMethod.c_str());
    if (core_->TakeReceiveSlot(this, [this] { Read(); })) Read();
  }
  void OnReadDone(bool ok) override {
    core_->GiveReceiveSlot(this);
    if (!core_->Claim(this)) return;  // Halt refused it while its message was on its way
    if (!ok) {  // the client half-closed without a message, or went away (server.gate's words)
      core_->ArrivalDone(this);
      Finish(grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, "the call sent no request message"));
      return;
    }
    grpc::ServerUnaryReactor* call = front_->Infer(context_, &bytes_, &response_, admitted_early_);
    binding_.Bind(call);
    call_.store(call);
    core_->ArrivalDone(this);  // after it is queued (in flight): a drain never sees it in neither
    if (cancelled_.load() && !cancel_told_.exchange(true)) call->OnCancel();  // it went while being admitted
  }
  void OnCancel() override {
    cancelled_.store(true);
    if (grpc::ServerUnaryReactor* call = call_.load()) {
      if (!cancel_told_.exchange(true)) call->OnCancel();
      return;
    }
    // Still waiting for a slot (never read), and not refused by Halt meanwhile: answered here.
    if (core_->GiveReceiveSlot(this) && core_->Claim(this)) {
      core_->ArrivalDone(this);
      Finish(ToGrpc(Cancelled()));
    }
  }
  void OnDone() override {
    core_->GiveReceiveSlot(this);  // nothing of it stays in the slots
    core_->ArrivalDone(this);      // nor in the arriving calls
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
    core_->GiveReceiveSlot(this);
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
  GrpcFront* front_;
  Core* core_;
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
  explicit RefusedStream(const grpc::Status& status) { Finish(status); }
  void OnDone() override { delete this; }
};

}  // namespace

GrpcFront::GrpcFront(Core* core) : core_(core) {
  // Methods served neither here nor through the rare RPCs' relay go to the generic service, which
  // hands them to the Python server (relay.h); without one gRPC answers them UNIMPLEMENTED.
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
                             return new RefusedStream(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, security_.refusal));
                           }
                           return new StreamCall(this, CallDeadline(context), context);
                         }));
}

GrpcFront::~GrpcFront() = default;

grpc::ServerUnaryReactor* GrpcFront::Infer(grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
                                       inference::ModelInferResponse* response, bool admitted_early) {
  const TimePoint deadline = CallDeadline(context);
  auto* call = new InferCall(core_, deadline);
  if (TokenDeferred() && !TokenAdmits(context)) {  // the processor let it through to us
    RecordTokenRefusal(context, "ModelInfer", /*arrival=*/false);  // its headers line is written
    call->Finish(grpc::Status(grpc::StatusCode::UNAUTHENTICATED, security_.refusal));
    return call;
  }
  std::shared_ptr<CallNote> note;
  if (core_->records()) note = Note(context, "ModelInfer", static_cast<int64_t>(bytes->Length()));
  std::string why;
  if (!Parse(*bytes, &call->request, &why)) {
    const Status status = Bounded(Invalid(why));
    core_->Unparsed(status, note.get());
    call->Finish(ToGrpc(status));
  } else if (upstream_ && ToPython(call->request)) {  // its message, as it came
    call->relayed = upstream_->Unary(*context, kModelInferMethod, *bytes);
    call->relayed->Start([call, response](const grpc::Status& status, const grpc::ByteBuffer& answer) {
      call->Finish(status.ok() ? ToGrpc(ReadAnswer(answer, response)) : status);
    });
  } else {
    call->budget = core_->budget();
    core_->Submit(call, &call->request, response, deadline, call->budget ? &call->reserved : nullptr,
                  &call->answered_by, std::move(note), admitted_early);
  }
  return call;
}

bool GrpcFront::Parse(const grpc::ByteBuffer& bytes, inference::ModelInferRequest* request, std::string* why) const {
  std::vector<grpc::Slice> slices;  // the message's own, referenced while the core parses them
  if (!bytes.Dump(&slices).ok()) {
    *why = "the request message could not be read";
    return false;
  }
  Chunks chunks;
  chunks.reserve(slices.size());
  for (const grpc::Slice& slice : slices) chunks.emplace_back(reinterpret_cast<const char*>(slice.begin()), slice.size());
  return core_->Parse(chunks, request, why);
}

bool GrpcFront::ToPython(const inference::ModelInferRequest& request) const {
  if (fallback_all_) return true;
  for (const std::string& key : fallback_keys_) {
    for (const auto& input : request.inputs())
      if (input.parameters().count(key) != 0) return true;
    for (const auto& output : request.outputs())
      if (output.parameters().count(key) != 0) return true;
  }
  return false;
}

void GrpcFront::SetAnswer(const std::string& method, const std::string& name, std::string bytes) {
  answers_[{method, name}] = std::move(bytes);
}

int GrpcFront::Start(const std::vector<std::string>& addresses, int max_message_bytes, int max_concurrent_streams) {
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
  return ports[0];
}

void GrpcFront::Shutdown(double grace_s) {
  if (!server_) return;
  // Batches being computed finish meanwhile (their runner threads call Complete).
  server_->Shutdown(std::chrono::system_clock::now() + std::chrono::microseconds(static_cast<int64_t>(grace_s * 1e6)));
  server_.reset();
}

void GrpcFront::HeadersLine(const char* method) {  // the gate's arrival line, among the arrival counts (records.h)
  if (!core_->records() || !core_->records_arrivals()) return;
  core_->records()->AddArrival(method);
}

void GrpcFront::RecordArrival(const char* method) {
  if (!core_->records() || !core_->records_arrivals()) return;
  core_->records()->AddArrival(std::string("/inference.GRPCInferenceService/") + method);
}

void GrpcFront::RecordTokenRefusal(const grpc::CallbackServerContext* context, const char* method, bool arrival) {
  refusals_.Note(std::string("/inference.GRPCInferenceService/") + method);
  Records* records = core_->records();
  if (records == nullptr) return;
  if (arrival) RecordArrival(method);
  CallRecord r;
  r.traced = false;  // the Python gate's line: the method and the peer, no model, no span
  r.method = method;
  r.peer = context->peer();
  r.code = GRPC_STATUS_UNAUTHENTICATED;
  r.details = security_.refusal.substr(0, 200);
  r.start_ns = r.end_ns = records->EpochNs(std::chrono::steady_clock::now());
  records->Add(std::move(r));
}

std::shared_ptr<CallNote> GrpcFront::Note(const grpc::CallbackServerContext* context, const char* method,
                                      int64_t bytes_in) const {
  auto note = std::make_shared<CallNote>();
  note->started = std::chrono::steady_clock::now();
  note->method = method;
  note->peer = context->peer();
  const auto& metadata = context->client_metadata();
  note->traceparent = MetadataValue(metadata, "traceparent");
  note->tracestate = MetadataValue(metadata, "tracestate");
  note->bytes_in = bytes_in;
  return note;
}

}  // namespace attnserve

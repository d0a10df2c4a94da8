// The relay to the Python server (relay.h; docs/native-data-plane.md, "One port: the relay").
#include "relay.h"

#include <atomic>
#include <string_view>

namespace attnserve {

namespace {

std::string_view View(const grpc::string_ref& ref) { return {ref.data(), ref.size()}; }

// Headers the upstream call must not repeat: HTTP/2's and gRPC's own (gRPC sets or refuses
// them), and the peer header, which only the plane may set.
bool Forwarded(std::string_view key) {
  if (key.empty() || key.front() == ':' || key.rfind("grpc-", 0) == 0) return false;
  static constexpr std::string_view kDropped[] = {"te", "content-type", "user-agent", "host", "connection",
                                                  "keep-alive", "proxy-connection", "transfer-encoding",
                                                  "upgrade", kPeerHeader, kMethodHeader};
  for (std::string_view dropped : kDropped)
    if (key == dropped) return false;
  return true;
}

// One relayed call: the caller's stream (this reactor) and the upstream one (Side), with one
// message in flight each way: the next message is read only once the last one is written.
// Two holds keep the upstream call's OnDone back while either direction may still start an
// operation on it; each is let go of once its direction is over. Deleted once both sides are done.
class RelayCall final : public grpc::ServerGenericBidiReactor {
 public:
  RelayCall(grpc::GenericStub* stub, grpc::GenericCallbackServerContext* context)
      : context_(context), method_(context->method()), side_(this) {
    ForwardCall(*context, &client_);
    stub->PrepareBidiStreamingCall(&client_, method_, grpc::StubOptions(), &side_);
    side_.AddMultipleHolds(2);  // up: the caller's messages; down: the answers
    side_.StartRead(&down_);
    side_.StartCall();
    StartRead(&up_);
  }

  // -- the caller's side -----------------------------------------------------------------------
  void OnReadDone(bool ok) override {
    bool write = false, close = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (up_closed_) return;  // the upstream call is over: the message has nowhere to go
      if (ok) {
        write = up_writing_ = true;
      } else {  // the caller's half-close (or it is gone)
        close = up_closed_ = true;
      }
    }
    if (write) side_.StartWrite(&up_);
    if (close) {
      side_.StartWritesDone();
      side_.RemoveHold();
    }
  }
  void OnWriteDone(bool ok) override {
    bool read = false, release = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (ok) read = true; else release = true;
    }
    if (read) side_.StartRead(&down_);
    if (release) {  // the caller is gone: the upstream call is cancelled, no more answers read
      client_.TryCancel();
      side_.RemoveHold();
    }
  }
  void OnCancel() override { client_.TryCancel(); }
  void OnDone() override { Done(); }

  // -- the upstream side -----------------------------------------------------------------------
  void UpWritten(bool ok) {
    bool read = false, release = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      up_writing_ = false;
      if (up_closed_) return;
      if (ok && !down_ended_) {
        read = true;
      } else {
        release = up_closed_ = true;
      }
    }
    if (read) StartRead(&up_);
    if (release) side_.RemoveHold();
  }
  void DownRead(bool ok) {
    if (ok) {
      StartWrite(&down_);
      return;
    }
    bool release_up = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      down_ended_ = true;  // the upstream call has its status: the caller's later messages are dropped
      if (!up_closed_ && !up_writing_) release_up = up_closed_ = true;
    }
    if (release_up) side_.RemoveHold();
    side_.RemoveHold();
  }
  void UpstreamDone(const grpc::Status& status) {
    for (const auto& [key, value] : client_.GetServerTrailingMetadata()) {
      if (Forwarded(View(key))) context_->AddTrailingMetadata(std::string(View(key)), std::string(View(value)));
    }
    Finish(status);
    Done();
  }

 private:
  class Side final : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
   public:
    explicit Side(RelayCall* call) : call_(call) {}
    void OnReadDone(bool ok) override { call_->DownRead(ok); }
    void OnWriteDone(bool ok) override { call_->UpWritten(ok); }
    void OnDone(const grpc::Status& status) override { call_->UpstreamDone(status); }

   private:
    RelayCall* call_;
  };

  void Done() {
    if (dones_.fetch_add(1) == 1) delete this;
  }

  grpc::GenericCallbackServerContext* context_;
  const std::string method_;
  grpc::ClientContext client_;
  Side side_;
  grpc::ByteBuffer up_, down_;  // the message in flight each way
  std::mutex mu_;
  bool up_writing_ = false, up_closed_ = false, down_ended_ = false;
  std::atomic<int> dones_{0};
};

}  // namespace

void ForwardCall(const grpc::ServerContextBase& from, grpc::ClientContext* to) {
  for (const auto& [key, value] : from.client_metadata()) {
    if (Forwarded(View(key))) to->AddMetadata(std::string(View(key)), std::string(View(value)));
  }
  to->AddMetadata(kPeerHeader, from.peer());
  const auto deadline = from.deadline();
  if (deadline != std::chrono::system_clock::time_point::max()) to->set_deadline(deadline);
}

Upstream::Upstream(const std::string& target)
    : channel_([&] {
        grpc::ChannelArguments args;
        // The plane's port has bounded the caller's messages, and Python bounds its answers.
        args.SetMaxReceiveMessageSize(-1);
        args.SetMaxSendMessageSize(-1);
        return grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args);
      }()),
      stub_(channel_) {}

grpc::ServerGenericBidiReactor* Upstream::CreateReactor(grpc::GenericCallbackServerContext* context) {
  return new RelayCall(&stub_, context);
}

std::shared_ptr<UnaryRelay> Upstream::Unary(const grpc::ServerContextBase& from, const std::string& method,
                                            const grpc::ByteBuffer& request, const char* called) {
  auto relay = std::make_shared<UnaryRelay>();
  ForwardCall(from, &relay->context_);
  if (called != nullptr) relay->context_.AddMetadata(kMethodHeader, called);
  relay->stub_ = &stub_;
  relay->method_ = method;
  relay->request_ = request;  // shares the message's slices
  return relay;
}

void UnaryRelay::Start(Done done) {
  // The call keeps its relay (context, buffers) until done has run.
  auto self = shared_from_this();
  stub_->UnaryCall(&context_, method_, grpc::StubOptions(), &request_, &response_,
                   [self, done = std::move(done)](grpc::Status status) { done(status, self->response_); });
}

}  // namespace attnserve

// The gRPC front: grpc++'s callback server on the one gRPC port. It frames calls and submits each
// ModelInfer request into the core (core/core.h); the rare RPCs go to Python through the relay
// callback, and the methods it does not serve to the Python server behind a Unix socket (relay.h).
// docs/native-data-plane.md says what it does, docs/native-build.md how it is built.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <grpcpp/grpcpp.h>

#include "core.h"
#include "inference.grpc.pb.h"
#include "relay.h"

namespace attnserve {

// The core's status as gRPC sends it.
inline grpc::Status ToGrpc(const Status& status) {
  return status.ok() ? grpc::Status::OK
                     : grpc::Status(static_cast<grpc::StatusCode>(status.error_code()), status.error_message());
}

// The native port's TLS and token (security.cc), from server.security's checked files.
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

// A rare RPC handed to Python (docs/native-data-plane.md, "Model changes and the rare RPCs"):
// done(code, details, response bytes) is called once, from any thread; dropped uncalled, the
// call is answered UNAVAILABLE.
using RelayDone = std::function<void(int code, const std::string& details, const std::string& response)>;
using Relay = std::function<void(const std::string& method, const std::string& request, RelayDone done)>;

class StreamCall;

inline const std::string kModelInferMethod = "/inference.GRPCInferenceService/ModelInfer";

class GrpcFront final : public inference::GRPCInferenceService::CallbackService {
 public:
  explicit GrpcFront(Core* core);  // ModelInfer's handler: raw bytes, parsed by the core, then submitted
  ~GrpcFront() override;
  Core* core() const { return core_; }

  // The rare RPCs (ready, metadata, config, statistics, index) answered by Python, live.
  void SetRelay(Relay relay) { relay_ = std::move(relay); }
  // Serialized answers of the rare RPCs, by method and model name ("" for server-wide ones).
  void SetAnswer(const std::string& method, const std::string& name, std::string bytes);
  // Requests of one ModelStreamInfer stream in the core at once; reading pauses beyond it.
  void SetStreamWindow(int64_t window) { stream_window_ = window > 0 ? window : 1; }
  void SetSecurity(Security security) { security_ = std::move(security); }  // before Start
  void SetOpenPrefixes(std::vector<std::string> prefixes) { security_.open_prefixes = std::move(prefixes); }
  // One port (relay.h): every other method, and the requests ToPython picks, go to the Python
  // server listening on `target` (a private Unix socket); set before Start.
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
  bool Serving() const { return server_ != nullptr; }
  // GOAWAY and the listener closed; calls still computing have grace_s to finish.
  void Shutdown(double grace_s);

  // ModelInfer's handler once its message is read: parsed, then submitted, refused or relayed.
  // admitted_early: its headers came before the drain's refusal (a drain serves it).
  grpc::ServerUnaryReactor* Infer(grpc::CallbackServerContext* context, const grpc::ByteBuffer* bytes,
                                  inference::ModelInferResponse* response, bool admitted_early = false);
  // The core's parse of a message as gRPC holds it (its slices, uncopied).
  bool Parse(const grpc::ByteBuffer& bytes, inference::ModelInferRequest* request, std::string* why) const;
  // With --access-log, a ModelInfer or ModelStreamInfer call's headers count among the arrivals
  // (records.h), written as the Python plane's "rpc METHOD" line (server.gate).
  void HeadersLine(const char* method);

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
  template <class Request, class Response>
  grpc::ServerUnaryReactor* Relayed(grpc::CallbackServerContext* context, const char* method, const Request& request,
                                    Response* response);
  grpc::ServerUnaryReactor* Table(grpc::CallbackServerContext* context, const std::string& method,
                                  const std::string& name, google::protobuf::Message* response);
  // Call records (core/records.h): a call's note from its headers; a refusal for its token.
  std::shared_ptr<CallNote> Note(const grpc::CallbackServerContext* context, const char* method,
                                 int64_t bytes_in) const;
  void RecordArrival(const char* method);  // the gate's arrival line of a rare RPC
  // With records on, the token of ModelInfer and ModelStreamInfer is checked here (security.cc), where
  // the call has its peer for the access line, instead of in the core's processor.
  bool TokenDeferred() const { return core_->records() != nullptr && !security_.token.empty(); }
  bool TokenAdmits(const grpc::CallbackServerContext* context) const;
  void RecordTokenRefusal(const grpc::CallbackServerContext* context, const char* method, bool arrival = true);
  std::shared_ptr<grpc::ServerCredentials> Credentials();  // security.cc; nullptr: unusable

  Core* core_;
  Relay relay_;
  std::map<std::pair<std::string, std::string>, std::string> answers_;
  std::unique_ptr<grpc::Server> server_;
  int64_t stream_window_ = 64;
  Security security_;
  bool reuse_port_ = false;
  std::string unbound_;  // the address Start could not bind
  Refusals refusals_;
  std::unique_ptr<Upstream> upstream_;
  std::unique_ptr<grpc::CallbackGenericService> no_upstream_;  // without upstream_: UNIMPLEMENTED, as gRPC answers
  std::vector<std::pair<std::string, int>> channel_args_;
  bool fallback_all_ = false;
  std::vector<std::string> fallback_keys_;
};

}  // namespace attnserve

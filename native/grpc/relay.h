// The plane's relay to the Python server (docs/native-data-plane.md, "One port: the relay"):
// every call the plane does not serve itself goes, byte for byte, to the Python grpc.aio server
// on its private Unix socket, with the caller's metadata, deadline and cancellation.
#pragma once

#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include <grpcpp/generic/async_generic_service.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

namespace attnserve {

// The caller's address, set by the plane on every relayed call; a client's own is dropped.
inline constexpr const char* kPeerHeader = "x-attnserve-peer";
// The method the caller called, set where the relayed call's differs (a stream's request relayed as
// a ModelInfer call), for Python's access line and span; a client's own is dropped.
inline constexpr const char* kMethodHeader = "x-attnserve-method";

// Copies what the caller sent onto the upstream call: its headers (less HTTP/2's and gRPC's own,
// and a client-sent peer header), its deadline, and the real peer (kPeerHeader).
void ForwardCall(const grpc::ServerContextBase& from, grpc::ClientContext* to);

// One unary call relayed (a ModelInfer request the plane does not carry itself), prepared by
// Upstream::Unary so that its owner holds it before it starts: Start(done) calls done(status,
// answer bytes) once, from a gRPC thread. Cancel() cancels the upstream call.
class UnaryRelay : public std::enable_shared_from_this<UnaryRelay> {
 public:
  using Done = std::function<void(const grpc::Status&, const grpc::ByteBuffer&)>;
  void Start(Done done);
  void Cancel() { context_.TryCancel(); }

 private:
  friend class Upstream;
  grpc::GenericStub* stub_ = nullptr;
  grpc::ClientContext context_;
  std::string method_;
  grpc::ByteBuffer request_, response_;
};

// The private channel to the Python server, and the generic service that relays every method
// no registered service has.
class Upstream final : public grpc::CallbackGenericService {
 public:
  explicit Upstream(const std::string& target);  // "unix:/path/to/socket"
  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* context) override;
  // `called`: the caller's method where it is not `method` (kMethodHeader), else nullptr.
  std::shared_ptr<UnaryRelay> Unary(const grpc::ServerContextBase& from, const std::string& method,
                                    const grpc::ByteBuffer& request, const char* called = nullptr);

 private:
  std::shared_ptr<grpc::Channel> channel_;
  grpc::GenericStub stub_;
};

}  // namespace attnserve

// The rare RPCs on the gRPC front (front.h): liveness here; readiness, metadata, config, statistics
// and the index relayed to Python's handlers live, or answered from the tables Python set.
#include <atomic>

#include "front.h"
#include "text.h"

namespace attnserve {

grpc::ServerUnaryReactor* GrpcFront::Table(grpc::CallbackServerContext* context, const std::string& method,
                                       const std::string& name, google::protobuf::Message* response) {
  auto* reactor = context->DefaultReactor();
  auto found = answers_.find({method, name});
  if (found == answers_.end() || !response->ParseFromString(found->second)) {
    reactor->Finish(grpc::Status(grpc::StatusCode::NOT_FOUND, method + ": unknown model '" + name + "'"));
  } else {
    reactor->Finish(grpc::Status::OK);
  }
  return reactor;
}

grpc::ServerUnaryReactor* GrpcFront::ServerLive(grpc::CallbackServerContext* context, const inference::ServerLiveRequest*,
                                            inference::ServerLiveResponse* response) {
  response->set_live(true);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

namespace {

// A relayed call's answer: given once by Python (or, if Python drops it unanswered, UNAVAILABLE).
class RelayReply {
 public:
  RelayReply(grpc::ServerUnaryReactor* reactor, google::protobuf::Message* response) : reactor_(reactor), response_(response) {}
  ~RelayReply() { Give(static_cast<int>(grpc::StatusCode::UNAVAILABLE), "the server did not answer (it is stopping)", ""); }
  void Give(int code, const std::string& details, const std::string& bytes) {
    if (given_.exchange(true)) return;
    if (code == 0 && !response_->ParseFromString(bytes)) {
      reactor_->Finish(grpc::Status(grpc::StatusCode::INTERNAL, "the answer does not parse"));
    } else {
      reactor_->Finish(code == 0 ? grpc::Status::OK : ToGrpc(Bounded(Status(static_cast<StatusCode>(code), details))));
    }
  }

 private:
  grpc::ServerUnaryReactor* reactor_;
  google::protobuf::Message* response_;
  std::atomic<bool> given_{false};
};

}  // namespace

template <class Request, class Response>
grpc::ServerUnaryReactor* GrpcFront::Relayed(grpc::CallbackServerContext* context, const char* method,
                                         const Request& request, Response* response) {
  RecordArrival(method);  // the gate's line, as the Python port writes it for these
  auto* reactor = context->DefaultReactor();
  auto reply = std::make_shared<RelayReply>(reactor, response);
  try {
    relay_(method, request.SerializeAsString(),
           [reply](int code, const std::string& details, const std::string& bytes) { reply->Give(code, details, bytes); });
  } catch (const std::exception& err) {  // Python could not take it: the reply's end answers UNAVAILABLE
    reply->Give(static_cast<int>(grpc::StatusCode::UNAVAILABLE), std::string("the server could not answer: ") + err.what(), "");
  }
  return reactor;
}

grpc::ServerUnaryReactor* GrpcFront::ServerReady(grpc::CallbackServerContext* context,
                                             const inference::ServerReadyRequest* request,
                                             inference::ServerReadyResponse* response) {
  if (relay_ && !core_->Stopping()) return Relayed(context, "ServerReady", *request, response);
  response->set_ready(core_->Ready());
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GrpcFront::ModelReady(grpc::CallbackServerContext* context,
                                            const inference::ModelReadyRequest* request,
                                            inference::ModelReadyResponse* response) {
  if (relay_ && !core_->Stopping()) return Relayed(context, "ModelReady", *request, response);
  response->set_ready(core_->Ready() && core_->Routable(request->name()));
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status::OK);
  return reactor;
}

grpc::ServerUnaryReactor* GrpcFront::ServerMetadata(grpc::CallbackServerContext* context,
                                                const inference::ServerMetadataRequest* request,
                                                inference::ServerMetadataResponse* response) {
  if (relay_) return Relayed(context, "ServerMetadata", *request, response);
  return Table(context, "ServerMetadata", "", response);
}

grpc::ServerUnaryReactor* GrpcFront::ModelMetadata(grpc::CallbackServerContext* context,
                                               const inference::ModelMetadataRequest* request,
                                               inference::ModelMetadataResponse* response) {
  if (relay_) return Relayed(context, "ModelMetadata", *request, response);
  return Table(context, "ModelMetadata", request->name(), response);
}

grpc::ServerUnaryReactor* GrpcFront::ModelConfig(grpc::CallbackServerContext* context,
                                             const inference::ModelConfigRequest* request,
                                             inference::ModelConfigResponse* response) {
  if (relay_) return Relayed(context, "ModelConfig", *request, response);
  return Table(context, "ModelConfig", request->name(), response);
}

grpc::ServerUnaryReactor* GrpcFront::ModelStatistics(grpc::CallbackServerContext* context,
                                                 const inference::ModelStatisticsRequest* request,
                                                 inference::ModelStatisticsResponse* response) {
  if (relay_) return Relayed(context, "ModelStatistics", *request, response);
  return Table(context, "ModelStatistics", request->name(), response);
}

grpc::ServerUnaryReactor* GrpcFront::RepositoryIndex(grpc::CallbackServerContext* context,
                                                 const inference::RepositoryIndexRequest* request,
                                                 inference::RepositoryIndexResponse* response) {
  if (relay_) return Relayed(context, "RepositoryIndex", *request, response);
  auto* reactor = context->DefaultReactor();
  reactor->Finish(grpc::Status(grpc::StatusCode::UNIMPLEMENTED, "RepositoryIndex is served on the Python port"));
  return reactor;
}

}  // namespace attnserve

// A ModelInfer answer as gRPC sends it, and a relayed answer read back.
#pragma once

#include <string>

#include <grpcpp/support/byte_buffer.h>

#include "inference.pb.h"
#include "status.h"

namespace attnserve {

// A ModelInfer answer's bytes, as response->SerializeAsString() writes them, with its
// raw_output_contents moved into slices of their own, which gRPC sends without another copy.
grpc::ByteBuffer EncodeAnswer(inference::ModelInferResponse* response);
// The same answer in a stream, as a ModelStreamInferResponse (its error_message, when not empty).
grpc::ByteBuffer EncodeStreamAnswer(const std::string& error_message, inference::ModelInferResponse* response);
// The Python server's answer to a relayed ModelInfer request, into the call's typed response.
Status ReadAnswer(const grpc::ByteBuffer& answer, inference::ModelInferResponse* response);

}  // namespace attnserve

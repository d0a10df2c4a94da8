// Answers as gRPC sends them (encode.h).
#include "encode.h"

#include <cstdint>
#include <vector>

#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/slice.h>

namespace attnserve {

namespace {

constexpr size_t kCopiedBelow = 4096;  // raw_output_contents shorter than this are copied into the answer's head

}  // namespace

// The Python server's answer to a relayed ModelInfer request, into the call's typed response.
Status ReadAnswer(const grpc::ByteBuffer& answer, inference::ModelInferResponse* response) {
  grpc::ByteBuffer copy(answer);  // shares the slices; the reader takes a mutable buffer
  grpc::ProtoBufferReader reader(&copy);
  if (!reader.status().ok() || !response->ParseFromZeroCopyStream(&reader)) {
    return Status(StatusCode::INTERNAL, "the Python server's answer does not parse as a ModelInferResponse");
  }
  return Status::OK;
}

// The answer's bytes as SerializeAsString writes them, without copying raw_output_contents again:
// those strings move into slices of their own, after the message's other fields (numbers 1-5).
grpc::ByteBuffer EncodeAnswer(inference::ModelInferResponse* response) {
  google::protobuf::RepeatedPtrField<std::string> contents;
  contents.Swap(response->mutable_raw_output_contents());  // the strings change hands, uncopied
  std::string head = response->SerializeAsString();
  std::vector<grpc::Slice> slices;
  slices.reserve(2 * static_cast<size_t>(contents.size()) + 1);
  for (std::string& bytes : contents) {
    head.push_back(static_cast<char>((inference::ModelInferResponse::kRawOutputContentsFieldNumber << 3) | 2));
    uint8_t size[10];
    const uint8_t* end = google::protobuf::io::CodedOutputStream::WriteVarint64ToArray(bytes.size(), size);
    head.append(reinterpret_cast<const char*>(size), static_cast<size_t>(end - size));
    if (bytes.size() < kCopiedBelow) {  // a slice of its own costs more than a copy
      head += bytes;
      continue;
    }
    slices.emplace_back(head);
    head.clear();
    auto* owned = new std::string(std::move(bytes));
    slices.emplace_back(owned->data(), owned->size(), [](void* s) { delete static_cast<std::string*>(s); }, owned);
  }
  if (!head.empty() || slices.empty()) slices.emplace_back(head);
  return grpc::ByteBuffer(slices.data(), slices.size());
}

grpc::ByteBuffer EncodeStreamAnswer(const std::string& error_message, inference::ModelInferResponse* response) {
  grpc::ByteBuffer inner = EncodeAnswer(response);
  std::vector<grpc::Slice> slices;
  if (!inner.Dump(&slices).ok()) slices.clear();  // Dump fails only on a compressed buffer, which this is not
  std::string head;
  google::protobuf::io::StringOutputStream to(&head);
  {
    google::protobuf::io::CodedOutputStream out(&to);
    if (!error_message.empty()) {
      out.WriteTag(inference::ModelStreamInferResponse::kErrorMessageFieldNumber << 3 | 2);
      out.WriteVarint64(error_message.size());
      out.WriteString(error_message);
    }
    out.WriteTag(inference::ModelStreamInferResponse::kInferResponseFieldNumber << 3 | 2);
    out.WriteVarint64(inner.Length());
  }
  slices.insert(slices.begin(), grpc::Slice(head));
  return grpc::ByteBuffer(slices.data(), slices.size());
}

}  // namespace attnserve

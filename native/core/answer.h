// One output tensor of an answer, written as the request asked: the batcher's split and the floor's zeros.
#pragma once

#include <cstring>
#include <initializer_list>
#include <string>

#include "inference.pb.h"

namespace attnserve {

// One output tensor of the answer: its header, then its floats in order, appended to its
// raw_output_contents (never zero-filled first) or written into its fp32_contents.
class OutputTo {
 public:
  OutputTo(inference::ModelInferResponse* response, const std::string& name, const std::string& datatype,
           std::initializer_list<int64_t> shape, bool raw, size_t count) {
    auto* tensor = response->add_outputs();
    tensor->set_name(name);
    tensor->set_datatype(datatype);
    for (int64_t d : shape) tensor->add_shape(d);
    if (raw) {
      bytes_ = response->add_raw_output_contents();
      bytes_->reserve(count * 4);
      return;
    }
    auto* values = tensor->mutable_contents()->mutable_fp32_contents();
    values->Resize(static_cast<int>(count), 0.0f);
    at_ = values->mutable_data();
  }
  void Put(const float* from, size_t count) {
    if (bytes_ != nullptr) {
      bytes_->append(reinterpret_cast<const char*>(from), count * 4);
    } else {
      std::memcpy(at_, from, count * 4);
      at_ += count;
    }
  }
  void Zeros(size_t count) {
    if (bytes_ != nullptr) {
      bytes_->append(count * 4, '\0');
    } else {
      at_ += count;  // Resize wrote them
    }
  }

 private:
  std::string* bytes_ = nullptr;
  float* at_ = nullptr;
};

}  // namespace attnserve

// libFuzzer target over the native core's wire parser, contract checks, batching and split, and the
// gRPC front's answer encoding: each input is one serialized ModelInferRequest, submitted as a call
// beside a valid one of the same model, then batched with it and answered with zeros (`make fuzz-native`,
// docs/native-build.md, "Sanitizers and fuzzing"). The models come from plane_models.txt beside the binary, written by
// native/fuzz/seeds.py from attnserve.contract and the server's defaults.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <google/protobuf/stubs/logging.h>

#include "core.h"
#include "encode.h"

namespace {

using attnserve::Contract;
using attnserve::Core;
using attnserve::ModelLimits;

// A call of no front: its answer is kept in its response, its status dropped.
class Call final : public attnserve::Reply {
 public:
  void Answered(uint64_t, const attnserve::Status&) override {}
};

struct Model {
  ModelLimits limits;
  std::string companion;  // a valid request for this model, serialized
};

Core* plane = nullptr;
std::vector<Model> models;

std::string Here() {
  std::vector<char> path(4096);
  const ssize_t n = readlink("/proc/self/exe", path.data(), path.size() - 1);
  std::string exe(path.data(), n > 0 ? static_cast<size_t>(n) : 0);
  return exe.substr(0, exe.rfind('/') + 1);
}

// One small valid request: (1, 2, query_dim) queries over (1, 3, kv_dim) keys, raw contents.
std::string Companion(const Contract& c, const ModelLimits& m) {
  inference::ModelInferRequest r;
  r.set_model_name(m.name);
  r.set_id("companion");
  const int64_t rows = 1, lq = 2, lk = 3;
  const std::pair<const std::string*, std::vector<int64_t>> inputs[3] = {
      {&c.query, {rows, lq, m.query_dim}}, {&c.key, {rows, lk, m.kv_dim}}, {&c.value, {rows, lk, m.kv_dim}}};
  for (const auto& [name, shape] : inputs) {
    auto* t = r.add_inputs();
    t->set_name(*name);
    t->set_datatype(c.fp32);
    for (int64_t d : shape) t->add_shape(d);
    r.add_raw_input_contents(std::string(static_cast<size_t>(shape[0] * shape[1] * shape[2]) * 4, '\0'));
  }
  return r.SerializeAsString();
}

void Load() {
  const std::string path = Here() + "plane_models.txt";
  std::ifstream in(path);
  Contract c;
  if (!(in >> c.query >> c.key >> c.value >> c.mask >> c.output >> c.attn_probs >> c.fp32 >> c.boolean)) {
    std::fprintf(stderr, "plane_fuzzer: cannot read the contract from %s (make fuzz-native writes it)\n", path.c_str());
    std::exit(2);
  }
  plane = new Core(c);  // never freed: libFuzzer exits without running destructors in order
  ModelLimits m;
  while (in >> m.name >> m.version >> m.query_dim >> m.kv_dim >> m.out_dim >> m.num_heads >> m.max_batch_size >>
         m.max_q_len >> m.max_kv_len >> m.max_attention_bytes >> m.max_queue_size >> m.max_padding_ratio) {
    plane->AddModel(m);
    models.push_back({m, Companion(c, m)});
  }
  if (models.empty()) {
    std::fprintf(stderr, "plane_fuzzer: no models in %s\n", path.c_str());
    std::exit(2);
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  Load();
  // protobuf logs every string that is not UTF-8 as an error: silent here, after the core's bound handler.
  google::protobuf::SetLogHandler([](google::protobuf::LogLevel, const char*, int, const std::string&) {});
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // The core's own parse, of the input's bytes in two pieces (a front's message may come in several).
  const std::string_view whole(reinterpret_cast<const char*>(data), size);
  const attnserve::Chunks bytes = {whole.substr(0, size / 2), whole.substr(size / 2)};
  inference::ModelInferRequest request;
  std::string why;
  if (!plane->Parse(bytes, &request, &why)) return 0;
  // The companion first, so the fuzzed request (when it is admitted) joins or follows its batch.
  std::vector<std::unique_ptr<inference::ModelInferRequest>> requests;
  std::vector<std::unique_ptr<inference::ModelInferResponse>> responses;
  std::vector<std::unique_ptr<Call>> calls;
  for (const Model& model : models) {
    if (model.limits.name != request.model_name()) continue;
    requests.push_back(std::make_unique<inference::ModelInferRequest>());
    requests.back()->ParseFromString(model.companion);
    responses.push_back(std::make_unique<inference::ModelInferResponse>());
    calls.push_back(std::make_unique<Call>());
    plane->Submit(calls.back().get(), requests.back().get(), responses.back().get());
  }
  responses.push_back(std::make_unique<inference::ModelInferResponse>());
  calls.push_back(std::make_unique<Call>());
  plane->Submit(calls.back().get(), &request, responses.back().get());
  // Batch whatever was queued and answer it with zeros of the batch's shapes.
  for (size_t index = 0; index < models.size(); ++index) {
    const ModelLimits& m = models[index].limits;
    while (plane->Queued(index) > 0) {
      std::shared_ptr<attnserve::Batch> batch = plane->NextBatch(index, 0);
      if (!batch) break;
      std::vector<float> output(static_cast<size_t>(batch->rows * batch->q_len * m.out_dim));
      std::vector<float> probs(batch->want_probs ? static_cast<size_t>(batch->rows * m.num_heads * batch->q_len *
                                                                       batch->k_len)
                                                 : 0);
      plane->Complete(*batch, output.data(), batch->want_probs ? probs.data() : nullptr);
    }
  }
  // Each answer as it would be sent, alone and in a stream: the bytes its own serialization writes.
  auto bytes_of = [](const grpc::ByteBuffer& buffer) {
    std::vector<grpc::Slice> slices;
    if (!buffer.Dump(&slices).ok()) abort();
    std::string got;
    for (const grpc::Slice& slice : slices) got.append(reinterpret_cast<const char*>(slice.begin()), slice.size());
    return got;
  };
  for (const auto& response : responses) {
    inference::ModelStreamInferResponse streamed;
    *streamed.mutable_infer_response() = *response;
    inference::ModelInferResponse copy = *response;
    if (bytes_of(attnserve::EncodeStreamAnswer("", &copy)) != streamed.SerializeAsString()) abort();
    const std::string want = response->SerializeAsString();
    if (bytes_of(attnserve::EncodeAnswer(response.get())) != want) abort();
  }
  return 0;
}

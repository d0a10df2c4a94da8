// ONNX Runtime's C API driven as the native plane would drive it, for bench/ort_c (issue 26):
// sessions opened with the server's options (server/engine.py's session_options), each run over
// tensors that view caller-owned memory, outputs included, timed per call (wall and process CPU).
//
// One command a line on stdin, one answer a line on stdout ("ok ..." or "error <why>"):
//   open <case> <intra_op_threads> <model path>            a session for this case
//   input <case> <name> <float32|bool|int32> <file> <rank> <dims...>   raw bytes, read once
//   output <case> <name> <rank> <dims...>                  a float32 output, preallocated
//   time <case> <calls>     -> ok {"wall_ns": [...], "cpu_ns": [...]}
//   dump <case> <folder>    -> one run, each output's bytes to <folder>/<name>.bin
//   version                 -> ok <library version> <header API version>
//   quit
#include <onnxruntime_c_api.h>

#include <time.h>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

// Every OrtStatus becomes an exception here, so each command fails alone with ORT's message.
void Check(const OrtApi& api, OrtStatus* status) {
  if (status == nullptr) return;
  std::string message = api.GetErrorMessage(status);
  api.ReleaseStatus(status);
  throw std::runtime_error(message);
}

template <typename T>
struct Releaser {
  void (*release)(T*);
  void operator()(T* p) const {
    if (p != nullptr) release(p);
  }
};
template <typename T>
using Owned = std::unique_ptr<T, Releaser<T>>;

struct FreeBytes {
  void operator()(std::byte* p) const { std::free(p); }
};

// A tensor's bytes, owned by this program as the plane owns a batch's buffers.
struct Tensor {
  std::string name;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  std::vector<int64_t> shape;
  size_t bytes = 0;
  std::unique_ptr<std::byte, FreeBytes> data;
};

struct Case {
  Owned<OrtSession> session;
  std::vector<Tensor> inputs, outputs;
};

int64_t Nanos(clockid_t clock) {
  timespec t{};
  clock_gettime(clock, &t);
  return int64_t{t.tv_sec} * 1000000000 + t.tv_nsec;
}

size_t ElementSize(ONNXTensorElementDataType type) {
  switch (type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT:
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32:
      return 4;
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL:
      return 1;
    default:
      throw std::runtime_error("unsupported element type");
  }
}

ONNXTensorElementDataType TypeNamed(const std::string& name) {
  if (name == "float32") return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  if (name == "bool") return ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
  if (name == "int32") return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
  throw std::runtime_error("dtype must be float32, bool or int32, got " + name);
}

// 64-byte aligned, as ONNX Runtime aligns its own buffers (server/tensors.py's INTO_ALIGNMENT).
Tensor NewTensor(std::istringstream& words, std::string name, ONNXTensorElementDataType type) {
  Tensor t;
  t.name = std::move(name);
  t.type = type;
  size_t rank = 0;
  words >> rank;
  size_t count = 1;
  for (size_t i = 0; i < rank; ++i) {
    int64_t dim = -1;
    words >> dim;
    if (!words || dim < 0) throw std::runtime_error("bad shape for " + t.name);
    t.shape.push_back(dim);
    count *= static_cast<size_t>(dim);
  }
  t.bytes = count * ElementSize(type);
  size_t padded = (t.bytes + 63) / 64 * 64;
  t.data.reset(static_cast<std::byte*>(std::aligned_alloc(64, padded == 0 ? 64 : padded)));
  if (!t.data) throw std::runtime_error("out of memory for " + t.name);
  return t;
}

class Bench {
 public:
  explicit Bench(const OrtApi& api)
      : api_(api), env_(nullptr, {api.ReleaseEnv}), memory_(nullptr, {api.ReleaseMemoryInfo}) {
    OrtEnv* env = nullptr;
    Check(api_, api_.CreateEnv(ORT_LOGGING_LEVEL_WARNING, "ort_c_bench", &env));
    env_.reset(env);
    OrtMemoryInfo* memory = nullptr;
    Check(api_, api_.CreateCpuMemoryInfo(OrtDeviceAllocator, OrtMemTypeDefault, &memory));
    memory_.reset(memory);
  }

  std::string Handle(const std::string& line) {
    std::istringstream words(line);
    std::string command, id;
    words >> command;
    if (command == "version") {
      return std::string(OrtGetApiBase()->GetVersionString()) + " " + std::to_string(ORT_API_VERSION);
    }
    words >> id;
    if (command == "open") return Open(id, words);
    auto found = cases_.find(id);
    if (found == cases_.end()) throw std::runtime_error("no case " + id + " (open it first)");
    Case& c = found->second;
    if (command == "input") {
      std::string name, dtype, file;
      words >> name >> dtype >> file;
      Tensor t = NewTensor(words, name, TypeNamed(dtype));
      std::ifstream in(file, std::ios::binary);
      if (!in.read(reinterpret_cast<char*>(t.data.get()), static_cast<std::streamsize>(t.bytes))) {
        throw std::runtime_error("cannot read " + std::to_string(t.bytes) + " bytes from " + file);
      }
      c.inputs.push_back(std::move(t));
      return "";
    }
    if (command == "output") {
      std::string name;
      words >> name;
      c.outputs.push_back(NewTensor(words, name, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT));
      return "";
    }
    if (command == "time") return Time(c, words);
    if (command == "dump") {
      std::string folder;
      words >> folder;
      RunOnce(c);
      for (const Tensor& t : c.outputs) {
        std::ofstream out(folder + "/" + t.name + ".bin", std::ios::binary);
        out.write(reinterpret_cast<const char*>(t.data.get()), static_cast<std::streamsize>(t.bytes));
        if (!out) throw std::runtime_error("cannot write " + t.name + " into " + folder);
      }
      return "";
    }
    throw std::runtime_error("unknown command " + command);
  }

 private:
  // server/engine.py's session_options: all optimisations, sequential, one inter-op thread, no
  // spinning between runs, no CPU memory arena.
  std::string Open(const std::string& id, std::istringstream& words) {
    int threads = 0;
    words >> threads;
    std::string path;
    std::getline(words >> std::ws, path);
    Owned<OrtSessionOptions> options(nullptr, {api_.ReleaseSessionOptions});
    OrtSessionOptions* raw = nullptr;
    Check(api_, api_.CreateSessionOptions(&raw));
    options.reset(raw);
    Check(api_, api_.SetSessionGraphOptimizationLevel(raw, ORT_ENABLE_ALL));
    Check(api_, api_.SetIntraOpNumThreads(raw, threads));
    Check(api_, api_.SetInterOpNumThreads(raw, 1));
    Check(api_, api_.SetSessionExecutionMode(raw, ORT_SEQUENTIAL));
    Check(api_, api_.AddSessionConfigEntry(raw, "session.intra_op.allow_spinning", "0"));
    Check(api_, api_.DisableCpuMemArena(raw));
    OrtSession* session = nullptr;
    Check(api_, api_.CreateSession(env_.get(), path.c_str(), raw, &session));
    Case c{Owned<OrtSession>(session, {api_.ReleaseSession}), {}, {}};
    cases_.insert_or_assign(id, std::move(c));
    return "";
  }

  // What the plane would do per batch: a RunOptions (its stop switch) and OrtValues that view the
  // batch's buffers, made, run and released.
  void RunOnce(Case& c) {
    OrtRunOptions* raw_options = nullptr;
    Check(api_, api_.CreateRunOptions(&raw_options));
    Owned<OrtRunOptions> options(raw_options, {api_.ReleaseRunOptions});
    std::vector<Owned<OrtValue>> values;
    std::vector<const char*> names;
    std::vector<OrtValue*> inputs, outputs;
    for (auto* group : {&c.inputs, &c.outputs}) {
      for (Tensor& t : *group) {
        OrtValue* value = nullptr;
        Check(api_, api_.CreateTensorWithDataAsOrtValue(memory_.get(), t.data.get(), t.bytes, t.shape.data(),
                                                        t.shape.size(), t.type, &value));
        values.emplace_back(value, Releaser<OrtValue>{api_.ReleaseValue});
        (group == &c.inputs ? inputs : outputs).push_back(value);
        names.push_back(t.name.c_str());
      }
    }
    std::vector<const OrtValue*> const_inputs(inputs.begin(), inputs.end());
    Check(api_, api_.Run(c.session.get(), options.get(), names.data(), const_inputs.data(), inputs.size(),
                         names.data() + inputs.size(), outputs.size(), outputs.data()));
  }

  std::string Time(Case& c, std::istringstream& words) {
    int calls = 0;
    words >> calls;
    if (calls < 1) throw std::runtime_error("calls must be >= 1");
    std::ostringstream wall, cpu;
    for (int i = 0; i < calls; ++i) {
      int64_t wall0 = Nanos(CLOCK_MONOTONIC), cpu0 = Nanos(CLOCK_PROCESS_CPUTIME_ID);
      RunOnce(c);
      int64_t cpu1 = Nanos(CLOCK_PROCESS_CPUTIME_ID), wall1 = Nanos(CLOCK_MONOTONIC);
      wall << (i ? "," : "") << wall1 - wall0;
      cpu << (i ? "," : "") << cpu1 - cpu0;
    }
    return "{\"wall_ns\": [" + wall.str() + "], \"cpu_ns\": [" + cpu.str() + "]}";
  }

  const OrtApi& api_;
  Owned<OrtEnv> env_;
  Owned<OrtMemoryInfo> memory_;
  std::map<std::string, Case> cases_;
};

}  // namespace

int main() {
  const OrtApi* api = OrtGetApiBase()->GetApi(ORT_API_VERSION);
  if (api == nullptr) {
    std::cout << "error the library (" << OrtGetApiBase()->GetVersionString() << ") does not serve C API version "
              << ORT_API_VERSION << " (the headers are newer than it)" << std::endl;
    return 1;
  }
  Bench bench(*api);
  std::string line;
  while (std::getline(std::cin, line)) {
    if (line == "quit") break;
    try {
      std::string answer = bench.Handle(line);
      std::cout << "ok" << (answer.empty() ? "" : " ") << answer << std::endl;
    } catch (const std::exception& err) {
      std::cout << "error " << err.what() << std::endl;
    }
  }
  return 0;
}

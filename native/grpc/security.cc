// The native port's TLS, mutual TLS and bearer token, with the Python plane's rules
// (server/security.py): the same files, checked there first, and the same refusal.
// docs/native-data-plane.md, "TLS, tokens and workers".
#include <cctype>
#include <string_view>

#include <grpc/grpc_security.h>

#include "front.h"

namespace attnserve {

namespace {

// The core credentials, bound as they are: grpc++'s InsecureServerCredentials() takes no
// metadata processor, and a plaintext port with a token must still check it.
class CoreCredentials final : public grpc::ServerCredentials {
 public:
  explicit CoreCredentials(grpc_server_credentials* creds) : creds_(creds) {}
  ~CoreCredentials() override { grpc_server_credentials_release(creds_); }
  // The processor is set on the core credentials (TokenProcessor); nothing calls this.
  void SetAuthMetadataProcessor(const std::shared_ptr<grpc::AuthMetadataProcessor>&) override {}

 private:
  int AddPortToServer(const std::string& addr, grpc_server* server) override {
    return grpc_server_add_http2_port(server, addr.c_str(), creds_);
  }
  grpc_server_credentials* creds_;
};

std::string_view View(const grpc_slice& slice) {
  return {reinterpret_cast<const char*>(GRPC_SLICE_START_PTR(slice)), GRPC_SLICE_LENGTH(slice)};
}

// Python's bytes.strip(): ASCII whitespace.
std::string_view Strip(std::string_view text) {
  const char* space = " \t\n\r\x0b\x0c";
  const size_t first = text.find_first_not_of(space);
  if (first == std::string_view::npos) return {};
  return text.substr(first, text.find_last_not_of(space) - first + 1);
}

// hmac.compare_digest's promise: the time depends on the lengths, never on where bytes differ.
bool SameBytes(std::string_view given, std::string_view token) {
  unsigned char diff = given.size() == token.size() ? 0 : 1;
  for (size_t i = 0; i < token.size(); ++i) {
    const unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff |= static_cast<unsigned char>(g ^ static_cast<unsigned char>(token[i]));
  }
  return diff == 0;
}

// server.security.BearerToken.authorized: exactly one `authorization` value, "Bearer <token>"
// (the scheme in any case), compared in constant time even when the scheme is wrong.
bool AuthorizedValue(std::string_view value, int values, const std::string& token) {
  if (values != 1) return false;
  value = Strip(value);
  const size_t space = value.find(' ');
  std::string scheme(value.substr(0, space));
  const std::string_view credential = space == std::string_view::npos ? std::string_view() : Strip(value.substr(space + 1));
  const bool matches = SameBytes(credential, token);
  for (char& c : scheme) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return matches && scheme == "bearer";
}

bool Authorized(const grpc_metadata* md, size_t count, const std::string& token) {
  std::string_view value;
  int values = 0;
  for (size_t i = 0; i < count; ++i) {
    if (View(md[i].key) == "authorization") {
      value = View(md[i].value);
      values++;
    }
  }
  return AuthorizedValue(value, values, token);
}

// The plane's own inference methods, whose token GrpcFront::TokenAdmits checks when calls are recorded.
bool Deferred(std::string_view path) {
  return path == "/inference.GRPCInferenceService/ModelInfer" || path == "/inference.GRPCInferenceService/ModelStreamInfer";
}

// Runs per call on gRPC's thread as the headers arrive, before any handler or message read.
struct TokenProcessor {
  std::string token, refusal;
  Refusals* refusals;
  std::vector<std::string> open_prefixes;
  Records* records;  // the access log's (nullptr: not recorded)

  static void Process(void* state, grpc_auth_context*, const grpc_metadata* md, size_t count,
                      grpc_process_auth_metadata_done_cb done, void* user_data) {
    auto* self = static_cast<TokenProcessor*>(state);
    std::string_view path;
    for (size_t i = 0; i < count; ++i)
      if (View(md[i].key) == ":path") path = View(md[i].value);
    // Probes and reflection stay open, as on the Python plane (server.security.OPEN).
    bool open = false;
    for (const std::string& prefix : self->open_prefixes) open = open || path.rfind(prefix, 0) == 0;
    // Recorded calls to the plane's methods are checked by their handler, which knows the peer.
    if (open || (self->records != nullptr && Deferred(path)) || Authorized(md, count, self->token)) {
      done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_OK, nullptr);
      return;
    }
    self->refusals->Note(path);
    if (self->records != nullptr) {  // the Python gate's line: the method, no model, no span
      CallRecord r;
      r.traced = false;
      r.method = std::string(path.substr(path.rfind('/') == std::string_view::npos ? 0 : path.rfind('/') + 1, 256));
      r.code = GRPC_STATUS_UNAUTHENTICATED;
      r.details = self->refusal;
      r.start_ns = r.end_ns = self->records->EpochNs(std::chrono::steady_clock::now());
      self->records->Add(std::move(r));
    }
    done(user_data, nullptr, 0, nullptr, 0, GRPC_STATUS_UNAUTHENTICATED, self->refusal.c_str());
  }
  static void Destroy(void* state) { delete static_cast<TokenProcessor*>(state); }
};

}  // namespace

void Refusals::Note(std::string_view method) {
  std::lock_guard<std::mutex> lock(mu_);
  count_++;
  latest_.assign(method.substr(0, 256));  // a path is client text: bounded
}

std::pair<uint64_t, std::string> Refusals::Read() {
  std::lock_guard<std::mutex> lock(mu_);
  return {count_, latest_};
}

bool GrpcFront::TokenAdmits(const grpc::CallbackServerContext* context) const {
  std::string_view value;
  int values = 0;
  const auto& metadata = context->client_metadata();
  for (auto [it, end] = metadata.equal_range("authorization"); it != end; ++it) {
    value = std::string_view(it->second.data(), it->second.size());
    values++;
  }
  return AuthorizedValue(value, values, security_.token);
}

std::shared_ptr<grpc::ServerCredentials> GrpcFront::Credentials() {
  const Security& s = security_;
  grpc_server_credentials* creds = nullptr;
  if (s.cert_chain.empty()) {
    creds = grpc_insecure_server_credentials_create();
  } else {
    grpc_ssl_pem_key_cert_pair pair{s.private_key.c_str(), s.cert_chain.c_str()};
    creds = grpc_ssl_server_credentials_create_ex(
        s.client_ca.empty() ? nullptr : s.client_ca.c_str(), &pair, 1,
        s.client_ca.empty() ? GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE
                            : GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY,
        nullptr);
  }
  if (creds == nullptr) return nullptr;
  if (!s.token.empty()) {
    auto* processor = new TokenProcessor{s.token, s.refusal, &refusals_, s.open_prefixes, core_->records()};
    grpc_server_credentials_set_auth_metadata_processor(
        creds, {&TokenProcessor::Process, &TokenProcessor::Destroy, processor});
  }
  return std::make_shared<CoreCredentials>(creds);
}

}  // namespace attnserve

// Models and routes (core.h): the queues Python adds, the names it routes to them, the codes
// counted per name, and the per-model settings it pushes.
#include <algorithm>
#include <cctype>

#include "core.h"
#include "text.h"

namespace attnserve {

size_t Core::AddModel(const ModelLimits& limits) {
  auto queue = std::make_unique<Queue>();
  queue->limits = limits;
  std::unique_lock<std::shared_mutex> routes(routes_mu_);
  queue->codes = CodesOf(limits.name);
  size_t index;
  {
    std::unique_lock<std::shared_mutex> lock(models_mu_);
    models_.push_back(std::move(queue));
    index = models_.size() - 1;
  }
  Routing& route = routes_[limits.name];  // the name routes here until Python routes it (Route)
  if (route.versions.empty()) {
    route.codes = CodesOf(limits.name);
    int64_t number = 0;
    route.versions[std::all_of(limits.version.begin(), limits.version.end(), ::isdigit) && !limits.version.empty() &&
                           limits.version.size() < 18
                       ? (number = std::stoll(limits.version))
                       : 0] = index;
    route.not_loaded = " is not loaded (loaded: [" + limits.version + "])";
  }
  return index;
}

// -- model changes, pushed by Python (server.native's sync) ------------------------------------

Codes* Core::CodesOf(const std::string& name) {
  auto& codes = codes_[name];
  if (!codes) codes = std::make_unique<Codes>();
  return codes.get();
}

Core::Queue& Core::At(size_t index) const {
  std::shared_lock<std::shared_mutex> lock(models_mu_);
  return *models_.at(index);
}

void Core::Route(const std::string& name, const std::map<int64_t, size_t>& versions, int code,
                  const std::string& refusal, const std::string& not_loaded) {
  for (const auto& [version, index] : versions) At(index);  // each index exists (throws otherwise)
  std::unique_lock<std::shared_mutex> lock(routes_mu_);
  Routing& route = routes_[name];
  route.versions = versions;
  route.refusal = code == 0 ? Status::OK : Status(static_cast<StatusCode>(code), refusal);
  route.not_loaded = not_loaded;
  route.codes = CodesOf(name);
}

void Core::Unroute(const std::string& name) {
  std::unique_lock<std::shared_mutex> lock(routes_mu_);
  routes_.erase(name);
}

void Core::SetServing(const std::string& serving) {
  std::unique_lock<std::shared_mutex> lock(routes_mu_);
  serving_ = serving;
}

void Core::Retire(size_t index) {
  Queue& queue = At(index);
  {
    // An Admit that found this queue holds routes_mu_ until it has queued: taking it here waits for it.
    std::unique_lock<std::shared_mutex> routes(routes_mu_);
    std::lock_guard<std::mutex> lock(queue.mu);
    queue.retired = true;
  }
  queue.arrived.notify_all();
}

bool Core::Drained(size_t index) {
  Queue& queue = At(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  return queue.retired && queue.pending.empty();
}

Status Core::Find(const inference::ModelInferRequest& request, Queue** queue, Codes** codes) const {
  const std::string& name = request.model_name();
  auto found = routes_.find(name);
  if (found == routes_.end()) return Status(StatusCode::NOT_FOUND, "unknown model " + Quoted(name) + serving_);
  const Routing& route = found->second;
  *codes = route.codes;
  if (!route.refusal.ok()) return route.refusal;
  const std::string& version = request.model_version();
  auto served = route.versions.end();
  if (version.empty() && !route.versions.empty()) {
    served = std::prev(route.versions.end());  // the highest, as the registry's default
  } else if (!version.empty() && version.size() < 18 && std::all_of(version.begin(), version.end(), ::isdigit)) {
    served = route.versions.find(std::stoll(version));  // "01" is version 1, as int() reads it
  }
  if (served == route.versions.end()) {
    return Status(StatusCode::NOT_FOUND, "model " + name + " version " + Quoted(version) + route.not_loaded);
  }
  *queue = &At(served->second);
  return Status::OK;
}

std::map<std::string, std::array<uint64_t, kCodes>> Core::FinalCodesByName() const {
  std::map<std::string, std::array<uint64_t, kCodes>> out;
  std::shared_lock<std::shared_mutex> lock(routes_mu_);
  for (const auto& [name, codes] : codes_) {
    auto& counts = out[name];
    for (size_t i = 0; i < kCodes; ++i) counts[i] = (*codes)[i].load();
  }
  auto& unknown = out[""];  // no model has the name "" (a repository's names are directories)
  for (size_t i = 0; i < kCodes; ++i) unknown[i] += unknown_codes_[i].load();
  return out;
}

std::array<uint64_t, kCodes> Core::FinalCodes(size_t index) const {
  std::shared_lock<std::shared_mutex> lock(models_mu_);
  const Codes& codes = index < models_.size() ? *models_[index]->codes : unknown_codes_;
  std::array<uint64_t, kCodes> out{};
  for (size_t i = 0; i < kCodes; ++i) out[i] = codes[i].load();
  return out;
}

void Core::SetGraphs(size_t index, const ModelLimits::Graphs& graphs) {
  Queue& queue = *models_.at(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  queue.limits.graphs = graphs;
}

void Core::SetQueueDelay(size_t index, int64_t max_queue_delay_us) {
  Queue& queue = *models_.at(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  queue.limits.max_queue_delay_us = max_queue_delay_us;
}

void Core::SetSchedule(size_t index, const ModelLimits::Schedule& schedule) {
  Queue& queue = *models_.at(index);
  std::lock_guard<std::mutex> lock(queue.mu);
  queue.limits.schedule = schedule;
}

bool Core::Routable(const std::string& name) const {
  std::shared_lock<std::shared_mutex> lock(routes_mu_);
  auto found = routes_.find(name);
  return found != routes_.end() && found->second.refusal.ok() && !found->second.versions.empty();
}

}  // namespace attnserve

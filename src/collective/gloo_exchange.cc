#include "collective/gloo_exchange.h"

#include <chrono>
#include <exception>
#include <stdexcept>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gloo/allgatherv.h"
#include "gloo/rendezvous/context.h"
#include "gloo/rendezvous/prefix_store.h"
#include "gloo/rendezvous/store.h"
#include "gloo/transport/tcp/device.h"

namespace pathways::collective {
namespace {

std::chrono::milliseconds ToChrono(absl::Duration d) {
  return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
}

// Gloo's store interface over ours. Gloo reports failures by exception; so does this.
class GlooStore : public gloo::rendezvous::Store {
 public:
  GlooStore(KeyValueStore& store, absl::Duration timeout) : store_(store), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_.Set(key, std::string(data.begin(), data.end()));
    if (!s.ok()) throw std::runtime_error(s.ToString());
  }
  std::vector<char> get(const std::string& key) override {
    auto v = store_.Get(key, timeout_);
    if (!v.ok()) throw std::runtime_error(v.status().ToString());
    return std::vector<char>(v->begin(), v->end());
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, ToChrono(timeout_)); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const std::string& key : keys) {
      auto v = store_.Get(key, absl::Milliseconds(timeout.count()));
      if (!v.ok()) throw std::runtime_error(v.status().ToString());
    }
  }

 private:
  KeyValueStore& store_;
  const absl::Duration timeout_;
};

}  // namespace

struct GlooExchange::Connection {
  explicit Connection(int64_t generation) : generation(generation) {}
  const int64_t generation;
  absl::Mutex mu;  // one call at a time on the context
  std::shared_ptr<gloo::rendezvous::Context> context;
};

absl::StatusOr<std::unique_ptr<GlooExchange>> GlooExchange::Create(const std::string& ip,
                                                                   std::shared_ptr<KeyValueStore> store) {
  try {
    gloo::transport::tcp::attr attr(ip.c_str());
    auto device = gloo::transport::tcp::CreateDevice(attr);
    return std::unique_ptr<GlooExchange>(new GlooExchange(std::move(device), std::move(store)));
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot open a Gloo device on ", ip, ": ", e.what()));
  }
}

GlooExchange::GlooExchange(std::shared_ptr<gloo::transport::Device> device, std::shared_ptr<KeyValueStore> store)
    : device_(std::move(device)), store_(std::move(store)) {}

GlooExchange::~GlooExchange() {
  absl::MutexLock lock(&mu_);
  connections_.clear();  // contexts before the device they use
}

absl::StatusOr<std::shared_ptr<GlooExchange::Connection>> GlooExchange::ConnectionFor(
    const std::vector<std::string>& hosts, int mine, const std::string& member_key, absl::Duration timeout) {
  std::shared_ptr<Connection> connection;
  {
    absl::MutexLock lock(&mu_);
    std::shared_ptr<Connection>& slot = connections_[member_key];
    if (slot == nullptr) slot = std::make_shared<Connection>(generations_[member_key]);
    connection = slot;
  }
  // The first caller connects while holding the connection's lock; later ones wait for it.
  absl::MutexLock lock(&connection->mu);
  if (connection->context != nullptr) return connection;
  try {
    auto context = std::make_shared<gloo::rendezvous::Context>(mine, static_cast<int>(hosts.size()));
    context->setTimeout(ToChrono(timeout));
    GlooStore store(*store_, timeout);
    gloo::rendezvous::PrefixStore prefixed(absl::StrCat("gloo/", member_key, "/", connection->generation), store);
    context->connectFullMesh(prefixed, device_);
    connection->context = std::move(context);
  } catch (const std::exception& e) {
    return absl::UnavailableError(absl::StrCat("cannot connect hosts [", absl::StrJoin(hosts, ", "),
                                               "] for collectives: ", e.what()));
  }
  return connection;
}

absl::StatusOr<std::vector<std::string>> GlooExchange::AllGather(const std::vector<std::string>& hosts, int mine,
                                                                 const std::string& member_key, uint32_t tag,
                                                                 const std::string& local, absl::Duration timeout) {
  std::vector<std::string> result;
  auto connection = ConnectionFor(hosts, mine, member_key, timeout);
  if (!connection.ok()) {
    Discard(member_key, nullptr);
    return connection.status();
  }
  absl::Status status = AllGatherOn(**connection, hosts, tag, local, timeout, result);
  if (!status.ok()) {
    Discard(member_key, *connection);
    return status;
  }
  return result;
}

void GlooExchange::Discard(const std::string& member_key, const std::shared_ptr<Connection>& connection) {
  absl::MutexLock lock(&mu_);
  auto it = connections_.find(member_key);
  if (it == connections_.end() || (connection != nullptr && it->second != connection)) return;
  connections_.erase(it);
  ++generations_[member_key];
}

absl::Status GlooExchange::AllGatherOn(Connection& connection, const std::vector<std::string>& hosts, uint32_t tag,
                                       const std::string& local, absl::Duration timeout,
                                       std::vector<std::string>& result) {
  absl::MutexLock lock(&connection.mu);
  // Sizes first: hosts may hold different numbers of members.
  std::vector<int64_t> sizes(hosts.size());
  result.assign(hosts.size(), std::string());
  try {
    int64_t my_size = static_cast<int64_t>(local.size());
    gloo::AllgathervOptions size_opts(connection.context);
    size_opts.setInput(&my_size, 1);
    size_opts.setOutput(sizes.data(), std::vector<size_t>(hosts.size(), 1));
    size_opts.setTag(tag);
    size_opts.setTimeout(ToChrono(timeout));
    gloo::allgatherv(size_opts);
    std::vector<size_t> counts;
    size_t total = 0;
    for (int64_t s : sizes) {
      counts.push_back(static_cast<size_t>(s));
      total += static_cast<size_t>(s);
    }
    std::string all(total, '\0');
    gloo::AllgathervOptions opts(connection.context);
    opts.setInput(const_cast<char*>(local.data()), local.size());
    opts.setOutput(all.data(), counts);
    opts.setTag(tag + 1);
    opts.setTimeout(ToChrono(timeout));
    gloo::allgatherv(opts);
    size_t offset = 0;
    for (size_t h = 0; h < hosts.size(); ++h) {
      result[h] = all.substr(offset, counts[h]);
      offset += counts[h];
    }
  } catch (const std::exception& e) {
    std::string message = absl::StrCat("exchange with hosts [", absl::StrJoin(hosts, ", "), "] failed: ", e.what());
    if (absl::StrContains(e.what(), "Timed out")) return absl::DeadlineExceededError(message);
    return absl::UnavailableError(message);
  }
  return absl::OkStatus();
}

}  // namespace pathways::collective

// `pathways`: one binary, with subcommands for the controller, a worker, cluster status and the
// demo.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "controller/controller.h"
#include "core/executor.h"
#include "core/logging.h"
#include "core/process.h"
#include "core/status_macros.h"
#include "ops/status_http_server.h"
#include "tools/demo.h"
#include "tools/flags.h"
#include "tools/tenant.h"
#include "tools/train.h"
#include "transport/auth.h"
#include "transport/controller_client.h"
#include "worker/worker.h"

namespace pathways {
namespace {

// How long a serving process may take to shut down before it exits without finishing.
constexpr absl::Duration kShutdownDeadline = absl::Seconds(60);
// The same for a worker that left because the cluster went on without it (it was silent past
// the heartbeat timeout): its runs failed already, so the work still on its devices is of no use
// to anyone, and a supervisor restarts it sooner.
constexpr absl::Duration kLeftShutdownDeadline = absl::Seconds(5);

constexpr char kUsage[] =
    "usage: pathways <command> [flags]\n"
    "  controller --listen HOST:PORT [--heartbeat-timeout-ms N] [--port-file FILE]\n"
    "             [--client-timeout-ms N] [--scheduler fifo|share] [--share-window-us N] [--token T]\n"
    "             [--cluster-token C] [--tenants FILE] (lines 'NAME TOKEN': a token per tenant)\n"
    "             [--max-client-weight W] [--max-connections N]\n"
    "             [--http-port N] (dashboard, /api/status and /metrics over HTTP, the token's guard; 0 any port)\n"
    "             [--stream-port N] (hosts' dataflow and clients' schedule streams over plain TCP; default any)\n"
    "  worker --controller HOST:PORT [--island N] [--devices N] [--device-memory SIZE]\n"
    "         [--listen HOST:PORT] [--intra-op-threads N] [--collective-timeout-ms N]\n"
    "         [--computation-timeout-ms N] (a computation longer is asked to stop, at a loop's next\n"
    "         turn, and its client refused; one that does not stop is stuck: the worker leaves;\n"
    "         0 never; default 600000)\n"
    "         [--peer-stall-timeout-ms N] (a host that takes none of this one's dataflow batches this\n"
    "         long is named to the controller, which makes one of the two leave; 0 never; default 15000)\n"
    "         [--memory-wait-ms N] [--token T] [--cluster-token C] [--tenants FILE] [--dcn-latency-us N]\n"
    "         [--dcn-gbps G]\n"
    "         [--data-dir DIR] [--checkpoint-dir DIR]  (where compiled functions may read training data\n"
    "         and keep checkpoint shards; neither by default) [--max-connections N]\n"
    "         [--device-kind cpu|sim] [--sim-cost-us NAME=US,...,*=US] (simulated devices: kernels take\n"
    "         modelled durations, default 100 us) [--hosts N] (hosts in this process; --listen port 0)\n"
    "         [--function-ops vetted|public] (the ops tenants' functions may call: the vetted ones by\n"
    "         default; every public op only where tenants trust each other)\n"
    "         [--data-port N] [--link-port N] (fixed ports for clients' puts and fetches and for other\n"
    "         hosts' collectives and blocks; default any free port)\n"
    "         [--compiled-memory SIZE] (what the functions compiled on this worker may keep in all:\n"
    "         graphs and constants folded from sources; past it a compile fails; default 2GiB)\n"
    "         [--compiled-memory-per-client SIZE] (what one client's functions may keep of it, or\n"
    "         one named tenant's clients' together; they go when the client does; default 512MiB)\n"
    "  status --controller HOST:PORT [--token T] [--json] (with the devices' work of the last 10 s)\n"
    "  demo [--islands N] [--hosts N] [--devices N] [--print-ir] [--trace FILE]\n"
    "  tenant --controller HOST:PORT [--devices N] [--runs N] [--value V] [--weight W] [--trace FILE]\n"
    "         [--token T] [--span-islands] [--wait-for-go] (starts its runs on a line on stdin)\n"
    "  train [--controller HOST:PORT] [--model tiny|small|medium|large] [--steps N] [--batch N]\n"
    "        [--seq-len N] [--vocab N] [--data-parallel D] [--tensor-parallel T] [--pipeline-stages S]\n"
    "        [--microbatches M] [--islands I] [--seed N] [--data markov] [--learning-rate LR]\n"
    "        [--trace FILE] [--metrics-jsonl FILE] [--device-memory SIZE] [--dcn-latency-us N]\n"
    "        [--dcn-gbps G] [--save MANIFEST [--save-every N]] [--resume MANIFEST] [--token T]\n"
    "        [--recompute] (pipeline stages recompute their forward pass instead of keeping residuals)\n"
    "Every command takes [--log-level debug|info|warning|error] (default info, or PATHWAYS_LOG_LEVEL).\n"
    "Every --token defaults to the environment variable PATHWAYS_TOKEN; without either, no token.\n"
    "Tenants show the token; the controller and workers show each other the cluster token\n"
    "(--cluster-token, else PATHWAYS_CLUSTER_TOKEN, else the token), so tenants cannot act as hosts.\n"
    "Controller and worker take [--tls-cert PEM --tls-key PEM] [--tls-ca PEM], status and tenant\n"
    "[--tls-ca PEM] (defaults PATHWAYS_TLS_CERT, _KEY, _CA): TLS on every connection.\n"
    "--max-connections caps the connections each of a server's listening ports holds (default: a quarter of\n"
    "the descriptor limit, at most 65536); one beyond is closed at once, until others close.\n";

// Serving commands stop on SIGINT or SIGTERM through a handler that writes to a pipe the main
// thread waits on. The threads the process makes once it serves block both signals, so the main
// thread, waiting in poll(), takes them: a thread parked in a futex wait would hold one back under
// ThreadSanitizer, which runs a handler only when its thread next enters the sanitizer's runtime
// (the controller and workers of `make sanitize-thread` never stopped). Threads a library started
// before main are not covered by the mask, so the handler stays the way the signal arrives: a
// signal landing on one of those without it ended the process without a shutdown (seen as
// "killed by signal 15" in tests).
int stop_pipe[2] = {-1, -1};

void OnTerminationSignal(int sig) {
  const char c = static_cast<char>(sig);
  (void)!write(stop_pipe[1], &c, 1);  // async-signal-safe
}

// Before the process makes its serving threads: they inherit the calling thread's mask.
void CatchTerminationSignals() {
  if (pipe2(stop_pipe, O_CLOEXEC) != 0) return;
  struct sigaction action {};
  action.sa_handler = OnTerminationSignal;
  sigemptyset(&action.sa_mask);
  action.sa_flags = SA_RESTART;
  sigaction(SIGINT, &action, nullptr);
  sigaction(SIGTERM, &action, nullptr);
  const sigset_t set = TerminationSignals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

// Ends WaitForTerminationSignal from within the process (a worker told to leave says why itself).
void StopWaiting() {
  const char c = 0;
  (void)!write(stop_pipe[1], &c, 1);
}

// Blocks until SIGINT or SIGTERM came (one that came earlier is taken now), or StopWaiting was
// called.
void WaitForTerminationSignal() {
  const sigset_t set = TerminationSignals();
  pthread_sigmask(SIG_UNBLOCK, &set, nullptr);
  if (stop_pipe[0] < 0) return;  // no pipe (CatchTerminationSignals failed): nothing to wait on
  char sig = 0;
  pollfd stop{.fd = stop_pipe[0], .events = POLLIN, .revents = 0};
  // Polled with a timeout, not read until it comes: ThreadSanitizer holds a signal that arrives
  // during a read() until the thread's next call into its runtime, which each poll() makes.
  while (poll(&stop, 1, /*timeout_ms=*/1000) <= 0 || read(stop_pipe[0], &sig, 1) != 1) {
  }
  if (sig != 0) std::fprintf(stderr, "pathways: received signal %d, shutting down\n", sig);
}

// --max-connections, for the serving commands.
absl::Status ApplyConnectionCap(const Flags& flags) {
  if (!flags.Has("max-connections")) return absl::OkStatus();
  PW_ASSIGN_OR_RETURN(int64_t max, flags.GetInt("max-connections", 0));
  absl::Status set = SetConnectionsPerListener(max);
  if (!set.ok()) return absl::InvalidArgumentError(absl::StrCat("--max-connections: ", set.message()));
  return absl::OkStatus();
}

absl::Status RunController(const Flags& flags) {
  PW_RETURN_IF_ERROR(ApplyConnectionCap(flags));
  CatchTerminationSignals();
  ControllerOptions options;
  PW_ASSIGN_OR_RETURN(options.listen_address, flags.GetAddress("listen", "127.0.0.1:7000", true));
  // A port file that cannot be written fails now, before anything listens.
  if (flags.Has("port-file")) {
    const std::string tmp = flags.Get("port-file") + ".tmp";
    if (!std::ofstream(tmp)) {
      return absl::InvalidArgumentError(absl::StrCat("--port-file: cannot write ", tmp, ": ", std::strerror(errno)));
    }
    std::remove(tmp.c_str());
  }
  PW_ASSIGN_OR_RETURN(int64_t timeout_ms, flags.GetInt("heartbeat-timeout-ms", 3000));
  if (timeout_ms < 40) return absl::InvalidArgumentError("--heartbeat-timeout-ms must be at least 40");
  options.heartbeat_timeout = absl::Milliseconds(timeout_ms);
  PW_ASSIGN_OR_RETURN(int64_t client_timeout_ms, flags.GetInt("client-timeout-ms", 3000));
  if (client_timeout_ms < 40) return absl::InvalidArgumentError("--client-timeout-ms must be at least 40");
  options.client_timeout = absl::Milliseconds(client_timeout_ms);
  const std::string policy = flags.Get("scheduler", "fifo");
  if (policy == "share") {
    options.scheduler.policy = SchedulingPolicy::kProportionalShare;
  } else if (policy != "fifo") {
    return absl::InvalidArgumentError(absl::StrCat("--scheduler must be fifo or share, got '", policy, "'"));
  }
  PW_ASSIGN_OR_RETURN(int64_t window_us, flags.GetInt("share-window-us", 2000));
  if (window_us < 1 || window_us > 10'000'000) return absl::InvalidArgumentError("--share-window-us must be 1..1e7");
  options.scheduler.window = absl::Microseconds(window_us);
  PW_ASSIGN_OR_RETURN(int64_t max_weight, flags.GetInt("max-client-weight", 1'000'000));
  if (max_weight < 1 || max_weight > 1'000'000) return absl::InvalidArgumentError("--max-client-weight must be 1..1e6");
  options.scheduler.max_client_weight = static_cast<double>(max_weight);
  PW_ASSIGN_OR_RETURN(options.token, TokenFromFlagOrEnv(flags.Get("token")));
  PW_ASSIGN_OR_RETURN(options.cluster_token, ClusterTokenFromFlagOrEnv(flags.Get("cluster-token"), options.token));
  options.tenants_file = flags.Get("tenants");
  if (!options.token.empty() && options.cluster_token == options.token) {
    std::fprintf(stderr,
                 "pathways controller: warning: the cluster token is the tenants' token, so a tenant can pose as "
                 "a host (and reach other tenants' data through it); give the controller and workers "
                 "--cluster-token (or PATHWAYS_CLUSTER_TOKEN) to tell them apart\n");
  }
  if (flags.Has("stream-port")) {
    PW_ASSIGN_OR_RETURN(int64_t stream_port, flags.GetInt("stream-port", 0));
    if (stream_port < 0 || stream_port > 65535) return absl::InvalidArgumentError("--stream-port must be 0..65535");
    options.stream_port = static_cast<int>(stream_port);
  }
  if (flags.Has("http-port")) {
    PW_ASSIGN_OR_RETURN(int64_t http_port, flags.GetInt("http-port", 0));
    if (http_port < 0 || http_port > 65535) return absl::InvalidArgumentError("--http-port must be 0..65535");
    options.http_port = static_cast<int>(http_port);
  }
  // Undocumented, for the test that shows what the cross-island order prevents.
  options.TEST_unordered_islands = flags.Has("test-unordered-islands");
  SetCallToken(options.cluster_token);  // its own calls to workers
  Controller controller(options);
  PW_RETURN_IF_ERROR(controller.Start());
  std::printf("controller listening on %s\n", controller.address().c_str());
  if (controller.http_port() != 0) {
    const bool v6 = controller.http_ip().find(':') != std::string::npos;
    std::printf("dashboard at http://%s%s%s:%d/\n", v6 ? "[" : "", controller.http_ip().c_str(), v6 ? "]" : "",
                controller.http_port());
  }
  std::fflush(stdout);
  if (flags.Has("port-file")) {
    // Written to a temporary name and renamed, so a reader never sees a partial file.
    std::string tmp = flags.Get("port-file") + ".tmp";
    std::ofstream out(tmp);
    out << controller.address() << "\n";
    out.close();
    if (!out || std::rename(tmp.c_str(), flags.Get("port-file").c_str()) != 0) {
      return absl::UnavailableError(absl::StrCat("--port-file: cannot write ", flags.Get("port-file")));
    }
  }
  WaitForTerminationSignal();
  return absl::OkStatus();
}

absl::Status RunWorker(const Flags& flags) {
  PW_RETURN_IF_ERROR(ApplyConnectionCap(flags));
  CatchTerminationSignals();
  WorkerOptions options;
  if (!flags.Has("controller")) return absl::InvalidArgumentError("worker needs --controller HOST:PORT");
  PW_ASSIGN_OR_RETURN(options.controller_address, flags.GetAddress("controller", "", false));
  PW_ASSIGN_OR_RETURN(options.listen_address, flags.GetAddress("listen", "127.0.0.1:0", true));
  PW_ASSIGN_OR_RETURN(int64_t island, flags.GetInt("island", 0));
  PW_ASSIGN_OR_RETURN(int64_t devices, flags.GetInt("devices", 4));
  PW_ASSIGN_OR_RETURN(int64_t threads, flags.GetInt("intra-op-threads", 1));
  PW_ASSIGN_OR_RETURN(int64_t collective_ms, flags.GetInt("collective-timeout-ms", 30'000));
  if (collective_ms < 1) return absl::InvalidArgumentError("--collective-timeout-ms must be positive");
  options.collective_timeout = absl::Milliseconds(collective_ms);
  PW_ASSIGN_OR_RETURN(int64_t memory_wait_ms, flags.GetInt("memory-wait-ms", 10'000));
  if (memory_wait_ms < 0) return absl::InvalidArgumentError("--memory-wait-ms must not be negative");
  options.memory_wait = absl::Milliseconds(memory_wait_ms);
  PW_ASSIGN_OR_RETURN(int64_t computation_ms, flags.GetInt("computation-timeout-ms", 600'000));
  // A computation's time includes the memory and collective waits it makes: a limit within them
  // would call a device stuck that only waits for a slow peer.
  if (computation_ms != 0 && (computation_ms < 0 || computation_ms <= collective_ms + memory_wait_ms)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--computation-timeout-ms must be 0 (none) or more than --collective-timeout-ms plus --memory-wait-ms (",
        collective_ms + memory_wait_ms, "), got ", computation_ms));
  }
  options.computation_timeout = computation_ms == 0 ? absl::InfiniteDuration() : absl::Milliseconds(computation_ms);
  PW_ASSIGN_OR_RETURN(int64_t stall_ms, flags.GetInt("peer-stall-timeout-ms", 15'000));
  if (stall_ms < 0 || stall_ms > 86'400'000) {
    return absl::InvalidArgumentError(
        absl::StrCat("--peer-stall-timeout-ms must be 0 (never) to 86400000 (a day), got ", stall_ms));
  }
  options.peer_stall_timeout = stall_ms == 0 ? absl::InfiniteDuration() : absl::Milliseconds(stall_ms);
  PW_ASSIGN_OR_RETURN(options.device_memory_bytes, flags.GetBytes("device-memory", int64_t{1} << 30));
  PW_ASSIGN_OR_RETURN(options.compiled_memory_bytes, flags.GetBytes("compiled-memory", FunctionCache::kDefaultLimit));
  if (options.compiled_memory_bytes <= 0) return absl::InvalidArgumentError("--compiled-memory must be positive");
  PW_ASSIGN_OR_RETURN(options.compiled_memory_per_client_bytes,
                      flags.GetBytes("compiled-memory-per-client", FunctionCache::kDefaultAccountLimit));
  if (options.compiled_memory_per_client_bytes <= 0) {
    return absl::InvalidArgumentError("--compiled-memory-per-client must be positive");
  }
  if (island < 0 || island > 1 << 20) return absl::InvalidArgumentError("--island must be non-negative");
  if (threads < 1 || threads > 256) return absl::InvalidArgumentError("--intra-op-threads must be 1..256");
  options.island = static_cast<int>(island);
  options.num_devices = static_cast<int>(std::min<int64_t>(devices, 1 << 20));
  options.intra_op_threads = static_cast<int>(threads);
  PW_ASSIGN_OR_RETURN(int64_t dcn_latency_us, flags.GetInt("dcn-latency-us", 0));
  if (dcn_latency_us < 0 || dcn_latency_us > 10'000'000) {
    return absl::InvalidArgumentError("--dcn-latency-us must be between 0 and 10000000");
  }
  options.dcn.latency = absl::Microseconds(dcn_latency_us);
  if (flags.Has("data-dir")) options.data_directories.push_back(flags.Get("data-dir"));
  options.checkpoint_directory = flags.Get("checkpoint-dir");
  const std::string gbps = flags.Get("dcn-gbps", "0");
  if (!absl::SimpleAtod(gbps, &options.dcn.gbps) || !(options.dcn.gbps >= 0) || options.dcn.gbps > 1e6) {
    return absl::InvalidArgumentError(absl::StrCat("--dcn-gbps must be a number from 0 (unlimited) to 1e6, got '",
                                                   gbps, "'"));
  }
  PW_ASSIGN_OR_RETURN(FunctionOps function_ops, ParseFunctionOps(flags.Get("function-ops", "vetted")));
  PW_ASSIGN_OR_RETURN(options.backend,
                      DeviceBackend::Create(flags.Get("device-kind", "cpu"), flags.Get("sim-cost-us"), function_ops));
  PW_ASSIGN_OR_RETURN(int64_t hosts, flags.GetInt("hosts", 1));
  if (hosts < 1 || hosts > 4096) return absl::InvalidArgumentError("--hosts must be between 1 and 4096");
  if (hosts > 1 && !absl::EndsWith(options.listen_address, ":0")) {
    return absl::InvalidArgumentError("--hosts above 1 needs a --listen address with port 0 (each host takes its own)");
  }
  for (auto [flag, port] : {std::pair{"data-port", &options.data_port}, std::pair{"link-port", &options.links_port}}) {
    PW_ASSIGN_OR_RETURN(int64_t value, flags.GetInt(flag, 0));
    if (value < 0 || value > 65535) return absl::InvalidArgumentError(absl::StrCat("--", flag, " must be in 0..65535"));
    if (value != 0 && hosts > 1) {
      return absl::InvalidArgumentError(absl::StrCat("--", flag, " with --hosts above 1: the hosts cannot share a port"));
    }
    *port = static_cast<int>(value);
  }
  PW_ASSIGN_OR_RETURN(options.token, TokenFromFlagOrEnv(flags.Get("token")));
  PW_ASSIGN_OR_RETURN(options.cluster_token, ClusterTokenFromFlagOrEnv(flags.Get("cluster-token"), options.token));
  options.tenants_file = flags.Get("tenants");
  SetCallToken(options.cluster_token);  // its own calls to the controller and to other workers
  // Told to leave: the main thread stops waiting, and the command exits with why.
  static absl::Mutex left_mu(absl::kConstInit);
  static absl::Status* left = new absl::Status();
  options.on_left = [](const absl::Status& why) {
    {
      absl::MutexLock lock(&left_mu);
      *left = why;
    }
    StopWaiting();
  };
  // Several hosts in one process (for scale runs on simulated devices): each has its own server,
  // port and registration; the process exits once every one of them was told to leave.
  static std::atomic<int64_t> hosts_left{0};
  options.on_left = [hosts, on_left = options.on_left](const absl::Status& why) {
    if (hosts_left.fetch_add(1) + 1 < hosts) {
      PW_LOG(Warning) << "a host of this worker process left: " << why;
      return;
    }
    on_left(why);
  };
  std::vector<std::unique_ptr<Worker>> workers;
  for (int64_t h = 0; h < hosts; ++h) {
    workers.push_back(std::make_unique<Worker>(options));
    PW_RETURN_IF_ERROR(workers.back()->Start());
    std::printf("worker %s serving %d %s devices for island %d, host %d\n", workers.back()->address().c_str(),
                options.num_devices, options.backend.kind(), options.island, workers.back()->host_id());
  }
  std::fflush(stdout);
  WaitForTerminationSignal();
  absl::MutexLock lock(&left_mu);
  for (const auto& w : workers) {
    if (!w->stuck()) continue;
    // Its stuck device thread cannot be stopped, so shutting down would wait for it forever.
    std::fprintf(stderr, "pathways: %s\n",
                 left->ok() ? "a device is stuck in a computation; the worker left" : left->ToString().c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
  // Shutting down finishes the work on the devices; one stuck in a computation that the worker
  // had not yet called stuck (it was stopped or expired first) would hold it for good.
  const absl::Duration deadline = left->ok() ? kShutdownDeadline : kLeftShutdownDeadline;
  std::thread([deadline] {
    NameThisThread("exit-deadline");
    absl::SleepFor(deadline);
    std::fprintf(stderr, "pathways: shutdown did not finish within %s (work still on the devices); exiting\n",
                 absl::FormatDuration(deadline).c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }).detach();
  return *left;
}

absl::Status RunStatus(const Flags& flags) {
  if (!flags.Has("controller")) return absl::InvalidArgumentError("status needs --controller HOST:PORT");
  PW_ASSIGN_OR_RETURN(std::string token, TokenFromFlagOrEnv(flags.Get("token")));
  SetCallToken(std::move(token));
  PW_ASSIGN_OR_RETURN(std::string address, flags.GetAddress("controller", "", false));
  ControllerClient controller(address);
  // As JSON, with the devices' work of the last seconds that the dashboard draws.
  PW_ASSIGN_OR_RETURN(rpc::ClusterStatus status,
                      controller.GetStatus(flags.Has("json") ? Controller::kDashboardTimeline : absl::ZeroDuration()));
  if (flags.Has("json")) {
    std::printf("%s\n", StatusJson(status).c_str());
    return absl::OkStatus();
  }
  std::map<int, std::vector<const rpc::HostStatus*>> islands;
  std::map<std::string, int64_t> client_micros;
  int64_t total_micros = 0;
  for (const auto& h : status.hosts()) {
    islands[h.island()].push_back(&h);
    for (const auto& d : h.devices()) {
      for (const auto& t : d.client_time()) {
        client_micros[t.client_id()] += t.busy_micros();
        total_micros += t.busy_micros();
      }
    }
  }
  std::printf("cluster at %s: %d islands, %d hosts\n", controller.address().c_str(),
              static_cast<int>(islands.size()), status.hosts_size());
  for (const auto& [island, hosts] : islands) {
    std::printf("island %d\n", island);
    for (const rpc::HostStatus* h : hosts) {
      std::printf("  host %d  %-21s %-5s heartbeat %lld ms ago\n", h->host_id(), h->address().c_str(),
                  h->alive() ? "alive" : "DEAD", static_cast<long long>(h->millis_since_heartbeat()));
      if (!h->left().empty()) std::printf("    left: %s\n", h->left().c_str());
      for (const auto& d : h->devices()) {
        std::printf("    device %-4d %s:%d  at (%s)  memory %lld / %lld bytes used (peak %lld)  ran %lld  busy %lld us\n",
                    d.device_id(), d.kind().c_str(), d.local_index(), absl::StrJoin(d.coords(), ",").c_str(),
                    static_cast<long long>(d.memory_used()), static_cast<long long>(d.memory_capacity()),
                    static_cast<long long>(d.memory_peak()),
                    static_cast<long long>(d.executed()), static_cast<long long>(d.busy_micros()));
      }
    }
  }
  for (const rpc::SchedulerStatus& sched : status.schedulers()) {
    std::printf("island %d scheduler (%s): %lld runs released in %lld rounds\n", sched.island(), sched.policy().c_str(),
                static_cast<long long>(sched.released_runs()), static_cast<long long>(sched.rounds()));
    for (const rpc::SchedulerClientStatus& c : sched.clients()) {
      std::printf("  client %s%s%s  weight %g  queued %lld  released %lld\n", c.client_id().c_str(),
                  c.tenant().empty() ? "" : " of tenant ", c.tenant().c_str(), c.weight(),
                  static_cast<long long>(c.queued_runs()), static_cast<long long>(c.released_runs()));
    }
  }
  for (const std::string& refused : status.refused_tenants()) std::printf("tenant refused: %s\n", refused.c_str());
  for (const rpc::SliceStatus& slice : status.slices()) {
    std::printf("slice %lld of client %s: mesh %s %s, devices %s\n", static_cast<long long>(slice.slice_id()),
                slice.client_id().c_str(), absl::StrJoin(slice.mesh_shape(), "x").c_str(), slice.device_kind().c_str(),
                absl::StrJoin(slice.device_ids(), " ").c_str());
  }
  if (!client_micros.empty()) {
    std::printf("clients (device time since the workers started, as of their last heartbeats)\n");
    for (const auto& [client, micros] : client_micros) {
      std::printf("  client %s  %lld us  %.1f%%\n", client.c_str(), static_cast<long long>(micros),
                  total_micros > 0 ? 100.0 * static_cast<double>(micros) / static_cast<double>(total_micros) : 0.0);
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) {
  using namespace pathways;
  InitServingProcess();
  if (argc < 2 || std::string(argv[1]) == "help" || std::string(argv[1]) == "--help") {
    std::fputs(kUsage, argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string command = argv[1];
  struct Command {
    const char* name;
    std::vector<std::string> flags;
    std::vector<std::string> switches;
    absl::Status (*run)(const Flags&);
  };
  // A command to a line.
  // clang-format off
  const Command commands[] = {
      {"controller", {"listen", "heartbeat-timeout-ms", "client-timeout-ms", "port-file", "scheduler", "share-window-us", "max-client-weight", "max-connections", "token", "cluster-token", "tenants", "tls-cert", "tls-key", "tls-ca", "http-port", "stream-port"}, {"test-unordered-islands"}, RunController},
      {"worker", {"controller", "listen", "island", "devices", "device-memory", "intra-op-threads", "collective-timeout-ms", "computation-timeout-ms", "peer-stall-timeout-ms", "memory-wait-ms", "token", "cluster-token", "tenants", "tls-cert", "tls-key", "tls-ca", "dcn-latency-us", "dcn-gbps", "data-dir", "checkpoint-dir", "max-connections", "device-kind", "sim-cost-us", "function-ops", "hosts", "data-port", "link-port", "compiled-memory", "compiled-memory-per-client"}, {}, RunWorker},
      {"status", {"controller", "token", "tls-ca"}, {"json"}, RunStatus},
      {"demo", {"islands", "hosts", "devices", "trace"}, {"print-ir"}, RunDemo},
      {"tenant", {"controller", "devices", "runs", "value", "weight", "trace", "token", "tls-ca"}, {"span-islands", "wait-for-go"}, RunTenant},
      {"train", {"controller", "model", "steps", "batch", "seq-len", "vocab", "data-parallel", "tensor-parallel",
                 "pipeline-stages", "microbatches", "islands", "seed", "data", "learning-rate", "trace",
                 "metrics-jsonl", "device-memory", "dcn-latency-us", "dcn-gbps", "save", "save-every", "resume", "token",
                 "tls-ca"}, {"recompute"}, RunTrain},
  };
  // clang-format on
  for (const Command& c : commands) {
    if (command != c.name) continue;
    std::vector<std::string> known = c.flags;
    known.push_back("log-level");  // every command's
    auto flags = Flags::Parse(argc - 2, argv + 2, known, c.switches);
    absl::Status status = flags.status();
    if (status.ok()) status = flags->ApplyLogLevel();
    // TLS (flags, else PATHWAYS_TLS_*) before any channel or server is made.
    if (status.ok()) status = ConfigureTls({flags->Get("tls-cert"), flags->Get("tls-key"), flags->Get("tls-ca")});
    if (status.ok()) status = c.run(*flags);
    if (!status.ok()) {
      std::fprintf(stderr, "pathways %s: %s\n", c.name, std::string(status.message()).c_str());
      return 1;
    }
    return 0;
  }
  std::fprintf(stderr, "pathways: unknown command '%s'\n%s", command.c_str(), kUsage);
  return 2;
}

#include "tools/train.h"

#include <limits.h>
#include <stdlib.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <cmath>
#include <cstdio>
#include <deque>
#include <memory>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "cluster/local_cluster.h"
#include "core/progress.h"
#include "core/status_macros.h"
#include "train/trainer.h"
#include "transport/auth.h"

namespace pathways {
namespace {

absl::StatusOr<TrainOptions> OptionsFromFlags(const Flags& flags) {
  TrainOptions o;
  PW_ASSIGN_OR_RETURN(o.model, TransformerPreset(flags.Get("model", "tiny")));
  PW_ASSIGN_OR_RETURN(int64_t seq_len, flags.GetInt("seq-len", o.model.seq_len));
  PW_ASSIGN_OR_RETURN(int64_t vocab, flags.GetInt("vocab", o.model.vocab));
  PW_ASSIGN_OR_RETURN(o.batch, flags.GetInt("batch", 16));
  PW_ASSIGN_OR_RETURN(o.layout.data, flags.GetInt("data-parallel", 1));
  PW_ASSIGN_OR_RETURN(o.layout.tensor, flags.GetInt("tensor-parallel", 1));
  PW_ASSIGN_OR_RETURN(o.layout.stages, flags.GetInt("pipeline-stages", 1));
  PW_ASSIGN_OR_RETURN(o.microbatches, flags.GetInt("microbatches", 1));
  PW_ASSIGN_OR_RETURN(int64_t islands, flags.GetInt("islands", 1));
  PW_ASSIGN_OR_RETURN(int64_t seed, flags.GetInt("seed", 0));
  const std::string lr = flags.Get("learning-rate", "3e-3");
  char* end = nullptr;
  o.adam.learning_rate = std::strtod(lr.c_str(), &end);
  if (end == lr.c_str() || *end != '\0' || !(o.adam.learning_rate > 0) || o.adam.learning_rate > 1) {
    return absl::InvalidArgumentError(absl::StrCat("--learning-rate '", lr, "' is not a number in (0, 1]"));
  }
  if (seq_len < 1 || seq_len > 4096 || vocab < 2 || vocab > 4096 || islands < 1 || islands > 64 || seed < 0) {
    return absl::InvalidArgumentError(
        "need 1 <= --seq-len <= 4096, 2 <= --vocab <= 4096, 1 <= --islands <= 64 and --seed >= 0");
  }
  const std::string data = flags.Get("data", "markov");
  if (data != "markov") o.text_file = data;  // a path on the workers' hosts
  o.model.seq_len = seq_len;
  o.model.vocab = vocab;
  o.model.init_seed = static_cast<uint64_t>(seed);
  o.data_seed = static_cast<uint64_t>(seed) + 1;
  o.islands = static_cast<int>(islands);
  o.resume_from = flags.Get("resume");
  o.recompute = flags.Has("recompute");
  return o;
}

// Devices for an embedded cluster that fits the layout: islands of hosts of `tensor` devices
// each (a tensor-parallel group shares a host, as it would share a chip's interconnect).
LocalClusterOptions EmbeddedCluster(const TrainOptions& o, int64_t device_memory) {
  const int64_t devices = o.layout.data * o.layout.tensor * o.layout.stages;
  const int64_t per_island = (devices + o.islands - 1) / o.islands;
  const int64_t per_host = std::min<int64_t>(o.layout.tensor, per_island);
  LocalClusterOptions c;
  c.num_islands = o.islands;
  c.devices_per_host = static_cast<int>(per_host);
  c.hosts_per_island = static_cast<int>((per_island + per_host - 1) / per_host);
  c.device_memory_bytes = device_memory;
  return c;
}

// Opens `path` for appending, making it when it does not exist (O_EXCL: then `made` is set to
// it, and it is this run's to remove).
absl::StatusOr<std::FILE*> OpenMetrics(const std::string& path, std::string& made) {
  int fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  const bool created = fd >= 0;
  if (!created && errno == EEXIST) fd = ::open(path.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
  std::FILE* file = fd >= 0 ? ::fdopen(fd, "a") : nullptr;
  if (file == nullptr) {
    const int error = errno;
    if (fd >= 0) ::close(fd);
    if (created) ::unlink(path.c_str());
    return absl::InvalidArgumentError(absl::StrCat("--metrics-jsonl ", path, ": cannot write: ", std::strerror(error)));
  }
  if (created) made = path;
  return file;
}

}  // namespace

absl::Status RunTrain(const Flags& flags) {
  PW_RETURN_IF_ERROR(flags.CheckWritable("trace"));  // before the work, not after it
  PW_ASSIGN_OR_RETURN(TrainOptions options, OptionsFromFlags(flags));
  PW_ASSIGN_OR_RETURN(int64_t steps, flags.GetInt("steps", 200));
  PW_ASSIGN_OR_RETURN(int64_t device_memory, flags.GetBytes("device-memory", int64_t{1} << 30));
  PW_ASSIGN_OR_RETURN(int64_t dcn_latency_us, flags.GetInt("dcn-latency-us", 0));
  double dcn_gbps = 0;
  if (!absl::SimpleAtod(flags.Get("dcn-gbps", "0"), &dcn_gbps) || !(dcn_gbps >= 0) || dcn_gbps > 1e6 || steps < 1 ||
      steps > 100'000'000 || dcn_latency_us < 0 || dcn_latency_us > 10'000'000) {
    return absl::InvalidArgumentError(
        "need 1 <= --steps <= 1e8, 0 <= --dcn-latency-us <= 1e7 and --dcn-gbps from 0 (unlimited) to 1e6");
  }
  PW_ASSIGN_OR_RETURN(int64_t save_every, flags.GetInt("save-every", 0));
  const std::string save = flags.Get("save");
  if (save_every < 0 || (save_every > 0 && save.empty())) {
    return absl::InvalidArgumentError("--save-every N needs N >= 0 and --save PATH");
  }
  if (!save.empty()) {
    // Saving replaces the manifest, the only record of its checkpoint's secret: an existing one is
    // replaced only when this run resumes from it.
    struct stat st;
    if (::stat(save.c_str(), &st) == 0 && save != options.resume_from) {
      return absl::AlreadyExistsError(absl::StrCat("--save ", save, " holds a checkpoint already: resume from it (--resume ",
                                                   save, "), or save elsewhere"));
    }
  }
  // Bad input leaves nothing behind: a shards directory or metrics file this run made goes again
  // if the run fails before its first step. The metrics file is opened first (one that cannot be
  // written fails before anything is made), for appending, so that an existing one keeps what it
  // holds until the run begins; then a regular file is emptied (a pipe or /dev/stdout is not).
  std::string made_directory, made_metrics;
  absl::Cleanup remove_made_directory = [&made_directory] {
    if (!made_directory.empty()) ::rmdir(made_directory.c_str());  // only if still empty
  };
  std::FILE* metrics = nullptr;
  if (flags.Has("metrics-jsonl")) {
    PW_ASSIGN_OR_RETURN(metrics, OpenMetrics(flags.Get("metrics-jsonl"), made_metrics));
  }
  std::unique_ptr<std::FILE, int (*)(std::FILE*)> metrics_file(metrics, [](std::FILE* f) {
    return f == nullptr ? 0 : std::fclose(f);
  });
  absl::Cleanup remove_made_metrics = [&made_metrics] {
    if (!made_metrics.empty()) ::unlink(made_metrics.c_str());
  };
  std::unique_ptr<LocalCluster> cluster;
  std::unique_ptr<Client> client;
  if (flags.Has("controller")) {
    PW_ASSIGN_OR_RETURN(std::string token, TokenFromFlagOrEnv(flags.Get("token")));
    SetCallToken(std::move(token));
    PW_ASSIGN_OR_RETURN(std::string address, flags.GetAddress("controller", "", false));
    PW_ASSIGN_OR_RETURN(client, Client::Connect(address));
  } else {
    LocalClusterOptions c = EmbeddedCluster(options, device_memory);
    if (!options.text_file.empty()) {
      // The embedded workers may read data from the file's directory (and what lies under it).
      char resolved[PATH_MAX];
      if (realpath(options.text_file.c_str(), resolved) == nullptr) {
        return absl::InvalidArgumentError(absl::StrCat("--data ", options.text_file, ": ", std::strerror(errno)));
      }
      options.text_file = resolved;
      const size_t slash = options.text_file.rfind('/');
      c.data_directories.push_back(slash == 0 ? "/" : options.text_file.substr(0, slash));
    }
    // The embedded workers keep checkpoint shards beside the manifests, in pathways-shards/.
    std::string manifests;
    for (const std::string& path : {save, options.resume_from}) {
      if (path.empty()) continue;
      const size_t slash = path.rfind('/');
      const std::string dir = slash == std::string::npos ? "." : path.substr(0, slash + 1);
      if (!manifests.empty() && dir != manifests) {
        return absl::InvalidArgumentError("--save and --resume name manifests in different directories");
      }
      manifests = dir;
    }
    if (!manifests.empty()) {
      c.checkpoint_directory = absl::StrCat(manifests, "/pathways-shards");
      if (mkdir(c.checkpoint_directory.c_str(), 0700) == 0) {
        made_directory = c.checkpoint_directory;
      } else if (errno != EEXIST) {
        return absl::InvalidArgumentError(
            absl::StrCat("cannot make ", c.checkpoint_directory, ": ", std::strerror(errno)));
      }
    }
    c.dcn.latency = absl::Microseconds(dcn_latency_us);
    c.dcn.gbps = dcn_gbps;
    std::printf("embedded cluster: %d islands x %d hosts x %d devices\n", c.num_islands, c.hosts_per_island,
                c.devices_per_host);
    std::fflush(stdout);
    PW_ASSIGN_OR_RETURN(cluster, LocalCluster::Start(c));
    PW_ASSIGN_OR_RETURN(client, cluster->Connect());
  }
  const absl::Time start = absl::Now();
  PW_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer, Trainer::Create(*client, options));
  const TrainOptions& o = options;
  std::printf("model: %s\n", o.model.ToString().c_str());
  std::printf("layout: data %lld x tensor %lld x %lld stages, %lld microbatches, %d islands; batch %lld x %lld tokens\n",
              static_cast<long long>(o.layout.data), static_cast<long long>(o.layout.tensor),
              static_cast<long long>(o.layout.stages), static_cast<long long>(o.microbatches), o.islands,
              static_cast<long long>(o.batch), static_cast<long long>(o.model.seq_len));
  const bool known_entropy = !std::isnan(trainer->entropy());
  std::printf("step: one program of %zu calls, set up in %.1f s; data: %s\n", trainer->step_program().calls().size(),
              absl::ToDoubleSeconds(absl::Now() - start),
              known_entropy ? absl::StrFormat("Markov chain over %d tokens, entropy %.4f nats", o.model.vocab,
                                              trainer->entropy()).c_str()
                            : absl::StrCat("the bytes of ", o.text_file).c_str());
  std::fflush(stdout);

  // A save that cannot happen (workers without --checkpoint-dir, say) fails now, not after the run.
  if (!save.empty()) PW_RETURN_IF_ERROR(trainer->Save(save));
  struct stat metrics_stat;
  if (metrics != nullptr && ::fstat(::fileno(metrics), &metrics_stat) == 0 && S_ISREG(metrics_stat.st_mode) &&
      ::ftruncate(::fileno(metrics), 0) != 0) {
    return absl::InternalError(absl::StrCat("--metrics-jsonl ", flags.Get("metrics-jsonl"),
                                            ": cannot empty it: ", std::strerror(errno)));
  }
  made_directory.clear();  // the run has begun: what it made stays, whatever happens next
  made_metrics.clear();
  const int64_t first_step = trainer->steps_issued();
  if (first_step > 0) std::printf("resumed from %s after step %lld\n", o.resume_from.c_str(), static_cast<long long>(first_step));
  // Steps go out ahead of their losses: one step in flight while the previous one's loss is read.
  Progress progress("step", steps, stdout, Progress::OffTerminal::kPlainLines, first_step);
  std::deque<Future<double>> in_flight;
  double last_loss = 0, first_loss = 0, tail_sum = 0;
  const int64_t tail = std::max<int64_t>(1, steps / 10);  // the closing line's loss: the mean of the last 10%
  const absl::Time train_start = absl::Now();
  absl::Time last = train_start;
  int64_t done = 0;
  auto finish_oldest = [&]() -> absl::Status {
    PW_ASSIGN_OR_RETURN(last_loss, in_flight.front().Await());
    in_flight.pop_front();
    ++done;
    if (done == 1) first_loss = last_loss;
    if (done > steps - tail) tail_sum += last_loss;
    const absl::Time now = absl::Now();
    const double tokens_per_s = static_cast<double>(trainer->tokens_per_step()) / absl::ToDoubleSeconds(now - last);
    last = now;
    progress.Show(done, absl::StrFormat("loss %.4f  %.0f tokens/s", last_loss, tokens_per_s));
    if (metrics != nullptr) {
      std::fprintf(metrics, "{\"step\": %lld, \"loss\": %.6f, \"tokens_per_s\": %.1f, \"elapsed_s\": %.3f}\n",
                   static_cast<long long>(first_step + done), last_loss, tokens_per_s,
                   absl::ToDoubleSeconds(now - train_start));
    }
    return absl::OkStatus();
  };
  for (int64_t i = 0; i < steps; ++i) {
    if (in_flight.size() == 2) PW_RETURN_IF_ERROR(finish_oldest());
    PW_ASSIGN_OR_RETURN(Future<double> loss, trainer->Step());
    in_flight.push_back(loss);
    if (save_every > 0 && (i + 1) % save_every == 0 && i + 1 < steps) PW_RETURN_IF_ERROR(trainer->Save(save));
  }
  while (!in_flight.empty()) PW_RETURN_IF_ERROR(finish_oldest());
  if (!save.empty()) {
    PW_RETURN_IF_ERROR(trainer->Save(save));
    std::printf("saved a checkpoint after step %lld: %s\n", static_cast<long long>(trainer->steps_issued()),
                save.c_str());
  }
  const double seconds = absl::ToDoubleSeconds(absl::Now() - train_start);
  const double final_loss = tail_sum / static_cast<double>(tail);
  std::printf("trained %lld steps in %.1f s (%.0f tokens/s): loss %.4f at the first step, %.4f over the last %lld",
              static_cast<long long>(steps), seconds,
              static_cast<double>(steps * trainer->tokens_per_step()) / seconds, first_loss, final_loss,
              static_cast<long long>(tail));
  if (known_entropy) {
    std::printf(", against the data's entropy %.4f nats (%.1f%% above it; guessing uniformly gives %.4f)",
                trainer->entropy(), 100 * (final_loss / trainer->entropy() - 1),
                std::log(static_cast<double>(o.model.vocab)));
  }
  std::printf("\n");
  if (flags.Has("trace")) {
    PW_RETURN_IF_ERROR(client->WriteTrace(flags.Get("trace"), absl::Now() - absl::Seconds(2)));
    std::printf("trace of the last 2 s of device work: %s\n", flags.Get("trace").c_str());
  }
  return absl::OkStatus();
}

}  // namespace pathways

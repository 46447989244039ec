// The multi-controller training baseline (issue 14, the paper's Table 1 comparison): N processes,
// each driving its own devices through the same SPMD training step as Trainer (train/trainer.h)
// with one stage, with the same compiled functions (MakeStageFunctions, DataFunction) and the same
// collectives as this runtime's workers, and no controller, scheduler or client: every process
// runs the same program, as JAX multi-controller training does. Processes meet through a
// directory (bench::DirectoryStore).
//
//   multicontroller_train RANK RANKS DEVICES STORE_DIR LAYERS BATCH STEPS REPEATS [TENSOR]
//
// The model is Trainer's "small" preset with LAYERS layers over a mesh of RANKS x DEVICES
// devices, TENSOR-way tensor parallel (default 1) and data parallel over the rest (Trainer's
// ("d", "t") mesh, row-major over the processes' devices), a global batch of BATCH sequences in
// one microbatch, Adam with Trainer's defaults. A
// step draws its tokens on the devices, runs the loss and its gradients (with the gradient
// all_reduce) and Adam in place, as Trainer's step does. After two warm-up steps, rank 0 prints
// per repeat "tokens_per_s R" over STEPS steps and then "loss L": the last step's loss, which
// the runtime's Trainer, given the same options, reaches as well.
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "collective/collective.h"
#include "compute/executable.h"
#include "compute/function_cache.h"
#include "core/process.h"
#include "core/status_macros.h"
#include "device/cpu_device.h"
#include "peers/peer_process.h"
#include "train/trainer.h"

namespace pathways {
namespace {

// A function compiled for this process's devices, with what a call needs to place its outputs.
struct Local {
  std::shared_ptr<const Executable> exe;
  std::vector<TensorSpec> outputs;  // local shapes
  std::vector<int> donors;          // per output, the input whose buffer it takes, or -1
};

absl::StatusOr<Local> Prepare(FunctionCache& cache, const FunctionSpec& spec, const ParallelLayout& layout) {
  Local f;
  PW_ASSIGN_OR_RETURN(f.exe, cache.Compile(spec.body));
  for (size_t j = 0; j < spec.outputs.size(); ++j) {
    const PartitionSpec sharding = spec.out_shardings.empty() ? PartitionSpec{} : spec.out_shardings[j];
    f.outputs.push_back({spec.outputs[j].dtype, LocalShape(spec.outputs[j].shape, sharding, layout)});
  }
  f.donors = spec.OutputDonors();
  return f;
}

// One device's part of the step, run on its own thread.
class DeviceLoop {
 public:
  DeviceLoop(int local_index, int64_t shard, collective::CollectiveHub& hub,
             std::shared_ptr<const collective::GangLayout> layout)
      : device_(local_index, int64_t{1} << 30), shard_(shard), hub_(hub), layout_(std::move(layout)) {}

  // Runs `f` on `inputs`; donated inputs become the outputs that take them (updated in place).
  absl::StatusOr<std::vector<BufferPtr>> Call(const Local& f, const std::vector<BufferPtr>& inputs) {
    std::vector<BufferPtr> outputs;
    for (size_t j = 0; j < f.outputs.size(); ++j) {
      if (f.donors[j] >= 0) {
        outputs.push_back(inputs[f.donors[j]]);
      } else {
        PW_ASSIGN_OR_RETURN(BufferPtr b, device_.Allocate(f.outputs[j].dtype, f.outputs[j].shape));
        outputs.push_back(std::move(b));
      }
    }
    std::vector<const DeviceBuffer*> in;
    for (const BufferPtr& b : inputs) in.push_back(b.get());
    std::vector<DeviceBuffer*> out;
    for (const BufferPtr& b : outputs) out.push_back(b.get());
    // Every process makes the same calls in the same order, so a call's number names it in every
    // process's collectives, as a run's id does in the runtime's.
    collective::ShardCollectives collectives(hub_, layout_, {&kClient, 0, calls_++, 0}, shard_);
    collective::ScopedShardCollectives scope(&collectives);
    PW_RETURN_IF_ERROR(f.exe->Run(in, out));
    return outputs;
  }

  CpuDevice& device() { return device_; }

 private:
  static inline const std::string kClient = "multi-controller";
  CpuDevice device_;
  const int64_t shard_;
  collective::CollectiveHub& hub_;
  const std::shared_ptr<const collective::GangLayout> layout_;
  int64_t calls_ = 0;
};

int Main(int argc, char** argv) {
  InitServingProcess();
  int rank = 0, ranks = 0, devices = 0, steps = 0, repeats = 0;
  int64_t layers = 0, batch = 0, tensor = 1;
  if ((argc != 9 && argc != 10) || (argc == 10 && !absl::SimpleAtoi(argv[9], &tensor)) ||
      !absl::SimpleAtoi(argv[1], &rank) || !absl::SimpleAtoi(argv[2], &ranks) || !absl::SimpleAtoi(argv[3], &devices) ||
      !absl::SimpleAtoi(argv[5], &layers) || !absl::SimpleAtoi(argv[6], &batch) || !absl::SimpleAtoi(argv[7], &steps) ||
      !absl::SimpleAtoi(argv[8], &repeats) || ranks < 1 || rank < 0 || rank >= ranks || devices < 1 || layers < 1 ||
      batch < 1 || steps < 1 || repeats < 1 || tensor < 1 || (static_cast<int64_t>(ranks) * devices) % tensor != 0) {
    std::fprintf(stderr,
                 "usage: multicontroller_train RANK RANKS DEVICES STORE_DIR LAYERS BATCH STEPS REPEATS [TENSOR]\n"
                 "(TENSOR must divide RANKS x DEVICES)\n");
    return 2;
  }
  auto fail = [rank](const absl::Status& s) {
    std::fprintf(stderr, "multicontroller_train %d: %s\n", rank, s.ToString().c_str());
    return 1;
  };
  ConfigureComputeThreads(1);  // as workers do: one thread per device, and the caching allocator

  TrainOptions options;  // Trainer's defaults, as train_bench gives them
  auto preset = TransformerPreset("small");
  if (!preset.ok()) return fail(preset.status());
  options.model = *preset;
  options.model.layers = layers;
  options.batch = batch;
  options.layout = {.data = static_cast<int64_t>(ranks) * devices / tensor, .tensor = tensor, .stages = 1};
  if (batch % options.layout.data != 0) {
    return fail(absl::InvalidArgumentError(
        absl::StrCat("a batch of ", batch, " does not split over ", options.layout.data, " devices")));
  }
  auto model = BuildTransformer(options.model, options.layout, options.batch);
  if (!model.ok()) return fail(model.status());
  const TransformerStage& stage = model->stages[0];
  auto specs = MakeStageFunctions(options, stage);
  if (!specs.ok()) return fail(specs.status());
  FunctionCache cache;
  auto init = Prepare(cache, specs->init, options.layout);
  auto vjp = Prepare(cache, *specs->vjp, options.layout);
  auto adam = Prepare(cache, specs->adam, options.layout);
  auto data_spec = DataFunction(options, *model, 0);
  if (!data_spec.ok()) return fail(data_spec.status());
  auto data = Prepare(cache, *data_spec, options.layout);
  for (const auto* f : {&init, &vjp, &adam, &data}) {
    if (!f->ok()) return fail(f->status());
  }

  auto connected = bench::ConnectPeerHub(rank, argv[4]);
  if (!connected.ok()) return fail(connected.status());
  collective::CollectiveHub& hub = **connected;
  // The mesh ("d", "t") of Trainer's slice.
  auto shared_layout = bench::RankMajorLayout({options.layout.data, options.layout.tensor}, {"d", "t"}, ranks, devices);

  const size_t n = stage.params.size();
  std::vector<double> seconds(repeats);
  std::vector<float> losses(repeats);
  absl::Status failure;
  absl::Mutex failure_mu;
  std::vector<std::thread> threads;
  for (int d = 0; d < devices; ++d) {
    threads.emplace_back([&, d] {
      DeviceLoop loop(d, static_cast<int64_t>(rank) * devices + d, hub, shared_layout);
      auto run = [&]() -> absl::Status {
        // State: params..., m..., v..., count, as init makes it and Adam updates it.
        PW_ASSIGN_OR_RETURN(std::vector<BufferPtr> state, loop.Call(*init, {}));
        PW_ASSIGN_OR_RETURN(BufferPtr cotangent, loop.device().Allocate(DType::kF32, {}));
        *reinterpret_cast<float*>(cotangent->data()) = 1.0f;  // one microbatch
        float loss = 0;
        auto step = [&]() -> absl::Status {
          const BufferPtr& count = state[3 * n];
          PW_ASSIGN_OR_RETURN(std::vector<BufferPtr> tokens, loop.Call(*data, {count}));
          std::vector<BufferPtr> in = {tokens[0]};
          in.insert(in.end(), state.begin(), state.begin() + static_cast<long>(n));
          in.push_back(cotangent);
          PW_ASSIGN_OR_RETURN(std::vector<BufferPtr> out, loop.Call(*vjp, in));  // loss, then gradients
          loss = *reinterpret_cast<const float*>(out[0]->data());
          std::vector<BufferPtr> update(state.begin(), state.begin() + static_cast<long>(n));
          update.insert(update.end(), out.begin() + 1, out.end());
          update.insert(update.end(), state.begin() + static_cast<long>(n), state.end());
          PW_ASSIGN_OR_RETURN(state, loop.Call(*adam, update));
          return absl::OkStatus();
        };
        for (int i = 0; i < 2; ++i) PW_RETURN_IF_ERROR(step());  // warm up
        for (int r = 0; r < repeats; ++r) {
          const absl::Time start = absl::Now();
          for (int i = 0; i < steps; ++i) PW_RETURN_IF_ERROR(step());
          if (d == 0) {
            seconds[r] = absl::ToDoubleSeconds(absl::Now() - start);
            losses[r] = loss;
          }
        }
        return absl::OkStatus();
      };
      if (absl::Status s = run(); !s.ok()) {
        absl::MutexLock lock(&failure_mu);
        if (failure.ok()) failure = s;
      }
    });
  }
  for (auto& t : threads) t.join();
  if (!failure.ok()) return fail(failure);
  if (rank == 0) {
    for (int r = 0; r < repeats; ++r) {
      std::printf("tokens_per_s %.1f\nloss %.6f\n",
                  static_cast<double>(steps) * static_cast<double>(batch * options.model.seq_len) / seconds[r],
                  static_cast<double>(losses[r]));
    }
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace
}  // namespace pathways

int main(int argc, char** argv) { return pathways::Main(argc, argv); }

// Training the Transformer (train/transformer.h) on a cluster: data, tensor and pipeline
// parallelism composed in one run, the whole step one traced program run with one client call.
//
// A step of S stages and M microbatches (GPipe): each microbatch's tokens are drawn on the devices
// of the first and last stages (never through the client), its activations go forward stage by
// stage, each stage's forward keeping its residuals on its devices (FunctionSpec::
// VjpKeepingResiduals); then every stage's backward runs that graph (the last stage's gradient
// runs its forward and backward in one call) and passes its input's cotangent back. With
// `recompute`, stages keep only the activations between them (one per microbatch) and their
// gradients run the forward again (rematerialisation: a third more work on every stage but the
// last, for less memory). Gradients add up in place over microbatches, and one Adam
// call per stage updates its parameters and moments in place (donated). The client only issues
// the step: the hosts plan and move the activations between stages, and parallel asynchronous
// dispatch keeps every stage's queue full.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"
#include "client/optimizer.h"
#include "client/program.h"
#include "train/transformer.h"

namespace pathways {

struct TrainOptions {
  TransformerConfig model;
  ParallelLayout layout;
  int64_t batch = 16;  // sequences per step, over all microbatches and data-parallel replicas
  int64_t microbatches = 1;
  // Islands the stages are spread over (stage s on island s * islands / stages); with one stage,
  // its slice spans this many islands (the data axis crosses them).
  int islands = 1;
  // Recompute each stage's forward pass in its gradient instead of keeping its residuals.
  bool recompute = false;
  AdamOptions adam = {.learning_rate = 3e-3};
  // The data: the built-in Markov source (compute/markov.h) over the model's vocabulary, or with
  // `text_file` set, that file's bytes (compute/text_source.h: a path on the workers' hosts, under
  // a directory they read data from; the vocabulary must hold the 256 byte values).
  uint64_t chain_seed = 0;
  uint64_t data_seed = 1;
  double sharpness = 2.0;
  std::string text_file;
  // Resume from the checkpoint whose manifest Trainer::Save wrote at this path: the model and the
  // layout must be the ones saved; parameters, optimizer state and the step count come back from
  // the workers' disks, so the run goes on with the losses an uninterrupted one would have.
  std::string resume_from;
};

// The functions of one stage's part of a training step, before compiling: what Trainer compiles,
// and what a program that runs the same step without the runtime (bench/peers/
// multicontroller_train.cc) runs on its own devices.
struct StageFunctionSpecs {
  // `forward` passes activations on (the primal, or with residuals kept the split product's
  // forward half, whose backward half is `backward`); `vjp` is the whole product (the last
  // stage's, or every stage's when recomputing). Each is set where the options need it.
  std::optional<FunctionSpec> forward, backward, vjp;
  FunctionSpec init, accumulate;
  // Inputs: params..., grads..., m..., v..., count; outputs: params..., m..., v..., count (donated).
  FunctionSpec adam;
};
absl::StatusOr<StageFunctionSpecs> MakeStageFunctions(const TrainOptions& options, const TransformerStage& stage);

// The function that draws microbatch `m`'s tokens on each device of a stage, from Adam's step
// count (an f32 scalar): [model.microbatch, seq_len + 1] i64 split over "d". InvalidArgument for
// a data file name that cannot be quoted in its source.
absl::StatusOr<FunctionSpec> DataFunction(const TrainOptions& options, const TransformerModel& model, int64_t m);

// Drives training on one client. Not thread-safe: one thread issues steps.
class Trainer {
 public:
  // Checks the options, places one slice per stage, compiles the model's functions, initialises
  // parameters and optimizer state on the devices and traces the step. Any error (a layout that
  // does not divide the model or the batch, a mesh larger than the cluster) comes back here,
  // before a step runs.
  static absl::StatusOr<std::unique_ptr<Trainer>> Create(Client& client, const TrainOptions& options);

  // Issues the next step with one client call and returns at once: the future of its loss (the
  // mean next-token cross-entropy over the step's batch, in nats).
  absl::StatusOr<Future<double>> Step();

  int64_t steps_issued() const { return steps_; }
  int64_t tokens_per_step() const { return options_.batch * options_.model.seq_len; }
  // The data's entropy rate: the best mean loss any model can reach; NaN where it is not known
  // (a text file).
  double entropy() const { return entropy_; }
  const TransformerModel& model() const { return model_; }
  const Program& step_program() const { return step_; }
  const std::vector<VirtualSlice>& slices() const { return slices_; }
  // Stage `stage`'s parameters as they are after the steps issued so far, in the stage's order.
  // The next Step donates them: these handles are valid until then.
  std::vector<ShardedArray> Parameters(int stage) const;
  // Checkpoints the parameters and optimizer state as of the steps issued so far: every device
  // writes the shards it holds on its own host (under the workers' --checkpoint-dir; nothing goes
  // through the client), and once every shard is on disk the manifest (what was saved, and the
  // checkpoint's secret that names its shards; readable by its owner only) is written at `path`,
  // replacing the one there at once. A save that fails leaves the previous manifest in place; a
  // path that holds anything but a manifest is left alone (AlreadyExists, before any shard is
  // written).
  // Blocks until done. Shards are named by their place in the slice and kept on the host that
  // held them: resuming needs each place on a host that sees its file (the same hosts, or a
  // --checkpoint-dir they share).
  absl::Status Save(const std::string& path);

 private:
  Trainer(Client& client, TrainOptions options) : client_(client), options_(std::move(options)) {}
  absl::Status Init();
  absl::StatusOr<Program> TraceStep();
  // The functions that save and load stage `s`'s state under the checkpoint's secret.
  FunctionSpec SaveFunction(int s) const;
  FunctionSpec LoadFunction(int s, int64_t step) const;
  // The manifest at options_.resume_from, checked against the options.
  struct Manifest {
    int64_t step;
    std::string secret;
  };
  absl::StatusOr<Manifest> ReadManifest() const;

  Client& client_;
  const TrainOptions options_;
  TransformerModel model_;
  double entropy_ = 0;
  std::vector<VirtualSlice> slices_;
  struct StageFunctions {
    // `forward` passes activations on: the primal, or with residuals kept, the split product's
    // forward half, whose backward half is `backward`. `vjp` is the whole product (the last
    // stage's, or every stage's when recomputing).
    CompiledFunction forward, backward, vjp, init, accumulate, adam;
  };
  std::vector<StageFunctions> functions_;
  std::vector<CompiledFunction> data_;  // per microbatch
  Program step_;
  // The step's arguments: per stage its params, Adam's first and second moments, and count; then
  // the loss cotangent (1 / microbatches). Replaced by the step's results after each step.
  std::vector<ShardedArray> state_;
  std::vector<size_t> stage_offset_;  // where each stage's arguments start in state_
  int64_t steps_ = 0;
  // Hex; names this run's checkpoint shards on the workers. A resumed run loads under its
  // checkpoint's secret and saves under a new one, so two runs resumed from one checkpoint never
  // write over each other's shards.
  std::string checkpoint_secret_;
  std::vector<CompiledFunction> save_;  // per stage, compiled at the first Save
};

}  // namespace pathways

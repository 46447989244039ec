#include "train/trainer.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <limits>
#include <map>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "compute/markov.h"
#include "compute/text_source.h"
#include "core/status_macros.h"
#include "transport/auth.h"

namespace pathways {

absl::StatusOr<StageFunctionSpecs> MakeStageFunctions(const TrainOptions& options, const TransformerStage& stage) {
  StageFunctionSpecs f;
  std::vector<int> wrt;
  if (!stage.first) wrt.push_back(0);
  const int params_at = static_cast<int>(stage.forward.inputs.size() - stage.params.size());
  for (size_t i = 0; i < stage.params.size(); ++i) wrt.push_back(params_at + static_cast<int>(i));
  if (stage.last || options.recompute) {
    PW_ASSIGN_OR_RETURN(f.vjp, FunctionSpec::Vjp(stage.forward, wrt, /*with_outputs=*/stage.last));
  }
  if (!stage.last && options.recompute) {
    f.forward = stage.forward;
  } else if (!stage.last) {
    PW_ASSIGN_OR_RETURN(FunctionSpec::SplitVjp split, FunctionSpec::VjpKeepingResiduals(stage.forward, wrt));
    f.forward = std::move(split.forward);
    f.backward = std::move(split.backward);
  }
  f.init = stage.init;
  f.accumulate = stage.accumulate;
  std::vector<TensorSpec> specs;
  std::vector<PartitionSpec> shardings;
  for (const TransformerParam& p : stage.params) {
    specs.push_back(p.spec);
    shardings.push_back(p.sharding);
  }
  PW_ASSIGN_OR_RETURN(f.adam, AdamUpdateGroup(specs, shardings, options.adam));
  return f;
}

namespace {

// The name goes into the data function's TorchScript source, in quotes.
absl::Status CheckTextFileName(const std::string& name) {
  if (name.find_first_of("'\\\n\r") != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("data file name '", name, "' has a quote, backslash or line break"));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<FunctionSpec> DataFunction(const TrainOptions& options, const TransformerModel& model, int64_t m) {
  PW_RETURN_IF_ERROR(CheckTextFileName(options.text_file));
  // Microbatch m of a step is sequences [m x microbatch, (m + 1) x microbatch) of its batch;
  // each device draws its rank's share of them. The step number is Adam's count before the
  // step's update, on the devices: nothing about the data comes from the client.
  const int64_t microbatch = model.microbatch, local = microbatch / model.layout.data;
  const int64_t length = options.model.seq_len + 1;
  const uint64_t data_seed = options.data_seed % (uint64_t{1} << 62);
  const std::string body =
      options.text_file.empty()
          ? absl::StrCat("def data(count):\n    return pathways.markov_tokens(", local, ", ", length, ", ",
                         options.model.vocab, ", ", options.chain_seed % (uint64_t{1} << 62), ", ", data_seed,
                         ", int(count.item()), 'd', ", absl::StrFormat("%#.17g", options.sharpness),  // a float
                         ", ", m * microbatch, ")\n")
          : absl::StrCat("def data(count):\n    return pathways.text_tokens('", options.text_file, "', ", local, ", ",
                         length, ", ", data_seed, ", int(count.item()), 'd', ", m * microbatch, ")\n");
  return FunctionSpec::Script("data", body, {{DType::kF32, {}}}, {model.tokens}, {{}}, {model.tokens_sharding});
}

absl::StatusOr<std::unique_ptr<Trainer>> Trainer::Create(Client& client, const TrainOptions& options) {
  const TrainOptions& o = options;
  const ParallelLayout& l = o.layout;
  // Each factor bounded first: the batch check below divides by their product.
  constexpr int64_t kMaxFactor = 1 << 16;
  for (const auto& [name, value] : {std::pair<const char*, int64_t>{"data parallelism", l.data},
                                    {"tensor parallelism", l.tensor},
                                    {"pipeline stages", l.stages},
                                    {"microbatches", o.microbatches}}) {
    if (value < 1 || value > kMaxFactor) {
      return absl::InvalidArgumentError(
          absl::StrCat(name, " is ", value, "; it must be between 1 and ", kMaxFactor));
    }
  }
  if (!(o.adam.learning_rate > 0) || o.adam.learning_rate > 1) {  // NaN too
    return absl::InvalidArgumentError(absl::StrCat("the learning rate ", o.adam.learning_rate, " is not in (0, 1]"));
  }
  if (o.batch < 1 || o.batch % (l.data * o.microbatches) != 0) {
    return absl::InvalidArgumentError(absl::StrCat("a batch of ", o.batch, " sequences does not split into ",
                                                   o.microbatches, " microbatches over data parallelism ", l.data,
                                                   " (it must be a multiple of ", l.data * o.microbatches, ")"));
  }
  if (o.islands < 1 || (l.stages > 1 && o.islands > l.stages) || (l.stages == 1 && l.data % o.islands != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        o.islands, " islands for ", l.stages, " stages and data parallelism ", l.data,
        ": islands hold whole stages, or (one stage) split its data axis, so they must divide it"));
  }
  double entropy = std::numeric_limits<double>::quiet_NaN();
  if (o.text_file.empty()) {
    if (o.model.vocab > MarkovSource::kMaxVocab) {
      return absl::InvalidArgumentError(
          absl::StrCat("a vocabulary of ", o.model.vocab, " is larger than the data's ", MarkovSource::kMaxVocab));
    }
    auto source = MarkovSource::Get(static_cast<int>(o.model.vocab), o.chain_seed, o.sharpness);
    if (!source.ok()) return source.status();
    entropy = (*source)->EntropyRate();
  } else {
    if (o.model.vocab < TextSource::kVocab) {
      return absl::InvalidArgumentError(absl::StrCat("a text file's tokens are its bytes: the vocabulary must be at least ",
                                                     TextSource::kVocab, ", not ", o.model.vocab));
    }
    PW_RETURN_IF_ERROR(CheckTextFileName(o.text_file));
  }
  auto model = BuildTransformer(o.model, l, o.batch / o.microbatches);
  if (!model.ok()) return model.status();
  std::unique_ptr<Trainer> trainer(new Trainer(client, options));
  trainer->model_ = *std::move(model);
  trainer->entropy_ = entropy;
  PW_RETURN_IF_ERROR(trainer->Init());
  return trainer;
}

absl::Status Trainer::Init() {
  const ParallelLayout& l = options_.layout;
  const int64_t stages = l.stages;
  for (int s = 0; s < stages; ++s) {
    SliceSpec spec{.mesh_shape = {l.data, l.tensor}, .axis_names = {"d", "t"}};
    if (options_.islands > 1) {
      if (stages > 1) {
        spec.island = static_cast<int>(s * options_.islands / stages);
      } else {
        spec.span_islands = true;
      }
    }
    auto slice = client_.CreateSlice(spec);
    if (!slice.ok()) {
      return absl::Status(slice.status().code(),
                          absl::StrCat("stage ", s, "'s slice of ", l.data, " x ", l.tensor, " devices",
                                       spec.island ? absl::StrCat(" on island ", *spec.island) : "", ": ",
                                       slice.status().message()));
    }
    slices_.push_back(*slice);
  }

  // The functions. Each is compiled once whatever the number of slices that call it.
  for (const TransformerStage& stage : model_.stages) {
    PW_ASSIGN_OR_RETURN(StageFunctionSpecs specs, MakeStageFunctions(options_, stage));
    StageFunctions f;
    for (auto [spec, compiled] :
         {std::pair{&specs.forward, &f.forward}, {&specs.backward, &f.backward}, {&specs.vjp, &f.vjp}}) {
      if (spec->has_value()) {
        PW_ASSIGN_OR_RETURN(*compiled, client_.Compile(**spec));
      }
    }
    PW_ASSIGN_OR_RETURN(f.init, client_.Compile(specs.init));
    PW_ASSIGN_OR_RETURN(f.accumulate, client_.Compile(specs.accumulate));
    PW_ASSIGN_OR_RETURN(f.adam, client_.Compile(specs.adam));
    functions_.push_back(std::move(f));
  }
  for (int64_t m = 0; m < options_.microbatches; ++m) {
    PW_ASSIGN_OR_RETURN(FunctionSpec spec, DataFunction(options_, model_, m));
    PW_ASSIGN_OR_RETURN(CompiledFunction data, client_.Compile(spec));
    data_.push_back(std::move(data));
  }

  // Parameters and optimizer state are made on the devices, or read there from a checkpoint.
  // A checkpoint's secret is as strong as a client's credential, and made the same way.
  const std::string secret = NewClientIdentity().credential;
  if (options_.resume_from.empty()) {
    checkpoint_secret_ = secret;
    for (int s = 0; s < stages; ++s) {
      stage_offset_.push_back(state_.size());
      PW_ASSIGN_OR_RETURN(std::vector<ShardedArray> made, client_.Call(functions_[s].init, slices_[s], {}));
      state_.insert(state_.end(), made.begin(), made.end());
    }
  } else {
    PW_ASSIGN_OR_RETURN(Manifest manifest, ReadManifest());
    steps_ = manifest.step;
    checkpoint_secret_ = manifest.secret;
    for (int s = 0; s < stages; ++s) {
      stage_offset_.push_back(state_.size());
      PW_ASSIGN_OR_RETURN(CompiledFunction load, client_.Compile(LoadFunction(s, steps_)));
      PW_ASSIGN_OR_RETURN(std::vector<ShardedArray> loaded, client_.Call(load, slices_[s], {}));
      state_.insert(state_.end(), loaded.begin(), loaded.end());
    }
    // A missing or damaged shard fails here, before any step runs.
    for (const ShardedArray& a : state_) {
      absl::Status ready = client_.Ready(a).Await().status();
      if (!ready.ok()) {
        return absl::Status(ready.code(), absl::StrCat("resuming from ", options_.resume_from, ": ", ready.message()));
      }
    }
    checkpoint_secret_ = secret;  // saves from here on are this run's own
  }
  PW_ASSIGN_OR_RETURN(HostArray cotangent, HostArray::Create(DType::kF32, {}));
  cotangent.mutable_data<float>()[0] = 1.0f / static_cast<float>(options_.microbatches);
  PW_ASSIGN_OR_RETURN(ShardedArray cot, client_.Put(cotangent, slices_.back()));
  state_.push_back(cot);
  PW_ASSIGN_OR_RETURN(step_, TraceStep());
  return absl::OkStatus();
}

absl::StatusOr<Program> Trainer::TraceStep() {
  const int stages = static_cast<int>(model_.stages.size());
  const int64_t microbatches = options_.microbatches;
  ProgramBuilder b("train_step");
  struct StageValues {
    std::vector<TracedValue> params, m, v;
    TracedValue count;
  };
  std::vector<StageValues> values(stages);
  for (int s = 0; s < stages; ++s) {
    const size_t n = model_.stages[s].params.size();
    for (int group = 0; group < 3; ++group) {
      for (size_t i = 0; i < n; ++i) {
        TracedValue v = b.Arg(model_.stages[s].params[i].spec);
        (group == 0 ? values[s].params : group == 1 ? values[s].m : values[s].v).push_back(v);
      }
    }
    values[s].count = b.Arg({DType::kF32, {}});
  }
  const TracedValue cotangent = b.Arg({DType::kF32, {}});
  auto call = [&](const CompiledFunction& f, int s, std::vector<TracedValue> inputs) {
    return b.Call(f, slices_[s], inputs);
  };
  auto with_params = [&](std::vector<TracedValue> inputs, int s) {
    inputs.insert(inputs.end(), values[s].params.begin(), values[s].params.end());
    return inputs;
  };

  // Forward: every microbatch through stages 0 .. S-2 (the last stage's forward runs inside its
  // gradient). inputs[s][m] is what stage s reads for microbatch m, residuals[s][m] the handle of
  // what its forward kept.
  const bool keep = !options_.recompute;
  std::vector<std::vector<TracedValue>> inputs(stages, std::vector<TracedValue>(microbatches));
  std::vector<std::vector<TracedValue>> residuals(stages, std::vector<TracedValue>(microbatches));
  std::vector<TracedValue> targets(microbatches);
  for (int64_t m = 0; m < microbatches; ++m) {
    PW_ASSIGN_OR_RETURN(auto tokens, call(data_[m], 0, {values[0].count}));
    inputs[0][m] = tokens[0];
    targets[m] = tokens[0];
    if (stages > 1) {
      PW_ASSIGN_OR_RETURN(auto last_tokens, call(data_[m], stages - 1, {values[stages - 1].count}));
      targets[m] = last_tokens[0];
    }
    for (int s = 0; s + 1 < stages; ++s) {
      PW_ASSIGN_OR_RETURN(auto out, call(functions_[s].forward, s, with_params({inputs[s][m]}, s)));
      inputs[s + 1][m] = out[0];
      if (keep) residuals[s][m] = out[1];
    }
  }

  // Backward, microbatch by microbatch from the last stage, accumulating each stage's gradients
  // (and the loss) in place.
  std::vector<std::vector<TracedValue>> grads(stages);
  for (int64_t m = 0; m < microbatches; ++m) {
    TracedValue upstream = cotangent;
    for (int s = stages - 1; s >= 0; --s) {
      const TransformerStage& stage = model_.stages[s];
      std::vector<TracedValue> out;
      if (keep && !stage.last) {
        PW_ASSIGN_OR_RETURN(out, call(functions_[s].backward, s, {residuals[s][m], upstream}));
      } else {
        std::vector<TracedValue> in = {inputs[s][m]};
        if (stage.last && !stage.first) in.push_back(targets[m]);
        in = with_params(in, s);
        in.push_back(upstream);
        PW_ASSIGN_OR_RETURN(out, call(functions_[s].vjp, s, in));
      }
      // Outputs: [loss when last], [input cotangent when not first], parameter cotangents.
      size_t at = 0;
      std::vector<TracedValue> acc;
      TracedValue loss;
      if (stage.last) loss = out[at++];
      if (!stage.first) upstream = out[at++];
      acc.assign(out.begin() + static_cast<long>(at), out.end());
      if (stage.last) acc.push_back(loss);
      if (m == 0) {
        grads[s] = acc;
      } else {
        std::vector<TracedValue> a = grads[s];
        a.insert(a.end(), acc.begin(), acc.end());
        PW_ASSIGN_OR_RETURN(grads[s], call(functions_[s].accumulate, s, a));
      }
    }
  }

  // Adam on every stage, in place.
  std::vector<TracedValue> results = {grads[stages - 1].back()};  // the loss, summed over microbatches
  for (int s = 0; s < stages; ++s) {
    const size_t n = model_.stages[s].params.size();
    std::vector<TracedValue> in = values[s].params;
    in.insert(in.end(), grads[s].begin(), grads[s].begin() + static_cast<long>(n));
    in.insert(in.end(), values[s].m.begin(), values[s].m.end());
    in.insert(in.end(), values[s].v.begin(), values[s].v.end());
    in.push_back(values[s].count);
    PW_ASSIGN_OR_RETURN(auto updated, call(functions_[s].adam, s, in));
    results.insert(results.end(), updated.begin(), updated.end());
  }
  return b.Build(results);
}

absl::StatusOr<Future<double>> Trainer::Step() {
  PW_ASSIGN_OR_RETURN(std::vector<ShardedArray> out, client_.Run(step_, state_));
  // Results: the loss, then per stage its params, moments and count: the next step's arguments
  // in the same order (the cotangent stays).
  std::copy(out.begin() + 1, out.end(), state_.begin());
  ++steps_;
  const double microbatches = static_cast<double>(options_.microbatches);
  return client_.Fetch(out[0]).Then([microbatches](const HostArray& loss) -> double {
    return static_cast<double>(loss.data<float>()[0]) / microbatches;
  });
}

namespace {

// Names of a stage's saved arrays, in the order of its state: params, moments, count.
std::vector<std::string> StateNames(const TransformerStage& stage) {
  std::vector<std::string> names;
  for (const char* suffix : {"", "_m", "_v"}) {
    for (const TransformerParam& p : stage.params) names.push_back(absl::StrCat("s", stage.index, "_", p.name, suffix));
  }
  names.push_back(absl::StrCat("s", stage.index, "_count"));
  return names;
}

constexpr char kManifestHeader[] = "pathways-checkpoint 1";

// A manifest is a few hundred bytes: one read stops here.
constexpr size_t kMaxManifestBytes = 64 << 10;

// The first kMaxManifestBytes + 1 bytes of `path`, which must be a regular file: a device, FIFO or
// directory named as a manifest is refused before anything blocks on it or reads it whole.
absl::StatusOr<std::string> ReadManifestFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    const int error = errno;
    return absl::Status(error == ENOENT ? absl::StatusCode::kNotFound : absl::StatusCode::kPermissionDenied,
                        absl::StrCat("checkpoint manifest ", path, ": ", std::strerror(error)));
  }
  std::string text;
  struct stat st;
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("checkpoint manifest ", path, " is not a regular file"));
  }
  text.resize(kMaxManifestBytes + 1);
  size_t got = 0;
  for (ssize_t n; got < text.size() && (n = ::read(fd, text.data() + got, text.size() - got)) != 0;) {
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error = errno;
      ::close(fd);
      return absl::InternalError(absl::StrCat("checkpoint manifest ", path, ": read: ", std::strerror(error)));
    }
    got += static_cast<size_t>(n);
  }
  ::close(fd);
  text.resize(got);
  return text;
}

// Writes `text` to `path` through a temporary file that is synced, then renamed over it, and syncs
// the directory: a crash leaves the old file or the new one, never half of either.
absl::Status WriteFileAtomically(const std::string& path, const std::string& text, mode_t mode) {
  const std::string temporary = path + ".tmp";
  auto failed = [&](const char* what) {
    const int error = errno;
    return absl::Status(error == ENOSPC                       ? absl::StatusCode::kResourceExhausted
                        : error == EACCES || error == EPERM   ? absl::StatusCode::kPermissionDenied
                        : error == ENOENT || error == ENOTDIR ? absl::StatusCode::kNotFound
                                                              : absl::StatusCode::kInternal,
                        absl::StrCat("checkpoint manifest ", path, ": ", what, ": ", std::strerror(error)));
  };
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) return failed("open");
  const bool written = ::write(fd, text.data(), text.size()) == static_cast<ssize_t>(text.size());
  if (!written || ::fsync(fd) != 0) {
    absl::Status status = failed("write");
    ::close(fd);
    ::unlink(temporary.c_str());
    return status;
  }
  ::close(fd);
  if (::rename(temporary.c_str(), path.c_str()) != 0) return failed("rename");
  const size_t slash = path.rfind('/');
  const std::string dir = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
  if (const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

std::string ManifestModel(const TransformerConfig& c) {
  return absl::StrCat(c.vocab, " ", c.d_model, " ", c.heads, " ", c.layers, " ", c.mlp_hidden, " ", c.seq_len);
}
std::string ManifestLayout(const ParallelLayout& l) { return absl::StrCat(l.data, " ", l.tensor, " ", l.stages); }

}  // namespace

FunctionSpec Trainer::SaveFunction(int s) const {
  const TransformerStage& stage = model_.stages[s];
  const std::vector<std::string> names = StateNames(stage);
  std::vector<TensorSpec> inputs;
  std::vector<PartitionSpec> shardings;
  std::vector<std::string> args;
  std::string body;
  for (size_t i = 0; i < names.size(); ++i) {
    const bool count = i + 1 == names.size();
    const TransformerParam& p = stage.params[i % stage.params.size()];
    inputs.push_back(count ? TensorSpec{DType::kF32, {}} : p.spec);
    shardings.push_back(count ? PartitionSpec{} : p.sharding);
    args.push_back(absl::StrCat("x", i));
    // The step is the state's own count: the number of steps it has taken.
    absl::StrAppend(&body, "    pathways.save_shard(x", i, ", '", checkpoint_secret_, "', step, '", names[i], "')\n");
  }
  const std::string source = absl::StrCat("def save(", absl::StrJoin(args, ", "), "):\n    step = int(x",
                                          names.size() - 1, ".item())\n", body, "    return torch.ones([])\n");
  return FunctionSpec::Script("save", source, inputs, {{DType::kF32, {}}}, shardings, {{}});
}

FunctionSpec Trainer::LoadFunction(int s, int64_t step) const {
  const TransformerStage& stage = model_.stages[s];
  const std::vector<std::string> names = StateNames(stage);
  const FunctionSpec& init = stage.init;  // the same outputs: params, moments, count
  std::vector<std::string> loads;
  for (size_t i = 0; i < names.size(); ++i) {
    const std::vector<int64_t> local = LocalShape(init.outputs[i].shape, init.out_shardings[i], model_.layout);
    loads.push_back(absl::StrCat("pathways.load_shard([", absl::StrJoin(local, ", "), "], '", checkpoint_secret_,
                                 "', ", step, ", '", names[i], "')"));
  }
  return FunctionSpec::Script("load", absl::StrCat("def load():\n    return ", absl::StrJoin(loads, ", "), "\n"), {},
                              init.outputs, {}, init.out_shardings);
}

absl::Status Trainer::Save(const std::string& path) {
  // The manifest replaces an earlier one at `path`, and nothing else: not a file of the user's,
  // nor a device (renamed over, /dev/null became a regular file), checked before any shard is
  // written.
  if (struct stat st; ::lstat(path.c_str(), &st) == 0) {
    absl::StatusOr<std::string> there =
        S_ISREG(st.st_mode) ? ReadManifestFile(path) : absl::InvalidArgumentError("not a regular file");
    if (!there.ok() || !absl::StartsWith(*there, absl::StrCat(kManifestHeader, "\n"))) {
      return absl::AlreadyExistsError(
          absl::StrCat("saving a checkpoint: ", path, " exists and is not a checkpoint manifest; it is left as it is"));
    }
  }
  std::vector<ShardedArray> done;
  for (size_t s = 0; s < model_.stages.size(); ++s) {
    if (save_.size() == s) {
      PW_ASSIGN_OR_RETURN(CompiledFunction f, client_.Compile(SaveFunction(static_cast<int>(s))));
      save_.push_back(std::move(f));
    }
    const size_t n = 3 * model_.stages[s].params.size() + 1;
    const std::vector<ShardedArray> state(state_.begin() + static_cast<long>(stage_offset_[s]),
                                          state_.begin() + static_cast<long>(stage_offset_[s] + n));
    PW_ASSIGN_OR_RETURN(std::vector<ShardedArray> out, client_.Call(save_[s], slices_[s], state));
    done.push_back(out[0]);
  }
  for (const ShardedArray& d : done) {
    absl::Status saved = client_.Ready(d).Await().status();
    if (!saved.ok()) return absl::Status(saved.code(), absl::StrCat("saving a checkpoint: ", saved.message()));
  }
  // Every shard is on disk: the manifest makes the checkpoint the current one, all at once. It
  // holds the secret, so only its owner may read it.
  const std::string text = absl::StrCat(kManifestHeader, "\nsecret ", checkpoint_secret_, "\nstep ", steps_,
                                        "\nmodel ", ManifestModel(options_.model), "\nlayout ",
                                        ManifestLayout(model_.layout), "\n");
  return WriteFileAtomically(path, text, 0600);
}

absl::StatusOr<Trainer::Manifest> Trainer::ReadManifest() const {
  const std::string& path = options_.resume_from;
  PW_ASSIGN_OR_RETURN(const std::string text, ReadManifestFile(path));
  if (text.size() > kMaxManifestBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, " is not a checkpoint manifest (larger than ", kMaxManifestBytes, " bytes)"));
  }
  std::vector<absl::string_view> lines = absl::StrSplit(text, '\n');
  if (lines.front() != kManifestHeader) {
    return absl::InvalidArgumentError(absl::StrCat(path, " is not a checkpoint manifest (its first line is not '",
                                                   kManifestHeader, "')"));
  }
  std::map<std::string, std::string> fields;
  for (size_t i = 1; i < lines.size(); ++i) {
    const size_t space = lines[i].find(' ');
    if (space != absl::string_view::npos)
      fields[std::string(lines[i].substr(0, space))] = std::string(lines[i].substr(space + 1));
  }
  auto mismatch = [&](const char* what, const std::string& saved, const std::string& now) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint ", path, " holds a ", what, " of (", saved,
                                                   ") but this run has (", now, ")"));
  };
  if (fields["model"] != ManifestModel(options_.model)) {
    return mismatch("model (vocabulary, d_model, heads, layers, MLP, context)", fields["model"],
                    ManifestModel(options_.model));
  }
  if (fields["layout"] != ManifestLayout(model_.layout)) {
    return mismatch("layout (data, tensor, stages)", fields["layout"], ManifestLayout(model_.layout));
  }
  int64_t step = -1;
  const std::string& secret = fields["secret"];
  if (!absl::SimpleAtoi(fields["step"], &step) || step < 0 || secret.size() < 32 || secret.size() > 128 ||
      !std::all_of(secret.begin(), secret.end(), [](char c) { return absl::ascii_isxdigit(c); })) {
    return absl::InvalidArgumentError(absl::StrCat("checkpoint manifest ", path, " has no valid step and secret"));
  }
  return Manifest{step, secret};
}

std::vector<ShardedArray> Trainer::Parameters(int stage) const {
  const size_t n = model_.stages[stage].params.size();
  return std::vector<ShardedArray>(state_.begin() + static_cast<long>(stage_offset_[stage]),
                                   state_.begin() + static_cast<long>(stage_offset_[stage] + n));
}

}  // namespace pathways

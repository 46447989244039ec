#include "train/transformer.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace pathways {
namespace {

// How a parameter starts.
enum class Init { kZeros, kOnes, kNormal };

// One kind of parameter: per layer (stacked in a stage) or once for the model.
struct ParamKind {
  const char* name;
  int id;  // with the layer, names the parameter's random draw: stable whatever the layout
  Init init;
};

// Block parameters in the order the block function takes them.
constexpr ParamKind kBlockParams[] = {
    {"ln1_g", 1, Init::kOnes},   {"ln1_b", 2, Init::kZeros},  {"wq", 3, Init::kNormal},
    {"wk", 4, Init::kNormal},    {"wv", 5, Init::kNormal},    {"wo", 6, Init::kNormal},
    {"bo", 7, Init::kZeros},     {"ln2_g", 8, Init::kOnes},   {"ln2_b", 9, Init::kZeros},
    {"w1", 10, Init::kNormal},   {"b1", 11, Init::kZeros},    {"w2", 12, Init::kNormal},
    {"b2", 13, Init::kZeros},
};
constexpr ParamKind kEmbeddings[] = {{"tok_emb", 20, Init::kNormal}, {"pos_emb", 21, Init::kNormal}};
constexpr ParamKind kHead[] = {{"lnf_g", 22, Init::kOnes}, {"lnf_b", 23, Init::kZeros}, {"head", 24, Init::kNormal}};

std::string Num(double v) { return absl::StrFormat("%.17g", v); }

std::string List(const std::vector<int64_t>& v) { return absl::StrCat("[", absl::StrJoin(v, ", "), "]"); }

std::string SpecList(const PartitionSpec& spec, size_t rank) {
  std::vector<std::string> quoted;
  for (size_t i = 0; i < rank; ++i) quoted.push_back(absl::StrCat("'", i < spec.size() ? spec[i] : "", "'"));
  return absl::StrCat("[", absl::StrJoin(quoted, ", "), "]");
}

class Builder {
 public:
  Builder(const TransformerConfig& c, const ParallelLayout& l, int64_t microbatch)
      : c_(c), l_(l), microbatch_(microbatch) {}

  // A parameter's global shape (one layer's, for block parameters) and its sharding over (d, t).
  std::pair<std::vector<int64_t>, PartitionSpec> Layout(const std::string& name) const {
    const int64_t d = c_.d_model, f = c_.mlp_hidden;
    if (name == "wq" || name == "wk" || name == "wv") return {{d, d}, {"", "t"}};
    if (name == "wo") return {{d, d}, {"t", ""}};
    if (name == "w1") return {{d, f}, {"", "t"}};
    if (name == "b1") return {{f}, {"t"}};
    if (name == "w2") return {{f, d}, {"t", ""}};
    if (name == "tok_emb") return {{c_.vocab, d}, {"", ""}};
    if (name == "pos_emb") return {{c_.seq_len, d}, {"", ""}};
    if (name == "head") return {{d, c_.vocab}, {"", ""}};
    return {{d}, {""}};  // LayerNorm gains and biases, biases added after an all_reduce
  }

  // The standard deviation of a normal parameter: GPT-2's, with residual projections scaled down
  // by the depth.
  double Std(const std::string& name) const {
    if (name == "wo" || name == "w2") return 0.02 / std::sqrt(2.0 * static_cast<double>(c_.layers));
    if (name == "pos_emb") return 0.01;
    return 0.02;
  }


  // `x` summed over the tensor axis, when it is split.
  std::string OverT(const std::string& x) const {
    return l_.tensor > 1 ? absl::StrCat("pathways.all_reduce(", x, ", 't')") : x;
  }

  std::string BlockSource() const {
    const int64_t d = c_.d_model, heads = c_.heads / l_.tensor, dh = c_.d_model / c_.heads;
    std::vector<std::string> args = {"x"};
    for (const ParamKind& k : kBlockParams) args.push_back(k.name);
    return absl::StrCat(
        "def block(", absl::StrJoin(args, ", "), "):\n",
        "    b = x.size(0)\n", "    n = x.size(1)\n",
        "    h = torch.layer_norm(x, [", d, "], ln1_g, ln1_b, 1e-5, False)\n",
        "    q = (h @ wq).view(b, n, ", heads, ", ", dh, ").transpose(1, 2)\n",
        "    k = (h @ wk).view(b, n, ", heads, ", ", dh, ").transpose(1, 2)\n",
        "    v = (h @ wv).view(b, n, ", heads, ", ", dh, ").transpose(1, 2)\n",
        "    s = (q @ k.transpose(2, 3)) * ", Num(1.0 / std::sqrt(static_cast<double>(dh))), "\n",
        "    s = s.masked_fill(torch.ones([n, n]).triu(1) > 0.5, -1e9)\n",
        "    a = (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, n, ", heads * dh, ") @ wo\n",
        "    x = x + ", OverT("a"), " + bo\n",
        "    h = torch.layer_norm(x, [", d, "], ln2_g, ln2_b, 1e-5, False)\n",
        "    h = torch.gelu(h @ w1 + b1) @ w2\n",
        "    return x + ", OverT("h"), " + b2\n");
  }

  absl::StatusOr<TransformerStage> Stage(int index) const {
    TransformerStage stage;
    stage.index = index;
    stage.first = index == 0;
    stage.last = index == l_.stages - 1;
    stage.first_layer = c_.layers * index / l_.stages;
    stage.num_layers = c_.layers * (index + 1) / l_.stages - stage.first_layer;
    std::vector<std::pair<const ParamKind*, bool>> kinds;  // kind, stacked
    if (stage.first) {
      for (const ParamKind& k : kEmbeddings) kinds.push_back({&k, false});
    }
    for (const ParamKind& k : kBlockParams) kinds.push_back({&k, true});
    if (stage.last) {
      for (const ParamKind& k : kHead) kinds.push_back({&k, false});
    }

    // Parameters, and the init function's source drawing each on the devices.
    std::string init = "def init():\n";
    std::vector<std::string> param_names, moment_names[2];
    for (const auto& entry : kinds) {
      // Plain names, not structured bindings: the lambda below captures them (clang 14 cannot).
      const ParamKind* kind = entry.first;
      const bool stacked = entry.second;
      auto layout = Layout(kind->name);
      std::vector<int64_t> shape = std::move(layout.first);
      PartitionSpec spec = std::move(layout.second);
      const std::vector<int64_t> local = LocalShape(shape, spec, l_);
      auto draw = [&](int64_t layer) {
        switch (kind->init) {
          case Init::kZeros: return absl::StrCat("torch.zeros(", List(local), ")");
          case Init::kOnes: return absl::StrCat("torch.ones(", List(local), ")");
          case Init::kNormal:
            return absl::StrCat("pathways.normal(", List(local), ", ", SpecList(spec, shape.size()), ", ",
                                c_.init_seed % (uint64_t{1} << 62), ", ", kind->id * 65536 + layer, ") * ",
                                Num(Std(kind->name)));
        }
        return std::string();
      };
      std::string value;
      if (stacked) {
        std::vector<std::string> layers;
        for (int64_t l = 0; l < stage.num_layers; ++l) layers.push_back(draw(stage.first_layer + l));
        value = absl::StrCat("torch.stack([", absl::StrJoin(layers, ", "), "])");
        shape.insert(shape.begin(), stage.num_layers);
        spec.insert(spec.begin(), "");
      } else {
        value = draw(0);
      }
      absl::StrAppend(&init, "    ", kind->name, " = ", value, "\n");
      param_names.push_back(kind->name);
      for (int m = 0; m < 2; ++m) {
        const std::string name = absl::StrCat(kind->name, m == 0 ? "_m" : "_v");
        absl::StrAppend(&init, "    ", name, " = torch.zeros_like(", kind->name, ")\n");
        moment_names[m].push_back(name);
      }
      TransformerParam param;
      param.name = kind->name;
      param.spec = {DType::kF32, std::move(shape)};
      param.sharding = std::move(spec);
      stage.params.push_back(std::move(param));
    }
    absl::StrAppend(&init, "    return ", absl::StrJoin(param_names, ", "), ", ", absl::StrJoin(moment_names[0], ", "),
                    ", ", absl::StrJoin(moment_names[1], ", "), ", torch.zeros([])\n");

    // The forward function.
    const TensorSpec tokens{DType::kI64, {microbatch_, c_.seq_len + 1}};
    const TensorSpec activations{DType::kF32, {microbatch_, c_.seq_len, c_.d_model}};
    const PartitionSpec batch_split = {"d", "", ""};
    std::vector<std::string> args;
    std::vector<TensorSpec> inputs;
    std::vector<PartitionSpec> in_shardings;
    if (!stage.first) {
      args.push_back("x");
      inputs.push_back(activations);
      in_shardings.push_back(batch_split);
    }
    if (stage.first || stage.last) {
      args.push_back("tokens");
      inputs.push_back(tokens);
      in_shardings.push_back({"d", ""});
    }
    for (const TransformerParam& p : stage.params) {
      args.push_back(p.name);
      inputs.push_back(p.spec);
      in_shardings.push_back(p.sharding);
    }
    const std::string name = stage.last ? "loss" : "stage";
    std::string body = absl::StrCat(BlockSource(), "\n", "def ", name, "(", absl::StrJoin(args, ", "), "):\n");
    if (stage.first) absl::StrAppend(&body, "    x = torch.embedding(tok_emb, tokens[:, :-1]) + pos_emb\n");
    // Each stacked parameter is split into its layers once: the gradient of unbind is one stack
    // of the layers' gradients, where indexing each layer's slice (w[i]) would make a zero-filled
    // stacked gradient per layer and add them up, layers x the parameter's size in work.
    std::vector<std::string> layer_args = {"x"};
    for (const ParamKind& k : kBlockParams) {
      absl::StrAppend(&body, "    ", k.name, "_l = ", k.name, ".unbind(0)\n");
      layer_args.push_back(absl::StrCat(k.name, "_l[i]"));
    }
    absl::StrAppend(&body, "    for i in range(", stage.num_layers, "):\n", "        x = block(",
                    absl::StrJoin(layer_args, ", "), ")\n");
    if (stage.last) {
      absl::StrAppend(&body, "    x = torch.layer_norm(x, [", c_.d_model, "], lnf_g, lnf_b, 1e-5, False)\n",
                      "    logp = torch.log_softmax(x @ head, -1)\n",
                      "    nll = -logp.gather(2, tokens[:, 1:].unsqueeze(2)).mean()\n", "    return ",
                      l_.data > 1 ? "pathways.all_reduce(nll, 'd', 'mean')" : "nll", "\n");
      stage.forward = FunctionSpec::Script(name, std::move(body), inputs, {{DType::kF32, {}}}, in_shardings, {{}});
    } else {
      absl::StrAppend(&body, "    return x\n");
      stage.forward = FunctionSpec::Script(name, std::move(body), inputs, {activations}, in_shardings, {batch_split});
    }

    std::vector<TensorSpec> init_outputs;
    std::vector<PartitionSpec> init_shardings;
    for (int group = 0; group < 3; ++group) {
      for (const TransformerParam& p : stage.params) {
        init_outputs.push_back(p.spec);
        init_shardings.push_back(p.sharding);
      }
    }
    init_outputs.push_back({DType::kF32, {}});
    init_shardings.push_back({});
    stage.init = FunctionSpec::Script("init", std::move(init), {}, init_outputs, {}, init_shardings);

    // Gradient accumulation (and the loss's, on the last stage), in place.
    std::vector<TensorSpec> acc;
    std::vector<PartitionSpec> acc_shardings;
    for (const TransformerParam& p : stage.params) {
      acc.push_back(p.spec);
      acc_shardings.push_back(p.sharding);
    }
    if (stage.last) {
      acc.push_back({DType::kF32, {}});
      acc_shardings.push_back({});
    }
    std::vector<std::string> a, g;
    std::string adds;
    for (size_t i = 0; i < acc.size(); ++i) {
      a.push_back(absl::StrCat("a", i));
      g.push_back(absl::StrCat("g", i));
      absl::StrAppend(&adds, "    a", i, ".add_(g", i, ")\n");
    }
    std::vector<TensorSpec> acc_inputs = acc;
    acc_inputs.insert(acc_inputs.end(), acc.begin(), acc.end());
    std::vector<PartitionSpec> acc_in_shardings = acc_shardings;
    acc_in_shardings.insert(acc_in_shardings.end(), acc_shardings.begin(), acc_shardings.end());
    stage.accumulate = FunctionSpec::Script(
        "accumulate",
        absl::StrCat("def accumulate(", absl::StrJoin(a, ", "), ", ", absl::StrJoin(g, ", "), "):\n", adds,
                     "    return ", absl::StrJoin(a, ", "), "\n"),
        acc_inputs, acc, acc_in_shardings, acc_shardings);
    for (size_t i = 0; i < acc.size(); ++i) stage.accumulate.donated_inputs.push_back(static_cast<int>(i));
    return stage;
  }

 private:
  const TransformerConfig& c_;
  const ParallelLayout& l_;
  int64_t microbatch_;
};

}  // namespace

std::vector<int64_t> LocalShape(std::vector<int64_t> shape, const PartitionSpec& sharding, const ParallelLayout& layout) {
  for (size_t i = 0; i < shape.size() && i < sharding.size(); ++i) {
    if (sharding[i] == "t") shape[i] /= layout.tensor;
    if (sharding[i] == "d") shape[i] /= layout.data;
  }
  return shape;
}

int64_t TransformerConfig::NumParameters() const {
  const int64_t per_layer = 4 * d_model * d_model + 2 * d_model * mlp_hidden + mlp_hidden + 6 * d_model;
  return layers * per_layer + 2 * vocab * d_model + seq_len * d_model + 2 * d_model;
}

std::string TransformerConfig::ToString() const {
  return absl::StrFormat("%d layers, d_model %d, %d heads, MLP %d, vocabulary %d, context %d: %.2fM parameters",
                         layers, d_model, heads, mlp_hidden, vocab, seq_len,
                         static_cast<double>(NumParameters()) / 1e6);
}

absl::StatusOr<TransformerConfig> TransformerPreset(std::string_view name) {
  TransformerConfig c;
  if (name == "tiny") {
    c.d_model = 32, c.heads = 2, c.layers = 2, c.mlp_hidden = 128, c.seq_len = 32;
  } else if (name == "small") {
    c.d_model = 64, c.heads = 4, c.layers = 4, c.mlp_hidden = 256, c.seq_len = 64;
  } else if (name == "medium") {
    c.d_model = 128, c.heads = 8, c.layers = 8, c.mlp_hidden = 512, c.seq_len = 128;
  } else if (name == "large") {
    c.d_model = 256, c.heads = 8, c.layers = 8, c.mlp_hidden = 1024, c.seq_len = 256;
  } else {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown model '", std::string(name), "': the sizes are tiny, small, medium and large"));
  }
  return c;
}

absl::StatusOr<TransformerModel> BuildTransformer(const TransformerConfig& config, const ParallelLayout& layout,
                                                  int64_t microbatch) {
  const TransformerConfig& c = config;
  const ParallelLayout& l = layout;
  auto positive = [](int64_t v) { return v >= 1 && v <= (int64_t{1} << 20); };
  if (!positive(c.vocab) || !positive(c.d_model) || !positive(c.heads) || !positive(c.layers) ||
      !positive(c.mlp_hidden) || !positive(c.seq_len) || !positive(l.data) || !positive(l.tensor) ||
      !positive(l.stages) || !positive(microbatch)) {
    return absl::InvalidArgumentError(absl::StrCat("model sizes and parallelism must be 1 to 2^20 (", c.ToString(),
                                                   "; data ", l.data, ", tensor ", l.tensor, ", stages ", l.stages,
                                                   ", microbatch ", microbatch, ")"));
  }
  if (c.d_model % c.heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("d_model ", c.d_model, " does not split into ", c.heads, " heads"));
  }
  if (c.heads % l.tensor != 0 || c.mlp_hidden % l.tensor != 0) {
    return absl::InvalidArgumentError(absl::StrCat("tensor parallelism ", l.tensor, " must divide the ", c.heads,
                                                   " heads and the MLP width ", c.mlp_hidden));
  }
  if (l.stages > c.layers) {
    return absl::InvalidArgumentError(
        absl::StrCat(l.stages, " pipeline stages for a model of ", c.layers, " layers: every stage needs a layer"));
  }
  if (microbatch % l.data != 0) {
    return absl::InvalidArgumentError(absl::StrCat("a microbatch of ", microbatch,
                                                   " sequences does not split over data parallelism ", l.data));
  }
  TransformerModel model;
  model.config = c;
  model.layout = l;
  model.microbatch = microbatch;
  model.tokens = {DType::kI64, {microbatch, c.seq_len + 1}};
  model.tokens_sharding = {"d", ""};
  Builder builder(c, l, microbatch);
  for (int s = 0; s < l.stages; ++s) {
    auto stage = builder.Stage(s);
    if (!stage.ok()) return stage.status();
    model.stages.push_back(*std::move(stage));
  }
  return model;
}

}  // namespace pathways

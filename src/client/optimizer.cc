#include "client/optimizer.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace pathways {

absl::StatusOr<FunctionSpec> AdamUpdate(const TensorSpec& param, const PartitionSpec& sharding,
                                        const AdamOptions& options) {
  return AdamUpdateGroup({param}, {sharding}, options);
}

absl::StatusOr<FunctionSpec> AdamUpdateGroup(const std::vector<TensorSpec>& params,
                                             const std::vector<PartitionSpec>& shardings,
                                             const AdamOptions& options) {
  if (params.empty() || params.size() != shardings.size()) {
    return absl::InvalidArgumentError(absl::StrCat("Adam needs one sharding per parameter: ", params.size(),
                                                   " parameters, ", shardings.size(), " shardings"));
  }
  for (const TensorSpec& param : params) {
    if (param.dtype != DType::kF32) {
      return absl::InvalidArgumentError(absl::StrCat("Adam updates f32 parameters, not ", param.ToString()));
    }
  }
  const auto& o = options;
  if (!(o.learning_rate > 0) || !(o.beta1 >= 0 && o.beta1 < 1) || !(o.beta2 >= 0 && o.beta2 < 1) ||
      !(o.epsilon > 0) || !(o.weight_decay >= 0)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Adam options out of range: learning rate %g (> 0), betas %g and %g (in [0, 1)), epsilon %g (> 0), "
        "weight decay %g (>= 0)",
        o.learning_rate, o.beta1, o.beta2, o.epsilon, o.weight_decay));
  }
  // The constants are part of the source, so each setting compiles once and runs without
  // scalar inputs. Every operation but the bias corrections is in place on donated buffers.
  auto num = [](double v) { return absl::StrFormat("%.17g", v); };
  const size_t n = params.size();
  std::vector<std::string> args;
  for (const char* group : {"p", "g", "m", "v"}) {
    for (size_t i = 0; i < n; ++i) args.push_back(absl::StrCat(group, i));
  }
  std::string source = absl::StrCat("def adam(", absl::StrJoin(args, ", "), ", count):\n    count.add_(1.0)\n",
                                    "    c1 = 1.0 - torch.pow(", num(o.beta1), ", count)\n",
                                    "    c2 = 1.0 - torch.pow(", num(o.beta2), ", count)\n");
  std::vector<std::string> results[3];
  for (size_t i = 0; i < n; ++i) {
    const std::string p = absl::StrCat("p", i), g = absl::StrCat("g", i), m = absl::StrCat("m", i),
                      v = absl::StrCat("v", i);
    if (o.weight_decay > 0) absl::StrAppend(&source, "    ", p, ".mul_(", num(1 - o.learning_rate * o.weight_decay), ")\n");
    absl::StrAppend(&source, "    ", m, ".mul_(", num(o.beta1), ").add_(", g, ", alpha=", num(1 - o.beta1), ")\n",
                    "    ", v, ".mul_(", num(o.beta2), ").addcmul_(", g, ", ", g, ", value=", num(1 - o.beta2), ")\n",
                    "    ", p, ".addcdiv_(", m, " / c1, (", v, " / c2).sqrt_().add_(", num(o.epsilon),
                    "), value=", num(-o.learning_rate), ")\n");
    results[0].push_back(p);
    results[1].push_back(m);
    results[2].push_back(v);
  }
  absl::StrAppend(&source, "    return ", absl::StrJoin(results[0], ", "), ", ", absl::StrJoin(results[1], ", "), ", ",
                  absl::StrJoin(results[2], ", "), ", count\n");
  const TensorSpec count{DType::kF32, {}};
  std::vector<TensorSpec> inputs, outputs;
  std::vector<PartitionSpec> in_shardings, out_shardings;
  for (int group = 0; group < 4; ++group) {
    inputs.insert(inputs.end(), params.begin(), params.end());
    in_shardings.insert(in_shardings.end(), shardings.begin(), shardings.end());
    if (group == 1) continue;  // gradients are read, not returned
    outputs.insert(outputs.end(), params.begin(), params.end());
    out_shardings.insert(out_shardings.end(), shardings.begin(), shardings.end());
  }
  inputs.push_back(count);
  outputs.push_back(count);
  in_shardings.push_back({});
  out_shardings.push_back({});
  FunctionSpec spec = FunctionSpec::Script("adam", std::move(source), std::move(inputs), std::move(outputs),
                                           std::move(in_shardings), std::move(out_shardings));
  // Params, moments and the count, in the order of the outputs, so each takes its own buffer.
  for (size_t i = 0; i < 4 * n + 1; ++i) {
    if (i < n || i >= 2 * n) spec.donated_inputs.push_back(static_cast<int>(i));
  }
  return spec;
}

}  // namespace pathways

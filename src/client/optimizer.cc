#include "client/optimizer.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace pathways {

absl::StatusOr<FunctionSpec> AdamUpdate(const TensorSpec& param, const PartitionSpec& sharding,
                                        const AdamOptions& options) {
  if (param.dtype != DType::kF32) {
    return absl::InvalidArgumentError(absl::StrCat("Adam updates f32 parameters, not ", param.ToString()));
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
  std::string source = "def adam(p, g, m, v, count):\n    count.add_(1.0)\n";
  if (o.weight_decay > 0) absl::StrAppend(&source, "    p.mul_(", num(1 - o.learning_rate * o.weight_decay), ")\n");
  absl::StrAppend(&source, "    m.mul_(", num(o.beta1), ").add_(g, alpha=", num(1 - o.beta1), ")\n",
                  "    v.mul_(", num(o.beta2), ").addcmul_(g, g, value=", num(1 - o.beta2), ")\n",
                  "    m_hat = m / (1.0 - torch.pow(", num(o.beta1), ", count))\n",
                  "    v_hat = v / (1.0 - torch.pow(", num(o.beta2), ", count))\n",
                  "    p.addcdiv_(m_hat, v_hat.sqrt_().add_(", num(o.epsilon), "), value=", num(-o.learning_rate), ")\n",
                  "    return p, m, v, count\n");
  const TensorSpec count{DType::kF32, {}};
  FunctionSpec spec = FunctionSpec::Script("adam", std::move(source), {param, param, param, param, count},
                                           {param, param, param, count},
                                           {sharding, sharding, sharding, sharding, {}}, {sharding, sharding, sharding, {}});
  spec.donated_inputs = {0, 2, 3, 4};
  return spec;
}

}  // namespace pathways

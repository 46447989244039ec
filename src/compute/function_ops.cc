#include "compute/function_ops.h"

#include <algorithm>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pathways {
namespace {

// The ops a body may call under FunctionOps::kVetted, by what they are. Every overload of each was
// called with hostile arguments on libtorch 1.13 (2026-12-07: about 380,000 calls, inputs viewed
// inside canary buffers; indices, sizes and offsets out of range or at +-2^63, empty, expanded and
// non-contiguous tensors, bad dtype numbers, operands that disagree, NaN). Ops found reading or
// writing outside their tensors or crashing were left out (UncheckedPublic below); the arguments
// that crashed kernels of ops kept here are checked before they reach them (compute/op_guards.h:
// integer divisions, dtype numbers, ints past 32 bits, `out=` overloads, sorting lists of NaN).
// Some ops can still take long (a kernel of 2^40) or ask for much memory (both bounded by the
// worker: the computation timeout, the device's memory). An op joins this list only after such a try.
constexpr const char* kVetted[] = {
    // TorchScript's own: what the compiler emits for Python's built-ins on numbers, lists, strings
    // and dicts, and the operators (`__getitem__`, `l[i] = v` as _set_item, `range` loops).
    "Bool Float Int FloatImplicit IntImplicit ScalarImplicit Delete append extend insert pop remove clear reverse "
    "count copy list dict keys values items get setdefault update popitem len size dim numel item sorted str format "
    "join split strip lstrip rstrip lower upper startswith endswith find replace ord chr floordiv divmod "
    "mathremainder warn device is_grad_enabled set_grad_enabled is_scripting is_floating_point is_complex "
    "is_contiguous is_nonzero is_same_size is_signed element_size stride result_type can_cast promote_types "
    "__getitem__ _set_item __range_length __derive_index __is__ __isnot__ __not__ __contains__ __and__ __or__ "
    "__xor__ __lshift__ __rshift__ __iand__ __ior__ __ixor__ __ilshift__ __irshift__ __round_to_zero_floordiv",
    // Elementwise, one operand.
    "abs absolute acos arccos acosh arccosh asin arcsin asinh arcsinh atan arctan atanh arctanh ceil floor round "
    "trunc fix frac sign sgn signbit neg negative positive reciprocal rsqrt sqrt square exp exp2 expm1 log log2 "
    "log10 log1p sin sinh cos cosh tan tanh sigmoid logit erf erfc erfinv lgamma digamma polygamma mvlgamma i0 sinc "
    "deg2rad rad2deg isnan isinf isfinite isposinf isneginf isreal nan_to_num logical_not bitwise_not clamp "
    "clamp_min clamp_max clip",
    // Elementwise, two or three operands.
    "add sub subtract rsub mul multiply div divide true_divide floor_divide remainder fmod pow float_power atan2 "
    "arctan2 hypot maximum minimum fmax fmin eq ne not_equal lt less le less_equal gt greater ge greater_equal "
    "equal isclose allclose logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor "
    "bitwise_left_shift bitwise_right_shift where lerp addcmul addcdiv copysign xlogy heaviside nextafter logaddexp "
    "logaddexp2 gcd lcm ldexp masked_fill masked_select masked_scatter",
    // Reductions, scans, sorting.
    "sum nansum mean nanmean prod max min amax amin aminmax argmax argmin all any std var std_mean var_mean norm "
    "linalg_norm linalg_vector_norm linalg_matrix_norm logsumexp cumsum cumprod cummax cummin logcumsumexp "
    "mode kthvalue topk sort argsort msort count_nonzero dist renorm quantile nanquantile histc "
    "unique_consecutive",
    // Linear algebra.
    "mm bmm matmul mv dot vdot inner outer ger addmm addmv addbmm baddbmm addr einsum tensordot linear bilinear "
    "kron chain_matmul linalg_multi_dot trace diag diagonal diag_embed diagflat tril triu cross linalg_cross "
    "inverse linalg_inv det linalg_det logdet slogdet linalg_slogdet linalg_solve cholesky linalg_cholesky "
    "cholesky_solve cholesky_inverse qr linalg_qr svd linalg_svd linalg_svdvals linalg_eigh linalg_eigvalsh "
    "pinverse linalg_pinv matrix_power linalg_matrix_power linalg_solve_triangular linalg_lstsq matrix_exp "
    "linalg_matrix_exp linalg_vecdot cdist pdist cosine_similarity pairwise_distance",
    // Shapes, views and indexing.
    "view view_as reshape reshape_as flatten unflatten squeeze unsqueeze permute transpose swapaxes swapdims "
    "movedim moveaxis t adjoint mT contiguous clone detach expand expand_as broadcast_to broadcast_tensors repeat "
    "repeat_interleave tile cat concat concatenate stack hstack vstack dstack column_stack row_stack "
    "split_with_sizes tensor_split hsplit vsplit dsplit chunk unbind unsafe_split unsafe_chunk "
    "unsafe_split_with_sizes narrow select slice index_select gather scatter scatter_add scatter_reduce index "
    "index_put index_add index_copy index_fill take take_along_dim flip fliplr flipud roll rot90 unfold nonzero "
    "argwhere ravel atleast_1d atleast_2d atleast_3d meshgrid block_diag cartesian_prod combinations diff "
    "searchsorted bucketize isin one_hot tril_indices triu_indices",
    // Dtypes and new tensors, random ones from the generator the worker's tenants share (no body may
    // seed it; pathways.uniform and pathways.normal are the caller's own streams).
    "to type_as zeros ones full empty zeros_like ones_like full_like empty_like new_zeros new_ones new_full "
    "new_empty arange range linspace logspace eye tensor scalar_tensor as_tensor fill zero rand randn randint "
    "randperm rand_like randn_like randint_like bernoulli multinomial normal uniform dropout feature_dropout "
    "alpha_dropout feature_alpha_dropout",
    // Neural networks.
    "relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh hardsigmoid hardswish hardshrink softshrink "
    "softplus threshold glu prelu log_sigmoid softmax log_softmax layer_norm group_norm batch_norm instance_norm "
    "embedding conv1d conv2d conv3d conv_transpose1d conv_transpose2d conv_transpose3d max_pool1d max_pool2d "
    "max_pool3d avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d "
    "adaptive_max_pool1d adaptive_max_pool2d constant_pad_nd "
    "replication_pad1d replication_pad2d pixel_unshuffle channel_shuffle cross_entropy_loss nll_loss nll_loss2d "
    "nll_loss_nd mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy binary_cross_entropy_with_logits "
    "kl_div soft_margin_loss margin_ranking_loss hinge_embedding_loss cosine_embedding_loss triplet_margin_loss "
    "poisson_nll_loss",
};

const absl::flat_hash_set<std::string>& Vetted() {
  static const auto* ops = [] {
    auto* set = new absl::flat_hash_set<std::string>;
    for (const char* group : kVetted) {
      for (absl::string_view op : absl::StrSplit(group, ' ', absl::SkipEmpty())) set->emplace(op);
    }
    return set;
  }();
  return *ops;
}

// Public ops of libtorch 1.13 that sweeps of hostile arguments (2026-12-07) found writing,
// reading or crashing out of bounds on CPU: bincount (a value of 2^63-1 writes before its output),
// median and nanmedian along a dim (an expanded input reads past it), reflection_pad* (an empty or
// -2^63 padding), as_strided* (an offset near 2^62 overflows the bounds check), linalg_ldl_solve and
// lu_unpack (pivots), batch_norm_update_stats and rrelu_with_noise
// (short running stats or noise), fractional_max_pool* (samples), ctc_loss (labels), the linear
// upsamplers (tiny scales, also reached through __interpolate and __upsample*), slow_conv* (a kernel
// size that is not the weight's), multi_margin_loss (a short weight), pixel_shuffle (an overflowing
// factor), grid_sampler* (a mode out of range returns memory never written); and set_ (a storage at
// any offset) and segment_reduce (an `unsafe` flag). Refused under both policies. searchsorted is
// refused only with a `sorter` (by its schema: compute/op_guards.cc).
bool UncheckedPublic(absl::string_view op) {
  static const auto* ops = new absl::flat_hash_set<absl::string_view>{"linalg_ldl_solve",
                                                                      "lu_unpack",
                                                                      "batch_norm_update_stats",
                                                                      "rrelu_with_noise",
                                                                      "ctc_loss",
                                                                      "upsample_linear1d",
                                                                      "upsample_bilinear2d",
                                                                      "upsample_trilinear3d",
                                                                      "multi_margin_loss",
                                                                      "pixel_shuffle",
                                                                      "set_",
                                                                      "segment_reduce",
                                                                      "__interpolate",
                                                                      "__upsample",
                                                                      "__upsample_bilinear",
                                                                      "bincount",
                                                                      "median",
                                                                      "nanmedian"};
  return ops->contains(op) || absl::StartsWith(op, "slow_conv") || absl::StartsWith(op, "as_strided") ||
         absl::StartsWith(op, "fractional_max_pool") || absl::StartsWith(op, "grid_sampler") ||
         absl::StartsWith(op, "reflection_pad");
}

}  // namespace

absl::StatusOr<FunctionOps> ParseFunctionOps(absl::string_view text) {
  if (text == "vetted") return FunctionOps::kVetted;
  if (text == "public") return FunctionOps::kPublic;
  return absl::InvalidArgumentError(
      absl::StrCat("unknown function ops '", text, "'; known: vetted (the default), public"));
}

const char* FunctionOpsName(FunctionOps ops) { return ops == FunctionOps::kVetted ? "vetted" : "public"; }

std::string RefusedOp(absl::string_view ns, absl::string_view op, FunctionOps ops) {
  constexpr const char* kElsewhere =
      "it runs part of the function on another thread, where the device's memory, its time limit and the op checks "
      "do not reach";
  if (ns == "pathways") return "";
  if (ns == "prim") {
    // TorchScript's control flow, constants, tuples and lists: the language itself.
    if (absl::StrContains(op, "rpc")) return "it calls other processes";
    if (op == "Print") return "it writes to the worker's log; a function's output is what it returns";
    // Not reachable from a source today (the compiler's resolver knows no `fork`), refused should
    // that change: a forked closure runs on libtorch's pool, past every check and bound of the body.
    if (op == "fork" || absl::StartsWith(op, "awaitable")) return kElsewhere;
    return "";
  }
  if (ns != "aten") return "a function may call aten, prim and pathways ops only";
  if (op == "wait") return kElsewhere;
  if (op == "from_file" || op == "save") return "it reads or writes files on the worker's host";
  if (op == "manual_seed" || op == "seed") {
    return "it reseeds the generator every tenant of the worker shares (pathways.uniform and pathways.normal are "
           "counter-based, the caller's own)";
  }
  const bool internal = (absl::StartsWith(op, "_") && !absl::StartsWith(op, "__") && op != "_set_item") ||
                        absl::StartsWith(op, "native_") || absl::StrContains(op, "backward") ||
                        absl::StrContains(op, "sparse") || absl::StrContains(op, "nested") ||
                        (absl::StrContains(op, "unsafe") && !absl::StartsWith(op, "unsafe_split") &&
                         !absl::StartsWith(op, "unsafe_chunk"));
  if (internal || UncheckedPublic(op)) return "it can reach memory outside its tensors (unchecked indices or sizes)";
  if (ops == FunctionOps::kPublic) return "";
  const bool in_place = op.size() > 1 && op.back() == '_' && !absl::EndsWith(op, "__");
  if (Vetted().contains(op) || (in_place && Vetted().contains(op.substr(0, op.size() - 1)))) return "";
  return "it is not among the ops vetted for workers that tenants share (src/compute/function_ops.cc lists "
         "them); a cluster whose tenants trust each other can allow every public op (worker flag "
         "--function-ops public)";
}

std::vector<std::string> VettedOps() {
  std::vector<std::string> ops(Vetted().begin(), Vetted().end());
  std::sort(ops.begin(), ops.end());
  return ops;
}

}  // namespace pathways

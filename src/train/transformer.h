// A decoder-only Transformer language model as compiled functions (pre-LayerNorm blocks, causal
// self-attention, a GELU MLP, learned positions), written for a mesh of data x tensor parallel
// devices and cut into pipeline stages. Torch-free: the functions are TorchScript sources that the
// workers compile; what this file knows is shapes, shardings and the order of parameters.
//
// Tensor parallelism is Megatron's: attention heads and the MLP's hidden units are split over the
// mesh axis "t" (query, key, value and the first MLP matmul by columns, the output projections by
// rows), so each block meets its partial products in two all_reduces over "t". The batch is split
// over "d". Everything else (embeddings, LayerNorms, biases added after an all_reduce, the output
// head) is replicated. Gradients need nothing more: FunctionSpec::Vjp differentiates the global
// function, so replicated parameters get their cotangents summed over the axes that replicate them
// (the data-parallel gradient all_reduce over "d" among them).
//
// Layers are stacked per stage: a stage holding layers [a, b) has one [b - a, ...] array per kind
// of block parameter. Every layer is initialised from its own global index (counter-based random
// numbers), so a model starts from the same values however it is cut into stages and shards.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "client/client.h"

namespace pathways {

struct TransformerConfig {
  int64_t vocab = 256;
  int64_t d_model = 64;
  int64_t heads = 4;
  int64_t layers = 2;
  int64_t mlp_hidden = 256;
  int64_t seq_len = 64;  // tokens a sequence feeds the model; the data draws one more as the last target
  uint64_t init_seed = 0;

  int64_t NumParameters() const;
  std::string ToString() const;
};

// Named sizes for `pathways train --model`: tiny, small, medium, large.
absl::StatusOr<TransformerConfig> TransformerPreset(std::string_view name);

// How a model is laid out over devices: each of `stages` pipeline stages runs on its own slice, a
// `data` x `tensor` mesh with axes "d" and "t".
struct ParallelLayout {
  int64_t data = 1;
  int64_t tensor = 1;
  int64_t stages = 1;
};

struct TransformerParam {
  std::string name;
  TensorSpec spec;        // global shape
  PartitionSpec sharding;  // over the stage's ("d", "t") mesh
};

// One pipeline stage's functions. Stage 0 takes tokens; the others the previous stage's
// activations. The last stage returns the loss instead of activations.
struct TransformerStage {
  int index = 0;
  int64_t first_layer = 0, num_layers = 0;
  bool first = false, last = false;
  std::vector<TransformerParam> params;
  // Inputs: (tokens | activations), [tokens when last and not first], params...; output:
  // activations [batch, seq, d_model] split over "d", or (last stage) the mean next-token loss
  // over the batch, a replicated f32 scalar.
  FunctionSpec forward;
  // No inputs; outputs: params..., then zeros shaped as each param twice (Adam's moments), then
  // a zero f32 scalar (Adam's step count).
  FunctionSpec init;
  // Inputs: accumulators..., addends...; outputs: accumulators (donated, added in place).
  // The accumulated values are the stage's parameter gradients, then (last stage) the loss.
  FunctionSpec accumulate;
};

struct TransformerModel {
  TransformerConfig config;
  ParallelLayout layout;
  int64_t microbatch = 0;  // sequences per forward call (the whole mesh's)
  std::vector<TransformerStage> stages;
  // The tokens one forward call on stage 0 (and the last stage) reads: [microbatch, seq_len + 1]
  // i64 split over "d".
  TensorSpec tokens;
  PartitionSpec tokens_sharding;
};

// The shape of one device's shard of an array of `shape` laid out by `sharding` over the layout's
// ("d", "t") mesh.
std::vector<int64_t> LocalShape(std::vector<int64_t> shape, const PartitionSpec& sharding, const ParallelLayout& layout);

// The model's functions for `layout` and forward calls of `microbatch` sequences. With one device
// per stage the sources call no `pathways` op: they are the model as plain libtorch runs it. Fails with
// InvalidArgument when the layout does not divide the model (heads or MLP width by the tensor
// axis, the microbatch by the data axis, layers by stages).
absl::StatusOr<TransformerModel> BuildTransformer(const TransformerConfig& config, const ParallelLayout& layout,
                                                  int64_t microbatch);

}  // namespace pathways

#include "train/transformer.h"

#include "gtest/gtest.h"

namespace pathways {
namespace {

TransformerConfig Small() {
  TransformerConfig c;
  c.vocab = 32, c.d_model = 32, c.heads = 4, c.layers = 3, c.mlp_hidden = 64, c.seq_len = 8;
  return c;
}

int64_t Elements(const TensorSpec& spec) {
  int64_t n = 1;
  for (int64_t d : spec.shape) n *= d;
  return n;
}

// Stages hold whole layers, every layer once; the embeddings sit on the first stage and the
// head on the last; the parameters of all stages add up to the model's count.
TEST(TransformerTest, StagesSplitTheLayersAndTheParameters) {
  for (int64_t stages : {1, 2, 3}) {
    auto model = BuildTransformer(Small(), {.data = 1, .tensor = 1, .stages = stages}, 4);
    ASSERT_TRUE(model.ok()) << model.status();
    ASSERT_EQ(model->stages.size(), static_cast<size_t>(stages));
    int64_t layers = 0, params = 0;
    for (const TransformerStage& s : model->stages) {
      EXPECT_EQ(s.first_layer, layers);
      EXPECT_GE(s.num_layers, 1);
      layers += s.num_layers;
      for (const TransformerParam& p : s.params) params += Elements(p.spec);
      EXPECT_EQ(s.params.front().name, s.first ? "tok_emb" : "ln1_g");
      EXPECT_EQ(s.params.back().name, s.last ? "head" : "b2");
      EXPECT_EQ(s.init.outputs.size(), 3 * s.params.size() + 1);
    }
    EXPECT_EQ(layers, 3);
    EXPECT_EQ(params, Small().NumParameters()) << stages << " stages";
  }
}

// Megatron's split: attention and the MLP's hidden units over "t", the batch over "d"; with one
// device the source is plain libtorch, with a tensor axis each block meets its partial sums twice.
TEST(TransformerTest, TensorParallelismSplitsHeadsAndTheMlp) {
  auto one = BuildTransformer(Small(), {}, 4);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(one->stages[0].forward.body.source.find("pathways."), std::string::npos);
  auto split = BuildTransformer(Small(), {.data = 2, .tensor = 2}, 4);
  ASSERT_TRUE(split.ok()) << split.status();
  const TransformerStage& s = split->stages[0];
  for (const TransformerParam& p : s.params) {
    const bool split_over_t = p.name == "wq" || p.name == "wk" || p.name == "wv" || p.name == "wo" ||
                              p.name == "w1" || p.name == "b1" || p.name == "w2";
    EXPECT_EQ(std::count(p.sharding.begin(), p.sharding.end(), "t"), split_over_t ? 1 : 0) << p.name;
    EXPECT_EQ(std::count(p.sharding.begin(), p.sharding.end(), "d"), 0) << p.name;
  }
  const std::string& source = s.forward.body.source;
  EXPECT_NE(source.find("pathways.all_reduce(a, 't')"), std::string::npos) << source;
  EXPECT_NE(source.find("pathways.all_reduce(h, 't')"), std::string::npos) << source;
  EXPECT_NE(source.find("pathways.all_reduce(nll, 'd', 'mean')"), std::string::npos) << source;
  EXPECT_EQ(split->tokens_sharding, (PartitionSpec{"d", ""}));
}

TEST(TransformerTest, LayoutsThatDoNotDivideTheModelAreRefused) {
  auto heads = BuildTransformer(Small(), {.tensor = 3}, 4);
  EXPECT_EQ(heads.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(heads.status().message().find("heads"), std::string::npos) << heads.status();
  auto stages = BuildTransformer(Small(), {.stages = 4}, 4);
  EXPECT_EQ(stages.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(stages.status().message().find("every stage needs a layer"), std::string::npos) << stages.status();
  auto batch = BuildTransformer(Small(), {.data = 3}, 4);
  EXPECT_EQ(batch.status().code(), absl::StatusCode::kInvalidArgument);
  TransformerConfig odd = Small();
  odd.d_model = 30;
  EXPECT_EQ(BuildTransformer(odd, {}, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildTransformer(Small(), {.data = 0}, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(TransformerPreset("huge").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(TransformerPreset("small").ok());
}

}  // namespace
}  // namespace pathways

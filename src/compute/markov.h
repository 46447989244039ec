// The built-in training data set: token sequences from a fixed random Markov chain. Its best
// possible loss is known (the chain's entropy rate), so a run shows how close training gets to it.
// Every token depends only on (chain seed, data seed, step, sequence, position): any host draws
// any part of any batch, the same on every run, with no state. Torch-free; the compute layer
// offers it to bodies as `pathways.markov_tokens`.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace pathways {

class MarkovSource {
 public:
  static constexpr int kMaxVocab = 4096;
  // A chain over `vocab` tokens whose rows are softmax(sharpness * standard normal draws) under
  // `seed`: the larger the sharpness, the more predictable the next token. Chains are built
  // once per (vocab, seed, sharpness) in a process and shared.
  static absl::StatusOr<std::shared_ptr<const MarkovSource>> Get(int vocab, uint64_t seed, double sharpness = 2.0);

  int vocab() const { return vocab_; }
  // P(next = j | current = i).
  double Transition(int i, int j) const { return transition_[static_cast<size_t>(i) * vocab_ + j]; }
  // The stationary distribution: where sequences start, and what the entropy rate weighs rows by.
  const std::vector<double>& stationary() const { return stationary_; }
  // The entropy rate in nats per token: sum over i of stationary(i) * H(row i). The expected
  // next-token cross-entropy of a model that knows the chain; no model does better on average.
  double EntropyRate() const { return entropy_rate_; }

  // Sequences first .. first + count - 1 of batch `step` under `data_seed`, each `length` tokens,
  // row-major into `out` (count * length tokens). Sequence s of a step is the same whoever draws it.
  void Sample(uint64_t data_seed, uint64_t step, int64_t first, int64_t count, int64_t length, int64_t* out) const;

 private:
  MarkovSource() = default;
  int vocab_ = 0;
  std::vector<double> transition_;  // row-major vocab x vocab
  std::vector<double> cumulative_;  // per row, running sums (the last is 1)
  std::vector<double> stationary_, stationary_cumulative_;
  double entropy_rate_ = 0;
};

}  // namespace pathways

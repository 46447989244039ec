#include "compute/markov.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "compute/counter_rng.h"

namespace pathways {
namespace {

// The index of the first cumulative value above `u` (u in [0, 1)).
int64_t Pick(const double* cumulative, int64_t n, double u) {
  const double* at = std::upper_bound(cumulative, cumulative + n, u);
  return std::min<int64_t>(at - cumulative, n - 1);
}

// A double in [0, 1) from two words.
double Unit53(uint32_t hi, uint32_t lo) {
  return static_cast<double>((uint64_t{hi} << 21) ^ (lo >> 11)) / 9007199254740992.0;  // 2^53
}

}  // namespace

absl::StatusOr<std::shared_ptr<const MarkovSource>> MarkovSource::Get(int vocab, uint64_t seed, double sharpness) {
  if (vocab < 2 || vocab > kMaxVocab) {
    return absl::InvalidArgumentError(absl::StrCat("a Markov source needs a vocabulary of 2 to ", kMaxVocab,
                                                   " tokens, not ", vocab));
  }
  if (!(sharpness >= 0 && sharpness <= 16)) {
    return absl::InvalidArgumentError(absl::StrCat("a Markov source's sharpness must be in [0, 16], not ", sharpness));
  }
  static std::mutex mu;
  static auto* chains = new std::map<std::tuple<int, uint64_t, double>, std::shared_ptr<const MarkovSource>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& chain = (*chains)[{vocab, seed, sharpness}];
  if (chain != nullptr) return chain;

  std::shared_ptr<MarkovSource> m(new MarkovSource());
  const size_t v = static_cast<size_t>(vocab);
  m->vocab_ = vocab;
  std::vector<float> draws(v * v);
  const int64_t shape[] = {vocab, vocab}, origin[] = {0, 0};
  FillRandom(RandomDistribution::kNormal, seed, /*step=*/0, shape, origin, shape, draws.data());
  m->transition_.resize(v * v);
  m->cumulative_.resize(v * v);
  for (size_t i = 0; i < v; ++i) {
    double* row = &m->transition_[i * v];
    const float top = *std::max_element(&draws[i * v], &draws[i * v] + v);
    double sum = 0;
    for (size_t j = 0; j < v; ++j) sum += row[j] = std::exp(sharpness * (draws[i * v + j] - top));
    double running = 0;
    for (size_t j = 0; j < v; ++j) m->cumulative_[i * v + j] = running += row[j] /= sum;
    m->cumulative_[i * v + v - 1] = 1;
  }
  // Every row is positive, so the chain is ergodic: power iteration converges to its one
  // stationary distribution.
  std::vector<double> pi(v, 1.0 / static_cast<double>(v)), next(v);
  for (int iteration = 0; iteration < 10000; ++iteration) {
    std::fill(next.begin(), next.end(), 0.0);
    for (size_t i = 0; i < v; ++i) {
      for (size_t j = 0; j < v; ++j) next[j] += pi[i] * m->transition_[i * v + j];
    }
    double change = 0;
    for (size_t j = 0; j < v; ++j) change += std::fabs(next[j] - pi[j]);
    pi.swap(next);
    if (change < 1e-14) break;
  }
  m->stationary_ = pi;
  double running = 0;
  for (double p : pi) m->stationary_cumulative_.push_back(running += p);
  m->stationary_cumulative_.back() = 1;
  for (size_t i = 0; i < v; ++i) {
    double h = 0;
    for (size_t j = 0; j < v; ++j) {
      const double p = m->transition_[i * v + j];
      if (p > 0) h -= p * std::log(p);
    }
    m->entropy_rate_ += pi[i] * h;
  }
  chain = std::move(m);
  return chain;
}

void MarkovSource::Sample(uint64_t data_seed, uint64_t step, int64_t first, int64_t count, int64_t length,
                          int64_t* out) const {
  const std::array<uint32_t, 2> key = {static_cast<uint32_t>(data_seed), static_cast<uint32_t>(data_seed >> 32)};
  for (int64_t s = 0; s < count; ++s) {
    const uint64_t sequence = static_cast<uint64_t>(first + s);
    int64_t* tokens = out + s * length;
    // Two uniform draws per block: tokens 2b and 2b + 1 of the sequence.
    std::array<uint32_t, 4> words{};
    for (int64_t t = 0; t < length; ++t) {
      if (t % 2 == 0) {
        words = PhiloxBlock({static_cast<uint32_t>(t / 2), static_cast<uint32_t>(sequence),
                             static_cast<uint32_t>(sequence >> 32) ^ static_cast<uint32_t>(step >> 32) * 0x9E3779B9u,
                             static_cast<uint32_t>(step)},
                            key);
      }
      const double u = t % 2 == 0 ? Unit53(words[0], words[1]) : Unit53(words[2], words[3]);
      tokens[t] = t == 0 ? Pick(stationary_cumulative_.data(), vocab_, u)
                         : Pick(&cumulative_[static_cast<size_t>(tokens[t - 1]) * vocab_], vocab_, u);
    }
  }
}

}  // namespace pathways

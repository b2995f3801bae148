// Text generation with a KV cache: the prompt runs once through the model, each new token runs one
// position, attending to the cached keys and values of every earlier position. Under longtrain-run
// the cache can be sharded over a sequence-parallel group (KvCache, decode_tokens' `group`).
#pragma once

#include <cstdint>
#include <vector>

#include "model/llama.h"
#include "parallel/communicator.h"

namespace longtrain::model {

// Positions 0 .. capacity-1 of one sequence. With `ranks` > 1 (sequence-parallel generation) the
// cache is sharded: rank r holds the keys and values of positions [r·block, (r+1)·block), block =
// ceil(capacity / ranks), so each rank stores 1/ranks of them.
class KvCache {
 public:
  KvCache(const LlamaConfig& config, Precision precision, int64_t max_len, int rank = 0, int ranks = 1);
  int64_t length() const { return length_; }      // positions filled, over all ranks
  int64_t capacity() const { return max_len_; }   // positions of the whole sequence
  int64_t first() const { return first_; }        // the global position of this rank's row 0
  int64_t block() const { return block_; }        // rows this rank holds
  Tensor keys(int64_t layer) const;    // [block, Hkv, D]: positions first() .. first() + block - 1
  Tensor values(int64_t layer) const;  // [block, Hkv, D]
  void advance(int64_t n) { length_ += n; }
  void clear() { length_ = 0; }

 private:
  int64_t max_len_, first_, block_;
  int64_t length_ = 0;
  Arena arena_;
};

// Runs `tokens` at positions cache.length() .. + n through the model, appends their K/V to the
// cache, and returns the logits of the last token (vocab_size floats, on the host).
//
// With `group` (sequence-parallel generation; the cache sharded over its ranks, every rank calling
// with the same tokens): every rank computes the tokens' layers, but attention splits over the
// ranks: each one attends the queries to the keys it holds (earlier positions fully, the new ones
// causally), and the partial results (O, LSE) are all-gathered and merged in rank order, the same
// on every rank. So every rank returns the same logits.
std::vector<float> decode_tokens(const LlamaModel& model, KvCache& cache, const std::vector<int32_t>& tokens,
                                 parallel::Communicator* group = nullptr);

struct SamplingParams {
  double temperature = 0.8;  // 0 = greedy
  double top_p = 0.95;
  uint64_t seed = 0;
};

// Samples a token id from logits with temperature and nucleus (top-p) filtering; `state` is the
// generator's state (splitmix64), advanced by each call.
int32_t sample_token(const std::vector<float>& logits, const SamplingParams& p, uint64_t& state);

// Prompt tokens in, `max_new_tokens` sampled tokens out (stops early at `stop_token` >= 0).
// With `group`, every rank of it calls generate with the same arguments: the KV cache is sharded over
// the ranks (each holds 1/P of it), the prompt runs in pieces of at most one rank's block, and every
// rank returns the same tokens (the same logits and sampler state everywhere).
std::vector<int32_t> generate(const LlamaModel& model, const std::vector<int32_t>& prompt, int64_t max_new_tokens,
                              const SamplingParams& p, int32_t stop_token = -1,
                              parallel::Communicator* group = nullptr);

}  // namespace longtrain::model

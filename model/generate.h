// Text generation with a KV cache: the prompt runs once through the model, each new token runs one
// position, attending to the cached keys and values of every earlier position.
#pragma once

#include <cstdint>
#include <vector>

#include "model/llama.h"

namespace longtrain::model {

class KvCache {
 public:
  KvCache(const LlamaConfig& config, Precision precision, int64_t max_len);
  int64_t length() const { return length_; }
  int64_t capacity() const { return max_len_; }
  Tensor keys(int64_t layer) const;    // [capacity, Hkv, D]
  Tensor values(int64_t layer) const;  // [capacity, Hkv, D]
  void advance(int64_t n) { length_ += n; }
  void clear() { length_ = 0; }

 private:
  int64_t max_len_;
  int64_t length_ = 0;
  Arena arena_;
};

// Runs `tokens` at positions cache.length() .. + n through the model, appends their K/V to the
// cache, and returns the logits of the last token (vocab_size floats, on the host).
std::vector<float> decode_tokens(const LlamaModel& model, KvCache& cache, const std::vector<int32_t>& tokens);

struct SamplingParams {
  double temperature = 0.8;  // 0 = greedy
  double top_p = 0.95;
  uint64_t seed = 0;
};

// Samples a token id from logits with temperature and nucleus (top-p) filtering; `state` is the
// generator's state (splitmix64), advanced by each call.
int32_t sample_token(const std::vector<float>& logits, const SamplingParams& p, uint64_t& state);

// Prompt tokens in, `max_new_tokens` sampled tokens out (stops early at `stop_token` >= 0).
std::vector<int32_t> generate(const LlamaModel& model, const std::vector<int32_t>& prompt, int64_t max_new_tokens,
                              const SamplingParams& p, int32_t stop_token = -1);

}  // namespace longtrain::model

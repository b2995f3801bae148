// Passkey retrieval (LongLoRA's passkey_retrivial.py, after Landmark Attention): a key hidden at a
// depth of a long run of filler text must be recalled at the end.
//
// The prompt is
//   "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I
//    will quiz you about the important information there." + the filler "The grass is green. The sky
//    is blue. The sun is yellow. Here we go. There and back again." repeated, with "The pass key is
//    N. Remember it. N is the pass key." after the fraction `depth` of the fillers, ending with
//    "What is the pass key? The pass key is"
// and the answer is " N" (N a random integer in 1..50000). The filler is repeated as often as fits in
// `length` tokens, answer included. Scoring is exact match of every answer token by greedy argmax
// under teacher forcing: token k of the answer must be the argmax after the prompt and the true
// answer tokens before it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "data/tokenizer.h"
#include "model/llama.h"
#include "parallel/communicator.h"
#include "parallel/layout.h"

namespace longtrain::trainer {

struct PasskeyPrompt {
  std::vector<int32_t> prompt;  // BOS (when the tokenizer has one) + the prompt's tokens
  std::vector<int32_t> answer;  // the tokens of " N" as they follow the prompt
  int64_t key_token = 0;        // index in `prompt` where the key sentence starts
  int64_t fillers = 0;          // filler repetitions
};

// Throws naming `length` when not even one filler fits.
PasskeyPrompt build_passkey_prompt(const data::Tokenizer& tokenizer, int64_t length, double depth, int64_t key);

// Appends `tokens` to the sequence so far and returns the logits of the next token (vocab_size values),
// as decoding with a KV cache does.
using NextTokenLogits = std::function<std::vector<float>(const std::vector<int32_t>& tokens)>;

// True when every answer token is the argmax of its teacher-forced logits: `append_and_predict` gets
// the prompt, then the true answer tokens one at a time (it stops at the first miss).
bool passkey_correct(const PasskeyPrompt& p, const NextTokenLogits& append_and_predict);

struct PasskeyCell {
  int64_t length = 0;
  double depth = 0.0;
  int64_t trials = 0, correct = 0;
  double accuracy() const { return trials ? static_cast<double>(correct) / static_cast<double>(trials) : 0.0; }
};

struct PasskeyOptions {
  std::vector<int64_t> lengths;
  std::vector<double> depths = {0.0, 0.25, 0.5, 0.75, 1.0};
  int64_t trials = 5;
  uint64_t seed = 0;  // keys: splitmix64 from it, one per (length, depth, trial)
};

// The grid, lengths outer and depths inner, each cell `trials` keys: with `model` decoding through a
// fresh KV cache per trial (model/generate.h; one process, not sequence parallel: the cross-check of
// passkey_eval_forward), or with one `append_and_predict` for every trial (each trial starts with a
// call that passes its whole prompt).
std::vector<PasskeyCell> passkey_eval(const model::LlamaModel& model, const data::Tokenizer& tokenizer,
                                      const PasskeyOptions& options);
std::vector<PasskeyCell> passkey_eval(const data::Tokenizer& tokenizer, const PasskeyOptions& options,
                                      const NextTokenLogits& append_and_predict);

// Where a one-forward passkey evaluation runs: this rank's place in the job (a single process is
// the default) and the layout its sequence-parallel group shards a sequence in.
struct PasskeyRanks {
  SeqLayout layout = SeqLayout::contiguous;
  int sp_rank = 0, sp_size = 1, dp_rank = 0, dp_size = 1;
  parallel::Communicator* world = nullptr;  // every rank of the job; null in a single process
};

// The tokens a trial of `length` runs over: `length` rounded up to what the layout splits over
// `sp_size` ranks (the padding follows the answer, so causal attention never lets it be seen).
int64_t passkey_forward_length(int64_t length, SeqLayout layout, int sp_size);

// The grid by one forward pass per trial, the way the scoring asks and the way that works
// under sequence parallelism: the prompt and the true answer (teacher forcing), padded to
// passkey_forward_length, sharded over the group as the loader shards a window (global positions for
// RoPE); every rank of the group runs the forward and takes the argmax at the answer rows it holds.
// Data-parallel groups take every dp_size-th trial; the counts meet in one reduction over `world`
// at the end, so every rank returns the same grid. `model` must hold
// passkey_forward_length(max length) / sp_size tokens and run causal attention.
std::vector<PasskeyCell> passkey_eval_forward(model::LlamaModel& model, const data::Tokenizer& tokenizer,
                                              const PasskeyOptions& options, const PasskeyRanks& ranks = {});

// The length × depth grid as text, as JSON ({"cells": [{length, depth, trials, correct, accuracy}]}),
// and as an SVG heatmap (accuracy 0 red to 1 green, one row per length, one column per depth).
std::string passkey_table(const std::vector<PasskeyCell>& cells);
std::string passkey_json(const std::vector<PasskeyCell>& cells);
std::string passkey_svg(const std::vector<PasskeyCell>& cells, const std::string& title);

}  // namespace longtrain::trainer

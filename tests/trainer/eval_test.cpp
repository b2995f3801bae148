// Evaluation and generation from a checkpoint (trainer/eval.cpp, model/generate.h): eval of a
// checkpoint reproduces the training loop's validation loss and follows the run's document mask,
// generate prints the prompt and its continuation as one text with either tokenizer kind, and eval's
// and generate's errors name the problem (through the real `longtrain` binary).
#include <unistd.h>

#include <cstdlib>
#include <filesystem>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "model/generate.h"
#include "model/hf_export.h"
#include "runtime/device.h"
#include "train_fixture.h"
#include "trainer/checkpoint.h"

namespace longtrain::trainer {
namespace {

using test::TrainTest;
using test::read_file;
using test::expect_no_source_location;
using test::run_cli;
namespace fs = std::filesystem;

TEST_F(TrainTest, EvalOfACheckpointReproducesTheLoopsValidationLoss) {
  TrainSummary s = train(config("evaluated", {"train.steps=3", "checkpoint.every=0"}));
  ASSERT_TRUE(s.final_eval && s.last_checkpoint);
  LoadedModel m = load_model_from_checkpoint(*s.last_checkpoint);
  EXPECT_EQ(m.step, 3);
  data::LoaderOptions o;
  o.shard_dir = m.config.data.train;
  o.split = "val";
  o.seq_len = m.config.data.seq_len;
  o.prefetch = 0;
  data::Loader val(o);
  EvalResult e = evaluate(*m.model, val, m.config.eval.batches, m.config.eval.position_buckets);
  EXPECT_EQ(e.loss, s.final_eval->loss);
  EXPECT_EQ(e.tokens, s.final_eval->tokens);
  EXPECT_EQ(e.bucket_loss.size(), static_cast<size_t>(m.config.eval.position_buckets));
}

// eval and generate refuse what they cannot use, naming it: a checkpoint missing a file, a missing
// tokenizer, a tokenizer or data whose vocabulary is not the model's.
// `longtrain eval` follows the checkpoint's data.document_mask, and --document-mask overrides it: the
// printed validation loss is the run's final one with the mask and another one without it.
TEST_F(TrainTest, EvalCliFollowsTheRunsDocumentMask) {
  TrainSummary s = train(config("cli_docmask", {"train.steps=2", "checkpoint.every=0", "eval.batches=3",
                                                "optim.warmup_steps=1", "data.document_mask=true"}));
  ASSERT_TRUE(s.last_checkpoint && s.final_eval);
  const std::string masked_line = fmt::format("validation loss {:.4f}", s.final_eval->loss);
  std::string out;
  ASSERT_EQ(run_cli("eval --checkpoint " + s.last_checkpoint->string() + " --batches 3", out), 0) << out;
  EXPECT_NE(out.find("document mask on"), std::string::npos) << out;
  EXPECT_NE(out.find(masked_line), std::string::npos) << out;
  ASSERT_EQ(run_cli("eval --checkpoint " + s.last_checkpoint->string() + " --batches 3 --document-mask false", out), 0)
      << out;
  EXPECT_EQ(out.find("document mask on"), std::string::npos) << out;
  EXPECT_EQ(out.find(masked_line), std::string::npos) << out;
  EXPECT_NE(out.find("validation loss "), std::string::npos) << out;
  EXPECT_NE(run_cli("eval --checkpoint " + s.last_checkpoint->string() + " --document-mask maybe", out), 0) << out;
}

TEST_F(TrainTest, EvalAndGenerateErrorsNameTheProblem) {
  TrainSummary s = train(config("cli_errors", {"train.steps=2", "checkpoint.every=0", "eval.batches=1"}));
  ASSERT_TRUE(s.last_checkpoint);
  const fs::path good = *s.last_checkpoint;
  std::string out;
  ASSERT_EQ(run_cli("eval --checkpoint " + good.string(), out), 0) << out;
  ASSERT_EQ(run_cli("generate --checkpoint " + good.string() + " --prompt 'the cat' --max-new-tokens 3", out), 0)
      << out;

  // An incomplete checkpoint: its model file is gone.
  const fs::path incomplete = root_ / "cli_errors_incomplete";
  fs::copy(good, incomplete, fs::copy_options::recursive);
  fs::remove(incomplete / "model.safetensors");
  for (const char* cmd : {"eval", "generate"}) {
    const std::string extra = std::string(cmd) == "generate" ? " --prompt hi --max-new-tokens 3" : "";
    EXPECT_EQ(run_cli(std::string(cmd) + " --checkpoint " + incomplete.string() + extra, out), 1) << cmd << out;
    EXPECT_NE(out.find(incomplete.string()), std::string::npos) << cmd << ": " << out;
    EXPECT_NE(out.find("model.safetensors"), std::string::npos) << cmd << ": " << out;
    expect_no_source_location(out);
  }

  // No tokenizer: the run's data.tokenizer was moved away, so the checkpoint holds none either.
  TrainSummary moved = train(config("cli_errors_moved_tokenizer", {"train.steps=2", "checkpoint.every=0",
                                                                   "eval.batches=0",
                                                                   "data.tokenizer=" + (root_ / "gone.model").string()}));
  ASSERT_TRUE(moved.last_checkpoint);
  ASSERT_FALSE(fs::exists(*moved.last_checkpoint / "tokenizer.model"));
  EXPECT_EQ(run_cli("generate --checkpoint " + moved.last_checkpoint->string() + " --prompt hi --max-new-tokens 3",
                    out), 1) << out;
  EXPECT_NE(out.find("gone.model"), std::string::npos) << out;
  EXPECT_NE(out.find("--tokenizer"), std::string::npos) << out;
  // An explicit --tokenizer that is not there is refused, not replaced by the checkpoint's.
  EXPECT_EQ(run_cli("generate --checkpoint " + good.string() + " --prompt hi --max-new-tokens 3 --tokenizer " +
                        (root_ / "nowhere.model").string(), out), 1) << out;
  EXPECT_NE(out.find("nowhere.model"), std::string::npos) << out;

  // A vocabulary that is not the model's: another tokenizer, and data prepared with it.
  const fs::path other = root_ / "cli_errors_other";
  fs::create_directories(other);
  tokenizer_and_shards(other, 300);
  EXPECT_EQ(run_cli("generate --checkpoint " + good.string() + " --prompt hi --max-new-tokens 3 --tokenizer " +
                        (other / "tok.model").string(), out), 1) << out;
  EXPECT_NE(out.find("300"), std::string::npos) << out;
  EXPECT_NE(out.find("320"), std::string::npos) << out;
  EXPECT_EQ(run_cli("eval --checkpoint " + good.string() + " --data " + (other / "shards").string(), out), 1) << out;
  EXPECT_NE(out.find("300"), std::string::npos) << out;
  EXPECT_NE(out.find("320"), std::string::npos) << out;
  expect_no_source_location(out);
}

// generate prints the prompt and its continuation decoded as one sequence: what SentencePiece gives
// for the prompt's tokens followed by the sampled ones (greedy here, so the test can sample the same).
TEST_F(TrainTest, GeneratePrintsPromptAndContinuationAsOneText) {
  TrainSummary s = train(config("generated", {"train.steps=6", "checkpoint.every=0", "eval.batches=0"}));
  ASSERT_TRUE(s.last_checkpoint);
  const std::string prompt = "the old man";
  std::string out;
  ASSERT_EQ(run_cli("generate --checkpoint " + s.last_checkpoint->string() + " --prompt '" + prompt +
                        "' --temperature 0 --max-new-tokens 8", out), 0) << out;
  LoadedModel m = load_model_from_checkpoint(*s.last_checkpoint, 1);
  data::Tokenizer tok((*s.last_checkpoint / "tokenizer.model").string());
  std::vector<int32_t> ids;
  if (tok.bos_id() >= 0) ids.push_back(tok.bos_id());
  const std::vector<int32_t> prompt_ids = tok.encode(prompt);
  ids.insert(ids.end(), prompt_ids.begin(), prompt_ids.end());
  model::SamplingParams greedy;
  greedy.temperature = 0;
  const std::vector<int32_t> continuation = model::generate(*m.model, ids, 8, greedy, tok.eos_id());
  ASSERT_FALSE(continuation.empty());
  std::vector<int32_t> all = prompt_ids;
  all.insert(all.end(), continuation.begin(), continuation.end());
  EXPECT_EQ(out, tok.decode(all) + "\n");
  EXPECT_EQ(out.rfind(prompt, 0), 0u) << out;
  // A continuation whose first piece starts a word keeps the space in front of it.
  if (tok.piece(continuation[0]).rfind("\xe2\x96\x81", 0) == 0) {
    EXPECT_EQ(out[prompt.size()], ' ') << out;
  }
}

// A Hugging Face directory whose tokenizer is a tokenizer.json (GPT-2-style byte-level BPE from the
// parity fixture): generate picks it by default and prints the prompt and the greedy continuation
// as the tokenizer decodes them; a run with data.tokenizer = a tokenizer.json keeps it in each
// checkpoint under that name.
TEST_F(TrainTest, GenerateAndCheckpointsUseATokenizerJson) {
  const fs::path json_path = fs::path(LONGTRAIN_HF_TOKENIZER_FIXTURE) / "gpt2_style/tokenizer.json";
  const fs::path dir = root_ / "hf_bpe";
  fs::create_directories(dir);
  model::LlamaConfig cfg;
  cfg.vocab_size = 1024;  // the tokenizer's 1000 ids, padded as published models pad theirs
  cfg.dim = 32;
  cfg.n_layers = 1;
  cfg.n_heads = 4;
  cfg.n_kv_heads = 2;
  cfg.head_dim = 8;
  cfg.ffn_dim = 64;
  cfg.max_seq_len = 64;
  {
    model::LlamaModel random(cfg, model::Precision::cpu(DType::f32), model::CheckpointPolicy::none, 64);
    random.initialize(5, 0.5);
    model::HfLlamaConfig hf;
    hf.model = cfg;
    model::export_hf_directory(dir.string(), hf, random.params(), DType::f32);
  }
  fs::copy_file(json_path, dir / "tokenizer.json");
  const std::string prompt = "It is a truth universally acknowledged";
  std::string out;
  ASSERT_EQ(run_cli("generate --checkpoint " + dir.string() + " --prompt '" + prompt +
                        "' --temperature 0 --max-new-tokens 6", out), 0) << out;
  LoadedModel m = load_model_from_checkpoint(dir, 1);
  EXPECT_EQ(m.config.data.tokenizer, (dir / "tokenizer.json").string());
  data::Tokenizer tok((dir / "tokenizer.json").string());
  ASSERT_TRUE(tok.is_hf());
  const std::vector<int32_t> prompt_ids = tok.encode(prompt);
  model::SamplingParams greedy;
  greedy.temperature = 0;
  const std::vector<int32_t> continuation = model::generate(*m.model, prompt_ids, 6, greedy, tok.eos_id());
  std::vector<int32_t> all = prompt_ids;
  all.insert(all.end(), continuation.begin(), continuation.end());
  EXPECT_EQ(out, tok.decode(all) + "\n");
  EXPECT_EQ(out.rfind(" " + prompt, 0), 0u) << out;  // GPT-2's add_prefix_space
  // A tokenizer smaller than the model is fine for a tokenizer.json, a larger one is not.
  fs::create_directories(root_ / "hf_small");
  for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(dir / f, root_ / "hf_small" / f);
  fs::copy_file(fs::path(LONGTRAIN_HF_TOKENIZER_FIXTURE) / "llama3_style/tokenizer.json",
                root_ / "hf_small/tokenizer.json");
  EXPECT_EQ(run_cli("generate --checkpoint " + (root_ / "hf_small").string() + " --prompt hi", out), 1) << out;
  EXPECT_NE(out.find("has 1501 pieces but the model's vocabulary is 1024"), std::string::npos) << out;

  TrainSummary s = train(config("json_tok", {"train.steps=2", "checkpoint.every=0", "eval.batches=0",
                                             "data.tokenizer=" + json_path.string()}));
  ASSERT_TRUE(s.last_checkpoint);
  EXPECT_TRUE(read_file(*s.last_checkpoint / "tokenizer.json") == read_file(json_path));
  EXPECT_FALSE(fs::exists(*s.last_checkpoint / "tokenizer.model"));
}

}  // namespace
}  // namespace longtrain::trainer

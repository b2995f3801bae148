// model.init_from: a run starts from a Hugging Face Llama directory's weights (at step 0, with a
// fresh optimizer); the shape comes from its config.json and a contradicting key is an error naming
// both values; data.tokenizer defaults to its tokenizer.model; --resume continues from the run's own
// checkpoint and never reads the directory's weights again; eval loads a plain HF directory.
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>

#include "model/hf_export.h"
#include "model/safetensors.h"
#include "train_fixture.h"

namespace longtrain::trainer::test {
namespace {

using ::longtrain::test::error_of;

std::vector<float> arena_floats(const fs::path& safetensors_file, const std::string& name) {
  model::SafetensorsFile f(safetensors_file.string());
  const model::SafetensorsTensor* t = f.find(name);
  EXPECT_NE(t, nullptr) << name;
  if (!t) return {};
  EXPECT_EQ(t->shape.size(), 2u) << name;
  if (t->shape.size() != 2) return {};
  std::vector<float> out(static_cast<size_t>(t->numel));
  f.read(name, Tensor(out.data(), DType::f32, {t->shape[0], t->shape[1]}));
  return out;
}

class InitFromTest : public TrainTest {
 protected:
  // A plain Hugging Face directory (config.json, model.safetensors, tokenizer.model; no MANIFEST) made
  // from a short run's final checkpoint, stored in bf16 as most published checkpoints are.
  static fs::path hf_directory() {
    static fs::path dir;
    if (!dir.empty()) return dir;
    TrainSummary s = train(config("source", {"train.steps=20", "checkpoint.every=0", "eval.batches=0"}));
    EXPECT_TRUE(s.last_checkpoint.has_value());
    dir = root_ / "hf_source";
    fs::create_directories(dir);
    const LoadedModel m = load_model_from_checkpoint(*s.last_checkpoint);
    model::HfLlamaConfig hf;
    hf.model = m.config.model;
    model::export_hf_directory(dir.string(), hf, m.model->params(), DType::bf16);
    fs::copy_file(root_ / "tok.model", dir / "tokenizer.model");
    return dir;
  }
};

TEST_F(InitFromTest, ShapeAndTokenizerComeFromTheDirectory) {
  const fs::path dir = hf_directory();
  const std::string yaml = fmt::format("model:\n  init_from: {}\ndata:\n  train: {}\n  seq_len: 32\n", dir.string(),
                                       (root_ / "shards").string());
  TrainConfig c = config_from_yaml_string(yaml);
  EXPECT_EQ(c.model.vocab_size, 320);
  EXPECT_EQ(c.model.dim, 32);
  EXPECT_EQ(c.model.n_layers, 2);
  EXPECT_EQ(c.model.n_kv_heads, 2);
  EXPECT_EQ(c.model.ffn_dim, 64);
  EXPECT_EQ(c.model.max_seq_len, 64);
  EXPECT_EQ(c.data.tokenizer, (dir / "tokenizer.model").string());

  // The keys that extend the context may change; a shape key may not.
  TrainConfig longer = config_from_yaml_string(
      yaml, {"model.max_seq_len=512", "model.rope_theta=80000", "model.rope_scaling=yarn", "model.rope_factor=8",
             "model.rope_original_max_position_embeddings=64"});
  EXPECT_EQ(longer.model.max_seq_len, 512);
  EXPECT_EQ(longer.model.rope_theta, 80000.0);
  EXPECT_EQ(longer.model.rope_scaling.type, "yarn");
  EXPECT_EQ(longer.model.dim, 32);
  std::string msg = error_of([&] { config_from_yaml_string(yaml, {"model.dim=48"}); });
  EXPECT_NE(msg.find("model.dim is 48"), std::string::npos) << msg;
  EXPECT_NE(msg.find("hidden_size = 32"), std::string::npos) << msg;
  EXPECT_NE(msg.find((dir / "config.json").string()), std::string::npos) << msg;
  msg = error_of([&] { config_from_yaml_string(yaml, {"model.tie_embeddings=true"}); });
  EXPECT_NE(msg.find("model.tie_embeddings is true"), std::string::npos) << msg;
  EXPECT_NE(msg.find("tie_word_embeddings = false"), std::string::npos) << msg;
  msg = error_of([&] { config_from_yaml_string(yaml, {"model.init_from=" + (root_ / "nowhere").string()}); });
  EXPECT_NE(msg.find("model.init_from"), std::string::npos) << msg;
  EXPECT_NE(msg.find("nowhere' is not a directory"), std::string::npos) << msg;
  msg = error_of([&] { config_from_yaml_string(yaml, {"model.init_from=" + (root_ / "shards").string()}); });
  EXPECT_NE(msg.find("has no config.json"), std::string::npos) << msg;
}

// rope_scaling written as in config.json, a mapping inside the model section.
TEST_F(InitFromTest, RopeScalingAsAMapping) {
  const std::string yaml = fmt::format(
      "model:\n  max_seq_len: 2048\n  rope_scaling: {{rope_type: yarn, factor: 8, original_max_position_embeddings: "
      "256, beta_fast: 16}}\ndata:\n  train: {}\n  seq_len: 2048\n",
      (root_ / "shards").string());
  TrainConfig c = config_from_yaml_string(yaml);
  EXPECT_EQ(c.model.rope_scaling.type, "yarn");
  EXPECT_EQ(c.model.rope_scaling.factor, 8.0);
  EXPECT_EQ(c.model.rope_scaling.original_max_position_embeddings, 256);
  EXPECT_EQ(c.model.rope_scaling.beta_fast, 16.0);
  std::string msg = error_of([&] {
    config_from_yaml_string("model:\n  rope_scaling: {rope_type: yarn, factr: 8}\ndata:\n  train: x\n");
  });
  EXPECT_NE(msg.find("<string>:2: model.rope_scaling has no field 'factr'"), std::string::npos) << msg;
  msg = error_of([&] { config_from_yaml_string("model:\n  rope_scaling: yarn\ndata:\n  train: x\n"); });
  EXPECT_NE(msg.find("rope_scaling yarn needs model.rope_factor"), std::string::npos) << msg;
  msg = error_of([&] { config_from_yaml_string("model:\n  rope_scaling: yarm\ndata:\n  train: x\n"); });
  EXPECT_NE(msg.find("model.rope_scaling: expected one of default, linear, dynamic, yarn, llama3, got 'yarm'"),
            std::string::npos)
      << msg;
}

TEST_F(InitFromTest, RunStartsAtStepZeroFromTheWeightsAndResumeNeverRereadsThem) {
  const fs::path dir = hf_directory();
  // Learning rate 0: after its steps the run's weights are still the directory's (bf16 widened to f32).
  TrainConfig c = config("init_lr0", {"model.init_from=" + dir.string(), "optim.lr=0", "optim.min_lr=0",
                                      "optim.warmup_steps=0", "train.steps=2", "checkpoint.every=1", "eval.batches=0"});
  TrainSummary s = train(c);
  EXPECT_EQ(s.first_step, 1);
  ASSERT_EQ(s.losses.size(), 2u);
  // On the same first batch, the pretrained weights do better than the random init the run would
  // otherwise start from.
  TrainSummary random = train(config("random_lr0", {"optim.lr=0", "optim.min_lr=0", "optim.warmup_steps=0",
                                                    "train.steps=1", "checkpoint.every=0", "eval.batches=0"}));
  ASSERT_EQ(random.losses.size(), 1u);
  EXPECT_LT(s.losses[0], random.losses[0] - 0.3);
  for (const char* name : {"model.embed_tokens.weight", "model.layers.1.mlp.down_proj.weight", "lm_head.weight"}) {
    EXPECT_EQ(arena_floats(*s.last_checkpoint / "model.safetensors", name), arena_floats(dir / "model.safetensors", name))
        << name;
  }

  // Resume: the directory's weights are not read again (they are gone), the run's checkpoint is.
  TrainConfig r = config("init_resume", {"model.init_from=" + dir.string(), "train.steps=3", "checkpoint.every=1",
                                         "eval.batches=0"});
  TrainSummary first = train(r);
  ASSERT_EQ(first.losses.size(), 3u);
  const fs::path saved = root_ / "hf_source_weights.safetensors";
  fs::rename(dir / "model.safetensors", saved);
  fs::remove_all(fs::path(r.checkpoint.dir) / "step_3");
  TrainSummary resumed = train(r, "auto");
  fs::rename(saved, dir / "model.safetensors");
  EXPECT_EQ(resumed.first_step, 3);
  ASSERT_EQ(resumed.losses.size(), 1u);
  EXPECT_EQ(resumed.losses[0], first.losses[2]);
  // A fresh run does read them: without the weights it fails naming the directory.
  fs::rename(dir / "model.safetensors", saved);
  std::string msg = error_of([&] { train(config("init_missing", {"model.init_from=" + dir.string()})); });
  fs::rename(saved, dir / "model.safetensors");
  EXPECT_NE(msg.find("model.init_from '" + dir.string() + "'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("neither model.safetensors nor model.safetensors.index.json"), std::string::npos) << msg;
}

// eval and generate's loader takes a plain HF directory (no MANIFEST.json) as well as a checkpoint,
// at any length.
// One of our own checkpoints is a Hugging Face directory too: init_from takes its weights only, and the
// new run starts at step 0 with a fresh optimizer and a fresh loader (a new run from an old one).
TEST_F(InitFromTest, OwnCheckpointStartsANewRunFromItsWeightsOnly) {
  TrainSummary old = train(config("old_run", {"train.steps=6", "checkpoint.every=0", "eval.batches=0"}));
  ASSERT_TRUE(old.last_checkpoint);
  const fs::path ckpt = *old.last_checkpoint;  // .../step_6 with MANIFEST, optimizer shard, trainer state
  ASSERT_TRUE(fs::exists(ckpt / "optimizer.rank0.safetensors"));

  // During step 1 (before its update) the weights are the checkpoint's, bit for bit.
  TrainHooks hooks;
  std::vector<float> at_step1;
  hooks.after_backward = [&](int64_t step, model::LlamaModel& m) {
    if (step != 1 || !at_step1.empty()) return;
    const Tensor p = m.params().flat();
    at_step1.assign(p.ptr<float>(), p.ptr<float>() + p.numel());
  };
  TrainConfig c = config("from_own", {"train.steps=2", "checkpoint.every=0", "eval.batches=0",
                                      "model.init_from=" + ckpt.string()});
  TrainSummary fresh = train(c, "", hooks);
  EXPECT_EQ(fresh.first_step, 1) << "init_from starts a new run at step 0";
  EXPECT_EQ(fresh.losses.size(), 2u);
  const LoadedModel source = load_model_from_checkpoint(ckpt);
  const Tensor sp = source.model->params().flat();
  ASSERT_EQ(at_step1.size(), static_cast<size_t>(sp.numel()));
  EXPECT_TRUE(std::equal(at_step1.begin(), at_step1.end(), sp.ptr<float>())) << "the weights are not the checkpoint's";
  // Its first loss is the old model's loss on the new run's first batch, far below a random start's.
  TrainSummary random = train(config("random_start", {"train.steps=2", "checkpoint.every=0", "eval.batches=0"}));
  EXPECT_LT(fresh.losses[0], random.losses[0] - 0.3) << fresh.losses[0] << " vs " << random.losses[0];
  // The new run's state is its own: step 2, a loader at its start plus two steps, a fresh optimizer.
  const nlohmann::json state =
      nlohmann::json::parse(read_file(*fresh.last_checkpoint / "trainer_state.json"));
  EXPECT_EQ(state.at("step").get<int64_t>(), 2);
  EXPECT_EQ(state.at("optimizer_steps").get<int64_t>(), 2);
  EXPECT_EQ(state.at("loader").at("cursor").get<int64_t>(), 2 * 4);
}

TEST_F(InitFromTest, EvalLoadsAPlainHuggingFaceDirectory) {
  const fs::path dir = hf_directory();
  ASSERT_FALSE(fs::exists(dir / "MANIFEST.json"));
  LoadedModel m = load_model_from_checkpoint(dir, 48);
  EXPECT_EQ(m.step, 0);
  EXPECT_EQ(m.config.model.dim, 32);
  EXPECT_EQ(m.config.data.tokenizer, (dir / "tokenizer.model").string());
  EXPECT_TRUE(m.config.data.train.empty());
  data::LoaderOptions o;
  o.shard_dir = (root_ / "shards").string();
  o.split = "val";
  o.seq_len = 48;  // beyond the source run's 32
  o.prefetch = 0;
  data::Loader val(o);
  EvalResult e = evaluate(*m.model, val, 2, 4);
  EXPECT_TRUE(std::isfinite(e.loss));
  EXPECT_LT(e.loss, std::log(320.0) - 0.3);  // the trained weights, not a random init
  EXPECT_GT(e.tokens, 0);
  EXPECT_LE(e.tokens, 2 * 48);
  std::string msg = error_of([&] { load_model_from_checkpoint(root_ / "shards"); });
  EXPECT_NE(msg.find("neither a longtrain checkpoint"), std::string::npos) << msg;
}

}  // namespace
}  // namespace longtrain::trainer::test

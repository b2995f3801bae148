// The training config: a valid file round-trips through resolved_yaml with the same values and hash;
// defaults and --set overrides apply; every class of mistake (unknown key or section, wrong type,
// out of range, inconsistent combination, missing file, malformed YAML) is an error whose text
// starts with the file and line (or the --set) and names the key; loading creates nothing.
#include <algorithm>
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "runtime/error.h"
#include "test_util.h"
#include "trainer/config.h"

namespace longtrain::trainer {
namespace {

namespace fs = std::filesystem;

constexpr const char* kName = "cfg/test.yaml";

// A small valid config; line numbers matter to the tests below.
constexpr const char* kValid = R"(model:
  vocab_size: 512
  dim: 64
  n_layers: 2
  n_heads: 4
  n_kv_heads: 2
  ffn_dim: 176
  max_seq_len: 512
  checkpoint: full
data:
  train: data/tiny
  seq_len: 256
train:
  device: cpu
  dtype: f64
  steps: 50
  seed: 7
optim:
  lr: 1e-3
  min_lr: 1e-4
  warmup_steps: 5
  no_decay: [norm, bias]
parallel:
  sp_size: 2
  layout: contiguous
attention:
  schedule: distflash
logging:
  run_dir: runs/custom
  plot: false
)";

TrainConfig load(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  return config_from_yaml_string(yaml, overrides, kName);
}

// The message of the longtrain::Error that `f` throws ("" and a test failure when it throws none).
using ::longtrain::test::error_of;

std::string load_error(const std::string& yaml, const std::vector<std::string>& overrides = {}) {
  return error_of([&] { load(yaml, overrides); });
}

::testing::AssertionResult starts_with(const std::string& text, const std::string& prefix) {
  if (text.rfind(prefix, 0) == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\"\n does not start with \"" << prefix << "\"";
}

::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << text << "\"\n does not contain \"" << part << "\"";
}

TEST(TrainerConfig, ValidFileLoadsWithItsValues) {
  TrainConfig c = load(kValid);
  EXPECT_EQ(c.source, kName);
  EXPECT_EQ(c.model.vocab_size, 512);
  EXPECT_EQ(c.model.head_dim, 16);  // 0 in the table: dim / n_heads
  EXPECT_EQ(c.model.checkpoint, model::CheckpointPolicy::full);
  EXPECT_EQ(c.data.train, "data/tiny");
  EXPECT_EQ(c.train.device, DeviceChoice::cpu);
  EXPECT_EQ(c.train.dtype, DTypeChoice::f64);
  EXPECT_EQ(c.train.seed, 7);
  EXPECT_DOUBLE_EQ(c.optim.lr, 1e-3);
  EXPECT_EQ(c.optim.no_decay, (std::vector<std::string>{"norm", "bias"}));
  EXPECT_EQ(c.parallel.layout, SeqLayout::contiguous);
  EXPECT_EQ(c.attention.schedule, AttentionSchedule::distflash);
  EXPECT_EQ(c.logging.run_dir, "runs/custom");
  EXPECT_EQ(c.checkpoint.dir, (fs::path("runs/custom") / "checkpoints").string());
  EXPECT_FALSE(c.logging.plot);
}

TEST(TrainerConfig, ResolvedYamlRoundTrips) {
  TrainConfig c = load(kValid);
  const std::string text = resolved_yaml(c);
  TrainConfig back = load(text);
  EXPECT_EQ(resolved_yaml(back), text);
  EXPECT_EQ(config_hash(back), config_hash(c));
  EXPECT_TRUE(config_changes(c, back).empty());
  EXPECT_EQ(back.model.head_dim, 16);
  EXPECT_EQ(back.optim.no_decay, c.optim.no_decay);
  EXPECT_DOUBLE_EQ(back.optim.min_lr, 1e-4);
  EXPECT_TRUE(contains(text, "config_hash: " + config_hash(c)));

  // Awkward strings survive the trip too (quoted on the way out).
  TrainConfig odd = load(kValid, {"data.val=\"dir with spaces/#x: y\"", R"(data.tokenizer='it''s \ "q" é')"});
  TrainConfig odd_back = load(resolved_yaml(odd));
  EXPECT_EQ(odd_back.data.val, "dir with spaces/#x: y");
  EXPECT_EQ(odd_back.data.tokenizer, R"(it's \ "q" é)");
  EXPECT_EQ(resolved_yaml(odd_back), resolved_yaml(odd));
}

TEST(TrainerConfig, LoadsFromFileAndCreatesNothing) {
  const fs::path dir = fs::temp_directory_path() /
                       ("longtrain_config_test_" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  fs::create_directories(dir);
  const fs::path file = dir / "tiny.yaml";
  std::ofstream(file) << "data:\n  train: data/tiny\n  seq_len: 128\n";
  const fs::path run_dir = dir / "run";
  TrainConfig c = load_config(file.string(), {"logging.run_dir=" + run_dir.string()});
  EXPECT_EQ(c.source, file.string());
  EXPECT_EQ(c.data.seq_len, 128);
  EXPECT_FALSE(fs::exists(run_dir)) << "loading a config must not create the run directory";
  EXPECT_FALSE(fs::exists(c.checkpoint.dir));
  // Without run_dir the default is runs/<file stem>.
  EXPECT_EQ(load_config(file.string()).logging.run_dir, (fs::path("runs") / "tiny").string());
  fs::remove_all(dir);
}

// A config is UTF-8 text: other bytes (found by the config fuzz target in a data.train path, where
// they escaped as a JSON exception from the config hash) are refused, naming the line or override.
TEST(TrainerConfig, TextThatIsNotUtf8IsRefusedNamingWhere) {
  const std::string bad = "\x98\xf5";
  EXPECT_TRUE(contains(load_error("model:\n  dim: 32\ndata:\n  train: d" + bad + "\n"), ":4: byte 0x98 is not printable UTF-8"));
  EXPECT_TRUE(contains(load_error("model:\n  dim: 32\n", {"data.train=x" + bad}), "--set data.train: byte 0x98"));
  // Control characters too: a NUL in a plain scalar made yaml-cpp return bytes that are not UTF-8.
  EXPECT_TRUE(contains(load_error(std::string("data:\n  train: d\0_x\n", 17)), ":2: byte 0x00 is not printable"));
  for (const std::string& seq : {std::string("\xc0\xaf"), std::string("\xed\xa0\x80"), std::string("\xf4\x90\x80\x80"),
                                 std::string("\xe2\x82")})  // overlong, surrogate, past U+10FFFF, cut short
    EXPECT_TRUE(contains(load_error("data:\n  train: d" + seq + "\n"), "is not printable UTF-8")) << seq.size();
  // Well-formed multi-byte text stays accepted.
  EXPECT_EQ(load("data:\n  train: d\xc3\xa9j\xc3\xa0-vu-\xe2\x82\xac-\xf0\x9f\x98\x80\n").data.train,
            "d\xc3\xa9j\xc3\xa0-vu-\xe2\x82\xac-\xf0\x9f\x98\x80");
}

TEST(TrainerConfig, DefaultsApply) {
  TrainConfig c = load("data:\n  train: d\n");
  const model::LlamaConfig shape{};
  EXPECT_EQ(c.model.vocab_size, shape.vocab_size);
  EXPECT_EQ(c.model.dim, shape.dim);
  EXPECT_EQ(c.model.n_heads, shape.n_heads);
  EXPECT_EQ(c.model.n_kv_heads, shape.n_kv_heads);
  EXPECT_EQ(c.model.head_dim, shape.dim / shape.n_heads);
  EXPECT_EQ(c.model.max_seq_len, shape.max_seq_len);
  EXPECT_FALSE(c.model.checkpoint.has_value());  // auto: chosen from the memory plan at the start
  EXPECT_FALSE(c.model.offload.has_value());
  EXPECT_EQ(c.model.tiling.mlp_chunk_tokens, 0);
  EXPECT_EQ(c.model.tiling.loss_chunk_tokens, 0);
  EXPECT_DOUBLE_EQ(c.model.init_std, 0.02);
  EXPECT_EQ(c.train.device, DeviceChoice::auto_select);
  EXPECT_EQ(c.train.dtype, DTypeChoice::auto_select);
  EXPECT_EQ(c.train.on_nonfinite, NonFinitePolicy::skip);
  EXPECT_EQ(c.optim.schedule, LrSchedule::cosine);
  EXPECT_DOUBLE_EQ(c.optim.lr, 3e-4);
  EXPECT_DOUBLE_EQ(c.optim.beta2, 0.95);
  EXPECT_EQ(c.optim.no_decay, (std::vector<std::string>{"norm", "embed_tokens"}));
  EXPECT_EQ(c.parallel.sp_size, 1);
  EXPECT_EQ(c.parallel.layout, SeqLayout::zigzag);
  EXPECT_EQ(c.attention.schedule, AttentionSchedule::zigzag);
  EXPECT_TRUE(c.attention.causal);
  EXPECT_EQ(c.data.val, "");
  EXPECT_EQ(c.logging.run_dir, (fs::path("runs") / "test").string());
  EXPECT_EQ(c.checkpoint.dir, (fs::path("runs") / "test" / "checkpoints").string());
  // An empty section or an empty value for a string key is fine.
  EXPECT_EQ(load("eval:\ndata:\n  train: d\n  val:\n").data.val, "");
}

TEST(TrainerConfig, OverridesWin) {
  TrainConfig c = load(kValid, {"optim.lr=2e-3", "optim.no_decay=[]", "model.checkpoint=none", "data.val=",
                                "train.steps=1e3", "logging.plot=true", "optim.lr = 5e-4"});
  EXPECT_DOUBLE_EQ(c.optim.lr, 5e-4);  // the later --set of a key wins
  EXPECT_TRUE(c.optim.no_decay.empty());
  EXPECT_EQ(c.model.checkpoint, model::CheckpointPolicy::none);
  EXPECT_EQ(c.data.val, "");
  EXPECT_EQ(c.train.steps, 1000);
  EXPECT_TRUE(c.logging.plot);
  // Every model.checkpoint name is the model's own.
  for (const char* p : {"none", "full", "remat_aware"})
    EXPECT_EQ(load(kValid, {std::string("model.checkpoint=") + p}).model.checkpoint, model::parse_checkpoint_policy(p));
  EXPECT_FALSE(load(kValid, {"model.checkpoint=auto"}).model.checkpoint.has_value());
  EXPECT_EQ(load(kValid, {"model.offload=checkpoints"}).model.offload, model::Offload::checkpoints);
  EXPECT_EQ(load(kValid, {"model.offload=none"}).model.offload, model::Offload::none);
  const TrainConfig tiled = load(kValid, {"model.mlp_chunk_tokens=4096", "model.loss_chunk_tokens=1000"});
  EXPECT_EQ(tiled.model.tiling.mlp_chunk_tokens, 4096);
  EXPECT_EQ(tiled.model.tiling.loss_chunk_tokens, 1000);
  // auto survives the resolved config (what a run directory's config.yaml holds).
  EXPECT_TRUE(contains(resolved_yaml(load(kValid, {"model.checkpoint=auto"})), "checkpoint: auto"));
}

TEST(TrainerConfig, BadOverridesAreNamed) {
  EXPECT_EQ(load_error(kValid, {"optim.lr=fast"}), "--set optim.lr=fast: optim.lr: expected a number, got 'fast'");
  EXPECT_TRUE(starts_with(load_error(kValid, {"optim.lr"}), "--set optim.lr: expected section.key=value"));
  EXPECT_TRUE(starts_with(load_error(kValid, {"lr=1"}), "--set lr=1: expected section.key=value"));
  EXPECT_EQ(load_error(kValid, {"optim.learning_rate=1e-3"}),
            "--set optim.learning_rate=1e-3: unknown key optim.learning_rate (did you mean optim.lr?)");
  EXPECT_TRUE(starts_with(load_error(kValid, {"optimizer.lr=1e-3"}),
                          "--set optimizer.lr=1e-3: unknown section optimizer (did you mean optim?)"));
  EXPECT_TRUE(starts_with(load_error(kValid, {"optim.beta2=1"}), "--set optim.beta2=1: optim.beta2 must be in [0, 1)"));
  EXPECT_TRUE(starts_with(load_error(kValid, {"optim.no_decay=[a"}), "--set optim.no_decay=[a: optim.no_decay: malformed value"));
  // A combination broken by a --set points at the --set and says where the other key came from.
  EXPECT_EQ(load_error(kValid, {"parallel.sp_size=3"}),
            "--set parallel.sp_size=3: data.seq_len (256) must be a multiple of parallel.sp_size = 3 with "
            "parallel.layout contiguous: each rank holds seq_len / sp_size tokens (data.seq_len: line 12; "
            "parallel.layout: line 25)");
}

TEST(TrainerConfig, UnknownKeysSuggestTheRightOne) {
  EXPECT_EQ(load_error("data:\n  train: d\noptim:\n  lr: 1e-3\n  betas: 2\n  warmup: 3\n  learning_rate: 1e-3\n"),
            "cfg/test.yaml:5: unknown key optim.betas (did you mean optim.beta1?)");
  EXPECT_EQ(load_error("optim:\n  learning_rate: 1e-3\n"),
            "cfg/test.yaml:2: unknown key optim.learning_rate (did you mean optim.lr?)");
  EXPECT_EQ(load_error("optim:\n  wieght_decay: 0\n"),
            "cfg/test.yaml:2: unknown key optim.wieght_decay (did you mean optim.weight_decay?)");
  EXPECT_EQ(load_error("optim:\n  warmup: 10\n"),
            "cfg/test.yaml:2: unknown key optim.warmup (did you mean optim.warmup_steps?)");
  EXPECT_EQ(load_error("train:\n  lr: 1e-3\n"), "cfg/test.yaml:2: unknown key train.lr (did you mean optim.lr?)");
  EXPECT_EQ(load_error("model:\n  hidden_size: 64\n"),
            "cfg/test.yaml:2: unknown key model.hidden_size (did you mean model.dim?)");
  EXPECT_EQ(load_error("model:\n  eps: 1e-6\n"), "cfg/test.yaml:2: unknown key model.eps (did you mean model.norm_eps?)");
  EXPECT_EQ(load_error("train:\n  max_steps: 10\n"),
            "cfg/test.yaml:2: unknown key train.max_steps (did you mean train.steps?)");
  // Nothing close: the section's keys are listed instead.
  EXPECT_EQ(load_error("attention:\n  xyzzy: 1\n"),
            "cfg/test.yaml:2: unknown key attention.xyzzy; the keys of attention are schedule, causal, kernel");
}

TEST(TrainerConfig, UnknownSectionsSuggestTheRightOne) {
  EXPECT_TRUE(starts_with(load_error("data:\n  train: d\noptimizer:\n  lr: 1\n"),
                          "cfg/test.yaml:3: unknown section optimizer (did you mean optim?); sections are model, data"));
  EXPECT_TRUE(starts_with(load_error("modle:\n  dim: 8\n"), "cfg/test.yaml:1: unknown section modle (did you mean model?)"));
  EXPECT_TRUE(starts_with(load_error("lr: 1e-3\n"),
                          "cfg/test.yaml:1: unknown section lr (did you mean optim.lr? keys go inside their section)"));
  EXPECT_EQ(load_error("optim.lr: 1e-3\n"),
            "cfg/test.yaml:1: unknown section optim.lr (write it inside its section: optim: {lr: ...})");
  EXPECT_EQ(load_error("zzzzzzzz: 1\n"),
            "cfg/test.yaml:1: unknown section zzzzzzzz; sections are model, data, train, optim, parallel, attention, "
            "checkpoint, eval, logging");
}

// data.train as a weighted mixture: a YAML list of {path, weight} (block or flow, in the file or
// --set), carried as its canonical text, written back as a list that reloads to the same config,
// and every malformed entry refused naming its line and index.
TEST(TrainerConfig, DataTrainTakesAWeightedMixture) {
  const std::string yaml = "model:\n  dim: 32\ndata:\n  train:\n    - path: data/code\n      weight: 0.3\n"
                           "    - {path: data/books, weight: 0.7}\n";
  const TrainConfig c = load(yaml);
  EXPECT_EQ(c.data.train, R"([{"path":"data/code","weight":0.3},{"path":"data/books","weight":0.7}])");
  const std::string text = resolved_yaml(c);
  EXPECT_TRUE(contains(text, R"(train: [{"path":"data/code","weight":0.3},{"path":"data/books","weight":0.7}])"))
      << text;
  EXPECT_EQ(load(text).data.train, c.data.train);
  EXPECT_EQ(config_hash(load(text)), config_hash(c));
  EXPECT_EQ(load("model:\n  dim: 32\n", {"data.train=[{path: data/code, weight: 0.3}, {path: data/books, weight: 0.7}]"})
                .data.train,
            c.data.train);
  // One source of weight 1 is the plain path (so configs and their hashes are as before).
  EXPECT_EQ(load("data:\n  train: [{path: data/x, weight: 1}]\n").data.train, "data/x");
  // The same mixture spelled with other paths to the same directories is no change on resume.
  EXPECT_TRUE(config_changes(c, load(yaml, {"data.train=[{path: ./data/code, weight: 0.3}, {path: data//books/, "
                                            "weight: 0.7}]"})).empty());
  EXPECT_EQ(config_changes(c, load(yaml, {"data.train=[{path: data/code, weight: 0.4}, {path: data/books, weight: "
                                          "0.6}]"})).size(), 1u);
  EXPECT_EQ(on_resume("data.train"), OnResume::allowed);
  // Bad entries, named by line and index.
  EXPECT_EQ(load_error("data:\n  train:\n    - {path: a, weight: 0}\n"),
            "cfg/test.yaml:2: data.train[0] (a): weight 0 must be positive and finite");
  EXPECT_EQ(load_error("data:\n  train:\n    - {path: a, weight: 1}\n    - {path: b, weight: -1}\n"),
            "cfg/test.yaml:2: data.train[1] (b): weight -1 must be positive and finite");
  EXPECT_EQ(load_error("data:\n  train:\n    - {path: a, weight: lots}\n"),
            "cfg/test.yaml:2: data.train[0]: weight must be a number, got 'lots'");
  EXPECT_EQ(load_error("data:\n  train:\n    - {path: a}\n"),
            "cfg/test.yaml:2: data.train[0] (a): weight is missing (the source's share of the windows)");
  EXPECT_EQ(load_error("data:\n  train:\n    - {weight: 2}\n"),
            "cfg/test.yaml:2: data.train[0]: path is missing (a shard directory or a Megatron dataset prefix)");
  EXPECT_EQ(load_error("data:\n  train:\n    - {path: a, weight: 1, wieght: 2}\n"),
            "cfg/test.yaml:2: data.train[0]: unknown field 'wieght' (a source has path and weight)");
  EXPECT_EQ(load_error("data:\n  train:\n    - a\n"),
            "cfg/test.yaml:2: data.train[0]: expected {path: ..., weight: ...}, got 'a'");
  EXPECT_EQ(load_error("data:\n  train: []\n"), "cfg/test.yaml:2: data.train: a mixture must list at least one {path, weight}");
  // The canonical text given as a string is checked too.
  EXPECT_TRUE(contains(load_error("data:\n  train: '[{\"path\": \"a\", \"weight\": -3}]'\n"), "weight -3 must be positive"));
  EXPECT_TRUE(contains(schema_text(), "weighted mixture"));
}

TEST(TrainerConfig, WrongTypesAreNamed) {
  EXPECT_EQ(load_error("data:\n  train: d\noptim:\n  lr: fast\n"), "cfg/test.yaml:4: optim.lr: expected a number, got 'fast'");
  EXPECT_EQ(load_error("data:\n  seq_len: 2.5\n"), "cfg/test.yaml:2: data.seq_len: expected an integer, got '2.5'");
  EXPECT_EQ(load_error("model:\n  dim: [1, 2]\n"), "cfg/test.yaml:2: model.dim: expected an integer, got a list");
  EXPECT_EQ(load_error("optim:\n  lr:\n"), "cfg/test.yaml:2: optim.lr: expected a number, got no value");
  EXPECT_EQ(load_error("optim:\n  lr: .nan\n"), "cfg/test.yaml:2: optim.lr: expected a number, got '.nan'");
  EXPECT_EQ(load_error("logging:\n  plot: maybe\n"), "cfg/test.yaml:2: logging.plot: expected true or false, got 'maybe'");
  EXPECT_EQ(load_error("data:\n  train: {a: 1}\n"),
            "cfg/test.yaml:2: data.train: expected a path or a list of {path, weight}, got a mapping");
  EXPECT_EQ(load_error("optim:\n  no_decay: norm\n"),
            "cfg/test.yaml:2: optim.no_decay: expected a list of strings like [a, b], got 'norm'");
  EXPECT_EQ(load_error("optim:\n  no_decay: [norm, [x]]\n"),
            "cfg/test.yaml:2: optim.no_decay: list items must be non-empty strings, got a list");
  EXPECT_EQ(load_error("attention:\n  schedule: zigzig\n"),
            "cfg/test.yaml:2: attention.schedule: expected one of ring, zigzag, distflash, burst, ulysses, got 'zigzig' "
            "(did you "
            "mean zigzag?)");
  EXPECT_EQ(load_error("model:\n  checkpoint: selective\n"),
            "cfg/test.yaml:2: model.checkpoint: expected one of auto, none, full, remat_aware, got 'selective'");
  EXPECT_EQ(load_error("model:\n  offload: host\n"),
            "cfg/test.yaml:2: model.offload: expected one of auto, none, checkpoints, got 'host'");
  EXPECT_TRUE(contains(load_error("model:\n  mlp_chunk_tokens: -1\n"), "model.mlp_chunk_tokens"));
  EXPECT_EQ(load_error("data:\n  train: d\noptim: 3\n"),
            "cfg/test.yaml:3: section optim must be a mapping of key: value lines, got '3'");
  EXPECT_EQ(load_error("- a\n- b\n"),
            "cfg/test.yaml:1: expected a mapping of sections (model:, data:, train:, ...), got a list");
}

TEST(TrainerConfig, OutOfRangeValuesAreNamed) {
  const std::string head = "data:\n  train: d\n";  // lines 1-2
  EXPECT_EQ(load_error(head + "optim:\n  lr: -1e-3\n"), "cfg/test.yaml:4: optim.lr must be >= 0, got -0.001");
  EXPECT_EQ(load_error(head + "optim:\n  beta1: 1\n"), "cfg/test.yaml:4: optim.beta1 must be in [0, 1), got 1.0");
  EXPECT_EQ(load_error(head + "optim:\n  beta2: -0.5\n"), "cfg/test.yaml:4: optim.beta2 must be in [0, 1), got -0.5");
  EXPECT_EQ(load_error(head + "optim:\n  eps: 0\n"), "cfg/test.yaml:4: optim.eps must be > 0, got 0.0");
  EXPECT_EQ(load_error(head + "  seq_len: 0\n"), "cfg/test.yaml:3: data.seq_len must be >= 1, got 0");
  EXPECT_EQ(load_error(head + "train:\n  steps: -5\n"), "cfg/test.yaml:4: train.steps must be >= 1, got -5");
  EXPECT_EQ(load_error(head + "model:\n  n_layers: 0\n"), "cfg/test.yaml:4: model.n_layers must be >= 1, got 0");
  EXPECT_EQ(load_error(head + "parallel:\n  timeout_s: 0\n"), "cfg/test.yaml:4: parallel.timeout_s must be > 0, got 0.0");
  EXPECT_EQ(load_error("data:\n  seq_len: 64\n"),
            "cfg/test.yaml: data.train is required: token shards written by `longtrain prepare`, a Megatron-LM/NeMo "
            "indexed dataset (PREFIX of PREFIX.bin/.idx), or a weighted mixture of them: [{path: a, weight: 0.3}, "
            "{path: b, weight: 0.7}]");
  EXPECT_EQ(load_error("data:\n  train: ''\n"),
            "cfg/test.yaml:2: data.train is required: token shards written by `longtrain prepare`, a Megatron-LM/NeMo "
            "indexed dataset (PREFIX of PREFIX.bin/.idx), or a weighted mixture of them: [{path: a, weight: 0.3}, "
            "{path: b, weight: 0.7}]");
}

TEST(TrainerConfig, InconsistentCombinationsAreNamed) {
  const std::string head = "data:\n  train: d\n";  // lines 1-2
  // seq_len vs the zigzag layout (the default) and sp_size.
  EXPECT_EQ(load_error(head + "  seq_len: 1000\nparallel:\n  sp_size: 8\n"),
            "cfg/test.yaml:3: data.seq_len (1000) must be a multiple of 2*parallel.sp_size = 16 with parallel.layout "
            "zigzag: each rank holds two chunks of seq_len / (2*sp_size) tokens (parallel.sp_size: line 5; "
            "parallel.layout: default)");
  EXPECT_TRUE(starts_with(load_error(head + "  seq_len: 1001\nparallel:\n  layout: contiguous\n  sp_size: 2\n"),
                          "cfg/test.yaml:3: data.seq_len (1001) must be a multiple of parallel.sp_size = 2 with "
                          "parallel.layout contiguous"));
  // Schedules and layouts.
  EXPECT_EQ(load_error(head + "parallel:\n  layout: contiguous\n"),
            "cfg/test.yaml:4: attention.schedule zigzag needs parallel.layout zigzag (it balances causal work through "
            "that layout); use schedule ring or distflash with the contiguous layout (attention.schedule: default)");
  EXPECT_TRUE(starts_with(load_error(head + "attention:\n  schedule: distflash\n"),
                          "cfg/test.yaml:4: attention.schedule distflash needs parallel.layout contiguous"));
  load(head + "attention:\n  schedule: burst\n");  // burst and ring work with either layout
  load(head + "attention:\n  schedule: ring\nparallel:\n  layout: contiguous\n");
  // Ulysses: the group size divides sp_size and the heads; schedule ulysses is Ulysses over the whole group.
  EXPECT_TRUE(starts_with(load_error(head + "parallel:\n  sp_size: 4\n  ulysses_size: 3\n"),
                          "cfg/test.yaml:5: parallel.ulysses_size (3) must divide parallel.sp_size (4)"));
  EXPECT_TRUE(contains(load_error(head + "attention:\n  schedule: ulysses\nparallel:\n  sp_size: 4\n  ulysses_size: 2\n"),
                       "for Ulysses inside groups of 2 with a ring across them, set attention.schedule to ring"));
  EXPECT_TRUE(contains(load_error(head + "attention:\n  schedule: ulysses\nmodel:\n  n_heads: 6\n  n_kv_heads: 2\n"
                                         "  dim: 48\nparallel:\n  sp_size: 4\n"),
                       "Ulysses splits the heads over parallel.sp_size = 4 ranks, but model.n_heads (6) is not a "
                       "multiple of 4"));
  EXPECT_TRUE(contains(load_error(head + "attention:\n  schedule: zigzag\nmodel:\n  n_heads: 12\n  n_kv_heads: 3\n"
                                         "  dim: 48\nparallel:\n  sp_size: 4\n  ulysses_size: 4\n"),
                       "Ulysses over parallel.ulysses_size = 4 ranks needs model.n_kv_heads (3)"));
  load(head + "attention:\n  schedule: ulysses\nmodel:\n  n_heads: 8\n  n_kv_heads: 2\n  dim: 64\nparallel:\n  sp_size: 4\n");
  load(head + "attention:\n  schedule: burst\nmodel:\n  n_heads: 8\n  n_kv_heads: 1\n  dim: 64\nparallel:\n  sp_size: 8\n"
              "  ulysses_size: 4\n");
  // The model.
  EXPECT_EQ(load_error(head + "  seq_len: 8192\n"),
            "cfg/test.yaml:3: data.seq_len (8192) exceeds model.max_seq_len (4096): raise model.max_seq_len or shorten "
            "the sequences (model.max_seq_len: default)");
  EXPECT_EQ(load_error(head + "model:\n  n_heads: 8\n  n_kv_heads: 3\n"),
            "cfg/test.yaml:4: model.n_heads (8) must be a multiple of model.n_kv_heads (3): each KV head serves a whole "
            "group of query heads (model.n_kv_heads: line 5)");
  EXPECT_EQ(load_error(head + "model:\n  head_dim: 31\n"),
            "cfg/test.yaml:4: model.head_dim (31) must be even: RoPE rotates pairs of dimensions");
  EXPECT_TRUE(starts_with(load_error(head + "model:\n  dim: 100\n  n_heads: 8\n"),
                          "cfg/test.yaml:4: model.head_dim is 0 (= dim / n_heads) but model.dim (100) is not a multiple "
                          "of model.n_heads (8)"));
  // Device and precision.
  EXPECT_EQ(load_error(head + "train:\n  device: cuda\n  dtype: f64\n"),
            "cfg/test.yaml:5: train.dtype f64 runs on the CPU only; on cuda the model trains in bf16 mixed precision "
            "(train.dtype bf16 or auto), or set train.device cpu (train.device: line 4)");
  EXPECT_TRUE(starts_with(load_error(head + "train:\n  device: cpu\n  dtype: bf16\n"),
                          "cfg/test.yaml:5: train.dtype bf16 needs train.device cuda"));
  // Document masking on either device.
  EXPECT_TRUE(load(head + "train:\n  device: cuda\n", {"data.document_mask=true"}).data.document_mask);
  EXPECT_TRUE(load(head + "train:\n  device: cpu\n", {"data.document_mask=true"}).data.document_mask);
  EXPECT_FALSE(load(head).data.document_mask);  // the default: today's behaviour
  // The optimizer.
  EXPECT_EQ(load_error(head + "train:\n  steps: 50\n"),
            "cfg/test.yaml:4: optim.warmup_steps (100) exceeds train.steps (50): the run would end before warmup does "
            "(optim.warmup_steps: default)");
  EXPECT_TRUE(starts_with(load_error(head + "optim:\n  lr: 1e-4\n  min_lr: 1e-3\n"),
                          "cfg/test.yaml:5: optim.min_lr (0.001) is above optim.lr (0.0001)"));
  EXPECT_TRUE(starts_with(load_error(head + "  seq_len: 4\neval:\n  position_buckets: 8\n"),
                          "cfg/test.yaml:5: eval.position_buckets (8) exceeds data.seq_len (4)"));
}

TEST(TrainerConfig, FileProblemsAreNamed) {
  EXPECT_TRUE(starts_with(error_of([] { load_config("/nonexistent/dir/x.yaml"); }),
                          "/nonexistent/dir/x.yaml: cannot read the config file: No such file or directory"));
  const std::string dir = fs::temp_directory_path().string();
  EXPECT_EQ(error_of([&] { load_config(dir); }), dir + ": is a directory; expected a YAML config file");
  EXPECT_EQ(load_error("data:\n  train: d\noptim:\n  no_decay: [norm, bias\ntrain:\n  steps: 3\n"),
            "cfg/test.yaml:5: malformed YAML (column 6): end of sequence flow not found");
  EXPECT_TRUE(starts_with(load_error("data:\n  train: d\n   seq_len: 3\n"), "cfg/test.yaml:3: malformed YAML"));
  EXPECT_EQ(load_error("data:\n  train: d\n  train: e\n"), "cfg/test.yaml:3: data.train is given twice (first at line 2)");
  EXPECT_EQ(load_error("data:\n  train: d\noptim:\n  lr: 1\noptim:\n  eps: 1\n"),
            "cfg/test.yaml:5: section optim appears twice (first at line 3)");
}

TEST(TrainerConfig, HashCoversWhatTrainingComputes) {
  const TrainConfig c = load(kValid);
  const std::string h = config_hash(c);
  ASSERT_EQ(h.size(), 16u);
  EXPECT_EQ(h.find_first_not_of("0123456789abcdef"), std::string::npos);
  // Keys a resumed run may change without changing the trajectory.
  for (const char* same : {"logging.log_every=1", "logging.run_dir=elsewhere", "checkpoint.every=7", "checkpoint.keep_last=9",
                           "eval.every=3", "eval.batches=0", "data.prefetch=0", "train.threads=3", "data.val=v",
                           "train.gemm_algorithm=heuristic",
                           "parallel.timeout_s=5", "train.on_nonfinite=stop"})
    EXPECT_EQ(config_hash(load(kValid, {same})), h) << same;
  // Keys that change what is computed.
  for (const char* other : {"optim.lr=2e-3", "train.steps=60", "train.seed=8", "model.dim=128", "data.seq_len=128",
                            "optim.no_decay=[norm]", "model.checkpoint=remat_aware", "data.train=other"})
    EXPECT_NE(config_hash(load(kValid, {other})), h) << other;
}

// Every key, a valid change of it from kValid, and the class a resume must give it. The list has
// to cover every key of the table: a key added without a line here fails the test below.
struct KeyChange {
  const char* key;
  std::vector<std::string> sets;  // applied to kValid; `key` and `also` come out changed, nothing else
  OnResume expected;
  std::vector<std::string> also = {};  // keys a valid change of `key` must change too
};
const std::vector<KeyChange>& key_changes() {
  constexpr OnResume refused = OnResume::refused, allowed = OnResume::allowed, elastic = OnResume::elastic;
  // RoPE scaling fields are valid only with a type that uses them, and with all of its fields.
  static const std::vector<std::string> kLlama3 = {
      "model.rope_scaling=llama3", "model.rope_factor=8", "model.rope_low_freq_factor=1",
      "model.rope_high_freq_factor=4", "model.rope_original_max_position_embeddings=32"};
  static const std::vector<std::string> kLlama3Keys = {
      "model.rope_scaling", "model.rope_factor", "model.rope_original_max_position_embeddings",
      "model.rope_low_freq_factor", "model.rope_high_freq_factor"};
  static const std::vector<std::string> kYarnKeys = {"model.rope_scaling", "model.rope_factor",
                                                     "model.rope_original_max_position_embeddings"};
  auto yarn_with = [](const std::string& field) {
    return std::vector<std::string>{"model.rope_scaling=yarn", "model.rope_factor=4",
                                    "model.rope_original_max_position_embeddings=32", field};
  };
  static const std::vector<KeyChange> changes = {
      {"model.vocab_size", {"model.vocab_size=1024"}, refused},
      {"model.dim", {"model.dim=128", "model.head_dim=16"}, refused},  // head_dim kept: it resolves from dim
      {"model.n_layers", {"model.n_layers=3"}, refused},
      {"model.n_heads", {"model.n_heads=8", "model.head_dim=16"}, refused},
      {"model.n_kv_heads", {"model.n_kv_heads=4"}, refused},
      {"model.head_dim", {"model.head_dim=32"}, refused},
      {"model.ffn_dim", {"model.ffn_dim=192"}, refused},
      {"model.rope_theta", {"model.rope_theta=500000"}, refused},
      {"model.rope_scaling", {"model.rope_scaling=linear", "model.rope_factor=2"}, refused, {"model.rope_factor"}},
      {"model.rope_factor", {"model.rope_scaling=linear", "model.rope_factor=2"}, refused, {"model.rope_scaling"}},
      {"model.rope_original_max_position_embeddings",
       {"model.rope_scaling=dynamic", "model.rope_factor=2", "model.rope_original_max_position_embeddings=32"},
       refused, {"model.rope_scaling", "model.rope_factor"}},
      {"model.rope_low_freq_factor", kLlama3, refused, kLlama3Keys},
      {"model.rope_high_freq_factor", kLlama3, refused, kLlama3Keys},
      {"model.rope_beta_fast", yarn_with("model.rope_beta_fast=16"), refused, kYarnKeys},
      {"model.rope_beta_slow", yarn_with("model.rope_beta_slow=2"), refused, kYarnKeys},
      {"model.rope_attention_factor", yarn_with("model.rope_attention_factor=1.2"), refused, kYarnKeys},
      {"model.rope_mscale", yarn_with("model.rope_mscale=1"), refused, kYarnKeys},
      {"model.rope_mscale_all_dim", yarn_with("model.rope_mscale_all_dim=1"), refused, kYarnKeys},
      {"model.rope_truncate", yarn_with("model.rope_truncate=false"), refused, kYarnKeys},
      {"model.norm_eps", {"model.norm_eps=1e-3"}, refused},
      {"model.tie_embeddings", {"model.tie_embeddings=true"}, refused},
      {"model.max_seq_len", {"model.max_seq_len=1024"}, refused},
      {"model.checkpoint", {"model.checkpoint=none"}, allowed},
      {"model.offload", {"model.offload=checkpoints"}, allowed},
      {"model.mlp_chunk_tokens", {"model.mlp_chunk_tokens=64"}, allowed},
      {"model.loss_chunk_tokens", {"model.loss_chunk_tokens=64"}, allowed},
      {"model.attention_head_groups", {"model.attention_head_groups=2"}, allowed},
      {"model.init_std", {"model.init_std=0.01"}, refused},
      // Needs a Hugging Face directory whose config.json is kValid's shape (tests/trainer/init_from_test.cpp).
      {"model.init_from", {}, allowed},
      {"data.train", {"data.train=data/other"}, allowed},
      {"data.val", {"data.val=data/val"}, allowed},
      {"data.tokenizer", {"data.tokenizer=tok.model"}, refused},
      {"data.seq_len", {"data.seq_len=128"}, refused},
      {"data.prefetch", {"data.prefetch=4"}, allowed},
      {"data.document_mask", {"data.document_mask=true"}, refused},
      {"train.device", {"train.device=auto"}, refused},
      {"train.dtype", {"train.dtype=f32"}, refused},
      {"train.steps", {"train.steps=60"}, allowed},
      {"train.batch_size", {"train.batch_size=2"}, elastic},
      {"train.grad_accum", {"train.grad_accum=2"}, elastic},
      {"train.grad_dtype", {"train.grad_dtype=f64"}, allowed},
      {"train.seed", {"train.seed=8"}, refused},
      {"train.on_nonfinite", {"train.on_nonfinite=stop"}, allowed},
      {"train.max_nonfinite_skips", {"train.max_nonfinite_skips=5"}, allowed},
      {"train.threads", {"train.threads=3"}, allowed},
      {"train.gemm_algorithm", {"train.gemm_algorithm=heuristic"}, allowed},
      {"train.cuda_graphs", {"train.cuda_graphs=true"}, allowed},
      {"optim.lr", {"optim.lr=2e-3"}, allowed},
      {"optim.min_lr", {"optim.min_lr=0"}, allowed},
      {"optim.weight_decay", {"optim.weight_decay=0.01"}, refused},
      {"optim.beta1", {"optim.beta1=0.8"}, refused},
      {"optim.beta2", {"optim.beta2=0.99"}, refused},
      {"optim.eps", {"optim.eps=1e-6"}, refused},
      {"optim.warmup_steps", {"optim.warmup_steps=10"}, allowed},
      {"optim.schedule", {"optim.schedule=linear"}, allowed},
      {"optim.grad_clip", {"optim.grad_clip=0.5"}, refused},
      {"optim.no_decay", {"optim.no_decay=[norm]"}, refused},
      {"parallel.sp_size", {"parallel.sp_size=4"}, elastic},
      {"parallel.ulysses_size", {"parallel.ulysses_size=2"}, allowed},
      {"parallel.layout", {"parallel.layout=zigzag", "attention.schedule=zigzag"}, elastic},
      {"parallel.timeout_s", {"parallel.timeout_s=5"}, allowed},
      {"parallel.store_timeout_s", {"parallel.store_timeout_s=5"}, allowed},
      {"attention.schedule", {"attention.schedule=ring"}, allowed},
      {"attention.causal", {"attention.causal=false"}, refused},
      {"attention.kernel", {"attention.kernel=cudnn"}, allowed},
      {"checkpoint.every", {"checkpoint.every=7"}, allowed},
      {"checkpoint.keep_last", {"checkpoint.keep_last=9"}, allowed},
      {"checkpoint.dir", {"checkpoint.dir=ck"}, allowed},
      {"eval.every", {"eval.every=3"}, allowed},
      {"eval.batches", {"eval.batches=0"}, allowed},
      {"eval.position_buckets", {"eval.position_buckets=4"}, allowed},
      {"logging.run_dir", {"logging.run_dir=runs/other", "checkpoint.dir=runs/custom/checkpoints"}, allowed},
      {"logging.log_every", {"logging.log_every=1"}, allowed},
      {"logging.plot", {"logging.plot=true"}, allowed},
  };
  return changes;
}

TEST(TrainerConfig, EveryKeyHasAResumeClassShownInTheSchema) {
  const std::vector<std::string> keys = config_keys();
  std::vector<std::string> listed;
  for (const KeyChange& k : key_changes()) listed.push_back(k.key);
  EXPECT_EQ(listed, keys) << "key_changes() must list every config key in table order, with its class";
  const std::string schema = schema_text();
  for (const KeyChange& k : key_changes()) {
    EXPECT_EQ(on_resume(k.key), k.expected) << k.key;
    // The key's row in its section shows the class in the resume column.
    const std::string full = k.key, section = full.substr(0, full.find('.')), key = full.substr(full.find('.') + 1);
    const size_t block = schema.find("\n" + section + ": ");
    ASSERT_NE(block, std::string::npos) << section;
    const size_t row = schema.find("\n  " + key + " ", block);
    ASSERT_NE(row, std::string::npos) << full;
    const std::string line = schema.substr(row + 1, schema.find('\n', row + 1) - row - 1);
    const std::string other = k.expected == OnResume::refused ? " allowed " : " refused ";
    EXPECT_TRUE(contains(line, fmt::format(" {} ", enum_name(k.expected)))) << line;
    EXPECT_FALSE(contains(line, other)) << line;
  }
  EXPECT_THROW(on_resume("optim.learning_rate"), Error);
  // The rules for changes on resume are part of the schema text.
  EXPECT_TRUE(contains(schema, "Changing keys on resume"));
  EXPECT_TRUE(contains(schema, "lr(s) = min_lr + (L - min_lr)*f(p)"));
  EXPECT_TRUE(contains(schema, "from its beginning (epoch 0) with the\n  run's train.seed"));
}

TEST(TrainerConfig, ConfigChangesNameEachKeyWithOldAndNewValueAndItsClass) {
  const TrainConfig base = load(kValid, {"model.head_dim=16"});
  EXPECT_TRUE(config_changes(base, base).empty());
  for (const KeyChange& k : key_changes()) {
    if (k.sets.empty()) continue;  // no change possible from kValid alone (model.init_from)
    std::vector<std::string> sets = {"model.head_dim=16"};
    sets.insert(sets.end(), k.sets.begin(), k.sets.end());
    const TrainConfig changed = load(kValid, sets);
    std::vector<ConfigChange> all = config_changes(base, changed);
    // parallel.layout's change needs another attention schedule (distflash needs contiguous).
    std::vector<std::string> also = k.also;
    if (std::string(k.key) == "parallel.layout") also = {"attention.schedule"};
    std::vector<std::string> want = {k.key}, got;
    want.insert(want.end(), also.begin(), also.end());
    for (const ConfigChange& c : all) got.push_back(c.key);
    std::sort(want.begin(), want.end());
    want.erase(std::unique(want.begin(), want.end()), want.end());
    std::sort(got.begin(), got.end());
    ASSERT_EQ(got, want) << k.key;
    const auto own = std::find_if(all.begin(), all.end(), [&](const ConfigChange& c) { return c.key == k.key; });
    ASSERT_NE(own, all.end()) << k.key;
    EXPECT_EQ(own->on_resume, k.expected) << k.key;
    EXPECT_NE(own->before, own->after) << k.key;
    EXPECT_TRUE(starts_with(own->text(), fmt::format("{}: {} -> ", k.key, own->before))) << own->text();
  }
  const std::vector<ConfigChange> lr = config_changes(base, load(kValid, {"model.head_dim=16", "optim.lr=2e-3"}));
  ASSERT_EQ(lr.size(), 1u);
  EXPECT_EQ(lr[0].text(), "optim.lr: 0.001 -> 0.002");
  // One directory spelled two ways is no change; another directory is.
  EXPECT_TRUE(config_changes(base, load(kValid, {"model.head_dim=16", "data.train=./data//tiny/"})).empty());
  const std::string abs = (fs::current_path() / "data/tiny").string();
  EXPECT_TRUE(config_changes(base, load(kValid, {"model.head_dim=16", "data.train=" + abs})).empty());
  EXPECT_EQ(config_changes(base, load(kValid, {"model.head_dim=16", "data.train=data/tiny2"})).size(), 1u);
}

TEST(TrainerConfig, ResolveDevice) {
  auto resolved = [](const std::vector<std::string>& sets, bool cuda) {
    TrainConfig c = load("data:\n  train: d\n", sets);
    resolve_device(c, cuda);
    return std::pair{c.train.device, c.train.dtype};
  };
  EXPECT_EQ(resolved({}, false), std::pair(DeviceChoice::cpu, DTypeChoice::f32));
  EXPECT_EQ(resolved({}, true), std::pair(DeviceChoice::cuda, DTypeChoice::bf16));
  EXPECT_EQ(resolved({"train.dtype=f64"}, true), std::pair(DeviceChoice::cpu, DTypeChoice::f64));
  EXPECT_EQ(resolved({"train.device=cpu"}, true), std::pair(DeviceChoice::cpu, DTypeChoice::f32));
  EXPECT_TRUE(starts_with(error_of([&] { resolved({"train.device=cuda"}, false); }),
                          "cfg/test.yaml: train.device is cuda but no CUDA device is usable here"));
  EXPECT_TRUE(starts_with(error_of([&] { resolved({"train.dtype=bf16"}, false); }),
                          "cfg/test.yaml: train.dtype bf16 needs a CUDA device"));
  // A document mask does not change the device choice.
  EXPECT_EQ(resolved({"data.document_mask=true"}, true), std::pair(DeviceChoice::cuda, DTypeChoice::bf16));
  EXPECT_EQ(resolved({"data.document_mask=true"}, false), std::pair(DeviceChoice::cpu, DTypeChoice::f32));
}

// train.grad_dtype: auto is f32 on cuda when micro-batches are accumulated (grad_accum > 1), else the
// parameters' dtype; f32 beside bf16 is the one mixed pairing; each wrong pairing names both keys.
TEST(TrainerConfig, GradDtypeResolvesAndRefusesWhatCannotBe) {
  auto resolved = [](const std::vector<std::string>& sets, bool cuda) {
    TrainConfig c = load("data:\n  train: d\n", sets);
    resolve_device(c, cuda);
    return c.train.grad_dtype;
  };
  EXPECT_EQ(resolved({}, true), DTypeChoice::bf16);
  EXPECT_EQ(resolved({"train.grad_accum=2"}, true), DTypeChoice::f32);
  EXPECT_EQ(resolved({"train.grad_accum=2"}, false), DTypeChoice::f32);
  EXPECT_EQ(resolved({"train.grad_accum=2", "train.dtype=f64"}, false), DTypeChoice::f64);
  EXPECT_EQ(resolved({"train.grad_dtype=f32"}, true), DTypeChoice::f32);
  EXPECT_EQ(resolved({"train.grad_dtype=bf16", "train.grad_accum=4"}, true), DTypeChoice::bf16);
  // What other trainers call it is a did-you-mean.
  EXPECT_TRUE(contains(error_of([&] { load("data:\n  train: d\ntrain:\n  accumulate_allreduce_grads_in_fp32: true\n"); }),
                       "train.grad_dtype"));
  EXPECT_TRUE(contains(error_of([&] { load("data:\n  train: d\n", {"train.grad_dtype=bf16", "train.device=cpu"}); }), "train.grad_dtype bf16 needs train.device cuda"));
  EXPECT_TRUE(contains(error_of([&] { load("data:\n  train: d\n", {"train.grad_dtype=f32", "train.dtype=f64"}); }), "train.grad_dtype f32 cannot go with train.dtype f64"));
  // With train.dtype auto the pairing is checked once the device is known.
  EXPECT_TRUE(contains(error_of([&] { resolved({"train.grad_dtype=bf16"}, false); }), "cfg/test.yaml: train.grad_dtype bf16 needs train.device cuda"));
  EXPECT_TRUE(contains(error_of([&] { resolved({"train.grad_dtype=f64"}, true); }), "cfg/test.yaml: train.grad_dtype f64 cannot go with train.dtype bf16"));
}

// attention.kernel: auto by default (each call shape timed on cuDNN and our Hopper kernels), the three
// names, and a wrong one named with the accepted values. (The benchmarks time this default:
// bench_common.h, use_training_kernel_policies.)
TEST(TrainerConfig, AttentionKernelTakesItsThreeNames) {
  EXPECT_EQ(load("data:\n  train: d\n").attention.kernel, attn::KernelPolicy::autotune);
  EXPECT_EQ(load("data:\n  train: d\n", {"attention.kernel=cudnn"}).attention.kernel, attn::KernelPolicy::cudnn);
  EXPECT_EQ(load("data:\n  train: d\nattention:\n  kernel: hopper\n").attention.kernel, attn::KernelPolicy::hopper);
  const std::string msg = error_of([] { load("data:\n  train: d\n", {"attention.kernel=flash"}); });
  EXPECT_TRUE(contains(msg, "attention.kernel")) << msg;
  EXPECT_TRUE(contains(msg, "cudnn")) << msg;
}

// train.gemm_algorithm: auto by default (kernels/ops.h; the benchmarks time it, as above), heuristic the
// other name; anything else names the key.
TEST(TrainerConfig, GemmAlgorithmTakesItsTwoNames) {
  EXPECT_EQ(load("data:\n  train: d\n").train.gemm_algorithm, ops::GemmAlgoPolicy::autotune);
  EXPECT_EQ(load("data:\n  train: d\n", {"train.gemm_algorithm=heuristic"}).train.gemm_algorithm,
            ops::GemmAlgoPolicy::heuristic);
  const std::string msg = error_of([] { load("data:\n  train: d\n", {"train.gemm_algorithm=fastest"}); });
  EXPECT_TRUE(contains(msg, "train.gemm_algorithm")) << msg;
  EXPECT_TRUE(contains(msg, "heuristic")) << msg;
}

// train.cuda_graphs: auto by default (on wherever graphs can run), true or false in any spelling a
// boolean key takes, and not part of the config hash (a replayed graph runs the eager step's kernels
// with the same arguments: the numbers do not change).
TEST(TrainerConfig, CudaGraphsIsAnUnhashedChoiceAutoByDefault) {
  const TrainConfig by_default = load("data:\n  train: d\n");
  EXPECT_EQ(by_default.train.cuda_graphs, CudaGraphsChoice::auto_select);
  for (const auto& [text, want] : {std::pair{"true", CudaGraphsChoice::on}, std::pair{"on", CudaGraphsChoice::on},
                                   std::pair{"yes", CudaGraphsChoice::on}, std::pair{"false", CudaGraphsChoice::off},
                                   std::pair{"off", CudaGraphsChoice::off}, std::pair{"auto", CudaGraphsChoice::auto_select}}) {
    const TrainConfig c = load("data:\n  train: d\n", {std::string("train.cuda_graphs=") + text});
    EXPECT_EQ(c.train.cuda_graphs, want) << text;
    EXPECT_EQ(config_hash(c), config_hash(by_default)) << text;
  }
  const TrainConfig from_yaml = load("data:\n  train: d\ntrain:\n  cuda_graphs: false\n");
  EXPECT_EQ(from_yaml.train.cuda_graphs, CudaGraphsChoice::off);
  EXPECT_TRUE(contains(resolved_yaml(from_yaml), "cuda_graphs: false")) << resolved_yaml(from_yaml);
  const std::string msg = error_of([] { load("data:\n  train: d\n", {"train.cuda_graphs=sometimes"}); });
  EXPECT_TRUE(contains(msg, "train.cuda_graphs")) << msg;
  EXPECT_TRUE(contains(msg, "auto")) << msg;
}

TEST(TrainerConfig, SchemaMentionsEveryKeyInItsSection) {
  const std::string schema = schema_text();
  const std::vector<std::string> keys = config_keys();
  EXPECT_EQ(keys.size(), 74u);  // 65 before model.offload, model.mlp_chunk_tokens, model.loss_chunk_tokens,
                                 // parallel.ulysses_size, train.grad_dtype, attention.kernel,
                                 // model.attention_head_groups, train.gemm_algorithm and train.cuda_graphs
  for (const std::string& full : keys) {
    const std::string section = full.substr(0, full.find('.')), key = full.substr(full.find('.') + 1);
    const size_t at = schema.find("\n" + section + ": ");
    ASSERT_NE(at, std::string::npos) << section;
    const size_t next = schema.find("\n\n", at + 1);
    const std::string block = schema.substr(at, next == std::string::npos ? std::string::npos : next - at);
    EXPECT_TRUE(contains(block, "\n  " + key + " ")) << full;
  }
  // Types, ranges, defaults and meanings are there.
  EXPECT_TRUE(contains(schema, "auto|none|full|remat_aware"));
  EXPECT_TRUE(contains(schema, "auto|none|checkpoints"));
  EXPECT_TRUE(contains(schema, "default|linear|dynamic|yarn|llama3"));
  EXPECT_TRUE(contains(schema, "in [0, 1)"));
  EXPECT_TRUE(contains(schema, "0.0003"));
  EXPECT_TRUE(contains(schema, "[\"norm\", \"embed_tokens\"]"));
  EXPECT_TRUE(contains(schema, "(required)"));
  EXPECT_TRUE(contains(schema, "runs/<config file stem>"));
  EXPECT_TRUE(contains(schema, "peak learning rate"));
}

}  // namespace
}  // namespace longtrain::trainer

// Passkey retrieval: the prompt fits its length with the key at its depth, scoring is exact match of
// every answer token under teacher forcing, the grid/JSON/SVG report what was scored, the model path
// runs through the KV cache, and the one-forward path (passkey_eval_forward, what eval --passkey
// runs, also under sequence parallelism) scores exactly as the KV cache does.
#include <regex>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "passkey_model.h"
#include "trainer/passkey.h"
#include "train_fixture.h"

namespace longtrain::trainer::test {
namespace {

class PasskeyTest : public TrainTest {
 protected:
  static const data::Tokenizer& tokenizer() {
    static data::Tokenizer t((root_ / "tok.model").string());
    return t;
  }
};

TEST_F(PasskeyTest, PromptFitsItsLengthWithTheKeyAtItsDepth) {
  const data::Tokenizer& tok = tokenizer();
  for (int64_t L : {600, 3000}) {
    std::vector<int64_t> key_at;
    for (double depth : {0.0, 0.5, 1.0}) {
      SCOPED_TRACE(fmt::format("length {} depth {}", L, depth));
      const PasskeyPrompt p = build_passkey_prompt(tok, L, depth, 31337);
      const int64_t total = static_cast<int64_t>(p.prompt.size() + p.answer.size());
      EXPECT_LE(total, L);
      const auto per_filler = static_cast<int64_t>(
          tok.encode(" The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.")
              .size());
      EXPECT_GT(total, L - per_filler - 2) << "one more filler would have fit";
      const std::string text = tok.decode(std::vector<int32_t>(p.prompt.begin() + (tok.bos_id() >= 0), p.prompt.end()));
      EXPECT_EQ(text.rfind("There is an important info hidden inside a lot of irrelevant text.", 0), 0u) << text;
      EXPECT_NE(text.find("The pass key is 31337. Remember it. 31337 is the pass key."), std::string::npos);
      EXPECT_TRUE(text.ends_with("What is the pass key? The pass key is")) << text.substr(text.size() - 60);
      // The answer is " 31337" as it follows the prompt (decode drops a leading space on its own).
      std::vector<int32_t> whole(p.prompt.begin() + (tok.bos_id() >= 0), p.prompt.end());
      whole.insert(whole.end(), p.answer.begin(), p.answer.end());
      EXPECT_EQ(tok.decode(whole), text + " 31337");
      EXPECT_EQ(tok.decode(p.answer), "31337");
      const double relative = static_cast<double>(p.key_token) / static_cast<double>(p.prompt.size());
      if (L >= 3000) {  // the task and question lines are small beside it
        EXPECT_NEAR(relative, depth, 0.12);
      }
      key_at.push_back(p.key_token);
    }
    EXPECT_LT(key_at[0], key_at[1]);
    EXPECT_LT(key_at[1], key_at[2]);
  }
  std::string msg;
  try {
    build_passkey_prompt(tok, 20, 0.5, 7);
  } catch (const Error& e) {
    msg = e.what();
  }
  EXPECT_NE(msg.find("--lengths 20 is too short"), std::string::npos) << msg;
}

// A scorer that knows the key (read back from the prompt), so a cell's score is decided by what it
// is told to get wrong; it also checks that it is fed the true answer tokens (teacher forcing).
struct Oracle {
  const data::Tokenizer& tok;
  std::function<bool(double relative_key_position, size_t answer_token)> wrong;
  std::vector<int32_t> answer;
  double key_position = 0;
  size_t next = 0;
  int64_t prompts = 0;

  std::vector<float> operator()(const std::vector<int32_t>& tokens) {
    if (tokens.size() > 1) {  // a new trial: the whole prompt
      ++prompts;
      const std::string text = tok.decode(std::vector<int32_t>(tokens.begin() + (tok.bos_id() >= 0), tokens.end()));
      std::smatch m;
      EXPECT_TRUE(std::regex_search(text, m, std::regex("The pass key is ([0-9]+)\\.")));
      const std::vector<int32_t> prompt = tok.encode(text), full = tok.encode(text + " " + m[1].str());
      answer.assign(full.begin() + static_cast<std::ptrdiff_t>(prompt.size()), full.end());
      key_position = static_cast<double>(m.position(0)) / static_cast<double>(text.size());
      next = 0;
    } else {
      EXPECT_EQ(tokens[0], answer[next - 1]) << "not fed the true answer token";
    }
    std::vector<float> logits(static_cast<size_t>(tok.vocab_size()), 0.0f);
    int32_t id = answer[next];
    if (wrong(key_position, next)) id = (id + 1) % tok.vocab_size();
    logits[static_cast<size_t>(id)] = 1.0f;
    ++next;
    return logits;
  }
};

TEST_F(PasskeyTest, ScoringIsExactMatchOfEveryAnswerToken) {
  const data::Tokenizer& tok = tokenizer();
  PasskeyOptions o;
  o.lengths = {400, 800};
  o.depths = {0.0, 0.5, 1.0};
  o.trials = 3;

  auto run = [&](std::function<bool(double, size_t)> wrong) {
    auto oracle = std::make_shared<Oracle>(Oracle{tok, std::move(wrong), {}, 0.0, 0, 0});
    std::vector<PasskeyCell> cells =
        passkey_eval(tok, o, [oracle](const std::vector<int32_t>& t) { return (*oracle)(t); });
    EXPECT_EQ(oracle->prompts, 2 * 3 * 3);
    return cells;
  };
  for (const PasskeyCell& c : run([](double, size_t) { return false; })) EXPECT_EQ(c.correct, 3) << c.length;
  // Wrong only on the last answer token: still a miss (keys of 1..50000 take several tokens here).
  ASSERT_GT(build_passkey_prompt(tok, 400, 0.5, 12345).answer.size(), 1u);
  for (const PasskeyCell& c : run([](double, size_t k) { return k >= 1; })) EXPECT_EQ(c.correct, 0) << c.length;
  // Right only where the key sits in the first half: the grid shows which cells.
  std::vector<PasskeyCell> cells = run([](double position, size_t) { return position > 0.6; });
  ASSERT_EQ(cells.size(), 6u);
  for (const PasskeyCell& c : cells) EXPECT_EQ(c.correct, c.depth < 0.6 ? 3 : 0) << c.length << " " << c.depth;

  const nlohmann::json j = nlohmann::json::parse(passkey_json(cells));
  ASSERT_EQ(j["cells"].size(), 6u);
  EXPECT_EQ(j["cells"][0]["length"], 400);
  EXPECT_EQ(j["cells"][0]["accuracy"], 1.0);
  EXPECT_EQ(j["cells"][2]["accuracy"], 0.0);
  const std::string svg = passkey_svg(cells, "t");
  size_t rects = 0;
  for (size_t at = svg.find("<rect x="); at != std::string::npos; at = svg.find("<rect x=", at + 1)) ++rects;
  EXPECT_EQ(rects, 6u);
  EXPECT_NE(svg.find("length 800 depth 1: 0/3"), std::string::npos);
  EXPECT_NE(passkey_table(cells).find("3/3"), std::string::npos);
}

// The model path: a random model through the KV cache scores every trial (and, untrained, finds
// few keys).
TEST_F(PasskeyTest, ModelPathRunsThroughTheKvCache) {
  model::LlamaConfig c;
  c.vocab_size = tokenizer().vocab_size();
  c.dim = 32;
  c.n_layers = 1;
  c.n_heads = 2;
  c.n_kv_heads = 1;
  c.head_dim = 16;
  c.ffn_dim = 48;
  c.max_seq_len = 512;
  model::LlamaModel m(c, model::Precision::cpu(DType::f32), model::CheckpointPolicy::none, 1);
  m.initialize(1);
  PasskeyOptions o;
  o.lengths = {300};
  o.depths = {0.0, 1.0};
  o.trials = 2;
  std::vector<PasskeyCell> cells = passkey_eval(m, tokenizer(), o);
  ASSERT_EQ(cells.size(), 2u);
  for (const PasskeyCell& cell : cells) {
    EXPECT_EQ(cell.trials, 2);
    EXPECT_GE(cell.correct, 0);
    EXPECT_LE(cell.correct, 2);
  }
}

// The prompt and answer of the grid's only trial (one length, one depth, one trial), as the scorer
// sees them: recorded from the first call of a KV-path scorer, the answer read back from the key.
std::pair<std::vector<int32_t>, std::vector<int32_t>> only_trial(const data::Tokenizer& tok, const PasskeyOptions& o) {
  std::vector<int32_t> prompt;
  passkey_eval(tok, o, [&](const std::vector<int32_t>& tokens) {
    if (prompt.empty()) prompt = tokens;
    return std::vector<float>(static_cast<size_t>(tok.vocab_size()), 0.0f);  // argmax 0: a miss, one call
  });
  const std::string text = tok.decode(std::vector<int32_t>(prompt.begin() + (tok.bos_id() >= 0), prompt.end()));
  std::smatch m;
  EXPECT_TRUE(std::regex_search(text, m, std::regex("The pass key is ([0-9]+)\\.")));
  const std::vector<int32_t> head = tok.encode(text), full = tok.encode(text + " " + m[1].str());
  return {prompt, std::vector<int32_t>(full.begin() + static_cast<std::ptrdiff_t>(head.size()), full.end())};
}

// A model that knows the key finds it on both paths; the same model with one answer token mapped
// wrong finds it on neither; a random model gets the same grid on both paths.
TEST_F(PasskeyTest, OneForwardScoresAsTheKvCacheDoes) {
  const data::Tokenizer& tok = tokenizer();
  PasskeyOptions o;
  o.lengths = {300};
  o.depths = {0.5};
  o.trials = 1;
  std::map<int32_t, int32_t> f;
  std::pair<std::vector<int32_t>, std::vector<int32_t>> trial;
  for (o.seed = 0;; ++o.seed) {  // a key whose tokens make the mapping a function
    ASSERT_LT(o.seed, 50u) << "no key with a consistent mapping";
    trial = only_trial(tok, o);
    if (trial.second.size() >= 2 && key_mapping(trial.first, trial.second, f)) break;
  }
  model::LlamaModel m(key_mapping_config(tok.vocab_size(), 512), model::Precision::cpu(DType::f32),
                      model::CheckpointPolicy::none, 512);
  set_key_mapping_weights(m, f);
  EXPECT_EQ(passkey_eval(m, tok, o).at(0).correct, 1) << "the KV cache path misses a key the model knows";
  EXPECT_EQ(passkey_eval_forward(m, tok, o).at(0).correct, 1) << "the forward path misses a key the model knows";
  for (size_t wrong = 0; wrong < trial.second.size(); ++wrong) {  // each answer token in turn mapped wrong
    std::map<int32_t, int32_t> g = f;
    const int32_t from = wrong == 0 ? trial.first.back() : trial.second[wrong - 1];
    g[from] = (g[from] + 1) % static_cast<int32_t>(tok.vocab_size());
    set_key_mapping_weights(m, g);
    EXPECT_EQ(passkey_eval(m, tok, o).at(0).correct, 0) << "answer token " << wrong;
    EXPECT_EQ(passkey_eval_forward(m, tok, o).at(0).correct, 0) << "answer token " << wrong;
  }

  model::LlamaConfig c = key_mapping_config(tok.vocab_size(), 512);
  c.dim = 32, c.n_heads = 2, c.n_kv_heads = 1, c.head_dim = 16, c.ffn_dim = 48;
  model::LlamaModel random(c, model::Precision::cpu(DType::f32), model::CheckpointPolicy::none, 512);
  random.initialize(7, 0.3);
  PasskeyOptions grid;
  grid.lengths = {300, 500};
  grid.depths = {0.0, 1.0};
  grid.trials = 2;
  const std::vector<PasskeyCell> kv = passkey_eval(random, tok, grid), fwd = passkey_eval_forward(random, tok, grid);
  ASSERT_EQ(kv.size(), fwd.size());
  for (size_t i = 0; i < kv.size(); ++i) {
    EXPECT_EQ(fwd[i].correct, kv[i].correct) << "cell " << i;
    EXPECT_EQ(fwd[i].trials, kv[i].trials) << "cell " << i;
  }
}

// argmax_at's rows are the argmax of the full logits at those rows.
TEST_F(PasskeyTest, ArgmaxAtIsTheArgmaxOfTheLogits) {
  model::LlamaConfig c = key_mapping_config(97, 64);
  c.dim = 32, c.n_heads = 2, c.n_kv_heads = 1, c.head_dim = 16, c.ffn_dim = 48;
  model::LlamaModel m(c, model::Precision::cpu(DType::f32), model::CheckpointPolicy::none, 40);
  m.initialize(11, 0.3);
  const int64_t T = 40;
  std::vector<int32_t> tokens(T), labels(T, model::LlamaModel::kIgnoreIndex), positions(T);
  for (int64_t t = 0; t < T; ++t) tokens[t] = static_cast<int32_t>((t * 37 + 5) % 97), positions[t] = static_cast<int32_t>(t);
  const model::TokenShard shard{Tensor(tokens.data(), DType::i32, {T}), Tensor(labels.data(), DType::i32, {T}),
                                Tensor(positions.data(), DType::i32, {T})};
  std::vector<float> logits(static_cast<size_t>(T * 97));
  m.forward_logits(shard, Tensor(logits.data(), DType::f32, {T, 97}));
  const std::vector<int64_t> rows = {0, 7, 39, 7};
  const std::vector<int32_t> got = m.argmax_at(shard, rows);
  ASSERT_EQ(got.size(), rows.size());
  for (size_t i = 0; i < rows.size(); ++i) {
    const float* row = logits.data() + rows[i] * 97;
    EXPECT_EQ(got[i], std::max_element(row, row + 97) - row) << "row " << rows[i];
  }
  EXPECT_TRUE(m.argmax_at(shard, {}).empty());
}

}  // namespace
}  // namespace longtrain::trainer::test

#include "trainer/passkey.h"

#include <algorithm>
#include <cmath>
#include <memory>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "model/generate.h"
#include "runtime/device.h"
#include "runtime/error.h"

namespace longtrain::trainer {

namespace {

constexpr const char* kTask =
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize them. I will quiz you "
    "about the important information there.";
constexpr const char* kFiller = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.";
constexpr const char* kQuestion = "What is the pass key? The pass key is";

std::string fillers(int64_t n) {
  std::string out;
  for (int64_t i = 0; i < n; ++i) out += (i ? " " : "") + std::string(kFiller);
  return out;
}

// The prompt text with `before` fillers ahead of the key sentence and `after` behind it; `head` gets
// the text up to the key sentence.
std::string prompt_text(int64_t before, int64_t after, int64_t key, std::string* head = nullptr) {
  std::string text = std::string(kTask) + "\n";
  if (before > 0) text += fillers(before) + "\n";
  if (head) *head = text;
  text += fmt::format("The pass key is {0}. Remember it. {0} is the pass key.\n", key);
  if (after > 0) text += fillers(after) + "\n";
  return text + kQuestion;
}

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

PasskeyPrompt build_passkey_prompt(const data::Tokenizer& tok, int64_t length, double depth, int64_t key) {
  LT_CHECK(depth >= 0.0 && depth <= 1.0, "passkey: depth {} must be in [0, 1]", depth);
  LT_CHECK(key > 0, "passkey: the key must be a positive integer, got {}", key);
  const int64_t bos = tok.bos_id() >= 0 ? 1 : 0;
  auto split = [&](int64_t n) {
    const auto before = static_cast<int64_t>(std::llround(depth * static_cast<double>(n)));
    return std::pair{before, n - before};
  };
  const std::string answer_text = fmt::format(" {}", key);
  auto tokens_for = [&](int64_t n) {
    auto [before, after] = split(n);
    return bos + static_cast<int64_t>(tok.encode(prompt_text(before, after, key) + answer_text).size());
  };
  // The largest filler count whose prompt and answer fit in `length` tokens (the count grows with n).
  const int64_t per_filler = std::max<int64_t>(1, tokens_for(1) - tokens_for(0));
  int64_t lo = 0, hi = length / per_filler + 2;
  LT_CHECK(tokens_for(1) <= length, "passkey: --lengths {} is too short: one filler and the question take {} tokens",
           length, tokens_for(1));
  lo = 1;
  while (tokens_for(hi) <= length) hi *= 2;
  while (hi - lo > 1) {  // tokens_for(lo) fits, tokens_for(hi) does not
    const int64_t mid = lo + (hi - lo) / 2;
    (tokens_for(mid) <= length ? lo : hi) = mid;
  }

  PasskeyPrompt p;
  p.fillers = lo;
  auto [before, after] = split(lo);
  std::string head;
  const std::string text = prompt_text(before, after, key, &head);
  if (bos) p.prompt.push_back(tok.bos_id());
  const std::vector<int32_t> prompt = tok.encode(text), full = tok.encode(text + answer_text);
  p.prompt.insert(p.prompt.end(), prompt.begin(), prompt.end());
  p.key_token = bos + static_cast<int64_t>(tok.encode(head).size());
  // The answer's tokens as they follow the prompt in the whole text (SentencePiece joins " N" with
  // nothing before it, so the prompt's tokens are a prefix).
  LT_CHECK(full.size() > prompt.size() && std::equal(prompt.begin(), prompt.end(), full.begin()),
           "passkey: the tokenizer splits the prompt differently when the key follows it; cannot score exactly");
  p.answer.assign(full.begin() + static_cast<std::ptrdiff_t>(prompt.size()), full.end());
  return p;
}

bool passkey_correct(const PasskeyPrompt& p, const NextTokenLogits& append_and_predict) {
  std::vector<float> logits = append_and_predict(p.prompt);
  for (size_t k = 0; k < p.answer.size(); ++k) {
    LT_CHECK(!logits.empty(), "passkey: empty logits");
    for (float v : logits) LT_CHECK(std::isfinite(v), "passkey: the model's logits are not finite");
    const auto best = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    if (best != p.answer[k]) return false;
    if (k + 1 < p.answer.size()) logits = append_and_predict({p.answer[k]});
  }
  return true;
}

// The grid, lengths outer and depths inner: every trial's prompt goes to `score`, whose true answers
// are counted.
static std::vector<PasskeyCell> for_each_trial(const data::Tokenizer& tokenizer, const PasskeyOptions& o,
                                               const std::function<bool(const PasskeyPrompt&)>& score) {
  LT_CHECK(!o.lengths.empty(), "passkey: no lengths given (--lengths 4096,16384,...)");
  LT_CHECK(!o.depths.empty(), "passkey: no depths given (--depths 0,0.25,0.5,0.75,1)");
  LT_CHECK(o.trials > 0, "passkey: --trials must be positive, got {}", o.trials);
  std::vector<PasskeyCell> cells;
  for (size_t li = 0; li < o.lengths.size(); ++li) {
    for (size_t di = 0; di < o.depths.size(); ++di) {
      PasskeyCell cell{o.lengths[li], o.depths[di], o.trials, 0};
      for (int64_t t = 0; t < o.trials; ++t) {
        const uint64_t r = splitmix64(o.seed ^ splitmix64((li << 40) ^ (di << 20) ^ static_cast<uint64_t>(t)));
        const int64_t key = static_cast<int64_t>(r % 50000) + 1;
        cell.correct += score(build_passkey_prompt(tokenizer, o.lengths[li], o.depths[di], key));
      }
      cells.push_back(cell);
    }
  }
  return cells;
}

std::vector<PasskeyCell> passkey_eval(const data::Tokenizer& tokenizer, const PasskeyOptions& o,
                                      const std::function<NextTokenLogits(int64_t)>& new_scorer) {
  return for_each_trial(tokenizer, o, [&](const PasskeyPrompt& p) {
    return passkey_correct(p, new_scorer(static_cast<int64_t>(p.prompt.size() + p.answer.size())));
  });
}

std::vector<PasskeyCell> passkey_eval(const data::Tokenizer& tokenizer, const PasskeyOptions& o,
                                      const NextTokenLogits& logits_after) {
  return passkey_eval(tokenizer, o, std::function<NextTokenLogits(int64_t)>([&](int64_t) { return logits_after; }));
}

std::vector<PasskeyCell> passkey_eval(const model::LlamaModel& model, const data::Tokenizer& tokenizer,
                                      const PasskeyOptions& o) {
  // A tokenizer.json's vocabulary may be smaller than the model's (embeddings padded, as Qwen's).
  LT_CHECK(tokenizer.is_hf() ? tokenizer.vocab_size() <= model.config().vocab_size
                             : tokenizer.vocab_size() == model.config().vocab_size,
           "passkey: the tokenizer has {} pieces but the model's vocabulary is {}", tokenizer.vocab_size(),
           model.config().vocab_size);
  // One KV cache per trial, sized for its prompt and answer (the length RoPE scaling dynamic is
  // computed for); each call appends the tokens and predicts the next.
  return passkey_eval(tokenizer, o, std::function<NextTokenLogits(int64_t)>([&](int64_t capacity) {
                        auto cache = std::make_shared<model::KvCache>(model.config(), model.precision(), capacity);
                        return NextTokenLogits([&model, cache](const std::vector<int32_t>& tokens) {
                          return model::decode_tokens(model, *cache, tokens);
                        });
                      }));
}

int64_t passkey_forward_length(int64_t length, SeqLayout layout, int sp_size) {
  const int64_t chunks = layout_chunk_count(layout, sp_size);
  return (length + chunks - 1) / chunks * chunks;
}

std::vector<PasskeyCell> passkey_eval_forward(model::LlamaModel& model, const data::Tokenizer& tokenizer,
                                              const PasskeyOptions& o, const PasskeyRanks& r) {
  // The same rule as the KV-cache path: a tokenizer.json may cover fewer ids than padded embeddings.
  LT_CHECK(tokenizer.is_hf() ? tokenizer.vocab_size() <= model.config().vocab_size
                             : tokenizer.vocab_size() == model.config().vocab_size,
           "passkey: the tokenizer has {} pieces but the model's vocabulary is {}", tokenizer.vocab_size(),
           model.config().vocab_size);
  const Device device = model.precision().device;
  // Per trial, in grid order: the answer tokens this rank found wrong, and those it scored.
  std::vector<double> misses, scored;
  std::vector<int64_t> answer_len;
  int64_t trial = 0;
  const std::vector<PasskeyCell> grid = for_each_trial(tokenizer, o, [&](const PasskeyPrompt& p) {
    const int64_t mine = trial++;
    const auto n = static_cast<int64_t>(p.prompt.size() + p.answer.size());
    misses.push_back(0.0), scored.push_back(0.0);
    answer_len.push_back(static_cast<int64_t>(p.answer.size()));
    if (mine % r.dp_size != r.dp_rank) return false;  // another data-parallel group's trial
    // Length n rounded up for the layout; the padding (token 0) comes after the answer.
    const int64_t S = passkey_forward_length(n, r.layout, r.sp_size);
    std::vector<int32_t> seq(p.prompt);
    seq.insert(seq.end(), p.answer.begin(), p.answer.end());
    seq.resize(static_cast<size_t>(S), 0);
    const int64_t T = S / r.sp_size;
    std::vector<int32_t> tokens(T), labels(T, model::LlamaModel::kIgnoreIndex), positions(T);
    std::vector<int64_t> rows;
    std::vector<int32_t> expected;
    const auto first = static_cast<int64_t>(p.prompt.size()) - 1;  // predicts answer[0]
    for (int64_t i = 0; i < T; ++i) {
      const int64_t g = layout_global_index(r.layout, S, r.sp_size, r.sp_rank, i);
      tokens[i] = seq[static_cast<size_t>(g)];
      positions[i] = static_cast<int32_t>(g);
      if (g >= first && g < first + static_cast<int64_t>(p.answer.size())) {
        rows.push_back(i);
        expected.push_back(p.answer[static_cast<size_t>(g - first)]);
      }
    }
    model.set_rope_length(n);  // rope_scaling dynamic: as transformers over n tokens
    std::vector<int32_t> got;
    if (device == Device::cpu) {
      got = model.argmax_at({Tensor(tokens.data(), DType::i32, {T}),
                             Tensor(labels.data(), DType::i32, {T}),
                             Tensor(positions.data(), DType::i32, {T})},
                            rows);
    } else {
      Arena staging("passkey tokens", device);
      for (const char* name : {"tokens", "labels", "positions"}) staging.add(name, {T}, DType::i32);
      staging.allocate();
      copy(staging.get("tokens"), Tensor(tokens.data(), DType::i32, {T}));
      copy(staging.get("labels"), Tensor(labels.data(), DType::i32, {T}));
      copy(staging.get("positions"), Tensor(positions.data(), DType::i32, {T}));
      got = model.argmax_at({staging.get("tokens"), staging.get("labels"), staging.get("positions")},
                            rows);
    }
    for (size_t k = 0; k < rows.size(); ++k) misses.back() += got[k] != expected[k];
    scored.back() = static_cast<double>(rows.size());
    return false;  // counted below, once every rank's rows are in
  });
  // One reduction: each trial was run by one data-parallel group, whose ranks together scored every
  // answer token once.
  if (r.world && !misses.empty()) {
    parallel::all_reduce_host_values(*r.world, misses.data(), static_cast<int64_t>(misses.size()));
    parallel::all_reduce_host_values(*r.world, scored.data(), static_cast<int64_t>(scored.size()));
  }
  std::vector<PasskeyCell> cells = grid;
  size_t t = 0;
  for (PasskeyCell& cell : cells) {
    cell.correct = 0;
    for (int64_t k = 0; k < cell.trials; ++k, ++t) {
      LT_CHECK(scored[t] == static_cast<double>(answer_len[t]),
               "passkey: trial {} scored {} answer tokens of {} over the ranks", t, scored[t], answer_len[t]);
      cell.correct += misses[t] == 0.0;
    }
  }
  return cells;
}

std::string passkey_table(const std::vector<PasskeyCell>& cells) {
  std::vector<double> depths;
  std::vector<int64_t> lengths;
  for (const PasskeyCell& c : cells) {
    if (std::find(depths.begin(), depths.end(), c.depth) == depths.end()) depths.push_back(c.depth);
    if (std::find(lengths.begin(), lengths.end(), c.length) == lengths.end()) lengths.push_back(c.length);
  }
  std::string out = fmt::format("{:>9}", "length");
  for (double d : depths) out += fmt::format("  depth {:<5}", d);
  out += "\n";
  for (int64_t L : lengths) {
    out += fmt::format("{:>9}", L);
    for (double d : depths)
      for (const PasskeyCell& c : cells)
        if (c.length == L && c.depth == d) out += fmt::format("  {:>4}/{:<6}", c.correct, c.trials);
    out += "\n";
  }
  return out;
}

std::string passkey_json(const std::vector<PasskeyCell>& cells) {
  nlohmann::ordered_json j;
  j["cells"] = nlohmann::ordered_json::array();
  for (const PasskeyCell& c : cells)
    j["cells"].push_back(
        {{"length", c.length}, {"depth", c.depth}, {"trials", c.trials}, {"correct", c.correct}, {"accuracy", c.accuracy()}});
  return j.dump(2) + "\n";
}

std::string passkey_svg(const std::vector<PasskeyCell>& cells, const std::string& title) {
  std::vector<double> depths;
  std::vector<int64_t> lengths;
  for (const PasskeyCell& c : cells) {
    if (std::find(depths.begin(), depths.end(), c.depth) == depths.end()) depths.push_back(c.depth);
    if (std::find(lengths.begin(), lengths.end(), c.length) == lengths.end()) lengths.push_back(c.length);
  }
  const int cw = 70, ch = 34, left = 90, top = 50;
  const int w = left + cw * static_cast<int>(depths.size()) + 20, h = top + ch * static_cast<int>(lengths.size()) + 50;
  std::string svg = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"20\" font-size=\"14\">{}</text>\n",
      w, h, left, title);
  for (size_t r = 0; r < lengths.size(); ++r) {
    const int y = top + ch * static_cast<int>(r);
    svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n", left - 8, y + ch / 2 + 4, lengths[r]);
    for (size_t col = 0; col < depths.size(); ++col)
      for (const PasskeyCell& c : cells) {
        if (c.length != lengths[r] || c.depth != depths[col]) continue;
        const double a = c.accuracy();
        const int x = left + cw * static_cast<int>(col);
        svg += fmt::format("<rect x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"rgb({},{},80)\" "
                           "stroke=\"white\"><title>length {} depth {}: {}/{}</title></rect>\n",
                           x, y, cw, ch, static_cast<int>(220 * (1 - a) + 30), static_cast<int>(190 * a + 40), c.length,
                           c.depth, c.correct, c.trials);
        svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"white\">{:.0f}%</text>\n",
                           x + cw / 2, y + ch / 2 + 4, 100 * a);
      }
  }
  const int y = top + ch * static_cast<int>(lengths.size()) + 16;
  for (size_t col = 0; col < depths.size(); ++col)
    svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                       left + cw * static_cast<int>(col) + cw / 2, y, depths[col]);
  svg += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">depth of the key</text>\n",
                     left + cw * static_cast<int>(depths.size()) / 2, y + 18);
  svg += fmt::format("<text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">tokens</text>\n",
                     top + ch * static_cast<int>(lengths.size()) / 2, top + ch * static_cast<int>(lengths.size()) / 2);
  return svg + "</svg>\n";
}

}  // namespace longtrain::trainer

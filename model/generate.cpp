#include "model/generate.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "attention/local_attention.h"
#include "runtime/device.h"

namespace longtrain::model {

KvCache::KvCache(const LlamaConfig& c, Precision precision, int64_t max_len, int rank, int ranks)
    : max_len_(max_len), arena_("kv cache", precision.device) {
  LT_CHECK(ranks >= 1 && rank >= 0 && rank < ranks, "KvCache: rank {} of {}", rank, ranks);
  block_ = (max_len + ranks - 1) / ranks;
  first_ = std::min<int64_t>(max_len, rank * block_);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    arena_.add(fmt::format("k.{}", l), {block_, c.n_kv_heads, c.head_dim}, precision.act);
    arena_.add(fmt::format("v.{}", l), {block_, c.n_kv_heads, c.head_dim}, precision.act);
  }
  arena_.allocate();
}

Tensor KvCache::keys(int64_t l) const { return arena_.get(fmt::format("k.{}", l)); }
Tensor KvCache::values(int64_t l) const { return arena_.get(fmt::format("v.{}", l)); }

namespace {


// Copies the rows of a strided [n, H, D] view (each row contiguous) to rows of a contiguous cache.
void copy_rows(const Tensor& dst_rows, const Tensor& src) {
  const int64_t row = src.shape[1] * src.shape[2];
  for (int64_t t = 0; t < src.shape[0]; ++t) {
    Tensor s(static_cast<char*>(src.data) + t * src.stride[0] * static_cast<int64_t>(dtype_size(src.dtype)),
             src.dtype, {row}, src.device);
    Tensor d(static_cast<char*>(dst_rows.data) + t * row * static_cast<int64_t>(dtype_size(dst_rows.dtype)),
             dst_rows.dtype, {row}, dst_rows.device);
    copy(d, s);
  }
}

std::vector<float> to_host_floats(const Tensor& t) {
  std::vector<float> out(static_cast<size_t>(t.numel()));
  if (t.dtype == DType::f32) {
    copy(Tensor(out.data(), DType::f32, {t.numel()}), t);
  } else if (t.dtype == DType::f64) {
    std::vector<double> tmp(out.size());
    copy(Tensor(tmp.data(), DType::f64, {t.numel()}), t);
    std::copy(tmp.begin(), tmp.end(), out.begin());
  } else {
    std::vector<bf16> tmp(out.size());
    copy(Tensor(tmp.data(), DType::bf16, {t.numel()}), t);
    std::transform(tmp.begin(), tmp.end(), out.begin(), [](bf16 b) { return static_cast<float>(b); });
  }
  return out;
}

}  // namespace

std::vector<float> decode_tokens(const LlamaModel& model, KvCache& cache, const std::vector<int32_t>& tokens,
                                 parallel::Communicator* group) {
  const LlamaConfig& c = model.config();
  const Precision& pr = model.precision();
  const ModelParams& p = model.param_views();
  const int64_t n = static_cast<int64_t>(tokens.size()), past = cache.length();
  const int64_t C = c.dim, D = c.head_dim, Hq = c.n_heads, F = c.ffn_dim;
  LT_CHECK(n > 0, "decode_tokens: no tokens");
  LT_CHECK(past + n <= cache.capacity(), "generation needs {} positions but the KV cache holds {}", past + n,
           cache.capacity());
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));

  Arena ws("decode workspace", pr.device);
  ws.add("tokens", {n}, DType::i32);
  ws.add("positions", {n}, DType::i32);
  ws.add("x", {n, C}, pr.act);
  ws.add("n", {n, C}, pr.act);
  ws.add("rstd", {n}, pr.stat);
  ws.add("qkv", {n, c.qkv_dim()}, pr.act);
  ws.add("o", {n, Hq, D}, pr.act);
  ws.add("lse", {n, Hq}, pr.stat);
  ws.add("o_new", {n, Hq, D}, pr.act);
  ws.add("lse_new", {n, Hq}, pr.stat);
  ws.add("proj", {n, C}, pr.act);
  ws.add("gate_up", {n, 2 * F}, pr.act);
  ws.add("s", {n, F}, pr.act);
  ws.add("logits", {1, c.vocab_size}, pr.stat == DType::f64 ? DType::f64 : DType::f32);
  const int ranks = group ? group->size() : 1;
  if (group) {  // every rank's partial (O, LSE), gathered
    ws.add("o_all", {ranks * n, Hq, D}, pr.act);
    ws.add("lse_all", {ranks * n, Hq}, pr.stat);
  }
  ws.allocate();
  std::vector<int32_t> positions(static_cast<size_t>(n));
  std::iota(positions.begin(), positions.end(), static_cast<int32_t>(past));
  copy(ws.get("tokens"), Tensor(const_cast<int32_t*>(tokens.data()), DType::i32, {n}));
  copy(ws.get("positions"), Tensor(positions.data(), DType::i32, {n}));

  Tensor x = ws.get("x"), nrm = ws.get("n"), rstd = ws.get("rstd"), qkv = ws.get("qkv"), o = ws.get("o"),
         lse = ws.get("lse"), proj = ws.get("proj"), gate_up = ws.get("gate_up"), s = ws.get("s");
  // The run's length is the cache's capacity (prompt + new tokens): what rope_scaling dynamic is
  // computed for (model/rope_scaling.h).
  RopeTable table = c.rope(cache.capacity());
  const ops::RopeParams rope{c.rope_theta, std::move(table.inv_freq), table.attention_factor};
  ops::embedding_forward(x, ws.get("tokens"), p.embed);
  for (int64_t l = 0; l < c.n_layers; ++l) {
    const LayerParams& lp = p.layers[l];
    ops::rmsnorm_forward(nrm, rstd, x, lp.input_norm, c.norm_eps);
    ops::linear_forward(qkv, nrm, lp.qkv);
    const auto [q, k, v, qk] = split_qkv(qkv, c);
    ops::rope_forward(qk, ws.get("positions"), rope);
    // This rank holds positions [first, first + block): the new tokens' rows among them go to the cache.
    Tensor kc = cache.keys(l), vc = cache.values(l);
    const int64_t first = cache.first(), end = first + cache.block();
    const int64_t a = std::max(past, first), b = std::min(past + n, end);  // new positions held here
    if (a < b) {
      copy_rows(kc.narrow(a - first, b - a), k.narrow(a - past, b - a));
      copy_rows(vc.narrow(a - first, b - a), v.narrow(a - past, b - a));
    }
    // The queries against the keys held here: the earlier positions fully, the new ones causally
    // (query row i is position past + i). Starts from the empty partial (O = 0, LSE = -inf).
    attn::attention_block_forward(o, lse, q, kc.narrow(0, 0), vc.narrow(0, 0), attn::BlockMask::none, scale);
    const Tensor queries = q;  // a structured binding cannot be captured by clang 14's lambdas
    auto merge_block = [&](int64_t q0, int64_t q1, int64_t k0, int64_t k1, attn::BlockMask mask) {
      if (q0 >= q1 || k0 >= k1) return;
      Tensor on = ws.get("o_new").narrow(q0, q1 - q0), ln = ws.get("lse_new").narrow(q0, q1 - q0);
      attn::attention_block_forward(on, ln, queries.narrow(q0, q1 - q0), kc.narrow(k0 - first, k1 - k0),
                                    vc.narrow(k0 - first, k1 - k0), mask, scale);
      attn::lse_merge(o.narrow(q0, q1 - q0), lse.narrow(q0, q1 - q0), on, ln);
    };
    merge_block(0, n, first, std::min(past, end), attn::BlockMask::none);              // cached, earlier
    merge_block(a - past, b - past, a, b, attn::BlockMask::causal_diagonal);           // new, diagonal
    merge_block(b - past, n, a, b, attn::BlockMask::none);                             // new, earlier
    if (group) {
      // Every rank's partial, merged in rank order: the same result on every rank.
      Tensor o_all = ws.get("o_all"), lse_all = ws.get("lse_all");
      group->all_gather(o_all.reshape({ranks * n * Hq * D}), o.reshape({n * Hq * D}));
      group->all_gather(lse_all.reshape({ranks * n * Hq}), lse.reshape({n * Hq}));
      copy(o, o_all.narrow(0, n));
      copy(lse, lse_all.narrow(0, n));
      for (int r = 1; r < ranks; ++r)
        attn::lse_merge(o, lse, o_all.narrow(r * n, n), lse_all.narrow(r * n, n));
    }
    ops::linear_forward(proj, o.reshape({n, Hq * D}), lp.o_proj);
    ops::add_inplace(x, proj);
    ops::rmsnorm_forward(nrm, rstd, x, lp.post_norm, c.norm_eps);
    ops::linear_forward(gate_up, nrm, lp.gate_up);
    ops::swiglu_forward(s, gate_up);
    ops::linear_forward(proj, s, lp.down_proj);
    ops::add_inplace(x, proj);
  }
  cache.advance(n);
  Tensor last = x.narrow(n - 1, 1), last_norm = nrm.narrow(n - 1, 1);
  ops::rmsnorm_forward(last_norm, rstd.narrow(n - 1, 1), last, p.final_norm, c.norm_eps);
  Tensor logits = ws.get("logits");
  if (logits.dtype == pr.act) {
    ops::linear_forward(logits, last_norm, p.lm_head);
    return to_host_floats(logits);
  }
  // bf16 activations: the logits come out in bf16, then widen on the host.
  Arena lg("logits", pr.device);
  lg.add("logits", {1, c.vocab_size}, pr.act);
  lg.allocate();
  ops::linear_forward(lg.get("logits"), last_norm, p.lm_head);
  return to_host_floats(lg.get("logits"));
}

namespace {
double next_uniform(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * 0x1.0p-53;
}
}  // namespace

int32_t sample_token(const std::vector<float>& logits, const SamplingParams& sp, uint64_t& state) {
  LT_CHECK(!logits.empty(), "sample_token: empty logits");
  if (sp.temperature <= 0.0)
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  const double mx = *std::max_element(logits.begin(), logits.end());
  std::vector<std::pair<double, int32_t>> probs(logits.size());
  double total = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    double e = std::exp((logits[i] - mx) / sp.temperature);
    probs[i] = {e, static_cast<int32_t>(i)};
    total += e;
  }
  std::sort(probs.begin(), probs.end(), [](auto& a, auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); });
  // Keep the smallest prefix whose mass reaches top_p, then sample within it.
  double kept = 0.0;
  size_t k = 0;
  while (k < probs.size() && (k == 0 || kept < sp.top_p * total)) kept += probs[k++].first;
  double r = next_uniform(state) * kept;
  for (size_t i = 0; i < k; ++i) {
    r -= probs[i].first;
    if (r <= 0.0) return probs[i].second;
  }
  return probs[k - 1].second;
}

std::vector<int32_t> generate(const LlamaModel& model, const std::vector<int32_t>& prompt, int64_t max_new_tokens,
                              const SamplingParams& sp, int32_t stop_token, parallel::Communicator* group) {
  LT_CHECK(!prompt.empty(), "generate: the prompt is empty (it needs at least a BOS token)");
  const int64_t capacity = static_cast<int64_t>(prompt.size()) + max_new_tokens;
  LT_CHECK(capacity <= model.config().max_seq_len,
           "prompt ({} tokens) + {} new tokens exceed model.max_seq_len ({})", prompt.size(), max_new_tokens,
           model.config().max_seq_len);
  KvCache cache(model.config(), model.precision(), capacity, group ? group->rank() : 0, group ? group->size() : 1);
  uint64_t state = sp.seed;
  // One process: the prompt in one call. Sharded: in pieces of at most one block, so no rank holds
  // activations for more positions than its share of the cache.
  std::vector<float> logits;
  const auto P = static_cast<int64_t>(prompt.size());
  const int64_t piece = group ? cache.block() : P;
  for (int64_t s = 0; s < P; s += piece)
    logits = decode_tokens(model, cache, std::vector<int32_t>(prompt.begin() + s, prompt.begin() + std::min(P, s + piece)),
                           group);
  std::vector<int32_t> out;
  for (int64_t i = 0; i < max_new_tokens; ++i) {
    int32_t tok = sample_token(logits, sp, state);
    if (tok == stop_token) break;
    out.push_back(tok);
    if (i + 1 < max_new_tokens) logits = decode_tokens(model, cache, {tok}, group);
  }
  return out;
}

}  // namespace longtrain::model

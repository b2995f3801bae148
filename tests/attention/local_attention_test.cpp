// Local block attention (attention/local_attention.h) on the CPU: the forward against the definition
// (full score matrix, softmax), the backward against central finite differences and against the
// definition (given O or delta, accumulating or overwriting), blocks merged with lse_merge against the whole sequence, long blocks cut into several
// query tiles, bit-identical results for any thread count, the merge's empty cases, and argument
// errors.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "attention/cpu/work_items.h"
#include "attention/local_attention.h"
#include "test_util.h"

namespace longtrain::attn {
namespace {

using test::HostTensor;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr int64_t kHeadDim = 6;

template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, double> ? 1e-12 : 1e-5;
}
template <class T>
constexpr const char* dtype_label() {
  return std::is_same_v<T, double> ? "f64" : "f32";
}

// ---- cases -----------------------------------------------------------------------------------

struct HeadLayout {
  const char* name;
  int64_t hq, hkv;
};
constexpr HeadLayout kMHA{"MHA", 3, 3}, kGQA{"GQA", 6, 2}, kMQA{"MQA", 3, 1};

struct Dims {
  int64_t tq, tk, hq, hkv, d;
};

struct Case {
  HeadLayout heads;
  BlockMask mask;
  int64_t tq, tk;
  Dims dims() const { return {tq, tk, heads.hq, heads.hkv, kHeadDim}; }
  double scale() const { return 1.0 / std::sqrt(static_cast<double>(kHeadDim)); }
};

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (HeadLayout h : {kMHA, kGQA, kMQA}) {
    cases.push_back({h, BlockMask::causal_diagonal, 37, 37});
    cases.push_back({h, BlockMask::none, 37, 37});
    cases.push_back({h, BlockMask::none, 13, 29});
  }
  return cases;
}

std::string case_name(const testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return fmt::format("{}_{}_{}x{}", c.heads.name, c.mask == BlockMask::causal_diagonal ? "causal" : "none", c.tq,
                     c.tk);
}
void PrintTo(const Case& c, std::ostream* os) {  // what ctest and failures show as GetParam()
  *os << fmt::format("{} (Hq={}, Hkv={}), {} {}x{}", c.heads.name, c.heads.hq, c.heads.hkv,
                     c.mask == BlockMask::causal_diagonal ? "causal_diagonal" : "none", c.tq, c.tk);
}

// ---- data ------------------------------------------------------------------------------------

// n uniform values in [lo, hi), rounded to T (so a double reference sees exactly the inputs).
template <class T>
std::vector<double> random_values(size_t n, uint64_t seed, double lo = -1.5, double hi = 1.5) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = static_cast<double>(static_cast<T>(dist(rng)));
  return v;
}

// A [t, h, d] (or, with d = 0, [t, h]) view at buf + offset whose rows are row_stride apart.
template <class T>
Tensor view_into(std::vector<T>& buf, int64_t offset, int64_t t, int64_t h, int64_t d, int64_t row_stride) {
  Tensor v = d > 0 ? Tensor(buf.data() + offset, dtype_of<T>(), {t, h, d}) : Tensor(buf.data() + offset, dtype_of<T>(), {t, h});
  v.stride[0] = row_stride;
  return v;
}

// Contiguous values [t, h, (d)] in and out of a possibly strided view.
template <class T>
void store(const Tensor& dst, const std::vector<double>& values) {
  const int64_t n2 = dst.ndim == 3 ? dst.size(2) : 1;
  ASSERT_EQ(static_cast<int64_t>(values.size()), dst.size(0) * dst.size(1) * n2);
  T* p = dst.ptr<T>();
  size_t i = 0;
  for (int64_t a = 0; a < dst.size(0); ++a)
    for (int64_t b = 0; b < dst.size(1); ++b)
      for (int64_t c = 0; c < n2; ++c) p[a * dst.stride[0] + b * dst.stride[1] + c] = static_cast<T>(values[i++]);
}
template <class T>
std::vector<double> fetch(const Tensor& src) {
  const int64_t n2 = src.ndim == 3 ? src.size(2) : 1;
  const T* p = src.ptr<T>();
  std::vector<double> out;
  for (int64_t a = 0; a < src.size(0); ++a)
    for (int64_t b = 0; b < src.size(1); ++b)
      for (int64_t c = 0; c < n2; ++c) out.push_back(static_cast<double>(p[a * src.stride[0] + b * src.stride[1] + c]));
  return out;
}

// The tensors of one (Q block, K/V block) call. With `fused`, every view is strided the way the
// model lays them out: q/k/v in fused QKV buffers [T, (Hq + 2·Hkv)·D] (one buffer when Tq == Tk,
// self-attention), dq/dk/dv in fused dQKV buffers, o/d_o/lse/delta with padding after each row.
// Everything not covered by a view is NaN, so a read or write outside a view shows up.
template <class T>
struct BlockTensors {
  std::vector<T> qkv_q, qkv_kv, dqkv_q, dqkv_kv, o_buf, d_o_buf, lse_buf, delta_buf;
  Tensor q, k, v, o, d_o, dq, dk, dv, lse, delta;

  BlockTensors(const Dims& s, bool fused) {
    const T nan = static_cast<T>(kNaN);
    const int64_t qkv_row = fused ? (s.hq + 2 * s.hkv) * s.d : 0;
    const int64_t q_row = fused ? qkv_row : s.hq * s.d, kv_row = fused ? qkv_row : s.hkv * s.d;
    const int64_t k_at = fused ? s.hq * s.d : 0, v_at = fused ? (s.hq + s.hkv) * s.d : 0;
    const bool shared = fused && s.tq == s.tk;
    auto make_qkv = [&](std::vector<T>& qb, std::vector<T>& kvb, Tensor& tq, Tensor& tk, Tensor& tv) {
      if (fused) {
        qb.assign(s.tq * qkv_row, nan);
        std::vector<T>& kb = shared ? qb : kvb;
        if (!shared) kvb.assign(s.tk * qkv_row, nan);
        tq = view_into(qb, 0, s.tq, s.hq, s.d, q_row);
        tk = view_into(kb, k_at, s.tk, s.hkv, s.d, kv_row);
        tv = view_into(kb, v_at, s.tk, s.hkv, s.d, kv_row);
      } else {  // separate contiguous q | k | v in two vectors
        qb.assign(s.tq * q_row, nan);
        kvb.assign(2 * s.tk * kv_row, nan);
        tq = view_into(qb, 0, s.tq, s.hq, s.d, q_row);
        tk = view_into(kvb, 0, s.tk, s.hkv, s.d, kv_row);
        tv = view_into(kvb, s.tk * kv_row, s.tk, s.hkv, s.d, kv_row);
      }
    };
    make_qkv(qkv_q, qkv_kv, q, k, v);
    make_qkv(dqkv_q, dqkv_kv, dq, dk, dv);
    const int64_t o_row = s.hq * s.d + (fused ? 5 : 0), stat_row = s.hq + (fused ? 2 : 0);
    o_buf.assign(s.tq * o_row, nan);
    d_o_buf.assign(s.tq * o_row, nan);
    lse_buf.assign(s.tq * stat_row, nan);
    delta_buf.assign(s.tq * stat_row, nan);
    o = view_into(o_buf, 0, s.tq, s.hq, s.d, o_row);
    d_o = view_into(d_o_buf, 0, s.tq, s.hq, s.d, o_row);
    lse = view_into(lse_buf, 0, s.tq, s.hq, 0, stat_row);
    delta = view_into(delta_buf, 0, s.tq, s.hq, 0, stat_row);
  }
  BlockTensors(const BlockTensors&) = delete;
  BlockTensors& operator=(const BlockTensors&) = delete;
};

// Random inputs of one case (values rounded to T).
struct Inputs {
  std::vector<double> q, k, v, d_o;
};
template <class T>
Inputs make_inputs(const Dims& s, uint64_t seed) {
  return {random_values<T>(s.tq * s.hq * s.d, seed), random_values<T>(s.tk * s.hkv * s.d, seed + 1),
          random_values<T>(s.tk * s.hkv * s.d, seed + 2), random_values<T>(s.tq * s.hq * s.d, seed + 3)};
}

// ---- the naive reference: full score matrices, in double ----------------------------------------

bool visible(BlockMask mask, int64_t i, int64_t j) { return mask == BlockMask::none || j <= i; }

// P[h][i][j] = softmax_j(scale · q[i,h]·k[j,g]) over the visible keys (0 elsewhere), and lse[i,h].
void reference_probabilities(const Inputs& in, const Dims& s, BlockMask mask, double scale,
                             std::vector<double>& p, std::vector<double>& lse) {
  p.assign(s.hq * s.tq * s.tk, 0.0);
  lse.assign(s.tq * s.hq, -kInf);
  std::vector<double> scores(s.tk);
  for (int64_t h = 0; h < s.hq; ++h) {
    const int64_t g = h / (s.hq / s.hkv);
    for (int64_t i = 0; i < s.tq; ++i) {
      double m = -kInf;
      for (int64_t j = 0; j < s.tk; ++j) {
        double dot = 0.0;
        for (int64_t d = 0; d < s.d; ++d) dot += in.q[(i * s.hq + h) * s.d + d] * in.k[(j * s.hkv + g) * s.d + d];
        scores[j] = visible(mask, i, j) ? scale * dot : -kInf;
        m = std::max(m, scores[j]);
      }
      double sum = 0.0;
      for (int64_t j = 0; j < s.tk; ++j) sum += std::exp(scores[j] - m);
      for (int64_t j = 0; j < s.tk; ++j) p[(h * s.tq + i) * s.tk + j] = std::exp(scores[j] - m) / sum;
      lse[i * s.hq + h] = m + std::log(sum);
    }
  }
}

struct Reference {
  std::vector<double> o, lse, dq, dk, dv;
};

// O = P·V; with d_o: delta = rowsum(d_o ⊙ O), dP = d_o·Vᵀ, dS = P ⊙ (dP − delta),
// dQ = scale·dS·K, dK = scale·dSᵀ·Q, dV = Pᵀ·d_o (KV-head gradients summed over their group).
Reference reference_attention(const Inputs& in, const Dims& s, BlockMask mask, double scale) {
  Reference r;
  std::vector<double> p;
  reference_probabilities(in, s, mask, scale, p, r.lse);
  r.o.assign(s.tq * s.hq * s.d, 0.0);
  r.dq.assign(s.tq * s.hq * s.d, 0.0);
  r.dk.assign(s.tk * s.hkv * s.d, 0.0);
  r.dv.assign(s.tk * s.hkv * s.d, 0.0);
  auto at = [&](int64_t h, int64_t i, int64_t j) { return p[(h * s.tq + i) * s.tk + j]; };
  for (int64_t h = 0; h < s.hq; ++h) {
    const int64_t g = h / (s.hq / s.hkv);
    for (int64_t i = 0; i < s.tq; ++i) {
      const double* q = &in.q[(i * s.hq + h) * s.d];
      const double* d_o = &in.d_o[(i * s.hq + h) * s.d];
      double* o = &r.o[(i * s.hq + h) * s.d];
      for (int64_t j = 0; j < s.tk; ++j)
        for (int64_t d = 0; d < s.d; ++d) o[d] += at(h, i, j) * in.v[(j * s.hkv + g) * s.d + d];
      double delta = 0.0;
      for (int64_t d = 0; d < s.d; ++d) delta += d_o[d] * o[d];
      for (int64_t j = 0; j < s.tk; ++j) {
        const double* k = &in.k[(j * s.hkv + g) * s.d];
        const double* v = &in.v[(j * s.hkv + g) * s.d];
        double dp = 0.0;
        for (int64_t d = 0; d < s.d; ++d) dp += d_o[d] * v[d];
        const double ds = at(h, i, j) * (dp - delta);
        for (int64_t d = 0; d < s.d; ++d) {
          r.dq[(i * s.hq + h) * s.d + d] += scale * ds * k[d];
          r.dk[(j * s.hkv + g) * s.d + d] += scale * ds * q[d];
          r.dv[(j * s.hkv + g) * s.d + d] += at(h, i, j) * d_o[d];
        }
      }
    }
  }
  return r;
}

// ---- forward and backward against the definition -------------------------------------------------

class AttentionCases : public testing::TestWithParam<Case> {};

template <class T>
void check_forward(const Case& c, bool fused) {
  const Dims s = c.dims();
  const Inputs in = make_inputs<T>(s, 11);
  BlockTensors<T> t(s, fused);
  store<T>(t.q, in.q);
  store<T>(t.k, in.k);
  store<T>(t.v, in.v);
  attention_block_forward(t.o, t.lse, t.q, t.k, t.v, c.mask, c.scale());
  const Reference ref = reference_attention(in, s, c.mask, c.scale());
  const double err_o = test::relative_error(fetch<T>(t.o), ref.o);
  const double err_lse = test::relative_error(fetch<T>(t.lse), ref.lse);
  std::printf("  %s %-10s O rel err %.2e, LSE rel err %.2e\n", dtype_label<T>(), fused ? "fused" : "contiguous",
              err_o, err_lse);
  EXPECT_LT(err_o, tolerance<T>()) << dtype_label<T>() << (fused ? " fused" : " contiguous");
  EXPECT_LT(err_lse, tolerance<T>()) << dtype_label<T>() << (fused ? " fused" : " contiguous");
  // The padding around the views is untouched (still NaN).
  if (fused) {
    for (size_t i = s.hq * s.d; i < t.o_buf.size(); i += s.hq * s.d + 5) {
      EXPECT_TRUE(std::isnan(static_cast<double>(t.o_buf[i]))) << "o padding written at " << i;
    }
  }
}

TEST_P(AttentionCases, ForwardMatchesDefinition) {
  for (bool fused : {false, true}) {
    check_forward<double>(GetParam(), fused);
    check_forward<float>(GetParam(), fused);
  }
}

// What the backward is handed of the final O, and how it writes.
struct BackwardVariant {
  bool from_o;    // the final O (the backend forms delta) instead of delta
  GradMode mode;  // accumulate onto the initial dq/dk/dv, or overwrite them
  const char* name() const {
    if (from_o) return mode == GradMode::accumulate ? "o, accumulate" : "o, overwrite";
    return mode == GradMode::accumulate ? "delta, accumulate" : "delta, overwrite";
  }
};
constexpr BackwardVariant kBackwardVariants[] = {
    {false, GradMode::accumulate}, {true, GradMode::accumulate}, {false, GradMode::overwrite}, {true, GradMode::overwrite}};

template <class T>
size_t count_nan(const std::vector<T>& a) {
  return std::count_if(a.begin(), a.end(), [](T x) { return std::isnan(static_cast<double>(x)); });
}

// dq/dk/dv start from random values and must come back as initial + gradient (accumulate) or as the
// gradient alone (overwrite); nothing outside their views is written (the fused buffers' unused
// columns stay NaN). Returns dq, dk, dv as computed, for comparisons between variants.
template <class T>
std::vector<std::vector<double>> check_backward(const Case& c, bool fused, BackwardVariant variant) {
  const Dims s = c.dims();
  const Inputs in = make_inputs<T>(s, 23);
  BlockTensors<T> t(s, fused);
  store<T>(t.q, in.q);
  store<T>(t.k, in.k);
  store<T>(t.v, in.v);
  store<T>(t.d_o, in.d_o);
  const std::vector<double> dq0 = random_values<T>(in.q.size(), 91, -0.25, 0.25);
  const std::vector<double> dk0 = random_values<T>(in.k.size(), 92, -0.25, 0.25);
  const std::vector<double> dv0 = random_values<T>(in.v.size(), 93, -0.25, 0.25);
  store<T>(t.dq, dq0);
  store<T>(t.dk, dk0);
  store<T>(t.dv, dv0);
  const size_t nan_before = count_nan(t.dqkv_q) + count_nan(t.dqkv_kv);
  attention_block_forward(t.o, t.lse, t.q, t.k, t.v, c.mask, c.scale());
  if (variant.from_o) {
    attention_block_backward(t.dq, t.dk, t.dv, t.q, t.k, t.v, t.d_o, t.lse, t.o, Tensor{}, c.mask, c.scale(),
                             variant.mode);
  } else {
    attention_delta(t.delta, t.o, t.d_o);
    attention_block_backward(t.dq, t.dk, t.dv, t.q, t.k, t.v, t.d_o, t.lse, Tensor{}, t.delta, c.mask, c.scale(),
                             variant.mode);
  }
  EXPECT_EQ(count_nan(t.dqkv_q) + count_nan(t.dqkv_kv), nan_before) << "written outside the dq/dk/dv views";

  const Reference ref = reference_attention(in, s, c.mask, c.scale());
  const bool add = variant.mode == GradMode::accumulate;
  auto plus = [&](std::vector<double> a, const std::vector<double>& b) {
    for (size_t i = 0; i < a.size(); ++i) a[i] = (add ? a[i] : 0.0) + b[i];
    return a;
  };
  const double err_dq = test::relative_error(fetch<T>(t.dq), plus(dq0, ref.dq));
  const double err_dk = test::relative_error(fetch<T>(t.dk), plus(dk0, ref.dk));
  const double err_dv = test::relative_error(fetch<T>(t.dv), plus(dv0, ref.dv));
  std::printf("  %s %-10s %-17s dq %.2e, dk %.2e, dv %.2e\n", dtype_label<T>(), fused ? "fused" : "contiguous",
              variant.name(), err_dq, err_dk, err_dv);
  EXPECT_LT(err_dq, tolerance<T>()) << variant.name();
  EXPECT_LT(err_dk, tolerance<T>()) << variant.name();
  EXPECT_LT(err_dv, tolerance<T>()) << variant.name();
  return {fetch<T>(t.dq), fetch<T>(t.dk), fetch<T>(t.dv)};
}

// Every variant against the definition; and handing the backward O instead of delta changes no bit
// (the CPU forms each row's delta exactly as attention_delta does), so the distributed schedules may
// pass either.
template <class T>
void check_backward_variants(const Case& c, bool fused) {
  std::vector<std::vector<double>> by_variant[4];
  for (int i = 0; i < 4; ++i) by_variant[i] = check_backward<T>(c, fused, kBackwardVariants[i]);
  EXPECT_EQ(by_variant[0], by_variant[1]) << dtype_label<T>() << ": o and delta differ (accumulate)";
  EXPECT_EQ(by_variant[2], by_variant[3]) << dtype_label<T>() << ": o and delta differ (overwrite)";
}

TEST_P(AttentionCases, BackwardGivesTheDefinitionsGradientsFromOOrDelta) {
  for (bool fused : {false, true}) {
    check_backward_variants<double>(GetParam(), fused);
    check_backward_variants<float>(GetParam(), fused);
  }
}

// L = Σ G ⊙ O for a fixed random G: dL/dO = G, so d_o = G and delta = rowsum(G ⊙ O).
TEST_P(AttentionCases, GradientsMatchFiniteDifferences) {
  const Case& c = GetParam();
  const Dims s = c.dims();
  HostTensor<double> q({s.tq, s.hq, s.d}), k({s.tk, s.hkv, s.d}), v({s.tk, s.hkv, s.d}), g({s.tq, s.hq, s.d});
  HostTensor<double> o({s.tq, s.hq, s.d}), lse({s.tq, s.hq}), delta({s.tq, s.hq});
  HostTensor<double> dq({s.tq, s.hq, s.d}), dk({s.tk, s.hkv, s.d}), dv({s.tk, s.hkv, s.d});
  test::fill_uniform(q, 101, -1.5, 1.5);
  test::fill_uniform(k, 102, -1.5, 1.5);
  test::fill_uniform(v, 103, -1.5, 1.5);
  test::fill_uniform(g, 104);
  auto loss = [&] {
    attention_block_forward(o, lse, q, k, v, c.mask, c.scale());
    double l = 0.0;
    for (size_t i = 0; i < o.size(); ++i) l += g[i] * o[i];
    return l;
  };
  loss();
  attention_delta(delta, o, g);
  attention_block_backward(dq, dk, dv, q, k, v, g, lse, Tensor{}, delta, c.mask, c.scale(), GradMode::accumulate);

  const double err_dq = test::relative_error(dq.values, test::finite_difference(q.values, loss));
  const double err_dk = test::relative_error(dk.values, test::finite_difference(k.values, loss));
  const double err_dv = test::relative_error(dv.values, test::finite_difference(v.values, loss));
  std::printf("  f64 vs central differences: dq %.2e, dk %.2e, dv %.2e\n", err_dq, err_dk, err_dv);
  EXPECT_LT(err_dq, 1e-6);
  EXPECT_LT(err_dk, 1e-6);
  EXPECT_LT(err_dv, 1e-6);
}

INSTANTIATE_TEST_SUITE_P(LocalAttention, AttentionCases, testing::ValuesIn(all_cases()), case_name);

// Scores of several hundred: exp() of a raw score overflows, so this passes only with the row max
// subtracted (forward) and the final LSE subtracted (backward).
TEST(LocalAttention, LargeScoresStayFinite) {
  const Dims s{17, 17, 6, 2, kHeadDim};
  const double scale = 120.0;
  for (BlockMask mask : {BlockMask::causal_diagonal, BlockMask::none}) {
    const Inputs in = make_inputs<double>(s, 7);
    BlockTensors<double> t(s, true);
    store<double>(t.q, in.q);
    store<double>(t.k, in.k);
    store<double>(t.v, in.v);
    store<double>(t.d_o, in.d_o);
    store<double>(t.dq, std::vector<double>(in.q.size(), 0.0));
    store<double>(t.dk, std::vector<double>(in.k.size(), 0.0));
    store<double>(t.dv, std::vector<double>(in.v.size(), 0.0));
    attention_block_forward(t.o, t.lse, t.q, t.k, t.v, mask, scale);
    attention_delta(t.delta, t.o, t.d_o);
    attention_block_backward(t.dq, t.dk, t.dv, t.q, t.k, t.v, t.d_o, t.lse, Tensor{}, t.delta, mask, scale,
                             GradMode::accumulate);
    const Reference ref = reference_attention(in, s, mask, scale);
    EXPECT_GT(*std::max_element(ref.lse.begin(), ref.lse.end()), 710.0) << "scores must overflow exp()";
    EXPECT_LT(test::relative_error(fetch<double>(t.o), ref.o), 1e-12);
    EXPECT_LT(test::relative_error(fetch<double>(t.lse), ref.lse), 1e-12);
    EXPECT_LT(test::relative_error(fetch<double>(t.dq), ref.dq), 1e-12);
    EXPECT_LT(test::relative_error(fetch<double>(t.dk), ref.dk), 1e-12);
    EXPECT_LT(test::relative_error(fetch<double>(t.dv), ref.dv), 1e-12);
  }
}

// An empty K/V block (Tk = 0) gives the empty partial result (O = 0, LSE = -inf) that lse_merge
// ignores; and a query row whose final LSE is -inf (it saw no key anywhere) sends no gradient,
// where exp(s - lse) would otherwise be +inf and the gradients NaN.
TEST(LocalAttention, EmptyRowsGiveTheEmptyResultAndNoGradient) {
  const double scale = 0.4;
  HostTensor<double> q({5, 3, 6}), o({5, 3, 6}), lse({5, 3});
  HostTensor<double> k_none({0, 3, 6}), v_none({0, 3, 6});
  test::fill_uniform(q, 1);
  std::fill(o.values.begin(), o.values.end(), 7.0);
  attention_block_forward(o, lse, q, k_none, v_none, BlockMask::none, scale);
  for (double x : o.values) EXPECT_EQ(x, 0.0);
  for (double l : lse.values) EXPECT_EQ(l, -kInf);

  HostTensor<double> k({4, 3, 6}), v({4, 3, 6}), d_o({5, 3, 6}), delta({5, 3});
  test::fill_uniform(k, 2);
  test::fill_uniform(v, 3);
  test::fill_uniform(d_o, 4);
  attention_block_forward(o, lse, q, k, v, BlockMask::none, scale);
  attention_delta(delta, o, d_o);
  // Expected: row 2 contributes exactly nothing, as when its d_o and delta are 0.
  HostTensor<double> d_o_quiet = d_o, delta_quiet = delta;
  for (int64_t h = 0; h < 3; ++h) {
    delta_quiet[2 * 3 + h] = 0.0;
    for (int64_t d = 0; d < 6; ++d) d_o_quiet[(2 * 3 + h) * 6 + d] = 0.0;
  }
  HostTensor<double> dq_want({5, 3, 6}), dk_want({4, 3, 6}), dv_want({4, 3, 6});
  attention_block_backward(dq_want, dk_want, dv_want, q, k, v, d_o_quiet, lse, Tensor{}, delta_quiet, BlockMask::none,
                           scale, GradMode::accumulate);

  for (int64_t h = 0; h < 3; ++h) lse[2 * 3 + h] = -kInf;
  HostTensor<double> dq({5, 3, 6}), dk({4, 3, 6}), dv({4, 3, 6});
  attention_block_backward(dq, dk, dv, q, k, v, d_o, lse, Tensor{}, delta, BlockMask::none, scale, GradMode::accumulate);
  for (const auto* g : {&dq, &dk, &dv})
    for (double x : g->values) ASSERT_FALSE(std::isnan(x));
  EXPECT_LT(test::relative_error(dq.values, dq_want.values), 1e-15);
  EXPECT_LT(test::relative_error(dk.values, dk_want.values), 1e-15);
  EXPECT_LT(test::relative_error(dv.values, dv_want.values), 1e-15);

  // Overwriting with a block that has no query-key pairs writes zeros: dq for Tk = 0, dk/dv for Tq = 0.
  std::fill(dq.values.begin(), dq.values.end(), 7.0);
  attention_block_backward(dq, k_none, v_none, q, k_none, v_none, d_o, lse, o, Tensor{}, BlockMask::none, scale,
                           GradMode::overwrite);
  for (double x : dq.values) EXPECT_EQ(x, 0.0);
  HostTensor<double> q_none({0, 3, 6}), d_o_none({0, 3, 6}), lse_none({0, 3}), o_none({0, 3, 6});
  std::fill(dk.values.begin(), dk.values.end(), 7.0);
  std::fill(dv.values.begin(), dv.values.end(), 7.0);
  attention_block_backward(q_none, dk, dv, q_none, k, v, d_o_none, lse_none, o_none, Tensor{}, BlockMask::none, scale,
                           GradMode::overwrite);
  for (const auto* g : {&dk, &dv})
    for (double x : g->values) EXPECT_EQ(x, 0.0);
}

// ---- blocks equal the whole ----------------------------------------------------------------------

class BlocksEqualWhole : public testing::TestWithParam<Case> {};

// A 37-token sequence cut into 4 blocks of 9, 9, 9 and 10 tokens. Query block a meets key blocks in
// ring order (a, a-1, ..., then wrapping), skipping those above the diagonal when causal: the
// diagonal block with causal_diagonal, the others with none. Forward partials are merged with
// lse_merge into an accumulator that starts empty (lse = -inf, O = NaN); the backward runs block by
// block with the merged (final) LSE and delta, accumulating into fused dQKV views.
TEST_P(BlocksEqualWhole, ForwardAndBackward) {
  const Case& c = GetParam();
  const BlockMask mask = c.mask;
  const bool causal = mask == BlockMask::causal_diagonal;
  const Dims s = c.dims();
  const double scale = c.scale();
  const std::vector<int64_t> cut{0, 9, 18, 27, 37};
  const int n_blocks = 4;
  const Inputs in = make_inputs<double>(s, 31);

  BlockTensors<double> whole(s, true), parts(s, true);
  for (BlockTensors<double>* t : {&whole, &parts}) {
    store<double>(t->q, in.q);
    store<double>(t->k, in.k);
    store<double>(t->v, in.v);
    store<double>(t->d_o, in.d_o);
    store<double>(t->dq, std::vector<double>(in.q.size(), 0.0));
    store<double>(t->dk, std::vector<double>(in.k.size(), 0.0));
    store<double>(t->dv, std::vector<double>(in.v.size(), 0.0));
  }
  attention_block_forward(whole.o, whole.lse, whole.q, whole.k, whole.v, mask, scale);
  attention_delta(whole.delta, whole.o, whole.d_o);
  attention_block_backward(whole.dq, whole.dk, whole.dv, whole.q, whole.k, whole.v, whole.d_o, whole.lse, Tensor{},
                           whole.delta, mask, scale, GradMode::accumulate);

  auto rows = [&](const Tensor& t, int b) { return t.narrow(cut[b], cut[b + 1] - cut[b]); };
  auto visits = [&](int a) {  // key blocks of query block a, in ring order
    std::vector<int> bs;
    for (int step = 0; step < n_blocks; ++step) {
      const int b = (a - step + n_blocks) % n_blocks;
      if (!causal || b <= a) bs.push_back(b);
    }
    return bs;
  };
  auto block_mask = [&](int a, int b) { return causal && a == b ? BlockMask::causal_diagonal : BlockMask::none; };

  store<double>(parts.o, std::vector<double>(in.q.size(), kNaN));
  store<double>(parts.lse, std::vector<double>(s.tq * s.hq, -kInf));
  for (int a = 0; a < n_blocks; ++a) {
    const int64_t rows_a = cut[a + 1] - cut[a];
    HostTensor<double> o_blk({rows_a, s.hq, s.d}), lse_blk({rows_a, s.hq});
    for (int b : visits(a)) {
      attention_block_forward(o_blk, lse_blk, rows(parts.q, a), rows(parts.k, b), rows(parts.v, b), block_mask(a, b),
                              scale);
      lse_merge(rows(parts.o, a), rows(parts.lse, a), o_blk, lse_blk);
    }
  }
  attention_delta(parts.delta, parts.o, parts.d_o);
  for (int a = 0; a < n_blocks; ++a) {
    for (int b : visits(a)) {
      attention_block_backward(rows(parts.dq, a), rows(parts.dk, b), rows(parts.dv, b), rows(parts.q, a),
                               rows(parts.k, b), rows(parts.v, b), rows(parts.d_o, a), rows(parts.lse, a), Tensor{},
                               rows(parts.delta, a), block_mask(a, b), scale, GradMode::accumulate);
    }
  }

  const double err_o = test::relative_error(fetch<double>(parts.o), fetch<double>(whole.o));
  const double err_lse = test::relative_error(fetch<double>(parts.lse), fetch<double>(whole.lse));
  const double err_dq = test::relative_error(fetch<double>(parts.dq), fetch<double>(whole.dq));
  const double err_dk = test::relative_error(fetch<double>(parts.dk), fetch<double>(whole.dk));
  const double err_dv = test::relative_error(fetch<double>(parts.dv), fetch<double>(whole.dv));
  std::printf("  4 blocks vs whole: O %.2e, LSE %.2e, dq %.2e, dk %.2e, dv %.2e\n", err_o, err_lse, err_dq, err_dk,
              err_dv);
  EXPECT_LT(err_o, 1e-12);
  EXPECT_LT(err_lse, 1e-12);
  EXPECT_LT(err_dq, 1e-12);
  EXPECT_LT(err_dk, 1e-12);
  EXPECT_LT(err_dv, 1e-12);
  // And the whole is the definition.
  const Reference ref = reference_attention(in, s, mask, scale);
  EXPECT_LT(test::relative_error(fetch<double>(whole.o), ref.o), 1e-12);
  EXPECT_LT(test::relative_error(fetch<double>(whole.dk), ref.dk), 1e-12);
}

INSTANTIATE_TEST_SUITE_P(LocalAttention, BlocksEqualWhole,
                         testing::Values(Case{kMHA, BlockMask::causal_diagonal, 37, 37},
                                         Case{kMHA, BlockMask::none, 37, 37},
                                         Case{kGQA, BlockMask::causal_diagonal, 37, 37},
                                         Case{kGQA, BlockMask::none, 37, 37},
                                         Case{kMQA, BlockMask::causal_diagonal, 37, 37},
                                         Case{kMQA, BlockMask::none, 37, 37}),
                         case_name);

// ---- long blocks: several query tiles ------------------------------------------------------------

// The CPU path cuts a block into tiles of query rows; these blocks have several (the last one partial)
// and the head_dim of the CPU demo's model. Forward and backward against the definition, on fused
// strided views, with dq/dk/dv accumulating onto random initial values. Inputs are rounded to f32 for
// both dtypes, so one reference serves both.
template <class T>
void check_long_block(const Dims& s, BlockMask mask, const Inputs& in, const Reference& ref, double scale) {
  BlockTensors<T> t(s, true);
  store<T>(t.q, in.q);
  store<T>(t.k, in.k);
  store<T>(t.v, in.v);
  store<T>(t.d_o, in.d_o);
  const std::vector<double> dq0 = random_values<float>(in.q.size(), 94, -0.25, 0.25);
  const std::vector<double> dk0 = random_values<float>(in.k.size(), 95, -0.25, 0.25);
  const std::vector<double> dv0 = random_values<float>(in.v.size(), 96, -0.25, 0.25);
  store<T>(t.dq, dq0);
  store<T>(t.dk, dk0);
  store<T>(t.dv, dv0);
  attention_block_forward(t.o, t.lse, t.q, t.k, t.v, mask, scale);
  attention_delta(t.delta, t.o, t.d_o);
  attention_block_backward(t.dq, t.dk, t.dv, t.q, t.k, t.v, t.d_o, t.lse, Tensor{}, t.delta, mask, scale,
                           GradMode::accumulate);

  auto increment = [](const std::vector<double>& after, const std::vector<double>& before) {
    std::vector<double> d(after.size());
    for (size_t i = 0; i < d.size(); ++i) d[i] = after[i] - before[i];
    return d;
  };
  const double err_o = test::relative_error(fetch<T>(t.o), ref.o);
  const double err_lse = test::relative_error(fetch<T>(t.lse), ref.lse);
  // Gradients are compared as increments: the initial values are not part of what is measured.
  const double err_dq = test::relative_error(increment(fetch<T>(t.dq), dq0), ref.dq);
  const double err_dk = test::relative_error(increment(fetch<T>(t.dk), dk0), ref.dk);
  const double err_dv = test::relative_error(increment(fetch<T>(t.dv), dv0), ref.dv);
  std::printf("  %s %s %ldx%ld: O %.2e, LSE %.2e, dq %.2e, dk %.2e, dv %.2e\n", dtype_label<T>(),
              mask == BlockMask::causal_diagonal ? "causal" : "none  ", static_cast<long>(s.tq),
              static_cast<long>(s.tk), err_o, err_lse, err_dq, err_dk, err_dv);
  EXPECT_LT(err_o, tolerance<T>());
  EXPECT_LT(err_lse, tolerance<T>());
  EXPECT_LT(err_dq, tolerance<T>());
  EXPECT_LT(err_dk, tolerance<T>());
  EXPECT_LT(err_dv, tolerance<T>());
}

TEST(LocalAttention, LongBlocksMatchTheDefinition) {
  struct LongCase {
    Dims dims;
    BlockMask mask;
  };
  for (const LongCase& c : {LongCase{{600, 600, 4, 2, 32}, BlockMask::causal_diagonal},
                            LongCase{{600, 600, 4, 2, 32}, BlockMask::none},
                            LongCase{{211, 443, 4, 2, 32}, BlockMask::none}}) {
    const double scale = 1.0 / std::sqrt(static_cast<double>(c.dims.d));
    const Inputs in = make_inputs<float>(c.dims, 41);
    const Reference ref = reference_attention(in, c.dims, c.mask, scale);
    check_long_block<double>(c.dims, c.mask, in, ref, scale);
    check_long_block<float>(c.dims, c.mask, in, ref, scale);
  }
}

// ---- threads ---------------------------------------------------------------------------------------

// Fixes the CPU attention's thread count for a scope.
struct AttentionThreads {
  explicit AttentionThreads(int n) { cpu::set_attention_threads(n); }
  ~AttentionThreads() { cpu::set_attention_threads(0); }
  AttentionThreads(const AttentionThreads&) = delete;
  AttentionThreads& operator=(const AttentionThreads&) = delete;
};

// Every output of forward, delta and backward for one block, as computed with `threads` threads.
template <class T>
std::vector<std::vector<double>> outputs_with_threads(const Dims& s, BlockMask mask, int threads) {
  AttentionThreads fixed(threads);
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.d));
  const Inputs in = make_inputs<T>(s, 53);
  BlockTensors<T> t(s, true);
  store<T>(t.q, in.q);
  store<T>(t.k, in.k);
  store<T>(t.v, in.v);
  store<T>(t.d_o, in.d_o);
  store<T>(t.dq, random_values<T>(in.q.size(), 97, -0.25, 0.25));
  store<T>(t.dk, random_values<T>(in.k.size(), 98, -0.25, 0.25));
  store<T>(t.dv, random_values<T>(in.v.size(), 99, -0.25, 0.25));
  attention_block_forward(t.o, t.lse, t.q, t.k, t.v, mask, scale);
  attention_delta(t.delta, t.o, t.d_o);
  attention_block_backward(t.dq, t.dk, t.dv, t.q, t.k, t.v, t.d_o, t.lse, Tensor{}, t.delta, mask, scale,
                           GradMode::accumulate);
  return {fetch<T>(t.o), fetch<T>(t.lse), fetch<T>(t.delta), fetch<T>(t.dq), fetch<T>(t.dk), fetch<T>(t.dv)};
}

// Work is split over threads by (query head, query tile) in the forward and by KV head in the
// backward; no split may change a single bit, or runs would not reproduce across machines with
// different core counts (and checkpoint resume would not be bit-exact).
TEST(LocalAttention, ResultsAreBitIdenticalForAnyThreadCount) {
  const Dims s{300, 300, 6, 3, 32};  // 5 query tiles × 6 heads forward, 3 KV heads backward
  const char* names[] = {"o", "lse", "delta", "dq", "dk", "dv"};
  for (BlockMask mask : {BlockMask::causal_diagonal, BlockMask::none}) {
    const auto f64_1 = outputs_with_threads<double>(s, mask, 1);
    const auto f32_1 = outputs_with_threads<float>(s, mask, 1);
    for (int threads : {2, 3}) {
      const auto f64_n = outputs_with_threads<double>(s, mask, threads);
      const auto f32_n = outputs_with_threads<float>(s, mask, threads);
      for (size_t i = 0; i < f64_1.size(); ++i) {
        // Bit patterns, not values: -0 == 0 and NaN != NaN would hide or invent differences.
        EXPECT_EQ(0, std::memcmp(f64_1[i].data(), f64_n[i].data(), f64_1[i].size() * sizeof(double)))
            << "f64 " << names[i] << " differs between 1 and " << threads << " threads";
        EXPECT_EQ(0, std::memcmp(f32_1[i].data(), f32_n[i].data(), f32_1[i].size() * sizeof(double)))
            << "f32 " << names[i] << " differs between 1 and " << threads << " threads";
      }
    }
  }
}

// The work-item runner (attention/cpu/work_items.h) itself: every item runs exactly once, a second
// thread really takes items (so the test above compares real multi-threaded runs), OpenBLAS is held
// at one thread inside a multi-threaded run and restored after it, and an item's error reaches the caller.
TEST(CpuWorkItems, EveryItemRunsOnceAndHelpersTakePart) {
  const int blas_threads = cpu::attention_threads();  // OpenBLAS's count: no fixed count is set
  constexpr int64_t kItems = 40;
  std::vector<std::atomic<int>> runs(kItems);
  std::vector<int> worker_of(kItems, -1);
  std::atomic<int> max_threads_inside{0};
  cpu::run_work_items(kItems, 2, [&](int64_t item, int worker) {
    runs[static_cast<size_t>(item)].fetch_add(1);
    worker_of[static_cast<size_t>(item)] = worker;
    max_threads_inside.store(std::max(max_threads_inside.load(), cpu::attention_threads()));
    std::this_thread::sleep_for(std::chrono::milliseconds(1));  // long enough for the helper to wake
  });
  for (int64_t i = 0; i < kItems; ++i) EXPECT_EQ(runs[static_cast<size_t>(i)].load(), 1) << "item " << i;
  EXPECT_TRUE(std::all_of(worker_of.begin(), worker_of.end(), [](int w) { return w == 0 || w == 1; }));
  EXPECT_TRUE(std::count(worker_of.begin(), worker_of.end(), 1) > 0) << "no item ran on the helper thread";
  EXPECT_EQ(max_threads_inside.load(), 1) << "OpenBLAS was not held at one thread inside the run";
  EXPECT_EQ(cpu::attention_threads(), blas_threads) << "OpenBLAS's thread count was not restored";

  std::atomic<int> started{0};
  auto failing = [&](int64_t item, int) {
    started.fetch_add(1);
    if (item == 3) LT_FAIL("item {} failed", item);
  };
  try {
    cpu::run_work_items(kItems, 2, failing);
    ADD_FAILURE() << "the item's error was not rethrown";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("item 3 failed"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cpu::attention_threads(), blas_threads) << "OpenBLAS's thread count was not restored after an error";
}

// ---- lse_merge -----------------------------------------------------------------------------------

constexpr int64_t kMergeRows = 7, kMergeHeads = 3;

// Partial results (O, LSE) over kMergeRows × kMergeHeads rows.
template <class T>
struct Partial {
  HostTensor<T> o{kMergeRows, kMergeHeads, kHeadDim};
  HostTensor<T> lse{kMergeRows, kMergeHeads};
};

template <class T>
Partial<T> random_partial(uint64_t seed, double lse_lo, double lse_hi) {
  Partial<T> p;
  test::fill_uniform(p.o, seed);
  test::fill_uniform(p.lse, seed + 1000, lse_lo, lse_hi);
  return p;
}

template <class T>
Partial<T> empty_accumulator() {  // lse = -inf; O is garbage (NaN) that the merge must never read
  Partial<T> p;
  std::fill(p.o.values.begin(), p.o.values.end(), static_cast<T>(kNaN));
  std::fill(p.lse.values.begin(), p.lse.values.end(), static_cast<T>(-kInf));
  return p;
}

TEST(LseMerge, EmptyAccumulatorTakesTheBlockExactly) {
  Partial<double> acc = empty_accumulator<double>();
  const Partial<double> blk = random_partial<double>(1, -5.0, 5.0);
  lse_merge(acc.o, acc.lse, blk.o, blk.lse);
  EXPECT_EQ(acc.o.values, blk.o.values);
  EXPECT_EQ(acc.lse.values, blk.lse.values);
}

TEST(LseMerge, EmptyBlockLeavesTheAccumulatorExactly) {
  Partial<double> acc = random_partial<double>(2, -5.0, 5.0);
  const Partial<double> before = acc;
  const Partial<double> blk = empty_accumulator<double>();
  lse_merge(acc.o, acc.lse, blk.o, blk.lse);
  EXPECT_EQ(acc.o.values, before.o.values);
  EXPECT_EQ(acc.lse.values, before.lse.values);
}

TEST(LseMerge, TwoEmptiesStayEmptyWithZeroOutput) {
  Partial<float> acc = empty_accumulator<float>();
  const Partial<float> blk = empty_accumulator<float>();
  lse_merge(acc.o, acc.lse, blk.o, blk.lse);
  for (float x : acc.o.values) EXPECT_EQ(x, 0.0f);
  for (float l : acc.lse.values) EXPECT_EQ(l, -std::numeric_limits<float>::infinity());
}

// Four partials, with some rows empty in some partials and one row empty in all, LSEs from -3 to 800
// (exp(800) overflows a double): every merge order gives the same result, and it is
// L = log Σ_k exp(L_k), O = Σ_k exp(L_k - L)·O_k.
template <class T>
void check_merge_orders() {
  std::vector<Partial<T>> parts;
  for (int k = 0; k < 4; ++k) parts.push_back(random_partial<T>(10 + k, -3.0, 40.0));
  const T neg_inf = static_cast<T>(-kInf);
  parts[0].lse[0] = static_cast<T>(800.0);  // row 0: two huge LSEs 0.5 apart
  parts[1].lse[0] = static_cast<T>(799.5);
  parts[1].lse[1] = neg_inf;  // row 1: empty in two partials
  parts[3].lse[1] = neg_inf;
  for (int k = 0; k < 4; ++k) parts[k].lse[2] = neg_inf;  // row 2: empty everywhere
  for (int k = 1; k < 4; ++k) parts[k].lse[3] = neg_inf;  // row 3: only partial 0

  // The definition, in double.
  const size_t n_rows = kMergeRows * kMergeHeads;
  std::vector<double> want_lse(n_rows), want_o(n_rows * kHeadDim, 0.0);
  for (size_t r = 0; r < n_rows; ++r) {
    double m = -kInf;
    for (const auto& p : parts) m = std::max(m, static_cast<double>(p.lse[r]));
    if (m == -kInf) {
      want_lse[r] = -kInf;
      continue;
    }
    double sum = 0.0;
    for (const auto& p : parts) sum += std::exp(static_cast<double>(p.lse[r]) - m);
    want_lse[r] = m + std::log(sum);
    for (const auto& p : parts) {
      const double w = std::exp(static_cast<double>(p.lse[r]) - want_lse[r]);
      for (int64_t d = 0; d < kHeadDim; ++d) want_o[r * kHeadDim + d] += w * static_cast<double>(p.o[r * kHeadDim + d]);
    }
  }

  // Rows empty in every partial are compared exactly (O = 0, LSE = -inf) and then set to 0, because
  // relative_error cannot measure an infinity.
  std::vector<bool> empty_row(n_rows);
  for (size_t r = 0; r < n_rows; ++r) {
    empty_row[r] = want_lse[r] == -kInf;
    if (empty_row[r]) want_lse[r] = 0.0;
  }
  std::vector<int> order{0, 1, 2, 3};
  std::vector<double> first_o, first_lse;
  double worst = 0.0;
  do {
    Partial<T> acc = empty_accumulator<T>();
    for (int k : order) lse_merge(acc.o, acc.lse, parts[k].o, parts[k].lse);
    std::vector<double> o(acc.o.values.begin(), acc.o.values.end());
    std::vector<double> lse(acc.lse.values.begin(), acc.lse.values.end());
    for (double x : o) ASSERT_FALSE(std::isnan(x));
    for (size_t r = 0; r < n_rows; ++r) {
      if (!empty_row[r]) continue;
      EXPECT_EQ(lse[r], -kInf);
      for (int64_t d = 0; d < kHeadDim; ++d) EXPECT_EQ(o[r * kHeadDim + d], 0.0);
      lse[r] = 0.0;
    }
    if (first_o.empty()) {
      first_o = o;
      first_lse = lse;
    }
    worst = std::max({worst, test::relative_error(o, want_o), test::relative_error(lse, want_lse),
                      test::relative_error(o, first_o), test::relative_error(lse, first_lse)});
  } while (std::next_permutation(order.begin(), order.end()));
  std::printf("  %s: worst over 24 merge orders %.2e\n", dtype_label<T>(), worst);
  EXPECT_LT(worst, (std::is_same_v<T, double> ? 1e-13 : 1e-6));
}

TEST(LseMerge, EveryOrderGivesTheLogSumExp) {
  check_merge_orders<double>();
  check_merge_orders<float>();
}

TEST(LseMerge, SwappingTwoPartialsIsBitIdentical) {
  const Partial<double> a = random_partial<double>(3, -4.0, 4.0), b = random_partial<double>(4, -4.0, 4.0);
  Partial<double> ab = a, ba = b;
  lse_merge(ab.o, ab.lse, b.o, b.lse);
  lse_merge(ba.o, ba.lse, a.o, a.lse);
  EXPECT_EQ(ab.o.values, ba.o.values);
  EXPECT_EQ(ab.lse.values, ba.lse.values);
}

// ---- errors --------------------------------------------------------------------------------------

template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    // The message, then (for the tests that check it) the source location kept apart from it.
    return std::string(e.what()) + " [raised at " + e.where() + "]";
  }
  return "(no error)";
}

#define EXPECT_HAS(message, part) EXPECT_NE((message).find(part), std::string::npos) << (message)

TEST(LocalAttention, HeadsNotAMultipleOfKvHeadsIsAnError) {
  HostTensor<double> q({5, 4, 6}), k({5, 3, 6}), v({5, 3, 6}), o({5, 4, 6}), lse({5, 4});
  const std::string msg = error_of([&] { attention_block_forward(o, lse, q, k, v, BlockMask::none, 0.4); });
  EXPECT_HAS(msg, "attention_block_forward");
  EXPECT_HAS(msg, "Hq = 4 heads, not a multiple of the Hkv = 3 KV heads");
  EXPECT_HAS(msg, "f64[5, 4, 6] cpu");
  EXPECT_HAS(msg, "local_attention.cpp:");
}

TEST(LocalAttention, CausalBlockMustBeSquare) {
  HostTensor<double> q({13, 3, 6}), k({29, 3, 6}), v({29, 3, 6}), o({13, 3, 6}), lse({13, 3});
  const std::string msg = error_of([&] { attention_block_forward(o, lse, q, k, v, BlockMask::causal_diagonal, 0.4); });
  EXPECT_HAS(msg, "causal_diagonal needs a square diagonal block (Tq == Tk)");
  EXPECT_HAS(msg, "q is f64[13, 3, 6] cpu and k is f64[29, 3, 6] cpu");
  EXPECT_NO_THROW(attention_block_forward(o, lse, q, k, v, BlockMask::none, 0.4));
}

TEST(LocalAttention, HeadDimMismatchIsAnError) {
  HostTensor<double> q({5, 3, 6}), k({5, 3, 4}), v({5, 3, 4}), o({5, 3, 6}), lse({5, 3}), delta({5, 3});
  HostTensor<double> dq({5, 3, 6}), dk({5, 3, 4}), dv({5, 3, 4});
  std::string msg = error_of([&] { attention_block_forward(o, lse, q, k, v, BlockMask::none, 0.4); });
  EXPECT_HAS(msg, "attention_block_forward: head_dim differs between q f64[5, 3, 6] cpu, k f64[5, 3, 4] cpu");
  msg = error_of([&] {
    attention_block_backward(dq, dk, dv, q, k, v, o, lse, Tensor{}, delta, BlockMask::none, 0.4, GradMode::accumulate);
  });
  EXPECT_HAS(msg, "attention_block_backward: head_dim differs");
}

TEST(LocalAttention, BackwardTakesExactlyOneOfOAndDelta) {
  HostTensor<double> q({5, 3, 6}), k({5, 3, 6}), v({5, 3, 6}), o({5, 3, 6}), lse({5, 3}), delta({5, 3});
  HostTensor<double> dq({5, 3, 6}), dk({5, 3, 6}), dv({5, 3, 6}), o_bad({5, 2, 6});
  std::string msg = error_of([&] {
    attention_block_backward(dq, dk, dv, q, k, v, o, lse, o, delta, BlockMask::none, 0.4, GradMode::overwrite);
  });
  EXPECT_HAS(msg, "attention_block_backward: pass exactly one of o (the final O of the query rows) and delta");
  EXPECT_HAS(msg, "got o f64[5, 3, 6] cpu and delta f64[5, 3] cpu");
  msg = error_of([&] {
    attention_block_backward(dq, dk, dv, q, k, v, o, lse, Tensor{}, Tensor{}, BlockMask::none, 0.4,
                             GradMode::overwrite);
  });
  EXPECT_HAS(msg, "got o (none) and delta (none)");
  msg = error_of([&] {
    attention_block_backward(dq, dk, dv, q, k, v, o, lse, o_bad, Tensor{}, BlockMask::none, 0.4, GradMode::overwrite);
  });
  EXPECT_HAS(msg, "attention_block_backward: o is f64[5, 2, 6] cpu but must have the shape of q f64[5, 3, 6] cpu");
}

TEST(LocalAttention, OverlappingTokenRowsAreAnError) {
  HostTensor<double> q({5, 3, 6}), k({5, 3, 6}), v({5, 3, 6}), o({5, 3, 6}), lse({5, 3});
  Tensor k_overlapping = k;
  k_overlapping.stride[0] = 4;  // token rows 4 apart but 6 long
  const std::string msg =
      error_of([&] { attention_block_forward(o, lse, q, k_overlapping, v, BlockMask::none, 0.4); });
  EXPECT_HAS(msg, "attention_block_forward: k f64[5, 3, 6] cpu has token stride 4 < head_dim 6");
}

TEST(LocalAttention, MixedDtypesAndWrongShapesAreErrors) {
  HostTensor<float> qf({5, 3, 6});
  HostTensor<double> q({5, 3, 6}), k({5, 3, 6}), v({5, 3, 6}), o({5, 3, 6}), lse({5, 3}), lse_bad({5, 2});
  std::string msg = error_of([&] { attention_block_forward(o, lse, qf, k, v, BlockMask::none, 0.4); });
  EXPECT_HAS(msg, "k is f64[5, 3, 6] cpu but the other tensors are f32");
  msg = error_of([&] { attention_block_forward(o, lse_bad, q, k, v, BlockMask::none, 0.4); });
  EXPECT_HAS(msg, "lse is f64[5, 2] cpu, expected [5, 3]");
  msg = error_of([&] { lse_merge(o, lse, q, lse_bad); });
  EXPECT_HAS(msg, "lse_merge: lse_blk is f64[5, 2] cpu");
  HostTensor<double> o_short({4, 3, 6});
  msg = error_of([&] { lse_merge(o, lse, o_short, lse); });
  EXPECT_HAS(msg, "lse_merge: o_blk is f64[4, 3, 6] cpu but must have the shape of o_acc f64[5, 3, 6] cpu");
  msg = error_of([&] { attention_delta(lse_bad, o, o); });
  EXPECT_HAS(msg, "attention_delta: delta is f64[5, 2] cpu, expected [5, 3]");
}

// ---- segmented calls ----------------------------------------------------------------------------
// attention_segments_forward/backward on the CPU: each segment equals its own block call, rows outside
// every segment are empty partials (forward) and zero or untouched gradients (backward by mode), and
// overlapping segments are refused. (On CUDA the same calls are one cuDNN call: tests/gpu.)

// Seeded values written into a HostTensor's own storage (its view keeps pointing at it).
void fill_values(HostTensor<double>& t, uint64_t seed) {
  const std::vector<double> v = random_values<double>(t.values.size(), seed);
  std::copy(v.begin(), v.end(), t.values.begin());
}

TEST(SegmentedAttention, EachSegmentIsItsOwnBlockAndTheRestIsEmpty) {
  const int64_t Tq = 14, Tk = 11, Hq = 4, Hkv = 2, D = kHeadDim;
  const double scale = 0.37;
  const std::vector<Segment> segments = {{1, 4, 0, 3}, {6, 1, 5, 4}, {9, 3, 9, 2}, {13, 1, 3, 0}};
  HostTensor<double> q({Tq, Hq, D}), k({Tk, Hkv, D}), v({Tk, Hkv, D}), d_o({Tq, Hq, D});
  fill_values(q, 1);
  fill_values(k, 2);
  fill_values(v, 3);
  fill_values(d_o, 4);
  HostTensor<double> o({Tq, Hq, D}), lse({Tq, Hq});
  std::fill(o.values.begin(), o.values.end(), kNaN);  // garbage the call must overwrite everywhere
  attention_segments_forward(o, lse, q, k, v, segments, BlockMask::none, scale);

  // The reference: one block call per segment into zeroed (0, -inf) rows.
  HostTensor<double> o_ref({Tq, Hq, D}), lse_ref({Tq, Hq});
  std::fill(lse_ref.values.begin(), lse_ref.values.end(), -kInf);
  for (const Segment& g : segments) {
    if (g.k_len == 0) continue;
    attention_block_forward(Tensor(o_ref).narrow(0, g.q_start, g.q_len), Tensor(lse_ref).narrow(0, g.q_start, g.q_len),
                            Tensor(q).narrow(0, g.q_start, g.q_len), Tensor(k).narrow(0, g.k_start, g.k_len),
                            Tensor(v).narrow(0, g.k_start, g.k_len), BlockMask::none, scale);
  }
  EXPECT_EQ(o.values, o_ref.values);
  EXPECT_EQ(lse.values, lse_ref.values);  // rows 0, 5, 7, 8, 12, 13 (no keys): -inf

  // Backward, overwrite: garbage everywhere becomes the segments' gradients, zero elsewhere.
  HostTensor<double> dq({Tq, Hq, D}), dk({Tk, Hkv, D}), dv({Tk, Hkv, D});
  for (auto* t : {&dq, &dk, &dv}) std::fill(t->values.begin(), t->values.end(), kNaN);
  attention_segments_backward(dq, dk, dv, q, k, v, d_o, lse, o, Tensor{}, segments, BlockMask::none, scale,
                              GradMode::overwrite);
  HostTensor<double> dq_ref({Tq, Hq, D}), dk_ref({Tk, Hkv, D}), dv_ref({Tk, Hkv, D});
  for (const Segment& g : segments) {
    if (g.k_len == 0) continue;
    attention_block_backward(Tensor(dq_ref).narrow(0, g.q_start, g.q_len), Tensor(dk_ref).narrow(0, g.k_start, g.k_len),
                             Tensor(dv_ref).narrow(0, g.k_start, g.k_len), Tensor(q).narrow(0, g.q_start, g.q_len),
                             Tensor(k).narrow(0, g.k_start, g.k_len), Tensor(v).narrow(0, g.k_start, g.k_len),
                             Tensor(d_o).narrow(0, g.q_start, g.q_len), Tensor(lse).narrow(0, g.q_start, g.q_len),
                             Tensor(o).narrow(0, g.q_start, g.q_len), Tensor{}, BlockMask::none, scale,
                             GradMode::accumulate);
  }
  EXPECT_EQ(dq.values, dq_ref.values);
  EXPECT_EQ(dk.values, dk_ref.values);
  EXPECT_EQ(dv.values, dv_ref.values);

  // Accumulate adds the same gradients and leaves the other rows as they were.
  HostTensor<double> acc({Tq, Hq, D}), dk_acc({Tk, Hkv, D}), dv_acc({Tk, Hkv, D});
  fill_values(acc, 5);
  const std::vector<double> before = acc.values;
  attention_segments_backward(acc, dk_acc, dv_acc, q, k, v, d_o, lse, o, Tensor{}, segments, BlockMask::none, scale,
                              GradMode::accumulate);
  for (size_t i = 0; i < before.size(); ++i) ASSERT_NEAR(acc.values[i] - before[i], dq_ref.values[i], 1e-12) << i;
  EXPECT_EQ(dk_acc.values, dk_ref.values);
}

TEST(KernelPolicy, ParsesTheThreeNamesAndNamesTheSourceOfABadOne) {
  EXPECT_EQ(parse_kernel_policy("cudnn", "x"), KernelPolicy::cudnn);
  EXPECT_EQ(parse_kernel_policy("hopper", "x"), KernelPolicy::hopper);
  EXPECT_EQ(parse_kernel_policy("auto", "x"), KernelPolicy::autotune);
  for (KernelPolicy p : {KernelPolicy::cudnn, KernelPolicy::hopper, KernelPolicy::autotune})
    EXPECT_EQ(parse_kernel_policy(kernel_policy_name(p), "x"), p);
  const std::string msg = error_of([] { parse_kernel_policy("flash", "LONGTRAIN_ATTENTION_KERNEL"); });
  EXPECT_HAS(msg, "LONGTRAIN_ATTENTION_KERNEL: the attention kernel must be cudnn, hopper or auto, got 'flash'");
}

// A run's requested policy (its config's attention.kernel: trainer/run_setup.cpp, set_kernel_choices; the
// benchmarks' use_training_kernel_policies) takes effect unless LONGTRAIN_ATTENTION_KERNEL names one,
// which wins; a bad value there names the variable.
TEST(KernelPolicy, TheEnvironmentsPolicyWinsOverTheRequestedOne) {
  const KernelPolicy saved = kernel_policy();
  test::with_env("LONGTRAIN_ATTENTION_KERNEL", nullptr, [] {
    EXPECT_EQ(set_kernel_policy_unless_overridden(KernelPolicy::hopper), KernelPolicy::hopper);
    EXPECT_EQ(kernel_policy(), KernelPolicy::hopper);
  });
  test::with_env("LONGTRAIN_ATTENTION_KERNEL", "", [] {
    EXPECT_EQ(set_kernel_policy_unless_overridden(KernelPolicy::autotune), KernelPolicy::autotune);
  });
  test::with_env("LONGTRAIN_ATTENTION_KERNEL", "cudnn", [] {
    EXPECT_EQ(set_kernel_policy_unless_overridden(KernelPolicy::autotune), KernelPolicy::cudnn);
    EXPECT_EQ(kernel_policy(), KernelPolicy::cudnn);
  });
  test::with_env("LONGTRAIN_ATTENTION_KERNEL", "flash", [] {
    const std::string msg = error_of([] { set_kernel_policy_unless_overridden(KernelPolicy::autotune); });
    EXPECT_HAS(msg, "LONGTRAIN_ATTENTION_KERNEL: the attention kernel must be cudnn, hopper or auto, got 'flash'");
  });
  set_kernel_policy(saved);
}

// On the CPU a merged block call is the two steps it stands for, bit for bit.
TEST(BlockForwardMerge, OnTheCpuEqualsForwardThenLseMerge) {
  const int64_t Tq = 9, Tk = 13, Hq = 4, Hkv = 2, D = 6;
  HostTensor<double> q({Tq, Hq, D}), k({Tk, Hkv, D}), v({Tk, Hkv, D});
  fill_values(q, 1);
  fill_values(k, 2);
  fill_values(v, 3);
  // A running partial from a first block of keys, merged with a second block both ways.
  HostTensor<double> o_a({Tq, Hq, D}), lse_a({Tq, Hq}), o_b({Tq, Hq, D}), lse_b({Tq, Hq});
  HostTensor<double> o_blk({Tq, Hq, D}), lse_blk({Tq, Hq}), o_blk2({Tq, Hq, D}), lse_blk2({Tq, Hq});
  const Tensor k1 = Tensor(k).narrow(0, 0, 5), v1 = Tensor(v).narrow(0, 0, 5);
  const Tensor k2 = Tensor(k).narrow(0, 5, Tk - 5), v2 = Tensor(v).narrow(0, 5, Tk - 5);
  attention_block_forward(o_a, lse_a, q, k1, v1, BlockMask::none, 0.3);
  o_b.values = o_a.values;
  lse_b.values = lse_a.values;
  attention_block_forward_merge(o_a, lse_a, o_blk, lse_blk, q, k2, v2, BlockMask::none, 0.3);
  attention_block_forward(o_blk2, lse_blk2, q, k2, v2, BlockMask::none, 0.3);
  lse_merge(o_b, lse_b, o_blk2, lse_blk2);
  EXPECT_EQ(o_a.values, o_b.values);
  EXPECT_EQ(lse_a.values, lse_b.values);
}

TEST(SegmentedAttention, OverlappingOrOutOfRangeSegmentsAreErrors) {
  HostTensor<double> q({8, 2, 6}), k({8, 2, 6}), v({8, 2, 6}), o({8, 2, 6}), lse({8, 2});
  std::string msg = error_of([&] {
    attention_segments_forward(o, lse, q, k, v, {{0, 4, 0, 4}, {3, 2, 4, 2}}, BlockMask::none, 0.4);
  });
  EXPECT_HAS(msg, "attention_segments_forward: segments overlap in their query rows ([0, 4) and [3, 5))");
  msg = error_of([&] {
    attention_segments_backward(q, k, v, q, k, v, q, lse, o, Tensor{}, {{0, 2, 0, 4}, {4, 2, 3, 2}}, BlockMask::none,
                                0.4, GradMode::overwrite);
  });
  EXPECT_HAS(msg, "segments overlap in their key rows ([0, 4) and [3, 5))");
  msg = error_of([&] { attention_segments_forward(o, lse, q, k, v, {{6, 3, 0, 3}}, BlockMask::none, 0.4); });
  EXPECT_HAS(msg, "segment q [6, +3) k [0, +3) lies outside the 8 query and 8 key rows");
  msg = error_of([&] { attention_segments_forward(o, lse, q, k, v, {{0, 3, 0, 2}}, BlockMask::causal_diagonal, 0.4); });
  EXPECT_HAS(msg, "a causal_diagonal segment needs as many queries as keys, got 3 and 2");
}

}  // namespace
}  // namespace longtrain::attn

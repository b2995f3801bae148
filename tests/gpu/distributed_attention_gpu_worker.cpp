// The program distributed_attention_gpu_test.cpp runs under longtrain-run: 2 ranks, one GPU each,
// NCCL. Every schedule/layout pairing computes causal GQA attention (8 query heads, 2 KV heads,
// head_dim 128, 1024 tokens in all) in bf16 with f32 LSE, Q/K/V read as views of a fused QKV buffer
// and dQ/dK/dV written into a fused dQKV buffer that starts as garbage (backward overwrites), as the
// model calls it. Each rank also
// computes, over the whole sequence and from the same bf16 inputs:
//   - the f64 CPU reference (attention/cpu), and
//   - single-GPU attention (LocalSequenceAttention on its own GPU: the P = 1 path, where cuDNN reads
//     the final O and writes dQ/dK/dV in place into the fused dQKV views), and
//   - (bf16) the block calls of P = 1 and P = 2 computed exactly with their outputs rounded to bf16
//     where cuDNN rounds them (bf16_block_outputs),
// and reports for its own tokens (same rows for every error, so P = 1 and P = 2 are compared on the
// same scale):
//   ERR <config> <tensor> <P=1 vs f64> <P=2 vs f64> <P=2 vs P=1> <bf16 blocks P=1 vs f64>
//       <bf16 blocks P=2 vs f64> <P=2 vs its bf16 blocks>
//   CASE <name> <value> <bound>      (the test asserts value <= bound)
// Besides the errors: two problems (A, B) go through forward A, forward B, backward B, backward A
// with no host synchronisation in between (send buffers and accumulators are reused across calls
// while the device still runs, so missing stream ordering shows as wrong results); a second backward
// over the first's results gives them again (it overwrites; it does not add); a repeated forward
// gives the same bits; the bytes sent match the schedule's
// definition with bf16 tensors and f32 accumulators on the wire.
//
//   distributed_attention_gpu_worker          the GPU run (NCCL, bf16 tensors)
//   distributed_attention_gpu_worker --cpu    the same checks on CPU (Gloo, f32 tensors), to try the
//                                             worker itself where there is no GPU
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "attention/distributed/distributed_attention.h"
#include "attention/local_attention.h"
#include "attention/sequence_attention.h"
#include "parallel/distributed.h"
#include "parallel/layout.h"
#include "runtime/device.h"
#include "test_util.h"

namespace {

using namespace longtrain;
using namespace longtrain::attn;
using test::download;
using test::download_bytes;
using test::HostTensor;
using test::round_all;
using test::round_to;

constexpr int64_t kS = 1024, kHq = 8, kHkv = 2, kD = 128, kW = kHq + 2 * kHkv;

// Where the shards live and their dtype: CUDA and bf16, or (--cpu) CPU and f32. LSE is f32 on both.
Device g_device = Device::cuda;
DType g_dtype = DType::bf16;

// Errors are max|got - ref| / max|ref| (test::relative_error), and against f64 also norm-wise,
// ||got - ref|| / ||ref|| (test::norm_relative_error), under the same bounds. Bounds:
// - bf16 tensors (O, dQ, dK, dV): 4 bf16 ulps, as for the single-GPU attention tests (gpu_test_util.h).
// - f32 tensors (the LSE; everything with --cpu): 1e-4, the f32 bound of the same file (cuDNN forms
//   scores in f32 from bf16 inputs).
// - P = 2 against P = 1 (bf16): cuDNN writes each block call's O, dQ and dK/dV only in bf16 (measured
//   with cuDNN 9.19 on an H200: a graph with an f32 O finalizes on engine 2 but writes wrong values,
//   one with f32 dK/dV has no engine; for GQA it also rounds dK/dV per query head before the group
//   sum), so P ranks round every partial result once more than one rank does. P = 2's error is held
//   to P = 1's (cuDNN's own arithmetic, the same at any P) plus what those roundings cost, computed
//   exactly on the CPU (bf16_block_outputs: the same block calls in f64, outputs rounded where cuDNN
//   rounds them). Both, and P = 1's, are printed.
// - In f32 (--cpu) there is no per-block rounding to speak of: at most 1.5x P = 1's error, never asked
//   to resolve less than 2^-20 (~8 f32 ulps).
double tolerance(DType t) { return t == DType::bf16 ? 4.0 / 256.0 : 1e-4; }

// ---- device buffers -----------------------------------------------------------------------------------

struct DeviceBuffer {
  Tensor t;
  DeviceBuffer(DType dtype, std::initializer_list<int64_t> shape) {
    Tensor probe(nullptr, dtype, shape, g_device);
    t = probe;
    t.data = device_alloc(g_device, probe.nbytes());
    zero(t);
  }
  ~DeviceBuffer() { device_free(g_device, t.data); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

void upload(const Tensor& t, const std::vector<double>& v) {
  LT_CHECK(static_cast<size_t>(t.numel()) == v.size(), "upload: {} values into {}", v.size(), t.describe());
  std::vector<unsigned char> host(t.nbytes());
  for (size_t i = 0; i < v.size(); ++i) {
    if (t.dtype == DType::bf16) {
      reinterpret_cast<bf16*>(host.data())[i] = bf16(static_cast<float>(v[i]));
    } else {
      reinterpret_cast<float*>(host.data())[i] = static_cast<float>(v[i]);
    }
  }
  Tensor src = t;
  src.data = host.data();
  src.device = Device::cpu;
  copy(t, src);  // queued on the compute stream, like everything the schedules do
}

// [T, heads, D] columns [h0, h0 + heads) of a fused [T, W, D] buffer.
Tensor heads_of(const Tensor& fused, int64_t h0, int64_t heads) { return fused.narrow(1, h0, heads); }

// ---- the whole-sequence problem ----------------------------------------------------------------------

// Per-token tensors as doubles, row-major [tokens, heads, D] (or [tokens, heads] for the LSE).
struct Outputs {
  std::vector<double> o, lse, dq, dk, dv;
};
const char* const kTensorNames[5] = {"o", "lse", "dq", "dk", "dv"};
const std::vector<double>& part(const Outputs& x, int i) {
  const std::vector<double>* p[5] = {&x.o, &x.lse, &x.dq, &x.dk, &x.dv};
  return *p[i];
}
int64_t row_width(int i) { return i == 1 ? kHq : (i == 0 || i == 2 ? kHq * kD : kHkv * kD); }

struct Problem {
  double scale = 1.0 / std::sqrt(static_cast<double>(kD));
  std::vector<double> q, k, v, d_o;  // whole sequence, bf16-rounded
};

// Unit-variance Q/K (scores of O(1) after the 1/sqrt(D) scale, so softmax is neither flat nor
// one-hot) and dO, rounded to bf16 so that every computation sees the same inputs.
Problem make_problem(uint64_t seed) {
  Problem p;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-std::sqrt(3.0), std::sqrt(3.0));
  auto fill = [&](std::vector<double>& x, int64_t n) {
    x.resize(static_cast<size_t>(n));
    for (double& e : x) e = round_to(u(rng), DType::bf16);
  };
  fill(p.q, kS * kHq * kD);
  fill(p.k, kS * kHkv * kD);
  fill(p.v, kS * kHkv * kD);
  fill(p.d_o, kS * kHq * kD);
  return p;
}

Outputs cpu_reference(const Problem& p) {
  auto host = [](const std::vector<double>& v, std::initializer_list<int64_t> shape) {
    HostTensor<double> t(shape);
    t.values = v;
    t.view.data = t.values.data();
    return t;
  };
  const HostTensor<double> q = host(p.q, {kS, kHq, kD}), k = host(p.k, {kS, kHkv, kD}), v = host(p.v, {kS, kHkv, kD}),
                           d_o = host(p.d_o, {kS, kHq, kD});
  HostTensor<double> o({kS, kHq, kD}), lse({kS, kHq}), delta({kS, kHq}), dq({kS, kHq, kD}), dk({kS, kHkv, kD}),
      dv({kS, kHkv, kD});
  attention_block_forward(o, lse, q, k, v, BlockMask::causal_diagonal, p.scale);
  attention_delta(delta, o, d_o);
  attention_block_backward(dq, dk, dv, q, k, v, d_o, lse, Tensor{}, delta, BlockMask::causal_diagonal, p.scale,
                           GradMode::accumulate);
  return {o.values, lse.values, dq.values, dk.values, dv.values};
}

// ---- what bf16 block outputs cost ---------------------------------------------------------------------

double to_bf16(double x) { return round_to(x, DType::bf16); }

// Rows `idx` of a whole-sequence [S, heads, D] tensor, each KV head repeated `repeat` times (the
// query heads of its group), as a HostTensor [idx.size(), heads · repeat, D].
HostTensor<double> gather_rows(const std::vector<double>& whole, const std::vector<int64_t>& idx, int64_t heads,
                               int64_t dim, int64_t repeat = 1) {
  const int64_t n = static_cast<int64_t>(idx.size()), out_heads = heads * repeat;
  HostTensor<double> t({n, out_heads, dim});
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < out_heads; ++h)
      std::copy_n(whole.begin() + (idx[static_cast<size_t>(i)] * heads + h / repeat) * dim, dim,
                  t.values.begin() + (i * out_heads + h) * dim);
  return t;
}

// What rank r's tokens get from P ranks when every block call's outputs are rounded to bf16 where
// cuDNN rounds them, everything else exact: the schedules' block calls (plan_block_calls with
// `chunk_calls`), each computed in f64; O rounded per call, then merged
// exactly; dQ rounded per call; dK/dV rounded per query head (cuDNN's GQA group sum reads them in
// bf16), summed over the group, rounded per call, then summed exactly; the results rounded once more
// (the caller's bf16 outputs). delta comes from the exact O. P = 1 is one causal call over the whole
// sequence. What remains between this and the GPU is cuDNN's arithmetic inside a call.
Outputs bf16_block_outputs(const Problem& p, const Outputs& exact, SeqLayout layout, ChunkCalls chunk_calls, int P,
                           int r) {
  const int64_t T = kS / P, G = kHq / kHkv;
  auto rows = [&](int x) { return layout_global_indices(layout, kS, P, x); };
  auto slice = [](const std::vector<int64_t>& v, int64_t start, int64_t len) {
    return std::vector<int64_t>(v.begin() + start, v.begin() + start + len);
  };
  auto calls = [&](int q_rank, int kv_rank) {
    return plan_block_calls(layout, P, T, q_rank, kv_rank, /*causal=*/true, chunk_calls);
  };
  std::vector<double> delta(static_cast<size_t>(kS * kHq), 0.0);
  for (int64_t t = 0; t < kS * kHq; ++t)
    for (int64_t d = 0; d < kD; ++d) delta[t] += exact.o[t * kD + d] * p.d_o[t * kD + d];
  const std::vector<int64_t> mine = rows(r);

  HostTensor<double> o({T, kHq, kD}), lse({T, kHq}), dq({T, kHq, kD}), dk({T, kHkv, kD}), dv({T, kHkv, kD});
  std::fill(lse.values.begin(), lse.values.end(), -std::numeric_limits<double>::infinity());
  // One call's gradients, every K/V head repeated for its query heads (per-query-head dK/dV).
  struct Grads {
    HostTensor<double> dq, dk, dv;
  };
  auto backward = [&](const std::vector<int64_t>& qi, const std::vector<int64_t>& ki, BlockMask mask) {
    const int64_t nq = static_cast<int64_t>(qi.size()), nk = static_cast<int64_t>(ki.size());
    Grads g{HostTensor<double>({nq, kHq, kD}), HostTensor<double>({nk, kHq, kD}), HostTensor<double>({nk, kHq, kD})};
    attention_block_backward(g.dq, g.dk, g.dv, gather_rows(p.q, qi, kHq, kD), gather_rows(p.k, ki, kHkv, kD, G),
                             gather_rows(p.v, ki, kHkv, kD, G), gather_rows(p.d_o, qi, kHq, kD),
                             gather_rows(exact.lse, qi, kHq, 1).view.reshape({nq, kHq}), Tensor{},
                             gather_rows(delta, qi, kHq, 1).view.reshape({nq, kHq}), mask, p.scale,
                             GradMode::accumulate);
    return g;
  };
  for (int s = 0; s < P; ++s) {
    const std::vector<int64_t> theirs = rows(s);
    for (const BlockCall& c : calls(r, s)) {  // this rank's queries: O and dQ
      const std::vector<int64_t> qi = slice(mine, c.q_start, c.q_len), ki = slice(theirs, c.k_start, c.k_len);
      HostTensor<double> ob({c.q_len, kHq, kD}), lb({c.q_len, kHq});
      attention_block_forward(ob, lb, gather_rows(p.q, qi, kHq, kD), gather_rows(p.k, ki, kHkv, kD),
                              gather_rows(p.v, ki, kHkv, kD), c.mask, p.scale);
      for (double& x : ob.values) x = to_bf16(x);
      lse_merge(Tensor(o).narrow(0, c.q_start, c.q_len), Tensor(lse).narrow(0, c.q_start, c.q_len), ob, lb);
      Grads g = backward(qi, ki, c.mask);
      for (int64_t i = 0; i < c.q_len * kHq * kD; ++i) dq[(c.q_start * kHq * kD) + i] += to_bf16(g.dq[i]);
    }
    for (const BlockCall& c : calls(s, r)) {  // this rank's keys: dK and dV
      const std::vector<int64_t> qi = slice(theirs, c.q_start, c.q_len), ki = slice(mine, c.k_start, c.k_len);
      Grads g = backward(qi, ki, c.mask);
      for (int64_t j = 0; j < c.k_len; ++j)
        for (int64_t h = 0; h < kHkv; ++h)
          for (int64_t d = 0; d < kD; ++d) {
            double sk = 0, sv = 0;
            for (int64_t e = h * G; e < (h + 1) * G; ++e) {
              sk += to_bf16(g.dk[(j * kHq + e) * kD + d]);
              sv += to_bf16(g.dv[(j * kHq + e) * kD + d]);
            }
            const size_t at = static_cast<size_t>(((c.k_start + j) * kHkv + h) * kD + d);
            dk[at] += to_bf16(sk);
            dv[at] += to_bf16(sv);
          }
    }
  }
  return {round_all(o.values, DType::bf16), lse.values, round_all(dq.values, DType::bf16),
          round_all(dk.values, DType::bf16), round_all(dv.values, DType::bf16)};
}

// The rows of `whole` ([S, width]) at the global token indices `rows`.
std::vector<double> take_rows(const std::vector<double>& whole, const std::vector<int64_t>& rows, int64_t width) {
  std::vector<double> out;
  out.reserve(rows.size() * static_cast<size_t>(width));
  for (int64_t g : rows)
    out.insert(out.end(), whole.begin() + g * width, whole.begin() + (g + 1) * width);
  return out;
}

// One rank's tokens on the device, laid out as the model holds them.
struct Shard {
  std::vector<int64_t> rows;  // global index of each local token
  int64_t n;
  DeviceBuffer qkv, o, lse, d_o, dqkv;
  Tensor q, k, v, dq, dk, dv;

  Shard(const Problem& p, std::vector<int64_t> rows_)
      : rows(std::move(rows_)),
        n(static_cast<int64_t>(rows.size())),
        qkv(g_dtype, {n, kW, kD}),
        o(g_dtype, {n, kHq, kD}),
        lse(DType::f32, {n, kHq}),
        d_o(g_dtype, {n, kHq, kD}),
        dqkv(g_dtype, {n, kW, kD}) {
    q = heads_of(qkv.t, 0, kHq);
    k = heads_of(qkv.t, kHq, kHkv);
    v = heads_of(qkv.t, kHq + kHkv, kHkv);
    dq = heads_of(dqkv.t, 0, kHq);
    dk = heads_of(dqkv.t, kHq, kHkv);
    dv = heads_of(dqkv.t, kHq + kHkv, kHkv);
    std::vector<double> fused(static_cast<size_t>(n * kW * kD));
    for (int64_t j = 0; j < n; ++j) {
      const int64_t g = rows[static_cast<size_t>(j)];
      double* dst = fused.data() + j * kW * kD;
      std::copy_n(p.q.begin() + g * kHq * kD, kHq * kD, dst);
      std::copy_n(p.k.begin() + g * kHkv * kD, kHkv * kD, dst + kHq * kD);
      std::copy_n(p.v.begin() + g * kHkv * kD, kHkv * kD, dst + (kHq + kHkv) * kD);
    }
    upload(qkv.t, fused);
    upload(d_o.t, take_rows(p.d_o, rows, kHq * kD));
    // Garbage where the gradients go: backward must overwrite every element (the model does not zero).
    std::vector<double> garbage(static_cast<size_t>(n * kW * kD));
    std::mt19937_64 rng(977 + static_cast<uint64_t>(n));
    std::uniform_real_distribution<double> u(-3.0, 3.0);
    for (double& x : garbage) x = u(rng);
    upload(dqkv.t, garbage);
  }

  void forward(SequenceAttention& a) { a.forward(o.t, lse.t, q, k, v); }
  void backward(SequenceAttention& a) { a.backward(dq, dk, dv, q, k, v, o.t, lse.t, d_o.t); }

  Outputs read() const {
    Outputs x;
    x.o = download(o.t);
    x.lse = download(lse.t);
    const std::vector<double> g = download(dqkv.t);
    for (int64_t j = 0; j < n; ++j) {
      const double* row = g.data() + j * kW * kD;
      x.dq.insert(x.dq.end(), row, row + kHq * kD);
      x.dk.insert(x.dk.end(), row + kHq * kD, row + (kHq + kHkv) * kD);
      x.dv.insert(x.dv.end(), row + (kHq + kHkv) * kD, row + kW * kD);
    }
    return x;
  }
};

std::vector<int64_t> all_rows() {
  std::vector<int64_t> r(kS);
  for (int64_t i = 0; i < kS; ++i) r[static_cast<size_t>(i)] = i;
  return r;
}

// Single-GPU attention over the whole sequence (what one rank without sequence parallelism runs).
Outputs single_gpu(const Problem& p) {
  Shard whole(p, all_rows());
  LocalSequenceAttention local(/*causal=*/true, p.scale);
  whole.forward(local);
  whole.backward(local);
  return whole.read();
}

Outputs rows_of(const Outputs& whole, const std::vector<int64_t>& rows) {
  Outputs x;
  std::vector<double>* dst[5] = {&x.o, &x.lse, &x.dq, &x.dk, &x.dv};
  for (int i = 0; i < 5; ++i) *dst[i] = take_rows(part(whole, i), rows, row_width(i));
  return x;
}

// ---- one schedule --------------------------------------------------------------------------------------

struct Config {
  Schedule schedule;
  SeqLayout layout;
  ChunkCalls chunk_calls = ChunkCalls::merged;
};

// Bytes this rank sends in one forward and one backward at P = 2 (the definitions of
// tests/attention/distributed_attention_test.cpp's expected_bytes, P = 2), with tensors in their
// dtype (bf16 on the GPU: 2 bytes) and partials and accumulators in f32 (4 bytes) on the wire.
std::pair<int64_t, int64_t> expected_bytes(Schedule s, int rank, int64_t T) {
  const int64_t b = static_cast<int64_t>(dtype_size(g_dtype)), a = 4;
  const int64_t kv = 2 * T * kHkv * kD * b, dkv = 2 * T * kHkv * kD * a;
  const int64_t q_side = 2 * T * kHq * kD * b + 2 * T * kHq * a, dq = T * kHq * kD * a;
  switch (s) {
    case Schedule::ring:
    case Schedule::zigzag: return {kv, kv + dkv};
    case Schedule::burst: return {kv, q_side + dq};
    case Schedule::distflash: return rank == 0 ? std::pair<int64_t, int64_t>{kv, kv} : std::pair<int64_t, int64_t>{0, dkv};
    case Schedule::ulysses: break;  // not run by this worker
  }
  return {-1, -1};
}

// The bf16-block-output emulation of problem a, for this rank's rows (P = 1: all rows).
struct Emulated {
  Outputs one;                                                // P = 1
  std::map<std::pair<SeqLayout, ChunkCalls>, Outputs> shards;  // P = 2, this rank
};

void check_schedule(parallel::Distributed& d, const Config& cfg, const Problem& a, const Problem& b,
                    const Outputs& ref_a, const Outputs& gpu1_a, const Outputs& gpu1_b, Emulated& emulated) {
  parallel::Communicator& sp = d.sp();
  const int P = sp.size(), r = sp.rank();
  const std::string name = fmt::format("{}/{}{}", schedule_name(cfg.schedule), layout_name(cfg.layout),
                                       cfg.chunk_calls == ChunkCalls::per_chunk ? "/per_chunk" : "");
  SequenceAttentionSpec spec;
  spec.schedule = cfg.schedule;
  spec.causal = true;
  spec.scale = a.scale;
  spec.layout = cfg.layout;
  spec.chunk_calls = cfg.chunk_calls;
  spec.sp = &sp;
  spec.intra_node = &d.intra_node();  // as the trainer passes them: burst agrees on its rings on the device
  spec.inter_node = &d.inter_node();
  std::unique_ptr<SequenceAttention> attention = make_sequence_attention(spec);
  const auto* da = dynamic_cast<const DistributedAttention*>(attention.get());
  std::printf("CASE %s/is_distributed %d 0\n", name.c_str(), da == nullptr ? 1 : 0);
  if (da) std::printf("NOTE rank %d: %s\n", r, da->describe().c_str());

  const std::vector<int64_t> rows = layout_global_indices(cfg.layout, kS, P, r);
  Shard sa(a, rows), sb(b, rows);
  const auto t0 = std::chrono::steady_clock::now();
  const int64_t sent0 = sp.stats().bytes_sent;
  // Interleaved like two layers of a model, with no host synchronisation in between.
  sa.forward(*attention);
  sb.forward(*attention);
  sb.backward(*attention);
  sa.backward(*attention);
  const int64_t sent = sp.stats().bytes_sent - sent0;
  const Outputs got_a = sa.read(), got_b = sb.read();
  const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  std::printf("NOTE rank %d: %s: 2 forwards + 2 backwards in %.1f ms (first calls: cuDNN plans included)\n", r,
              name.c_str(), ms);

  const Outputs ref = rows_of(ref_a, rows), one = rows_of(gpu1_a, rows), one_b = rows_of(gpu1_b, rows);
  const bool bf16_blocks = g_dtype == DType::bf16;
  Outputs emul1, emul2;
  if (bf16_blocks) {
    const std::pair<SeqLayout, ChunkCalls> key{cfg.layout, cfg.chunk_calls};
    auto it = emulated.shards.find(key);
    if (it == emulated.shards.end())
      it = emulated.shards.emplace(key, bf16_block_outputs(a, ref_a, cfg.layout, cfg.chunk_calls, P, r)).first;
    emul1 = rows_of(emulated.one, rows);
    emul2 = it->second;
  }
  for (int i = 0; i < 5; ++i) {
    const DType stored = i == 1 ? DType::f32 : g_dtype;
    const double e1 = test::relative_error(part(one, i), part(ref, i));
    const double e2 = test::relative_error(part(got_a, i), part(ref, i));
    const double vs1 = test::relative_error(part(got_a, i), part(one, i));
    const double vs1_b = test::relative_error(part(got_b, i), part(one_b, i));
    // The emulated roundings' own error at P = 1 and P = 2, and how far the GPU's P = 2 is from its
    // emulation (cuDNN's arithmetic inside the calls).
    const double x1 = bf16_blocks ? test::relative_error(part(emul1, i), part(ref, i)) : 0.0;
    const double x2 = bf16_blocks ? test::relative_error(part(emul2, i), part(ref, i)) : 0.0;
    const double in2 = bf16_blocks ? test::relative_error(part(got_a, i), part(emul2, i)) : 0.0;
    std::printf("ERR %s %s %.4e %.4e %.4e %.4e %.4e %.4e\n", name.c_str(), kTensorNames[i], e1, e2, vs1, x1, x2, in2);
    std::printf("CASE %s/%s/p1_vs_f64 %.6e %.6e\n", name.c_str(), kTensorNames[i], e1, tolerance(stored));
    std::printf("CASE %s/%s/p2_vs_f64 %.6e %.6e\n", name.c_str(), kTensorNames[i], e2, tolerance(stored));
    // Norm-wise beside max-normalised: a wrong row or head of small values moves this one.
    std::printf("CASE %s/%s/p2_norm_vs_f64 %.6e %.6e\n", name.c_str(), kTensorNames[i],
                test::norm_relative_error(part(got_a, i), part(ref, i)), tolerance(stored));
    const double bound = bf16_blocks && stored == DType::bf16 ? e1 + x2 : std::max(1.5 * e1, std::ldexp(1.0, -20));
    std::printf("CASE %s/%s/p2_within_p1_plus_block_rounding %.6e %.6e\n", name.c_str(), kTensorNames[i], e2, bound);
    std::printf("CASE %s/%s/p2_vs_p1 %.6e %.6e\n", name.c_str(), kTensorNames[i], vs1, tolerance(stored));
    std::printf("CASE %s/%s/interleaved_b_vs_p1 %.6e %.6e\n", name.c_str(), kTensorNames[i], vs1_b, tolerance(stored));
  }

  const auto [fwd, bwd] = expected_bytes(cfg.schedule, r, kS / P);
  std::printf("CASE %s/bytes_sent %lld 0\n", name.c_str(), static_cast<long long>(std::llabs(sent - 2 * (fwd + bwd))));

  // backward overwrites: a second one over the first's results gives them again (adding would double
  // them); equal up to the non-determinism of cuDNN's dQ atomics.
  sa.backward(*attention);
  const Outputs twice = sa.read();
  for (int i = 2; i < 5; ++i) {
    std::printf("CASE %s/%s/second_backward_overwrites %.6e %.6e\n", name.c_str(), kTensorNames[i],
                test::relative_error(part(twice, i), part(got_a, i)), tolerance(g_dtype));
  }

  // The persistent buffers give the same bits when the forward runs again.
  const std::vector<unsigned char> o_bits = download_bytes(sa.o.t), lse_bits = download_bytes(sa.lse.t);
  sa.forward(*attention);
  const bool same = download_bytes(sa.o.t) == o_bits && download_bytes(sa.lse.t) == lse_bits;
  std::printf("CASE %s/repeat_forward_bitwise %d 0\n", name.c_str(), same ? 0 : 1);
  std::fflush(stdout);
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 1) {
      LT_CHECK(argc == 2 && std::string(argv[1]) == "--cpu",
               "usage: distributed_attention_gpu_worker [--cpu] (under longtrain-run --nproc-per-node 2)");
      g_device = Device::cpu;
      g_dtype = DType::f32;
    }
    const parallel::WorldInfo w = parallel::world_from_env();
    parallel::DistributedOptions opt;
    // NCCL takes GPU LOCAL_RANK first.
    opt.backend = g_device == Device::cuda ? parallel::Backend::nccl : parallel::Backend::gloo;
    opt.sp_size = w.world_size;
    parallel::Distributed d(w, parallel::options_from_env(opt));
    LT_CHECK(d.sp().size() == 2, "distributed_attention_gpu_worker runs on 2 ranks, got {}", d.sp().size());

    const Problem a = make_problem(1), b = make_problem(2);
    const Outputs ref_a = cpu_reference(a);
    const Outputs gpu1_a = single_gpu(a), gpu1_b = single_gpu(b);
    Emulated emulated;
    if (g_dtype == DType::bf16)
      emulated.one = bf16_block_outputs(a, ref_a, SeqLayout::contiguous, ChunkCalls::merged, /*P=*/1, /*r=*/0);
    const std::vector<Config> configs = {{Schedule::ring, SeqLayout::contiguous},
                                         {Schedule::ring, SeqLayout::zigzag},
                                         {Schedule::zigzag, SeqLayout::zigzag},
                                         {Schedule::distflash, SeqLayout::contiguous},
                                         {Schedule::burst, SeqLayout::zigzag},
                                         {Schedule::burst, SeqLayout::contiguous},
                                         {Schedule::zigzag, SeqLayout::zigzag, ChunkCalls::per_chunk}};
    for (const Config& cfg : configs) check_schedule(d, cfg, a, b, ref_a, gpu1_a, gpu1_b, emulated);
    d.sp().barrier();
    std::printf("DONE\n");
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "distributed_attention_gpu_worker: %s\n", e.what());
    std::fflush(stdout);
    return 1;
  }
}

// The single-GPU pieces of Ulysses attention (attention/distributed/ulysses_attention.h), against the
// CPU (labels gpu; skipped without a GPU):
//   - the all-to-all's packing and placing (head slices out of a fused QKV buffer, a peer's rows into
//     the gathered sequence in zigzag order and back, head slices written or accumulated into a fused
//     dQKV buffer) give the CPU's bits, bf16 and f32, on CUDA tensors;
//   - the whole-sequence attention over each member's H/U heads, packed and placed on the GPU as a
//     group of U ranks would (U = 2: K/V heads split; U = 4 > n_kv_heads = 2: each K/V head sent to
//     two members and its dK/dV partials summed back), equals full attention on the CPU in f64
//     within the bf16 tolerance: forward O and LSE, backward dQ, dK, dV.
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "attention/distributed/buffers.h"
#include "attention/distributed/ulysses_attention.h"
#include "attention/local_attention.h"
#include "attention/sequence_attention.h"
#include "gpu_test_util.h"

namespace longtrain::test {
namespace {

using attn::UlyssesHeads;
using attn::UlyssesRun;

template <class T>
HostTensor<T> host_random(std::initializer_list<int64_t> shape, uint64_t seed) {
  HostTensor<T> h(shape);
  const std::vector<double> v = random_values(h.values.size(), seed, dtype_of<T>());
  for (size_t i = 0; i < v.size(); ++i) h.values[i] = static_cast<T>(static_cast<float>(v[i]));
  return h;
}

template <class T>
void check_packing_bitwise() {
  constexpr int U = 4, R = 2, g = 1;  // member 1 of Ulysses group 1 of a 4 x 2 hybrid
  constexpr int64_t T_ = 6, Hq = 8, Hkv = 2, D = 5, W = Hq + 2 * Hkv;
  const DType dt = dtype_of<T>();
  const HostTensor<T> qkv = host_random<T>({T_, W, D}, 11);
  DeviceTensor qkv_d(dt, {T_, W, D});
  upload(qkv_d, download(qkv.view));
  const Tensor q_h = qkv.view.narrow(1, 0, Hq), k_h = qkv.view.narrow(1, Hq, Hkv);
  const Tensor q_d = qkv_d.view.narrow(1, 0, Hq), k_d = qkv_d.view.narrow(1, Hq, Hkv);
  for (int u = 0; u < U; ++u) {
    const UlyssesHeads heads = attn::ulysses_heads(Hq, Hkv, U, u);
    HostTensor<T> pq({T_, heads.q_count, D}), pk({T_, heads.kv_count, D});
    DeviceTensor pq_d(dt, {T_, heads.q_count, D}), pk_d(dt, {T_, heads.kv_count, D});
    attn::ulysses_pack_heads(pq.view, q_h, heads.q_begin);
    attn::ulysses_pack_heads(pk.view, k_h, heads.kv_begin);
    attn::ulysses_pack_heads(pq_d, q_d, heads.q_begin);
    attn::ulysses_pack_heads(pk_d, k_d, heads.kv_begin);
    EXPECT_EQ(download_bytes(pq_d), download_bytes(pq.view)) << "pack q heads, member " << u;
    EXPECT_EQ(download_bytes(pk_d), download_bytes(pk.view)) << "pack kv heads, member " << u;

    // This member's rows in the group's gathered sequence (zigzag: two runs) and back.
    const std::vector<UlyssesRun> runs = attn::ulysses_runs(SeqLayout::zigzag, T_, U, R, g, u);
    EXPECT_EQ(runs.size(), 2u);
    HostTensor<T> gathered = host_random<T>({U * T_, heads.q_count, D}, 20 + u);
    DeviceTensor gathered_d(dt, {U * T_, heads.q_count, D});
    upload(gathered_d, download(gathered.view));
    attn::ulysses_place_rows(gathered.view, pq.view, runs);
    attn::ulysses_place_rows(gathered_d, pq_d, runs);
    EXPECT_EQ(download_bytes(gathered_d), download_bytes(gathered.view)) << "place rows, member " << u;
    HostTensor<T> back({T_, heads.q_count, D});
    DeviceTensor back_d(dt, {T_, heads.q_count, D});
    attn::ulysses_pack_rows(back.view, gathered.view, runs);
    attn::ulysses_pack_rows(back_d, gathered_d, runs);
    EXPECT_EQ(download_bytes(back_d), download_bytes(back.view)) << "pack rows, member " << u;
    EXPECT_EQ(download_bytes(back.view), download_bytes(pq.view)) << "rows out and back, member " << u;

    // Heads into a fused gradient buffer: written (dQ) and accumulated (a replicated K/V head's dK).
    HostTensor<T> dqkv = host_random<T>({T_, W, D}, 30 + u);
    DeviceTensor dqkv_d(dt, {T_, W, D});
    upload(dqkv_d, download(dqkv.view));
    attn::ulysses_place_heads(dqkv.view.narrow(1, 0, Hq), pq.view, heads.q_begin, false);
    attn::ulysses_place_heads(dqkv.view.narrow(1, Hq, Hkv), pk.view, heads.kv_begin, true);
    attn::ulysses_place_heads(dqkv_d.view.narrow(1, 0, Hq), pq_d, heads.q_begin, false);
    attn::ulysses_place_heads(dqkv_d.view.narrow(1, Hq, Hkv), pk_d, heads.kv_begin, true);
    EXPECT_EQ(download_bytes(dqkv_d), download_bytes(dqkv.view)) << "place heads, member " << u;
  }
}

TEST(UlyssesGpu, PackingAndPlacingEqualTheCpuBitForBit) {
  LT_REQUIRE_GPU();
  check_packing_bitwise<float>();
  check_packing_bitwise<bf16>();
}

// Full attention over the whole sequence in f64 on the CPU, on the bf16-rounded inputs.
struct Reference {
  HostTensor<double> o, lse, dq, dk, dv;
};

Reference reference(const std::vector<double>& q, const std::vector<double>& k, const std::vector<double>& v,
                    const std::vector<double>& d_o, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, bool causal,
                    double scale) {
  Reference r{HostTensor<double>({S, Hq, D}), HostTensor<double>({S, Hq}), HostTensor<double>({S, Hq, D}),
              HostTensor<double>({S, Hkv, D}), HostTensor<double>({S, Hkv, D})};
  const HostTensor<double> qh = host_tensor({S, Hq, D}, q), kh = host_tensor({S, Hkv, D}, k),
                           vh = host_tensor({S, Hkv, D}, v), doh = host_tensor({S, Hq, D}, d_o);
  const attn::BlockMask mask = causal ? attn::BlockMask::causal_diagonal : attn::BlockMask::none;
  attn::attention_block_forward(r.o, r.lse, qh, kh, vh, mask, scale);
  attn::attention_block_backward(r.dq, r.dk, r.dv, qh, kh, vh, doh, r.lse, r.o, Tensor{}, mask, scale,
                                 attn::GradMode::overwrite);
  return r;
}

TEST(UlyssesGpu, AttentionOverEachMembersHeadsEqualsFullAttentionOnTheCpu) {
  LT_REQUIRE_GPU();
  constexpr int64_t S = 384, Hq = 8, Hkv = 2, D = 64;
  const double scale = 1.0 / std::sqrt(static_cast<double>(D));
  const auto q = random_values(S * Hq * D, 1, DType::bf16), k = random_values(S * Hkv * D, 2, DType::bf16);
  const auto v = random_values(S * Hkv * D, 3, DType::bf16), d_o = random_values(S * Hq * D, 4, DType::bf16);
  for (bool causal : {true, false}) {
    const Reference ref = reference(q, k, v, d_o, S, Hq, Hkv, D, causal, scale);
    for (int U : {2, 4}) {
      const std::string name = fmt::format("U={} {}", U, causal ? "causal" : "full");
      DeviceTensor qd(DType::bf16, {S, Hq, D}), kd(DType::bf16, {S, Hkv, D}), vd(DType::bf16, {S, Hkv, D}),
          dod(DType::bf16, {S, Hq, D});
      upload(qd, q);
      upload(kd, k);
      upload(vd, v);
      upload(dod, d_o);
      DeviceTensor od(DType::bf16, {S, Hq, D}), lsed(DType::f32, {S, Hq}), dqd(DType::bf16, {S, Hq, D}),
          dkd(DType::f32, {S, Hkv, D}), dvd(DType::f32, {S, Hkv, D});
      attn::dist::fill_tensor(dkd, 0.0);
      attn::dist::fill_tensor(dvd, 0.0);
      for (int u = 0; u < U; ++u) {
        // What member u holds after the all-to-all (the whole sequence for its heads) and computes.
        const UlyssesHeads h = attn::ulysses_heads(Hq, Hkv, U, u);
        DeviceTensor qs(DType::bf16, {S, h.q_count, D}), ks(DType::bf16, {S, h.kv_count, D}),
            vs(DType::bf16, {S, h.kv_count, D}), dos(DType::bf16, {S, h.q_count, D});
        DeviceTensor os(DType::bf16, {S, h.q_count, D}), lses(DType::f32, {S, h.q_count}),
            dqs(DType::bf16, {S, h.q_count, D}), dks(DType::bf16, {S, h.kv_count, D}),
            dvs(DType::bf16, {S, h.kv_count, D});
        attn::ulysses_pack_heads(qs, qd, h.q_begin);
        attn::ulysses_pack_heads(ks, kd, h.kv_begin);
        attn::ulysses_pack_heads(vs, vd, h.kv_begin);
        attn::ulysses_pack_heads(dos, dod, h.q_begin);
        attn::LocalSequenceAttention local(causal, scale);
        local.forward(os, lses, qs, ks, vs);
        local.backward(dqs, dks, dvs, qs, ks, vs, os, lses, dos);
        attn::ulysses_place_heads(od, os, h.q_begin, false);
        attn::ulysses_place_heads(lsed, lses, h.q_begin, false);
        attn::ulysses_place_heads(dqd, dqs, h.q_begin, false);
        attn::ulysses_place_heads(dkd, dks, h.kv_begin, true);  // replicated heads (U = 4) sum their partials
        attn::ulysses_place_heads(dvd, dvs, h.kv_begin, true);
      }
      expect_close(name + " o", DType::bf16, download(od), ref.o.values);
      expect_close(name + " lse", DType::bf16, download(lsed), ref.lse.values);
      expect_close(name + " dq", DType::bf16, download(dqd), ref.dq.values);
      expect_close(name + " dk", DType::bf16, download(dkd), ref.dk.values);
      expect_close(name + " dv", DType::bf16, download(dvd), ref.dv.values);
    }
  }
}

}  // namespace
}  // namespace longtrain::test

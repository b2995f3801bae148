// Sequence-parallel attention (attention/distributed/) with real processes: fork, Gloo on loopback.
//
//   - Every schedule and layout, P = 1..4 and 8, causal and full, MHA/GQA/MQA, f64 and f32: each rank's O,
//     LSE and dQ, dK, dV (overwriting views into fused QKV / dQKV buffers) equal single-rank attention
//     over the whole sequence, computed in double with the block ops (f64 below 1e-10 relative, f32
//     below 1e-5); the bytes each schedule sends equal the volumes derived from its definition and
//     the communicator's own count; every query-key pair is computed exactly once over the group; the
//     per-step work shows each schedule's balance (printed as a table).
//   - The whole model (f32) with P = 2 and 4 has P = 1's loss and gradients; 20 SGD steps with P = 2
//     have P = 1's losses.
//   - burst's double ring (2 nodes x 2 ranks from LOCAL_WORLD_SIZE=2; also 2 x 1, 3 x 1, 3 x 2) equals
//     its single ring, with the inter-node ring carrying exactly one block per cycle.
//   - burst's backward sends (3D + 2)/(4D) of a K/V + dK/dV ring's bytes with MHA (<= 0.8 at D = 16).
// Children report "CASE <name> <error> <tolerance>" lines; the parent asserts error <= tolerance.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <type_traits>

#include "attention/distributed/distributed_attention.h"
#include "attention/distributed/cost_model.h"
#include "attention/distributed/schedules.h"
#include "attention/distributed/ulysses_attention.h"
#include "model/llama.h"
#include "parallel/distributed.h"
#include "parallel/loopback_world.h"
#include "parallel/multiproc_util.h"
#include "parallel/net.h"
#include "test_util.h"

extern "C" void openblas_set_num_threads(int num_threads);

namespace longtrain::attn {
namespace {

using namespace std::chrono_literals;
using parallel::Communicator;
using parallel::Distributed;
using parallel::WorldInfo;
using test::HostTensor;

// ---- process setup ----------------------------------------------------------------------------------

// Several ranks share 2 cores: one BLAS thread each (the CPU attention follows OpenBLAS's count).
void one_thread_per_rank() { openblas_set_num_threads(1); }

template <class T>
constexpr double tolerance() {
  return std::is_same_v<T, double> ? 1e-10 : 1e-5;
}

// ---- the whole-sequence problem and its single-rank reference ------------------------------------------

struct Heads {
  const char* name;
  int64_t q, kv;
};
constexpr Heads kMha{"mha", 4, 4}, kGqa{"gqa", 4, 2}, kMqa{"mqa", 4, 1};

struct Problem {
  int64_t S, Hq, Hkv, D;
  bool causal;
  double scale;
  HostTensor<double> q, k, v, d_o;       // the whole sequence, in global order
  HostTensor<double> o, lse, dq, dk, dv;  // single-rank attention over it
};

// Inputs uniform in [-1, 1), rounded through float when the run is f32 so that the reference sees
// exactly the values the ranks get.
Problem make_problem(int64_t S, Heads h, int64_t D, bool causal, uint64_t seed, bool float_inputs) {
  Problem p{S, h.q, h.kv, D, causal, 1.0 / std::sqrt(static_cast<double>(D)), HostTensor<double>({S, h.q, D}),
            HostTensor<double>({S, h.kv, D}), HostTensor<double>({S, h.kv, D}), HostTensor<double>({S, h.q, D}),
            HostTensor<double>({S, h.q, D}), HostTensor<double>({S, h.q}), HostTensor<double>({S, h.q, D}),
            HostTensor<double>({S, h.kv, D}), HostTensor<double>({S, h.kv, D})};
  uint64_t s = seed;
  for (HostTensor<double>* t : {&p.q, &p.k, &p.v, &p.d_o}) {
    test::fill_uniform(*t, ++s);
    if (float_inputs)
      for (double& x : t->values) x = static_cast<float>(x);
  }
  const BlockMask mask = causal ? BlockMask::causal_diagonal : BlockMask::none;
  attention_block_forward(p.o, p.lse, p.q, p.k, p.v, mask, p.scale);
  HostTensor<double> delta({S, h.q});
  attention_delta(delta, p.o, p.d_o);
  attention_block_backward(p.dq, p.dk, p.dv, p.q, p.k, p.v, p.d_o, p.lse, Tensor{}, delta, mask, p.scale,
                           GradMode::accumulate);
  return p;
}

// One rank's shard: q/k/v are views into a fused [T, Hq + 2·Hkv, D] buffer and dq/dk/dv into a fused
// gradient buffer that starts with nonzero values (backward must overwrite them, not add to them).
template <class T>
struct Shard {
  std::vector<int64_t> rows;  // global index of each local token
  HostTensor<T> qkv, dqkv, o, lse, d_o;
  Tensor q, k, v, dq, dk, dv;

  Shard(const Problem& p, SeqLayout layout, int P, int rank, uint64_t seed)
      : rows(layout_global_indices(layout, p.S, P, rank)) {
    const int64_t n = static_cast<int64_t>(rows.size()), W = p.Hq + 2 * p.Hkv;
    qkv = HostTensor<T>({n, W, p.D});
    dqkv = HostTensor<T>({n, W, p.D});
    o = HostTensor<T>({n, p.Hq, p.D});
    lse = HostTensor<T>({n, p.Hq});
    d_o = HostTensor<T>({n, p.Hq, p.D});
    q = qkv.view.narrow(1, 0, p.Hq);
    k = qkv.view.narrow(1, p.Hq, p.Hkv);
    v = qkv.view.narrow(1, p.Hq + p.Hkv, p.Hkv);
    dq = dqkv.view.narrow(1, 0, p.Hq);
    dk = dqkv.view.narrow(1, p.Hq, p.Hkv);
    dv = dqkv.view.narrow(1, p.Hq + p.Hkv, p.Hkv);
    for (int64_t j = 0; j < n; ++j) {
      const int64_t g = rows[static_cast<size_t>(j)];
      for (int64_t d = 0; d < p.D; ++d) {
        for (int64_t h = 0; h < p.Hq; ++h) {
          qkv[static_cast<size_t>((j * W + h) * p.D + d)] =
              static_cast<T>(p.q[static_cast<size_t>((g * p.Hq + h) * p.D + d)]);
          d_o[static_cast<size_t>((j * p.Hq + h) * p.D + d)] =
              static_cast<T>(p.d_o[static_cast<size_t>((g * p.Hq + h) * p.D + d)]);
        }
        for (int64_t h = 0; h < p.Hkv; ++h) {
          qkv[static_cast<size_t>((j * W + p.Hq + h) * p.D + d)] =
              static_cast<T>(p.k[static_cast<size_t>((g * p.Hkv + h) * p.D + d)]);
          qkv[static_cast<size_t>((j * W + p.Hq + p.Hkv + h) * p.D + d)] =
              static_cast<T>(p.v[static_cast<size_t>((g * p.Hkv + h) * p.D + d)]);
        }
      }
    }
    test::fill_uniform(dqkv, seed, -0.5, 0.5);
  }
};

double element(const Tensor& t, int64_t j, int64_t e) {
  // e indexes the row's [H, D] (or [H]) entries.
  int64_t off = j * t.stride[0];
  if (t.ndim == 3) {
    off += (e / t.shape[2]) * t.stride[1] + (e % t.shape[2]) * t.stride[2];
  } else {
    off += e * t.stride[1];
  }
  if (t.dtype == DType::f64) return static_cast<const double*>(t.data)[off];
  return static_cast<const float*>(t.data)[off];
}

// max |got - ref| / max |ref| over this rank's rows, ref being the whole-sequence tensor (through
// test::relative_error, so a NaN or an infinity on either side is an infinite error).
double shard_error(const Tensor& got, const HostTensor<double>& ref, const std::vector<int64_t>& rows) {
  const int64_t per_row = got.ndim == 3 ? got.shape[1] * got.shape[2] : got.shape[1];
  std::vector<double> mine, want;
  for (size_t j = 0; j < rows.size(); ++j) {
    for (int64_t e = 0; e < per_row; ++e) {
      want.push_back(ref[static_cast<size_t>(rows[j] * per_row + e)]);
      mine.push_back(element(got, static_cast<int64_t>(j), e));
    }
  }
  return test::relative_error(mine, want);
}

bool bitwise_equal(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.data, b.data, a.nbytes()) == 0;
}

// ---- expected traffic -----------------------------------------------------------------------------------

struct Volumes {
  int64_t forward, backward;
};

// Bytes rank r sends in one forward and one backward, from each schedule's definition. On CPU the
// accumulator dtype is the tensor dtype, so one element size `b` serves both.
Volumes expected_bytes(Schedule s, bool causal, int P, int r, int64_t T, int64_t Hq, int64_t Hkv, int64_t D,
                       int64_t b) {
  const int64_t kv = 2 * T * Hkv * D * b;                 // K and V of one shard
  const int64_t dkv = kv;                                 // their gradients
  const int64_t q = T * Hq * D * b;                       // Q of one shard
  const int64_t partial = T * Hq * D * b + T * Hq * b;    // (O, LSE) of one shard
  const int64_t q_side = 2 * T * Hq * D * b + 2 * T * Hq * b;  // Q, dO, LSE, D
  const int64_t dq = q;
  switch (s) {
    case Schedule::ring:
    case Schedule::zigzag:  // P-1 hops of each K/V block, P-1 hops of each dK/dV accumulator
      return {(P - 1) * kv, (P - 1) * (kv + dkv)};
    case Schedule::burst:  // forward like ring; backward: P-1 hops of each Q side and of each dQ
      return {(P - 1) * kv, (P - 1) * (q_side + dq)};
    case Schedule::distflash: {
      if (!causal) return {(P - 1) * kv, (P - 1) * (kv + dkv)};
      // Owner steps t = 1..⌊P/2⌋ fetch K/V of rank r-t; helper steps t = 1..⌊(P-1)/2⌋ run on ranks
      // r < t for rank r-t+P. Rank r sends its K/V to r+t (< P), its Q side to the helper r+t-P (>= 0),
      // partial results as a helper (steps t > r) and dK/dV back as an owner (steps t <= r).
      const int owner_steps = P / 2, helper_steps = (P - 1) / 2;
      const int64_t kv_sends = std::min(owner_steps, P - 1 - r);
      const int64_t q_sends = std::max(0, helper_steps - std::max(1, P - r) + 1);
      const int64_t helper_results = std::max(0, helper_steps - r);
      const int64_t owner_results = std::min(r, owner_steps);
      return {kv_sends * kv + q_sends * q + helper_results * partial,
              kv_sends * kv + q_sends * q_side + owner_results * dkv + helper_results * dq};
    }
    case Schedule::ulysses: break;  // ulysses_a2a_bytes
  }
  return {-1, -1};
}

// ---- correctness of one configuration on every rank ------------------------------------------------------

struct Config {
  Schedule schedule;
  SeqLayout layout;
  ChunkCalls chunk_calls = ChunkCalls::merged;
};
// Also with one call per chunk pair, where a layout has more than one chunk per rank.
const std::vector<Config> kConfigs = {
    {Schedule::ring, SeqLayout::contiguous},      {Schedule::ring, SeqLayout::zigzag},
    {Schedule::zigzag, SeqLayout::zigzag},        {Schedule::distflash, SeqLayout::contiguous},
    {Schedule::burst, SeqLayout::zigzag},         {Schedule::burst, SeqLayout::contiguous},
    {Schedule::zigzag, SeqLayout::zigzag, ChunkCalls::per_chunk},
    {Schedule::burst, SeqLayout::zigzag, ChunkCalls::per_chunk}};

std::string steps_text(const ScheduleTrace& trace) {
  std::string s;
  for (const ScheduleStep& st : trace.steps) s += fmt::format(" {}", st.pairs);
  return s;
}

// The schedule's class itself, bypassing the factory (which hands one rank LocalSequenceAttention):
// the schedules also run, without communicating, on a group of one.
std::unique_ptr<SequenceAttention> make_schedule_directly(const SequenceAttentionSpec& spec) {
  switch (spec.schedule) {
    case Schedule::ring:
    case Schedule::zigzag: return std::make_unique<dist::RingAttention>(spec.schedule, spec);
    case Schedule::distflash: return std::make_unique<dist::DistFlashAttention>(spec);
    case Schedule::burst: return std::make_unique<dist::BurstAttention>(spec);
    case Schedule::ulysses: break;  // not a DistributedAttention (ulysses_attention_test below)
  }
  return nullptr;
}

template <class T>
void check_config(Communicator& sp, const Config& cfg, bool causal, Heads heads, int64_t S, int64_t D, bool direct,
                  std::ostream& rep) {
  const int P = sp.size(), r = sp.rank();
  const std::string name =
      fmt::format("P{}{}/{}/{}{}/{}/{}/{}", P, direct ? "direct" : "", schedule_name(cfg.schedule),
                  layout_name(cfg.layout), cfg.chunk_calls == ChunkCalls::per_chunk ? "/per_chunk" : "",
                  causal ? "causal" : "full", heads.name, dtype_name(dtype_of<T>()));
  const Problem p = make_problem(S, heads, D, causal, /*seed=*/S * 1000 + D * 10 + (causal ? 1 : 0),
                                 std::is_same_v<T, float>);
  SequenceAttentionSpec spec;
  spec.schedule = cfg.schedule;
  spec.causal = causal;
  spec.scale = p.scale;
  spec.layout = cfg.layout;
  spec.chunk_calls = cfg.chunk_calls;
  spec.sp = &sp;
  std::unique_ptr<SequenceAttention> attention = direct ? make_schedule_directly(spec) : make_sequence_attention(spec);
  Shard<T> sh(p, cfg.layout, P, r, /*seed=*/77 + static_cast<uint64_t>(r));
  const double tol = tolerance<T>();

  const int64_t sent0 = sp.stats().bytes_sent;
  attention->forward(sh.o, sh.lse, sh.q, sh.k, sh.v);
  const int64_t sent1 = sp.stats().bytes_sent;
  attention->backward(sh.dq, sh.dk, sh.dv, sh.q, sh.k, sh.v, sh.o, sh.lse, sh.d_o);
  const int64_t sent2 = sp.stats().bytes_sent;

  rep << "CASE " << name << "/o " << shard_error(sh.o, p.o, sh.rows) << " " << tol << "\n";
  rep << "CASE " << name << "/lse " << shard_error(sh.lse, p.lse, sh.rows) << " " << tol << "\n";
  rep << "CASE " << name << "/dq " << shard_error(sh.dq, p.dq, sh.rows) << " " << tol << "\n";
  rep << "CASE " << name << "/dk " << shard_error(sh.dk, p.dk, sh.rows) << " " << tol << "\n";
  rep << "CASE " << name << "/dv " << shard_error(sh.dv, p.dv, sh.rows) << " " << tol << "\n";
  rep << "CASE " << name << "/calls_counted "
      << std::abs(attention->counters.forward_calls - 1) + std::abs(attention->counters.backward_calls - 1) << " 0\n";

  // A second forward reuses the persistent buffers and gives the same bits.
  const int64_t n = static_cast<int64_t>(sh.rows.size());
  HostTensor<T> o2({n, p.Hq, p.D}), lse2({n, p.Hq});
  attention->forward(o2, lse2, sh.q, sh.k, sh.v);
  rep << "CASE " << name << "/repeat_bitwise " << !(bitwise_equal(o2, sh.o) && bitwise_equal(lse2, sh.lse)) << " 0\n";

  if (P == 1 && !direct) {
    rep << "CASE " << name << "/one_rank_is_local "
        << (dynamic_cast<LocalSequenceAttention*>(attention.get()) == nullptr) << " 0\n";
    return;
  }
  const auto* da = dynamic_cast<const DistributedAttention*>(attention.get());
  rep << "CASE " << name << "/is_distributed " << (da == nullptr) << " 0\n";
  if (da == nullptr) return;
  const Volumes want = expected_bytes(cfg.schedule, causal, P, r, n, p.Hq, p.Hkv, p.D, sizeof(T));
  rep << "CASE " << name << "/bytes_forward " << std::abs(sent1 - sent0 - want.forward) << " 0\n";
  rep << "CASE " << name << "/bytes_backward " << std::abs(sent2 - sent1 - want.backward) << " 0\n";
  // The cost model's bytes (attention/distributed/cost_model.h) are what the schedule really sent.
  const TrafficBytes modelled = ring_schedule_bytes(
      cfg.schedule, causal, P, r, {n, p.Hq, p.Hkv, p.D, int64_t{sizeof(T)}, int64_t{sizeof(T)}, int64_t{sizeof(T)}});
  rep << "CASE " << name << "/cost_model_bytes "
      << std::abs(sent1 - sent0 - modelled.forward) + std::abs(sent2 - sent1 - modelled.backward) << " 0\n";
  rep << "CASE " << name << "/bytes_traced "
      << std::abs(da->last_backward().bytes_sent() - (sent2 - sent1)) +
             std::abs(da->last_forward().bytes_sent() - (sp.stats().bytes_sent - sent2))
      << " 0\n";
  rep << "CASE " << name << "/bytes_counter "
      << std::abs(attention->counters.bytes_sent - (sp.stats().bytes_sent - sent0)) << " 0\n";
  const int64_t all_pairs = causal ? S * (S + 1) / 2 : S * S;
  rep << "PAIRS " << name << " " << da->last_forward().pairs() << " " << da->last_backward().pairs() << " "
      << all_pairs << "\n";
  rep << "STEPS " << name << " " << r << " " << n << " fwd" << steps_text(da->last_forward()) << "\n";
  rep << "STEPS " << name << " " << r << " " << n << " bwd" << steps_text(da->last_backward()) << "\n";
}

std::string every_schedule(int rank, int P, int port) {
  one_thread_per_rank();
  Distributed d(test::loopback_world(rank, P, port, P), test::distributed_options(P));
  std::ostringstream rep;
  rep.precision(3);
  for (const Config& cfg : kConfigs) {
    for (bool causal : {true, false}) {
      for (Heads h : {kMha, kGqa, kMqa}) {
        check_config<double>(d.sp(), cfg, causal, h, /*S=*/48, /*D=*/8, /*direct=*/false, rep);
        check_config<float>(d.sp(), cfg, causal, h, /*S=*/48, /*D=*/8, /*direct=*/false, rep);
        if (P == 1) {
          check_config<double>(d.sp(), cfg, causal, h, /*S=*/48, /*D=*/8, /*direct=*/true, rep);
          check_config<float>(d.sp(), cfg, causal, h, /*S=*/48, /*D=*/8, /*direct=*/true, rep);
        }
      }
    }
  }
  // A shard the zigzag layout cannot split (odd) is refused on every rank before anything is sent.
  if (P > 1) {
    SequenceAttentionSpec spec;
    spec.schedule = Schedule::zigzag;
    spec.scale = 0.5;
    spec.sp = &d.sp();
    auto attention = make_sequence_attention(spec);
    HostTensor<double> q({5, 2, 4}), kv({5, 1, 4}), o({5, 2, 4}), lse({5, 2});
    std::string message;
    try {
      attention->forward(o, lse, q, kv, kv);
    } catch (const Error& e) {
      message = e.what();
    }
    rep << "CASE errors/odd_zigzag_shard " << (message.find("cannot split") == std::string::npos) << " 0\n";
    rep << "CASE errors/nothing_sent_before_refusing " << attention->counters.bytes_sent << " 0\n";
  }
  return rep.str();
}

// ---- parent-side checks -------------------------------------------------------------------------------------

struct Reports {
  std::map<std::string, double> worst;                          // by (dtype, tensor)
  std::map<std::string, std::array<int64_t, 3>> pairs;          // name -> forward, backward, expected
  std::map<std::string, std::map<std::string, std::map<int, std::vector<int64_t>>>> steps;  // name, dir, rank
  std::map<std::string, int64_t> local_len;
};

void expect_cases(const std::vector<test::RankOutcome>& outcomes, int min_cases, Reports* reports = nullptr) {
  Reports local;
  Reports& rep = reports ? *reports : local;
  for (size_t r = 0; r < outcomes.size(); ++r) {
    ASSERT_TRUE(outcomes[r].exited(0)) << "rank " << r << ":\n" << outcomes[r].text;
    std::istringstream in(outcomes[r].text);
    std::string line;
    int cases = 0;
    while (std::getline(in, line)) {
      std::istringstream ls(line);
      std::string word, name;
      ls >> word >> name;
      if (word == "CASE") {
        double err = 0, tol = 0;
        EXPECT_TRUE(test::read_fields(ls, err, tol)) << "rank " << r << ": malformed line: " << line;
        ++cases;
        EXPECT_LE(err, tol) << "rank " << r << ": " << name;
        // worst error per dtype and tensor: ".../f64/dq" -> "f64/dq"
        const size_t last = name.rfind('/'), prev = last == std::string::npos ? last : name.rfind('/', last - 1);
        const std::string kind = prev == std::string::npos ? name : name.substr(prev + 1);
        rep.worst[kind] = std::max(rep.worst[kind], err);
      } else if (word == "PAIRS") {
        int64_t f = 0, b = 0, want = 0;
        EXPECT_TRUE(test::read_fields(ls, f, b, want)) << "rank " << r << ": malformed line: " << line;
        auto& acc = rep.pairs[name];
        acc[0] += f;
        acc[1] += b;
        acc[2] = want;
      } else if (word == "STEPS") {
        int rank = 0;
        int64_t T = 0;
        std::string dir;
        EXPECT_TRUE(test::read_fields(ls, rank, T)) << "rank " << r << ": malformed line: " << line;
        EXPECT_TRUE(static_cast<bool>(ls >> dir)) << "rank " << r << ": malformed line: " << line;
        std::vector<int64_t> v;
        for (std::string field; ls >> field;) {
          std::istringstream one(field);
          int64_t x = 0;
          EXPECT_TRUE(test::read_fields(one, x)) << "rank " << r << ": malformed line: " << line;
          v.push_back(x);
        }
        rep.steps[name][dir][rank] = v;
        rep.local_len[name] = T;
      }
    }
    EXPECT_GE(cases, min_cases) << "rank " << r << " reported too few cases:\n" << outcomes[r].text;
  }
  if (!reports)
    for (const auto& [kind, err] : rep.worst) std::cout << "  worst " << kind << ": " << err << "\n";
}

// Work per step and rank in units of a full (S/P)² block, and the balance properties each schedule
// promises (causal, f64, MHA runs).
void check_balance(const Reports& rep, int P) {
  for (const auto& [name, dirs] : rep.steps) {
    if (P == 1 || name.find("/causal/mha/f64") == std::string::npos) continue;
    const double block = static_cast<double>(rep.local_len.at(name) * rep.local_len.at(name));
    std::cout << "  work per step (rows: ranks; unit (S/P)^2) " << name << "\n";
    for (const auto& [dir, ranks] : dirs) {
      const size_t n_steps = ranks.begin()->second.size();
      for (const auto& [rank, v] : ranks) {
        std::cout << "    " << dir << " rank " << rank << ":";
        for (int64_t x : v) std::cout << " " << fmt::format("{:.2f}", static_cast<double>(x) / block);
        std::cout << "\n";
      }
      const bool zigzag_balanced = name.find("/zigzag/zigzag/") != std::string::npos ||
                                   name.find("/ring/zigzag/") != std::string::npos ||
                                   name.find("/burst/zigzag/") != std::string::npos;
      const bool distflash = name.find("/distflash/") != std::string::npos;
      for (size_t s = 0; s < n_steps; ++s) {
        std::set<int64_t> work;
        for (const auto& [rank, v] : ranks) work.insert(v[s]);
        if (zigzag_balanced) {
          EXPECT_EQ(work.size(), 1u) << name << " " << dir << " step " << s << " is unbalanced";
        }
        // distflash: one block per rank per step after the diagonal, except the even-P last step (idle
        // ranks) and the trailing entry that only carries the last results.
        const bool idle_step = P % 2 == 0 && s + 2 == n_steps;
        if (distflash && s > 0 && s + 1 < n_steps && !idle_step) {
          EXPECT_EQ(work, std::set<int64_t>{static_cast<int64_t>(block)}) << name << " " << dir << " step " << s;
        }
      }
      if (name.find("/ring/contiguous/") != std::string::npos && dir == "fwd") {
        const int64_t T = rep.local_len.at(name);
        for (const auto& [rank, v] : ranks) {
          int64_t total = 0;
          for (int64_t x : v) total += x;
          EXPECT_EQ(total, rank * T * T + T * (T + 1) / 2) << name << " rank " << rank;
        }
      }
    }
  }
}

class DistributedAttentionRanks : public testing::TestWithParam<int> {};

TEST_P(DistributedAttentionRanks, EveryScheduleEqualsSingleRankAttention) {
  const int P = GetParam();
  const int port = parallel::net::pick_free_port();
  auto out = test::run_ranks(P, [&](int r) { return every_schedule(r, P, port); }, 90s);
  Reports rep;
  expect_cases(out, static_cast<int>(kConfigs.size()) * 2 * 3 * 2 * 6, &rep);
  for (const auto& [kind, err] : rep.worst) std::cout << "  worst " << kind << ": " << err << "\n";
  // Every visible query-key pair of the sequence is computed exactly once over the group.
  for (const auto& [name, v] : rep.pairs) {
    EXPECT_EQ(v[0], v[2]) << name << " forward";
    EXPECT_EQ(v[1], v[2]) << name << " backward";
  }
  if (P > 1) {
    EXPECT_FALSE(rep.pairs.empty());
  }
  check_balance(rep, P);
}

INSTANTIATE_TEST_SUITE_P(Gloo, DistributedAttentionRanks, testing::Values(1, 2, 3, 4, 8),
                         [](const testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; });

// ---- Ulysses and the 2D hybrid ---------------------------------------------------------------------------------

// Bytes one rank's all-to-alls send (ulysses_attention.h): Q, K, V out and O, LSE back; Q, K, V, O, dO,
// LSE out and dQ, dK, dV back (kept forward: dO out and dQ, dK, dV back).
Volumes ulysses_a2a_bytes(int U, int64_t T, int64_t Hq, int64_t Hkv, int64_t D, int64_t b, bool kept) {
  const int64_t h = Hq / U, g = std::max<int64_t>(Hkv / U, 1);
  const int64_t backward_in = kept ? h * D : (3 * h + 2 * g) * D + h;
  return {(U - 1) * T * ((h + 2 * g) * D + h * D + h) * b, (U - 1) * T * (backward_in + (h + 2 * g) * D) * b};
}

// The head counts a group of U ranks can split: MHA, GQA with K/V heads split, GQA with K/V heads
// replicated to U/Hkv ranks (when U > 2 is even), MQA.
std::vector<Heads> ulysses_heads_for(int U) {
  std::vector<Heads> h = {{"mha", U, U}, {"gqa", 2 * U, U}, {"mqa", U, 1}};
  if (U > 2 && U % 2 == 0) h.push_back({"gqa_replicated", 2 * U, 2});
  return h;
}

// Ulysses (cfg.schedule ulysses: over the whole SP group) or the hybrid (a ring schedule over the rings
// across the Ulysses groups of `d`) against single-rank attention; bytes against ulysses_a2a_bytes plus
// the inner ring's expected_bytes over R ranks of U·T tokens with the group member's heads.
// keep: keep_forward over two layers, a second layer with other inputs running forward and backward
// between this layer's forward and backward, and every backward handed NaN for q, k, v, o and lse, so
// it must use what its own layer's forward kept and send only dO out.
template <class T>
void check_ulysses(Distributed& d, const Config& cfg, bool causal, Heads heads, int64_t S, int64_t D,
                   std::ostream& rep, bool keep = false) {
  Communicator& sp = d.sp();
  const int P = sp.size(), r = sp.rank();
  const bool hybrid = cfg.schedule != Schedule::ulysses;
  Communicator& group = hybrid ? *d.ulysses() : sp;
  const int U = group.size(), R = P / U;
  const std::string name = fmt::format("U{}xR{}/{}/{}/{}/{}/{}{}", U, R, schedule_name(cfg.schedule),
                                       layout_name(cfg.layout), causal ? "causal" : "full", heads.name,
                                       dtype_name(dtype_of<T>()), keep ? "/kept" : "");
  const Problem p = make_problem(S, heads, D, causal, /*seed=*/S * 1000 + D * 10 + (causal ? 1 : 0) + heads.kv,
                                 std::is_same_v<T, float>);
  SequenceAttentionSpec spec;
  spec.schedule = cfg.schedule;
  spec.causal = causal;
  spec.scale = p.scale;
  spec.layout = cfg.layout;
  spec.sp = &sp;
  if (hybrid) {
    spec.ulysses = d.ulysses();
    spec.ulysses_ring = d.ulysses_ring();
    spec.ulysses_ring_intra_node = d.ulysses_ring_intra_node();  // burst's double ring when it spans nodes
    spec.ulysses_ring_inter_node = d.ulysses_ring_inter_node();
  }
  std::unique_ptr<SequenceAttention> attention = make_sequence_attention(spec);
  auto* ua = dynamic_cast<UlyssesAttention*>(attention.get());
  rep << "CASE " << name << "/is_ulysses " << (ua == nullptr) << " 0\n";
  if (ua == nullptr) return;
  Shard<T> sh(p, cfg.layout, P, r, /*seed=*/77 + static_cast<uint64_t>(r));
  const double tol = tolerance<T>();
  auto sent = [&] {
    int64_t b = group.stats().bytes_sent;
    if (hybrid) b += d.ulysses_ring()->stats().bytes_sent;
    // burst's double ring across the groups sends over the ring's two rings
    for (Communicator* c : {d.ulysses_ring_intra_node(), d.ulysses_ring_inter_node()})
      if (hybrid && c != nullptr) b += c->stats().bytes_sent;
    return b;
  };
  const int64_t n = static_cast<int64_t>(sh.rows.size());
  // What a kept backward is handed for q, k, v, o, lse: NaN, which must not reach its results.
  HostTensor<T> nan_qkv({n, p.Hq + 2 * p.Hkv, p.D}), nan_o({n, p.Hq, p.D}), nan_lse({n, p.Hq});
  for (HostTensor<T>* t : {&nan_qkv, &nan_o, &nan_lse})
    for (T& x : t->values) x = std::numeric_limits<T>::quiet_NaN();
  const Tensor nan_q = nan_qkv.view.narrow(1, 0, p.Hq), nan_k = nan_qkv.view.narrow(1, p.Hq, p.Hkv),
               nan_v = nan_qkv.view.narrow(1, p.Hq + p.Hkv, p.Hkv);
  auto backward = [&](Shard<T>& x) {
    if (keep)
      attention->backward(x.dq, x.dk, x.dv, nan_q, nan_k, nan_v, nan_o, nan_lse, x.d_o);
    else
      attention->backward(x.dq, x.dk, x.dv, x.q, x.k, x.v, x.o, x.lse, x.d_o);
  };
  if (keep) attention->keep_forward(2);
  const int64_t sent0 = sent();
  attention->set_layer(0);
  attention->forward(sh.o, sh.lse, sh.q, sh.k, sh.v);
  const int64_t sent1 = sent();
  if (keep) {
    const Problem p2 = make_problem(S, heads, D, causal, /*seed=*/S * 1000 + D * 10 + 7, std::is_same_v<T, float>);
    Shard<T> sh2(p2, cfg.layout, P, r, /*seed=*/99 + static_cast<uint64_t>(r));
    attention->set_layer(1);
    attention->forward(sh2.o, sh2.lse, sh2.q, sh2.k, sh2.v);
    backward(sh2);
    rep << "CASE " << name << "/layer1_o " << shard_error(sh2.o, p2.o, sh2.rows) << " " << tol << "\n";
    rep << "CASE " << name << "/layer1_dq " << shard_error(sh2.dq, p2.dq, sh2.rows) << " " << tol << "\n";
    rep << "CASE " << name << "/layer1_dk " << shard_error(sh2.dk, p2.dk, sh2.rows) << " " << tol << "\n";
    rep << "CASE " << name << "/layer1_dv " << shard_error(sh2.dv, p2.dv, sh2.rows) << " " << tol << "\n";
    // A forward-only pass (evaluation) in between keeps nothing and leaves layer 0's kept state alone.
    attention->set_layer(SequenceAttention::kNoLayer);
    attention->forward(sh2.o, sh2.lse, sh2.q, sh2.k, sh2.v);
    rep << "CASE " << name << "/forward_only_o " << shard_error(sh2.o, p2.o, sh2.rows) << " " << tol << "\n";
  }
  const int64_t sent_before_backward = sent();
  attention->set_layer(0);
  backward(sh);
  const int64_t sent2 = sent();

  rep << "CASE " << name << "/o " << shard_error(sh.o, p.o, sh.rows) << " " << tol << "\n";
  rep << "CASE " << name << "/lse " << shard_error(sh.lse, p.lse, sh.rows) << " " << tol << "\n";
  rep << "CASE " << name << "/dq " << shard_error(sh.dq, p.dq, sh.rows) << " " << tol << "\n";
  rep << "CASE " << name << "/dk " << shard_error(sh.dk, p.dk, sh.rows) << " " << tol << "\n";
  rep << "CASE " << name << "/dv " << shard_error(sh.dv, p.dv, sh.rows) << " " << tol << "\n";
  // Backward runs neither the inner forward (the ring's or the local one) nor a forward all-to-all.
  const AttentionCounters& in = ua->inner().counters;
  const int64_t layers = keep ? 2 : 1, forwards = keep ? 3 : 1;  // kept: layers 0 and 1, and a forward-only pass
  rep << "CASE " << name << "/calls_counted "
      << std::abs(attention->counters.forward_calls - forwards) + std::abs(attention->counters.backward_calls - layers) +
             std::abs(in.forward_calls - forwards) + std::abs(in.backward_calls - layers)
      << " 0\n";
  const Volumes a2a = ulysses_a2a_bytes(U, n, p.Hq, p.Hkv, p.D, sizeof(T), keep);
  Volumes ring{0, 0};
  if (hybrid) {
    const int64_t h = p.Hq / U, g = std::max<int64_t>(p.Hkv / U, 1);
    ring = expected_bytes(cfg.schedule, causal, R, d.ulysses_ring()->rank(), U * n, h, g, p.D, sizeof(T));
  }
  rep << "CASE " << name << "/bytes_forward " << std::abs(sent1 - sent0 - a2a.forward - ring.forward) << " 0\n";
  rep << "CASE " << name << "/bytes_backward "
      << std::abs(sent2 - sent_before_backward - a2a.backward - ring.backward) << " 0\n";
  rep << "CASE " << name << "/bytes_a2a "
      << std::abs(ua->last_forward_a2a_bytes() - a2a.forward) + std::abs(ua->last_backward_a2a_bytes() - a2a.backward)
      << " 0\n";
  rep << "CASE " << name << "/bytes_counter " << std::abs(attention->counters.bytes_sent - (sent2 - sent0)) << " 0\n";
  const TrafficBytes modelled = hybrid_bytes(cfg.schedule, causal, P, U, r,
                                             {n, p.Hq, p.Hkv, p.D, int64_t{sizeof(T)}, int64_t{sizeof(T)},
                                              int64_t{sizeof(T)}, keep});
  rep << "CASE " << name << "/cost_model_bytes "
      << std::abs(sent1 - sent0 - modelled.forward) + std::abs(sent2 - sent_before_backward - modelled.backward)
      << " 0\n";
  const int64_t all_pairs = causal ? S * (S + 1) / 2 : S * S;
  // Forward and backward each cover every visible pair once per ring of R ranks, and there are U rings.
  rep << "PAIRS " << name << " " << attention->counters.pairs << " 0 " << all_pairs * U * (forwards + layers) << "\n";

  // A second forward reuses the persistent buffers and gives the same bits.
  HostTensor<T> o2({n, p.Hq, p.D}), lse2({n, p.Hq});
  attention->forward(o2, lse2, sh.q, sh.k, sh.v);
  rep << "CASE " << name << "/repeat_bitwise " << !(bitwise_equal(o2, sh.o) && bitwise_equal(lse2, sh.lse)) << " 0\n";
}

std::string ulysses_every_layout(int rank, int P, int port) {
  one_thread_per_rank();
  Distributed d(test::loopback_world(rank, P, port, P), test::distributed_options(P));
  std::ostringstream rep;
  rep.precision(3);
  for (SeqLayout layout : {SeqLayout::contiguous, SeqLayout::zigzag})
    for (bool causal : {true, false})
      for (Heads h : ulysses_heads_for(P)) {
        check_ulysses<double>(d, {Schedule::ulysses, layout}, causal, h, /*S=*/4 * P, /*D=*/4, rep);
        check_ulysses<float>(d, {Schedule::ulysses, layout}, causal, h, /*S=*/4 * P, /*D=*/4, rep);
        check_ulysses<double>(d, {Schedule::ulysses, layout}, causal, h, /*S=*/4 * P, /*D=*/4, rep, /*keep=*/true);
      }
  // Heads the group cannot split are refused naming the config keys, on every rank, before anything is sent.
  for (Heads bad : {Heads{"odd", P + 1, 1}, Heads{"kv3", 3 * P, 3}}) {
    if (bad.q % bad.kv != 0 || ((bad.kv % P == 0 || P % bad.kv == 0) && bad.q % P == 0)) continue;
    std::string message;
    try {
      check_ulysses<double>(d, {Schedule::ulysses, SeqLayout::contiguous}, true, bad, 4 * P, 4, rep);
    } catch (const Error& e) {
      message = e.what();
    }
    const bool named = message.find("model.n_heads") != std::string::npos ||
                       message.find("model.n_kv_heads") != std::string::npos;
    rep << "CASE P" << P << "/ulysses/refuses_" << bad.name << " "
        << !(named && message.find("parallel.sp_size") != std::string::npos) << " 0\n";
  }
  return rep.str();
}

class UlyssesRanks : public testing::TestWithParam<int> {};

TEST_P(UlyssesRanks, EqualsSingleRankAttentionWithExactAllToAllBytes) {
  const int P = GetParam();
  const int port = parallel::net::pick_free_port();
  auto out = test::run_ranks(P, [&](int r) { return ulysses_every_layout(r, P, port); }, 90s);
  Reports rep;
  expect_cases(out, 2 * 2 * 3 * (12 + 12 + 17), &rep);
  for (const auto& [kind, err] : rep.worst) std::cout << "  worst " << kind << ": " << err << "\n";
  // Every visible pair is computed once per head shard, forward and backward (pairs count positions,
  // not heads).
  EXPECT_FALSE(rep.pairs.empty());
  for (const auto& [name, v] : rep.pairs) EXPECT_EQ(v[0], v[2]) << name;
}

INSTANTIATE_TEST_SUITE_P(Gloo, UlyssesRanks, testing::Values(2, 3, 4, 5, 6, 7, 8),
                         [](const testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; });

// U x R: Ulysses inside groups of U consecutive ranks, each ring schedule across the R groups. With
// per_node < P ranks per node the ring across the groups spans nodes: burst alone, over its double ring.
std::string ulysses_hybrid(int rank, int U, int R, int per_node, int port) {
  one_thread_per_rank();
  const int P = U * R;
  parallel::DistributedOptions o = test::distributed_options(P);
  o.ulysses_size = U;
  Distributed d(test::loopback_world(rank, P, port, per_node), o);
  std::ostringstream rep;
  rep.precision(3);
  rep << "CASE groups " << !(d.ulysses() && d.ulysses()->size() == U && d.ulysses_ring()->size() == R) << " 0\n";
  const bool nodes = per_node < P;
  std::vector<Config> rings = {{Schedule::burst, SeqLayout::zigzag}};
  if (!nodes)
    rings = {{Schedule::ring, SeqLayout::contiguous},
             {Schedule::ring, SeqLayout::zigzag},
             {Schedule::zigzag, SeqLayout::zigzag},
             {Schedule::distflash, SeqLayout::contiguous},
             {Schedule::burst, SeqLayout::zigzag}};
  else {
    // The two rings of the ring across the groups exist and tile it; burst's double ring runs on them.
    const bool rings_given = d.ulysses_ring_intra_node() != nullptr && d.ulysses_ring_inter_node() != nullptr;
    rep << "CASE across_rings " << !rings_given << " 0\n";
    if (!rings_given) return rep.str();
    rep << "CASE across_rings_tile "
        << (d.ulysses_ring_intra_node()->size() * d.ulysses_ring_inter_node()->size() != R ||
            d.ulysses_ring_inter_node()->size() < 2)
        << " 0\n";
    SequenceAttentionSpec spec;
    spec.schedule = Schedule::burst;
    spec.causal = true;
    spec.scale = 0.5;
    spec.layout = SeqLayout::zigzag;
    spec.sp = &d.sp();
    spec.ulysses = d.ulysses();
    spec.ulysses_ring = d.ulysses_ring();
    spec.ulysses_ring_intra_node = d.ulysses_ring_intra_node();
    spec.ulysses_ring_inter_node = d.ulysses_ring_inter_node();
    std::unique_ptr<SequenceAttention> a = make_sequence_attention(spec);
    auto* ua = dynamic_cast<UlyssesAttention*>(a.get());
    auto* burst = ua ? dynamic_cast<dist::BurstAttention*>(&ua->inner()) : nullptr;
    rep << "CASE across_uses_double_ring " << !(burst && burst->uses_double_ring()) << " 0\n";
  }
  for (const Config& cfg : rings)
    for (bool causal : {true, false})
      for (Heads h : {Heads{"gqa", 2 * U, U}, Heads{"mqa", U, 1}}) {
        check_ulysses<double>(d, cfg, causal, h, /*S=*/4 * P, /*D=*/4, rep);
        check_ulysses<double>(d, cfg, causal, h, /*S=*/4 * P, /*D=*/4, rep, /*keep=*/true);
      }
  return rep.str();
}

struct HybridShape {
  int U, R, per_node;
};

class UlyssesHybrid : public testing::TestWithParam<HybridShape> {};

TEST_P(UlyssesHybrid, EveryRingScheduleAcrossUlyssesGroupsEqualsSingleRankAttention) {
  const HybridShape shape = GetParam();
  const int U = shape.U, R = shape.R, per_node = shape.per_node;
  const int port = parallel::net::pick_free_port();
  auto out = test::run_ranks(U * R, [&](int r) { return ulysses_hybrid(r, U, R, per_node, port); }, 90s);
  Reports rep;
  const int schedules = per_node < U * R ? 1 : 5;
  expect_cases(out, schedules * 2 * 2 * (12 + 17), &rep);
  for (const auto& [kind, err] : rep.worst) std::cout << "  worst " << kind << ": " << err << "\n";
  EXPECT_FALSE(rep.pairs.empty());
  for (const auto& [name, v] : rep.pairs) EXPECT_EQ(v[0], v[2]) << name;
}

// One node (2x2, 2x3, 4x2); the ring across the groups over two nodes: one member on each (2x2 with 2
// ranks per node) and two on each (2x4 with 4 ranks per node), burst's double ring of 2 x 1 and 2 x 2.
INSTANTIATE_TEST_SUITE_P(Gloo, UlyssesHybrid,
                         testing::Values(HybridShape{2, 2, 4}, HybridShape{2, 3, 6}, HybridShape{4, 2, 8},
                                         HybridShape{2, 2, 2}, HybridShape{2, 4, 4}),
                         [](const testing::TestParamInfo<HybridShape>& i) {
                           return fmt::format("{}x{}{}", i.param.U, i.param.R,
                                              i.param.per_node < i.param.U * i.param.R
                                                  ? fmt::format("_{}per_node", i.param.per_node)
                                                  : "");
                         });

// The cost model's predictions follow from its inputs: balance, bytes and link speeds.
TEST(CostModel, RanksTheSchedulesForATopologyAndLength) {
  Topology node;  // 8 GPUs per node, NVLink-class inside, one 200 Gb/s NIC per GPU across
  AttentionShape mha{.seq_len = 64 * 1024, .q_heads = 32, .kv_heads = 32, .head_dim = 128};
  auto find = [](const std::vector<ScheduleEstimate>& v, const std::string& name) {
    for (const ScheduleEstimate& e : v)
      if (e.name == name) return e;
    ADD_FAILURE() << "no candidate " << name;
    return ScheduleEstimate{};
  };
  auto print = [](const char* what, const std::vector<ScheduleEstimate>& v) {
    std::cout << "  " << what << ":\n";
    for (const ScheduleEstimate& e : v)
      std::cout << fmt::format("    {:<28} {:9.3f} ms  {:9.1f} MiB/layer  comm {:8.3f} ms  compute {:8.3f} ms\n",
                               e.name, e.seconds * 1e3, e.bytes_per_layer / 1048576.0, e.comm_seconds * 1e3,
                               e.compute_seconds * 1e3);
  };
  // One node, MHA, 64K: Ulysses moves (6Hq + 6Hkv)·(P-1)/P·T·D elements against the K/V ring's
  // 6·(P-1)·Hkv·T·D, so fewer bytes at P = 8; the causal ring over the contiguous layout is the
  // slowest (its last rank does 7.5 blocks against 4).
  const std::vector<ScheduleEstimate> one_node = estimate_schedules(mha, 8, node);
  print("8 ranks in one node, MHA 32 heads, 64K", one_node);
  EXPECT_LT(find(one_node, "ulysses").bytes_per_layer, find(one_node, "zigzag").bytes_per_layer);
  EXPECT_EQ(one_node.back().name, "ring (contiguous)");
  EXPECT_GT(find(one_node, "ring (contiguous)").compute_seconds, 1.8 * find(one_node, "zigzag").compute_seconds);
  // GQA 32/4 at 1M over 2 nodes: the K/V ring's bytes are small and hidden behind long blocks, while
  // Ulysses over 16 ranks pushes Q and O through the NICs: a ring-kind schedule or a hybrid wins.
  AttentionShape gqa{.seq_len = 1024 * 1024, .q_heads = 32, .kv_heads = 4, .head_dim = 128};
  const std::vector<ScheduleEstimate> two_nodes = estimate_schedules(gqa, 16, node);
  print("16 ranks on 2 nodes, GQA 32/4, 1M", two_nodes);
  EXPECT_NE(two_nodes.front().name, "ulysses");
  EXPECT_LT(two_nodes.front().seconds, find(two_nodes, "ulysses").seconds);
  // Short sequences: at 8K over 8 ranks of one node the blocks are too small to hide the K/V ring, so
  // Ulysses (a fifth of zigzag's bytes) beats every ring-only schedule, and a hybrid, which hides part
  // of its smaller ring's traffic, is predicted fastest.
  AttentionShape short_mha = mha;
  short_mha.seq_len = 8 * 1024;
  const std::vector<ScheduleEstimate> short_run = estimate_schedules(short_mha, 8, node);
  print("8 ranks in one node, MHA 32 heads, 8K", short_run);
  EXPECT_EQ(short_run.front().name.rfind("ulysses", 0), 0u) << short_run.front().name;
  for (const char* ring_only : {"zigzag", "distflash", "burst (zigzag)", "ring (contiguous)"})
    EXPECT_LT(find(short_run, "ulysses").seconds, find(short_run, ring_only).seconds) << ring_only;
  EXPECT_GT(find(short_run, "zigzag").comm_seconds, find(short_run, "zigzag").compute_seconds);
  for (const auto& v : {one_node, two_nodes, short_run})
    for (size_t i = 1; i < v.size(); ++i) EXPECT_LE(v[i - 1].seconds, v[i].seconds);
  // A faster inter-node link never makes a candidate slower.
  Topology fast = node;
  fast.inter.bytes_per_second *= 8;
  for (const ScheduleEstimate& e : estimate_schedules(gqa, 16, fast))
    EXPECT_LE(e.seconds, find(two_nodes, e.name).seconds * (1 + 1e-12)) << e.name;
  // Heads the group cannot split are not offered.
  AttentionShape odd = mha;
  odd.q_heads = odd.kv_heads = 12;
  for (const ScheduleEstimate& e : estimate_schedules(odd, 8, node)) EXPECT_NE(e.name, "ulysses");
}

// ---- burst's double ring -------------------------------------------------------------------------------------

// P ranks as P / per_node nodes, through the launcher's environment variables.
std::string double_ring(int rank, int P, int per_node, int port) {
  one_thread_per_rank();
  const std::map<std::string, std::string> env = {
      {"RANK", std::to_string(rank)},         {"WORLD_SIZE", std::to_string(P)},
      {"LOCAL_RANK", std::to_string(rank % per_node)}, {"LOCAL_WORLD_SIZE", std::to_string(per_node)},
      {"MASTER_ADDR", "127.0.0.1"},            {"MASTER_PORT", std::to_string(port)}};
  const WorldInfo w = parallel::world_from_env([&](const char* k) -> const char* {
    auto it = env.find(k);
    return it == env.end() ? nullptr : it->second.c_str();
  });
  Distributed d(w, test::distributed_options(P));
  const int nodes = P / per_node;
  std::ostringstream rep;
  rep.precision(3);
  for (SeqLayout layout : {SeqLayout::zigzag, SeqLayout::contiguous}) {
    for (bool causal : {true, false}) {
      for (Heads h : {kMha, kGqa}) {
        const std::string name = fmt::format("double_ring/{}x{}/{}/{}/{}", nodes, per_node, layout_name(layout),
                                             causal ? "causal" : "full", h.name);
        const Problem p = make_problem(48, h, 8, causal, 4242, false);
        SequenceAttentionSpec spec;
        spec.schedule = Schedule::burst;
        spec.causal = causal;
        spec.scale = p.scale;
        spec.layout = layout;
        spec.sp = &d.sp();
        auto single = make_sequence_attention(spec);
        spec.intra_node = &d.intra_node();
        spec.inter_node = &d.inter_node();
        auto twice = make_sequence_attention(spec);
        const auto* burst = dynamic_cast<const dist::BurstAttention*>(twice.get());
        rep << "CASE " << name << "/uses_double_ring " << !(burst && burst->uses_double_ring()) << " 0\n";
        rep << "CASE " << name << "/single_uses_single_ring "
            << dynamic_cast<const dist::BurstAttention*>(single.get())->uses_double_ring() << " 0\n";

        Shard<double> a(p, layout, P, d.sp().rank(), 5), b(p, layout, P, d.sp().rank(), 5);
        single->forward(a.o, a.lse, a.q, a.k, a.v);
        single->backward(a.dq, a.dk, a.dv, a.q, a.k, a.v, a.o, a.lse, a.d_o);
        const int64_t sp0 = d.sp().stats().bytes_sent, intra0 = d.intra_node().stats().bytes_sent,
                      inter0 = d.inter_node().stats().bytes_sent;
        twice->forward(b.o, b.lse, b.q, b.k, b.v);
        const int64_t inter1 = d.inter_node().stats().bytes_sent;
        twice->backward(b.dq, b.dk, b.dv, b.q, b.k, b.v, b.o, b.lse, b.d_o);
        const int64_t sp_bytes = d.sp().stats().bytes_sent - sp0,
                      intra_bytes = d.intra_node().stats().bytes_sent - intra0,
                      inter_fwd = inter1 - inter0, inter_bwd = d.inter_node().stats().bytes_sent - inter1;

        const double tol = tolerance<double>();
              rep << "CASE " << name << "/o " << shard_error(b.o, p.o, b.rows) << " " << tol << "\n";
        rep << "CASE " << name << "/lse " << shard_error(b.lse, p.lse, b.rows) << " " << tol << "\n";
        rep << "CASE " << name << "/dq " << shard_error(b.dq, p.dq, b.rows) << " " << tol << "\n";
        rep << "CASE " << name << "/dk " << shard_error(b.dk, p.dk, b.rows) << " " << tol << "\n";
        rep << "CASE " << name << "/dv " << shard_error(b.dv, p.dv, b.rows) << " " << tol << "\n";
        // Against the single ring directly: only the order of the merges and sums differs.
        // (A NaN or an infinity on either side makes it infinite: std::max alone would skip a NaN.)
        double vs_single = 0;
        auto widen = [&](double x, double y) {
          const double d = std::abs(x - y);
          vs_single = std::isfinite(d) ? std::max(vs_single, d) : INFINITY;
        };
        for (size_t i = 0; i < a.o.size(); ++i) widen(a.o[i], b.o[i]);
        for (size_t i = 0; i < a.dqkv.size(); ++i) widen(a.dqkv[i], b.dqkv[i]);
        rep << "CASE " << name << "/vs_single_ring " << vs_single << " 1e-13\n";

        // Traffic: nothing on the SP communicator; intra + inter = the single ring's volume; the
        // inter-node ring carries one K/V block per cycle but the last (forward), and one Q side and
        // one dQ running sum per cycle but the first (backward).
        const int64_t T = static_cast<int64_t>(b.rows.size()), e = sizeof(double);
        const Volumes want = expected_bytes(Schedule::burst, causal, P, d.sp().rank(), T, h.q, h.kv, 8, e);
        rep << "CASE " << name << "/bytes_total "
            << std::abs(intra_bytes + inter_fwd + inter_bwd - want.forward - want.backward) << " 0\n";
        rep << "CASE " << name << "/bytes_on_sp " << sp_bytes << " 0\n";
        rep << "CASE " << name << "/bytes_inter_forward " << std::abs(inter_fwd - (nodes - 1) * 2 * T * h.kv * 8 * e)
            << " 0\n";
        rep << "CASE " << name << "/bytes_inter_backward "
            << std::abs(inter_bwd - (nodes - 1) * ((2 * T * h.q * 8 + 2 * T * h.q) * e + T * h.q * 8 * e)) << " 0\n";
      }
    }
  }
  return rep.str();
}

// (nodes, ranks per node): 2 x 2 is the case; 2 x 1 and 3 x 1 have no intra-node hops; 3 x 2
// chains node partial sums over more than one inter-node hop.
class BurstDoubleRing : public testing::TestWithParam<std::pair<int, int>> {};

TEST_P(BurstDoubleRing, EqualsTheSingleRing) {
  const auto [nodes, per_node] = GetParam();
  const int P = nodes * per_node;
  const int port = parallel::net::pick_free_port();
  auto out = test::run_ranks(P, [&](int r) { return double_ring(r, P, per_node, port); }, 90s);
  expect_cases(out, 8 * 12);
}

INSTANTIATE_TEST_SUITE_P(Gloo, BurstDoubleRing,
                         testing::Values(std::pair{2, 2}, std::pair{2, 1}, std::pair{3, 1}, std::pair{3, 2}, std::pair{2, 4}, std::pair{4, 2}),
                         [](const testing::TestParamInfo<std::pair<int, int>>& i) {
                           return std::to_string(i.param.first) + "nodesOf" + std::to_string(i.param.second);
                         });

// ---- burst's backward traffic against the K/V + dK/dV ring ---------------------------------------------------

std::string burst_vs_ring_bytes(int rank, int P, int port) {
  one_thread_per_rank();
  Distributed d(test::loopback_world(rank, P, port, P), test::distributed_options(P));
  std::ostringstream rep;
  const int64_t D = 16;
  const Problem p = make_problem(48, kMha, D, true, 99, false);
  int64_t backward_bytes[2] = {0, 0};
  int i = 0;
  for (Schedule s : {Schedule::ring, Schedule::burst}) {
    SequenceAttentionSpec spec;
    spec.schedule = s;
    spec.scale = p.scale;
    spec.sp = &d.sp();
    auto attention = make_sequence_attention(spec);
    Shard<double> sh(p, SeqLayout::zigzag, P, rank, 3);
    attention->forward(sh.o, sh.lse, sh.q, sh.k, sh.v);
    const int64_t before = d.sp().stats().bytes_sent;
    attention->backward(sh.dq, sh.dk, sh.dv, sh.q, sh.k, sh.v, sh.o, sh.lse, sh.d_o);
    backward_bytes[i++] = d.sp().stats().bytes_sent - before;
  }
  const double ratio = static_cast<double>(backward_bytes[1]) / static_cast<double>(backward_bytes[0]);
  rep.precision(6);
  rep << "CASE burst_vs_ring/at_most_0.8 " << ratio << " 0.8\n";
  rep << "CASE burst_vs_ring/equals_(3D+2)/4D " << std::abs(ratio - (3.0 * D + 2) / (4.0 * D)) << " 1e-12\n";
  rep << "RATIO " << ratio << " " << backward_bytes[1] << " " << backward_bytes[0] << "\n";
  return rep.str();
}

TEST(BurstTraffic, BackwardSendsAQuarterLessThanTheKvRing) {
  const int port = parallel::net::pick_free_port();
  auto out = test::run_ranks(4, [&](int r) { return burst_vs_ring_bytes(r, 4, port); }, 60s);
  expect_cases(out, 2);
  std::istringstream in(out[0].text);
  for (std::string word; in >> word;) {
    if (word != "RATIO") continue;
    double ratio = 0;
    int64_t burst = 0, ring = 0;
    ASSERT_TRUE(test::read_fields(in, ratio, burst, ring)) << out[0].text;
    std::cout << "  burst backward / ring backward bytes (MHA, D = 16, P = 4): " << burst << " / " << ring << " = "
              << ratio << "\n";
  }
}

// ---- the whole model ------------------------------------------------------------------------------------------

model::LlamaConfig tiny_config() {
  model::LlamaConfig c;
  c.vocab_size = 50;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.ffn_dim = 24;
  c.max_seq_len = 64;
  return c;
}

// One sequence of S tokens with labels = the next token (some ignored) and global positions; a
// rank's shard is its layout's tokens.
struct Sequence {
  std::vector<int32_t> tokens, labels;
  int64_t valid = 0;
  Sequence(int64_t S, int64_t vocab, uint64_t seed) {
    std::mt19937_64 rng(seed);
    std::vector<int32_t> stream(static_cast<size_t>(S + 1));
    for (auto& t : stream) t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
    for (int64_t i = 0; i < S; ++i) {
      tokens.push_back(stream[static_cast<size_t>(i)]);
      const bool ignored = i % 7 == 3;
      labels.push_back(ignored ? model::LlamaModel::kIgnoreIndex : stream[static_cast<size_t>(i + 1)]);
      valid += !ignored;
    }
  }
};

struct ShardData {
  HostTensor<int32_t> tokens, labels, positions;
  ShardData(const Sequence& seq, SeqLayout layout, int P, int rank) {
    const int64_t S = static_cast<int64_t>(seq.tokens.size());
    const std::vector<int64_t> rows = layout_global_indices(layout, S, P, rank);
    const int64_t n = static_cast<int64_t>(rows.size());
    tokens = HostTensor<int32_t>({n});
    labels = HostTensor<int32_t>({n});
    positions = HostTensor<int32_t>({n});
    for (int64_t j = 0; j < n; ++j) {
      const int64_t g = rows[static_cast<size_t>(j)];
      tokens[static_cast<size_t>(j)] = seq.tokens[static_cast<size_t>(g)];
      labels[static_cast<size_t>(j)] = seq.labels[static_cast<size_t>(g)];
      positions[static_cast<size_t>(j)] = static_cast<int32_t>(g);
    }
  }
  model::TokenShard shard() const { return {tokens, labels, positions}; }
};

std::unique_ptr<SequenceAttention> model_attention(Communicator& sp, Schedule s, SeqLayout layout,
                                                   const model::LlamaConfig& c) {
  SequenceAttentionSpec spec;
  spec.schedule = s;
  spec.layout = layout;
  spec.scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  spec.sp = &sp;
  return make_sequence_attention(spec);
}

double global_loss(Communicator& sp, model::LossSum ls, int64_t valid) {
  double sum = ls.sum;
  sp.all_reduce(Tensor(&sum, DType::f64, {1}));
  return sum / static_cast<double>(valid);
}

// max |a - b| / max |b| per parameter tensor, the worst over the tensors.
double worst_gradient_error(const Arena& got, const Arena& want) {
  double worst = 0;
  for (size_t i = 0; i < want.table().size(); ++i) {
    const Tensor a = got.at(i), b = want.at(i);
    const std::vector<float> av(a.ptr<float>(), a.ptr<float>() + a.numel());
    const std::vector<float> bv(b.ptr<float>(), b.ptr<float>() + b.numel());
    worst = std::max(worst, test::relative_error(av, bv));
  }
  return worst;
}

std::string model_gradients(int rank, int P, int port) {
  one_thread_per_rank();
  Distributed d(test::loopback_world(rank, P, port, P), test::distributed_options(P));
  const model::LlamaConfig c = tiny_config();
  const int64_t S = 24;
  const Sequence seq(S, c.vocab_size, 2024);
  std::ostringstream rep;
  rep.precision(3);

  model::LlamaModel ref(c, model::Precision::cpu(DType::f32), model::CheckpointPolicy::remat_aware, S);
  ref.initialize(11, 0.2);
  ref.zero_grads();
  const model::LossSum ref_loss = ref.forward_backward(ShardData(seq, SeqLayout::contiguous, 1, 0).shard(),
                                                       1.0 / static_cast<double>(seq.valid));
  const double ref_mean = ref_loss.sum / static_cast<double>(seq.valid);

  struct Run {
    Schedule schedule;
    SeqLayout layout;
    model::CheckpointPolicy policy;
  };
  const std::vector<Run> runs = {{Schedule::ring, SeqLayout::contiguous, model::CheckpointPolicy::remat_aware},
                                 {Schedule::zigzag, SeqLayout::zigzag, model::CheckpointPolicy::remat_aware},
                                 {Schedule::distflash, SeqLayout::contiguous, model::CheckpointPolicy::remat_aware},
                                 {Schedule::burst, SeqLayout::zigzag, model::CheckpointPolicy::remat_aware},
                                 {Schedule::burst, SeqLayout::zigzag, model::CheckpointPolicy::full},
                                 {Schedule::zigzag, SeqLayout::zigzag, model::CheckpointPolicy::none}};
  for (const Run& run : runs) {
    const std::string name = fmt::format("model/P{}/{}/{}/{}", P, schedule_name(run.schedule),
                                         layout_name(run.layout), model::checkpoint_policy_name(run.policy));
    model::LlamaModel m(c, model::Precision::cpu(DType::f32), run.policy, S / P,
                        model_attention(d.sp(), run.schedule, run.layout, c));
    m.initialize(11, 0.2);
    m.zero_grads();
    const ShardData shard(seq, run.layout, P, rank);
    const model::LossSum ls = m.forward_backward(shard.shard(), 1.0 / static_cast<double>(seq.valid));
    d.sp().all_reduce(m.grads().flat());
    const double mean = global_loss(d.sp(), ls, seq.valid);
    rep << "CASE " << name << "/loss " << std::abs(mean - ref_mean) / ref_mean << " 1e-5\n";
    rep << "CASE " << name << "/grads " << worst_gradient_error(m.grads(), ref.grads()) << " 1e-5\n";
    // Attention forward runs once per layer and step, except under the full policy (twice).
    const int64_t forwards = c.n_layers * (run.policy == model::CheckpointPolicy::full ? 2 : 1);
    const auto* da = dynamic_cast<const DistributedAttention*>(&m.attention());
    rep << "CASE " << name << "/runs_distributed " << !(da && da->schedule() == run.schedule) << " 0\n";
    rep << "CASE " << name << "/attention_calls "
        << std::abs(m.attention().counters.forward_calls - forwards) +
               std::abs(m.attention().counters.backward_calls - c.n_layers)
        << " 0\n";
  }
  return rep.str();
}

class ModelRanks : public testing::TestWithParam<int> {};

TEST_P(ModelRanks, GradientsEqualOneRank) {
  const int P = GetParam();
  const int port = parallel::net::pick_free_port();
  auto out = test::run_ranks(P, [&](int r) { return model_gradients(r, P, port); }, 90s);
  expect_cases(out, 6 * 4);
}

INSTANTIATE_TEST_SUITE_P(Gloo, ModelRanks, testing::Values(2, 4),
                         [](const testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; });

// 20 SGD steps on two sequences in turn (so the loss falls: the model memorises them): the losses of
// P = 2 (zigzag) are P = 1's. In f64 they agree to rounding; in f32 the ranks' different summation
// orders (~1e-7 per step) are amplified by training, so the learning rate is moderate.
template <class T>
std::string training(int rank, int P, int port, double lr) {
  one_thread_per_rank();
  Distributed d(test::loopback_world(rank, P, port, P), test::distributed_options(P));
  const model::LlamaConfig c = tiny_config();
  const int64_t S = 24;
  const DType dt = dtype_of<T>();
  model::LlamaModel ref(c, model::Precision::cpu(dt), model::CheckpointPolicy::remat_aware, S);
  model::LlamaModel m(c, model::Precision::cpu(dt), model::CheckpointPolicy::remat_aware, S / P,
                      model_attention(d.sp(), Schedule::zigzag, SeqLayout::zigzag, c));
  ref.initialize(5, 0.1);
  m.initialize(5, 0.1);
  auto sgd = [&](model::LlamaModel& model) {
    Tensor w = model.params().flat(), g = model.grads().flat();
    T* wp = w.ptr<T>();
    const T* gp = g.ptr<T>();
    for (int64_t i = 0; i < w.numel(); ++i) wp[i] -= static_cast<T>(lr) * gp[i];
  };
  std::ostringstream rep;
  rep.precision(4);
  for (int step = 0; step < 20; ++step) {
    const Sequence seq(S, c.vocab_size, 100 + static_cast<uint64_t>(step % 2));
    const double scale = 1.0 / static_cast<double>(seq.valid);
    ref.zero_grads();
    const model::LossSum rl = ref.forward_backward(ShardData(seq, SeqLayout::zigzag, 1, 0).shard(), scale);
    sgd(ref);
    m.zero_grads();
    const model::LossSum ml = m.forward_backward(ShardData(seq, SeqLayout::zigzag, P, rank).shard(), scale);
    d.sp().all_reduce(m.grads().flat());
    sgd(m);
    const double want = rl.sum / static_cast<double>(seq.valid), got = global_loss(d.sp(), ml, seq.valid);
    rep << "CASE train/" << dtype_name(dt) << "/step" << step << " " << std::abs(got - want) / want << " "
        << tolerance<T>() << "\n";
    rep << "LOSS " << step << " " << want << " " << got << "\n";
  }
  return rep.str();
}

template <class T>
void check_training(double lr) {
  const int port = parallel::net::pick_free_port();
  auto out = test::run_ranks(2, [&](int r) { return training<T>(r, 2, port, lr); }, 90s);
  expect_cases(out, 20);
  std::istringstream in(out[0].text);
  std::string first, last;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("LOSS ", 0) != 0) continue;
    if (first.empty()) first = line;
    last = line;
  }
  std::cout << "  (step, P=1 loss, P=2 loss): " << first.substr(5) << " ... " << last.substr(5) << "\n";
}

TEST(Training, TwentyStepsWithTwoRanksGiveOneRanksLossesF64) { check_training<double>(0.2); }
TEST(Training, TwentyStepsWithTwoRanksGiveOneRanksLossesF32) { check_training<float>(0.2); }

// ---- single-process pieces ------------------------------------------------------------------------------------

// The zigzag half-block rules of docs/distributed-attention.md §1.4, P = 4, 12 tokens per rank (c = 6).
TEST(BlockPlan, ZigzagHalfBlockRules) {
  auto plan = [](int q, int kv) { return plan_block_calls(SeqLayout::zigzag, 4, 12, q, kv, true); };
  auto one = [](const std::vector<BlockCall>& calls, int64_t q0, int64_t qn, int64_t k0, int64_t kn, BlockMask m) {
    ASSERT_EQ(calls.size(), 1u);
    EXPECT_EQ(calls[0].q_start, q0);
    EXPECT_EQ(calls[0].q_len, qn);
    EXPECT_EQ(calls[0].k_start, k0);
    EXPECT_EQ(calls[0].k_len, kn);
    EXPECT_EQ(calls[0].mask, m);
  };
  one(plan(1, 1), 0, 12, 0, 12, BlockMask::causal_diagonal);  // step 0: causal over the local 2c tokens
  one(plan(2, 0), 0, 12, 0, 6, BlockMask::none);               // source j < r: all local Q x first half of KV
  one(plan(1, 3), 6, 6, 0, 12, BlockMask::none);               // source j > r: second half of Q x all KV
  one(plan(0, 3), 6, 6, 0, 12, BlockMask::none);
  // Contiguous: a later rank's keys are skipped, an earlier rank's are seen whole.
  EXPECT_TRUE(plan_block_calls(SeqLayout::contiguous, 4, 12, 1, 2, true).empty());
  one(plan_block_calls(SeqLayout::contiguous, 4, 12, 3, 1, true), 0, 12, 0, 12, BlockMask::none);
  // Full attention: one unmasked block whatever the ranks.
  one(plan_block_calls(SeqLayout::zigzag, 4, 12, 0, 3, false), 0, 12, 0, 12, BlockMask::none);

  // One call per chunk pair: the same pairs, each local chunk (6 tokens) on its own; a rank meeting
  // itself is still one causal call.
  auto split = [](int q, int kv) {
    return plan_block_calls(SeqLayout::zigzag, 4, 12, q, kv, true, ChunkCalls::per_chunk);
  };
  one(split(1, 1), 0, 12, 0, 12, BlockMask::causal_diagonal);
  auto two = [](const std::vector<BlockCall>& calls, std::array<int64_t, 4> a, std::array<int64_t, 4> b) {
    ASSERT_EQ(calls.size(), 2u);
    for (size_t i = 0; i < 2; ++i) {
      const auto& w = i == 0 ? a : b;
      EXPECT_EQ(calls[i].q_start, w[0]);
      EXPECT_EQ(calls[i].q_len, w[1]);
      EXPECT_EQ(calls[i].k_start, w[2]);
      EXPECT_EQ(calls[i].k_len, w[3]);
      EXPECT_EQ(calls[i].mask, BlockMask::none);
    }
  };
  two(split(2, 0), {0, 6, 0, 6}, {6, 6, 0, 6});   // each query chunk x the source's first chunk
  two(split(1, 3), {6, 6, 0, 6}, {6, 6, 6, 6});   // the late query chunk x each source chunk
  EXPECT_EQ(parse_chunk_calls(chunk_calls_name(ChunkCalls::per_chunk)), ChunkCalls::per_chunk);
  EXPECT_EQ(parse_chunk_calls(chunk_calls_name(ChunkCalls::merged)), ChunkCalls::merged);
  // A bad --chunk-calls value names what it got and what is accepted.
  std::string error;
  try {
    parse_chunk_calls("auto");
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("unknown chunk calls 'auto': use merged or per_chunk"), std::string::npos) << error;
}

// Over all (query rank, key rank) pairs, the calls cover each visible pair of the sequence once.
TEST(BlockPlan, CoversEveryVisiblePairOnce) {
  for (ChunkCalls calls : {ChunkCalls::merged, ChunkCalls::per_chunk})
  for (SeqLayout layout : {SeqLayout::contiguous, SeqLayout::zigzag}) {
    for (int P = 1; P <= 5; ++P) {
      const int64_t local = 6, S = local * P;
      for (bool causal : {true, false}) {
        std::vector<int> seen(static_cast<size_t>(S * S), 0);
        for (int q = 0; q < P; ++q) {
          const auto qg = layout_global_indices(layout, S, P, q);
          for (int kv = 0; kv < P; ++kv) {
            const auto kg = layout_global_indices(layout, S, P, kv);
            for (const BlockCall& c : plan_block_calls(layout, P, local, q, kv, causal, calls))
              for (int64_t i = c.q_start; i < c.q_start + c.q_len; ++i)
                for (int64_t j = c.k_start; j < c.k_start + c.k_len; ++j) {
                  if (c.mask == BlockMask::causal_diagonal && j - c.k_start > i - c.q_start) continue;
                  ++seen[static_cast<size_t>(qg[static_cast<size_t>(i)] * S + kg[static_cast<size_t>(j)])];
                }
          }
        }
        for (int64_t i = 0; i < S; ++i)
          for (int64_t j = 0; j < S; ++j)
            ASSERT_EQ(seen[static_cast<size_t>(i * S + j)], (!causal || j <= i) ? 1 : 0)
                << layout_name(layout) << " P " << P << (causal ? " causal" : " full") << " pair " << i << "," << j;
      }
    }
  }
}

// DistFlashAttn's schedule for P = 8, as tabled in docs/distributed-attention.md §1.3 ((q, kv) per
// rank and step; h = helper), and for P = 1..9: every causal block exactly once in ⌊P/2⌋ + 1 steps.
TEST(DistFlashSchedule, MatchesThePapersTableAndCoversEveryBlockOnce) {
  using dist::DistFlashTask;
  const char* table[] = {
      "(0,0) (1,1) (2,2) (3,3) (4,4) (5,5) (6,6) (7,7)",  "(7,0)h (1,0) (2,1) (3,2) (4,3) (5,4) (6,5) (7,6)",
      "(6,0)h (7,1)h (2,0) (3,1) (4,2) (5,3) (6,4) (7,5)", "(5,0)h (6,1)h (7,2)h (3,0) (4,1) (5,2) (6,3) (7,4)",
      "- - - - (4,0) (5,1) (6,2) (7,3)"};
  ASSERT_EQ(dist::distflash_steps(8, true), 5);
  for (int t = 0; t < 5; ++t) {
    std::string row;
    for (int r = 0; r < 8; ++r) {
      const DistFlashTask task = dist::distflash_task(8, true, r, t);
      if (!row.empty()) row += " ";
      switch (task.kind) {
        case DistFlashTask::idle: row += "-"; break;
        case DistFlashTask::own: row += fmt::format("({},{})", r, r); break;
        case DistFlashTask::owner: row += fmt::format("({},{})", r, task.peer); break;
        case DistFlashTask::helper: row += fmt::format("({},{})h", task.peer, r); break;
      }
    }
    EXPECT_EQ(row, table[t]) << "step " << t;
  }
  for (int P = 1; P <= 9; ++P) {
    for (bool causal : {true, false}) {
      std::map<std::pair<int, int>, int> blocks;
      for (int t = 0; t < dist::distflash_steps(P, causal); ++t)
        for (int r = 0; r < P; ++r) {
          const DistFlashTask task = dist::distflash_task(P, causal, r, t);
          if (task.kind == DistFlashTask::own || task.kind == DistFlashTask::owner) ++blocks[{r, task.peer}];
          if (task.kind == DistFlashTask::helper) ++blocks[{task.peer, r}];
        }
      const size_t want = causal ? static_cast<size_t>(P * (P + 1) / 2) : static_cast<size_t>(P * P);
      EXPECT_EQ(blocks.size(), want) << "P " << P;
      for (const auto& [qk, n] : blocks) {
        EXPECT_EQ(n, 1) << "P " << P << " block " << qk.first << "," << qk.second;
        if (causal) {
          EXPECT_LE(qk.second, qk.first);
        }
      }
    }
  }
}

TEST(SequenceAttentionFactory, RejectsImpossibleCombinationsNamingTheSetting) {
  auto message = [](SequenceAttentionSpec spec) -> std::string {
    try {
      make_sequence_attention(spec);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  SequenceAttentionSpec spec;
  spec.scale = 0.5;
  spec.schedule = Schedule::zigzag;
  spec.layout = SeqLayout::contiguous;
  EXPECT_NE(message(spec).find("attention.schedule zigzag needs parallel.layout zigzag"), std::string::npos);
  spec.schedule = Schedule::distflash;
  spec.layout = SeqLayout::zigzag;
  EXPECT_NE(message(spec).find("attention.schedule distflash needs parallel.layout contiguous"), std::string::npos);
  spec.layout = SeqLayout::contiguous;
  spec.scale = 0.0;
  EXPECT_NE(message(spec).find("softmax scale"), std::string::npos);
  spec.scale = 0.5;
  EXPECT_EQ(message(spec), "");
  // One rank: the single-rank attention.
  EXPECT_NE(dynamic_cast<LocalSequenceAttention*>(make_sequence_attention(spec).get()), nullptr);
  EXPECT_EQ(parse_schedule("burst"), Schedule::burst);
  try {
    parse_schedule("rign");
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use ring, zigzag, distflash, burst or ulysses"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace longtrain::attn

// Document masking (attention/document_mask.h, data.document_mask), against its definition: a packed
// window with document masking computes what each document computes alone.
//
//   - Block plans: over every pair of ranks, the per-document calls of every layout cover each
//     query-key pair inside one document (causal: keys not after the query) exactly once and no
//     other pair; a rank pair whose chunks share no document gets no call (skipped).
//   - Attention, f64, every schedule and layout (merged and per-chunk calls), P = 1..4 ranks (Gloo,
//     forked processes), causal and full, MHA and GQA: each rank's O, LSE, dQ, dK, dV equal those of
//     attention run on each document alone, and the pairs computed over the group are exactly the
//     pairs inside documents (and the pairs per rank are printed: how documents unbalance each schedule).
//   - The model, f64, every schedule, P = 1..4: the loss sum and the gradients of a packed window
//     with document masking (positions restarting per document, boundary labels ignored) equal the
//     sums over its documents, each run alone as a sequence of its own on one rank.
// Document sets: documents crossing chunk boundaries, single-token documents, chunks (of every P
// and layout used) lying wholly inside one document, and one document filling the window.
// Children report "CASE <name> <error> <tolerance>" lines; the parent asserts error <= tolerance.
#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <iostream>
#include <map>
#include <numeric>
#include <random>
#include <sstream>

#include "attention/distributed/distributed_attention.h"
#include "attention/distributed/schedules.h"
#include "attention/document_mask.h"
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
using test::HostTensor;

constexpr int64_t kS = 48;  // splits into the chunks of both layouts for P = 1..4

// Document lengths of the window (they sum to kS).
struct DocSet {
  const char* name;
  std::vector<int64_t> lengths;
};
const std::vector<DocSet> kDocSets = {
    // crossing chunk boundaries at every P; a one-token document; [6, 23) holds whole zigzag chunks
    {"mixed", {5, 1, 17, 3, 12, 10}},
    // [3, 33) holds contiguous chunks of P = 3 ([16, 32)) and P = 4 ([12, 24)) whole
    {"long_middle", {3, 30, 15}},
    // [20, 48) holds the second contiguous chunk of P = 2 whole; rank pairs sharing no document
    {"two", {20, 28}},
    // one document filling the window: the same as no document mask
    {"whole", {48}},
};

Documents documents_of(const DocSet& set) {
  Documents d;
  d.offsets.push_back(0);
  for (int64_t n : set.lengths) d.offsets.push_back(d.offsets.back() + n);
  return d;
}

// ---- block plans ------------------------------------------------------------------------------------

TEST(DocumentBlockCalls, CoverExactlyThePairsInsideDocuments) {
  for (SeqLayout layout : {SeqLayout::contiguous, SeqLayout::zigzag}) {
    for (ChunkCalls calls : {ChunkCalls::merged, ChunkCalls::per_chunk}) {
      for (int P = 1; P <= 4; ++P) {
        for (bool causal : {true, false}) {
          for (const DocSet& set : kDocSets) {
            const Documents docs = documents_of(set);
            const int64_t T = kS / P;
            std::vector<int> covered(static_cast<size_t>(kS * kS), 0);
            int64_t pairs = 0;
            for (int qr = 0; qr < P; ++qr) {
              const std::vector<int64_t> qg = layout_global_indices(layout, kS, P, qr);
              for (int kr = 0; kr < P; ++kr) {
                const std::vector<int64_t> kg = layout_global_indices(layout, kS, P, kr);
                const std::vector<BlockCall> plain = plan_block_calls(layout, P, T, qr, kr, causal, calls);
                const std::vector<BlockCall> cut = document_block_calls(plain, docs, layout, P, T, qr, kr, causal);
                bool shares = false;  // does any query of qr see any key of kr?
                for (int64_t a : qg)
                  for (int64_t b : kg)
                    shares = shares || (docs.document_of(a) == docs.document_of(b) && (!causal || b <= a));
                EXPECT_EQ(cut.empty(), !shares) << set.name << " P" << P << " ranks " << qr << "," << kr;
                for (const BlockCall& c : cut) {
                  pairs += c.pairs();
                  for (int64_t i = 0; i < c.q_len; ++i) {
                    for (int64_t j = 0; j < c.k_len; ++j) {
                      if (c.mask == BlockMask::causal_diagonal && j > i) continue;
                      const int64_t a = qg[static_cast<size_t>(c.q_start + i)];
                      const int64_t b = kg[static_cast<size_t>(c.k_start + j)];
                      covered[static_cast<size_t>(a * kS + b)]++;
                    }
                  }
                }
              }
            }
            int wrong = 0;
            for (int64_t a = 0; a < kS; ++a)
              for (int64_t b = 0; b < kS; ++b) {
                const bool visible = docs.document_of(a) == docs.document_of(b) && (!causal || b <= a);
                wrong += covered[static_cast<size_t>(a * kS + b)] != (visible ? 1 : 0);
              }
            EXPECT_EQ(wrong, 0) << set.name << " " << layout_name(layout) << " " << chunk_calls_name(calls) << " P"
                                << P << (causal ? " causal" : " full");
            EXPECT_EQ(pairs, document_pairs(docs, kS, causal)) << set.name << " P" << P;
          }
        }
      }
    }
  }
}

TEST(DocumentBlockCalls, EmptyDocumentsLeaveThePlanAsItIs) {
  const std::vector<BlockCall> plain = plan_block_calls(SeqLayout::zigzag, 3, 16, 2, 0, true);
  const std::vector<BlockCall> same = document_block_calls(plain, Documents{}, SeqLayout::zigzag, 3, 16, 2, 0, true);
  ASSERT_EQ(same.size(), plain.size());
  for (size_t i = 0; i < plain.size(); ++i) {
    EXPECT_EQ(same[i].q_start, plain[i].q_start);
    EXPECT_EQ(same[i].q_len, plain[i].q_len);
    EXPECT_EQ(same[i].k_start, plain[i].k_start);
    EXPECT_EQ(same[i].k_len, plain[i].k_len);
    EXPECT_EQ(same[i].mask, plain[i].mask);
  }
}

TEST(Documents, FromStartsCutsAtTheWindowAndChecksOffsets) {
  // starts 0 and S add nothing; a document crossing the window start begins at 0.
  EXPECT_EQ(documents_from_starts(std::vector<int32_t>{0, 5, 9, 12}, 12).offsets, (std::vector<int64_t>{0, 5, 9, 12}));
  EXPECT_EQ(documents_from_starts(std::vector<int32_t>{3}, 12).offsets, (std::vector<int64_t>{0, 3, 12}));
  EXPECT_EQ(documents_from_starts(std::vector<int32_t>{}, 12).offsets, (std::vector<int64_t>{0, 12}));
  EXPECT_THROW(documents_from_starts(std::vector<int32_t>{5, 3}, 12), Error);
  EXPECT_THROW(documents_from_starts(std::vector<int32_t>{13}, 12), Error);
  Documents bad;
  bad.offsets = {0, 4, 4, 12};
  EXPECT_THROW(check_documents(bad, 12, "test"), Error);
  bad.offsets = {0, 4, 10};
  try {
    check_documents(bad, 12, "test");
    ADD_FAILURE() << "a window of 10 tokens passed as 12";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("12 tokens"), std::string::npos) << e.what();
  }
  EXPECT_EQ(documents_of(kDocSets[0]).document_of(5), 1);
  EXPECT_EQ(documents_of(kDocSets[0]).document_of(47), 5);
}

// ---- processes ----------------------------------------------------------------------------------------

struct Config {
  Schedule schedule;
  SeqLayout layout;
  ChunkCalls chunk_calls = ChunkCalls::merged;
};
const std::vector<Config> kConfigs = {
    {Schedule::ring, SeqLayout::contiguous},  {Schedule::ring, SeqLayout::zigzag},
    {Schedule::zigzag, SeqLayout::zigzag},    {Schedule::distflash, SeqLayout::contiguous},
    {Schedule::burst, SeqLayout::zigzag},     {Schedule::burst, SeqLayout::contiguous},
    {Schedule::zigzag, SeqLayout::zigzag, ChunkCalls::per_chunk}};

std::string config_name(int P, const Config& c) {
  return fmt::format("P{}/{}/{}{}", P, schedule_name(c.schedule), layout_name(c.layout),
                     c.chunk_calls == ChunkCalls::per_chunk ? "/per_chunk" : "");
}

// The schedule's class itself, also at P = 1 (the factory hands one rank LocalSequenceAttention).
std::unique_ptr<SequenceAttention> make_attention(Communicator& sp, const Config& cfg, bool causal, double scale,
                                                  bool direct) {
  SequenceAttentionSpec spec;
  spec.schedule = cfg.schedule;
  spec.causal = causal;
  spec.scale = scale;
  spec.layout = cfg.layout;
  spec.chunk_calls = cfg.chunk_calls;
  spec.sp = &sp;
  if (!direct) return make_sequence_attention(spec);
  switch (cfg.schedule) {
    case Schedule::ring:
    case Schedule::zigzag: return std::make_unique<dist::RingAttention>(cfg.schedule, spec);
    case Schedule::distflash: return std::make_unique<dist::DistFlashAttention>(spec);
    case Schedule::burst: return std::make_unique<dist::BurstAttention>(spec);
    case Schedule::ulysses: break;  // not a ring schedule: only through make_sequence_attention
  }
  return nullptr;
}

// ---- attention: packed equals each document alone -------------------------------------------------------

struct Heads {
  const char* name;
  int64_t q, kv;
};

// The whole window's inputs, and the reference: attention over each document alone (its rows of
// q, k, v, dO as a sequence of their own), written into the window's rows.
struct Problem {
  int64_t Hq, Hkv, D;
  double scale;
  HostTensor<double> q, k, v, d_o, o, lse, dq, dk, dv;
  Problem(Heads h, int64_t D_, bool causal, const Documents& docs, uint64_t seed)
      : Hq(h.q), Hkv(h.kv), D(D_), scale(1.0 / std::sqrt(static_cast<double>(D_))), q({kS, h.q, D_}),
        k({kS, h.kv, D_}), v({kS, h.kv, D_}), d_o({kS, h.q, D_}), o({kS, h.q, D_}), lse({kS, h.q}),
        dq({kS, h.q, D_}), dk({kS, h.kv, D_}), dv({kS, h.kv, D_}) {
    uint64_t s = seed;
    for (HostTensor<double>* t : {&q, &k, &v, &d_o}) test::fill_uniform(*t, ++s);
    const BlockMask mask = causal ? BlockMask::causal_diagonal : BlockMask::none;
    for (int64_t d = 0; d < docs.count(); ++d) {
      const int64_t a = docs.offsets[static_cast<size_t>(d)], n = docs.offsets[static_cast<size_t>(d + 1)] - a;
      auto rows = [&](const HostTensor<double>& t) { return t.view.narrow(0, a, n); };
      attention_block_forward(rows(o), rows(lse), rows(q), rows(k), rows(v), mask, scale);
      HostTensor<double> delta({n, Hq});
      attention_delta(delta, rows(o), rows(d_o));
      attention_block_backward(rows(dq), rows(dk), rows(dv), rows(q), rows(k), rows(v), rows(d_o), rows(lse),
                               Tensor{}, delta, mask, scale, GradMode::overwrite);
    }
  }
};

// This rank's rows of a window tensor [S, ...], in local order.
HostTensor<double> local_rows(const HostTensor<double>& t, const std::vector<int64_t>& rows) {
  const int64_t per = t.view.numel() / kS, n = static_cast<int64_t>(rows.size());
  HostTensor<double> out = t.view.ndim == 3 ? HostTensor<double>({n, t.view.shape[1], t.view.shape[2]})
                                            : HostTensor<double>({n, t.view.shape[1]});
  for (int64_t j = 0; j < n; ++j)
    for (int64_t e = 0; e < per; ++e)
      out[static_cast<size_t>(j * per + e)] = t[static_cast<size_t>(rows[static_cast<size_t>(j)] * per + e)];
  return out;
}

std::string attention_cases(int rank, int P, int port) {
  openblas_set_num_threads(1);
  Distributed dist(test::loopback_world(rank, P, port), test::distributed_options(P));
  Communicator& sp = dist.sp();
  std::ostringstream rep;
  rep.precision(3);
  for (const Config& cfg : kConfigs) {
    for (bool direct : P == 1 ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
      for (bool causal : {true, false}) {
        for (Heads h : {Heads{"mha", 2, 2}, Heads{"gqa", 4, 2}}) {
          for (const DocSet& set : kDocSets) {
            const std::string name = fmt::format("attention/{}{}/{}/{}/{}", config_name(P, cfg),
                                                 direct ? "/direct" : "", causal ? "causal" : "full", h.name, set.name);
            const Documents docs = documents_of(set);
            const Problem p(h, 8, causal, docs, 100 + set.lengths.size());
            const std::vector<int64_t> rows = layout_global_indices(cfg.layout, kS, P, rank);
            HostTensor<double> q = local_rows(p.q, rows), k = local_rows(p.k, rows), v = local_rows(p.v, rows),
                               d_o = local_rows(p.d_o, rows);
            const int64_t n = static_cast<int64_t>(rows.size());
            HostTensor<double> o({n, p.Hq, p.D}), lse({n, p.Hq}), dq({n, p.Hq, p.D}), dk({n, p.Hkv, p.D}),
                dv({n, p.Hkv, p.D});
            // Backward overwrites: start from garbage.
            test::fill_uniform(dq, 5);
            test::fill_uniform(dk, 6);
            test::fill_uniform(dv, 7);
            std::unique_ptr<SequenceAttention> attention = make_attention(sp, cfg, causal, p.scale, direct);
            attention->set_documents(docs);
            attention->forward(o, lse, q, k, v);
            attention->backward(dq, dk, dv, q, k, v, o, lse, d_o);
            const double tol = 1e-10;
            rep << "CASE " << name << "/o " << test::relative_error(o.values, local_rows(p.o, rows).values) << " "
                << tol << "\n";
            rep << "CASE " << name << "/lse " << test::relative_error(lse.values, local_rows(p.lse, rows).values)
                << " " << tol << "\n";
            rep << "CASE " << name << "/dq " << test::relative_error(dq.values, local_rows(p.dq, rows).values) << " "
                << tol << "\n";
            rep << "CASE " << name << "/dk " << test::relative_error(dk.values, local_rows(p.dk, rows).values) << " "
                << tol << "\n";
            rep << "CASE " << name << "/dv " << test::relative_error(dv.values, local_rows(p.dv, rows).values) << " "
                << tol << "\n";
            // forward + backward pairs of this rank; the parent sums them over the group.
            rep << "PAIRS " << name << " " << attention->counters.pairs << " "
                << 2 * document_pairs(docs, kS, causal) << "\n";
          }
        }
      }
    }
  }
  return rep.str();
}

// ---- the model: packed equals the sum over documents alone ------------------------------------------------

model::LlamaConfig tiny_config() {
  model::LlamaConfig c;
  c.vocab_size = 40;
  c.dim = 16;
  c.n_layers = 2;
  c.n_heads = 4;
  c.n_kv_heads = 2;
  c.head_dim = 4;
  c.ffn_dim = 24;
  c.max_seq_len = kS;
  return c;
}

// A window of random tokens; a token's label is the next token of its document (the last one of a
// document has none: ignored), and a few more labels are ignored to mix with the ignore mechanism.
struct Window {
  std::vector<int32_t> tokens, labels, positions;  // [S], global order; positions within the document
  Window(const Documents& docs, int64_t vocab, uint64_t seed) {
    std::mt19937_64 rng(seed);
    for (int64_t g = 0; g < kS; ++g) tokens.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
    for (int64_t g = 0; g < kS; ++g) {
      const int64_t d = docs.document_of(g);
      const bool last = g + 1 == docs.offsets[static_cast<size_t>(d + 1)];
      labels.push_back(last || g % 11 == 4 ? model::LlamaModel::kIgnoreIndex : tokens[static_cast<size_t>(g + 1)]);
      positions.push_back(static_cast<int32_t>(g - docs.offsets[static_cast<size_t>(d)]));
    }
  }
};

struct Shard {
  HostTensor<int32_t> tokens, labels, positions;
  Shard(const Window& w, const std::vector<int64_t>& rows) {
    const int64_t n = static_cast<int64_t>(rows.size());
    tokens = HostTensor<int32_t>({n});
    labels = HostTensor<int32_t>({n});
    positions = HostTensor<int32_t>({n});
    for (int64_t j = 0; j < n; ++j) {
      const size_t g = static_cast<size_t>(rows[static_cast<size_t>(j)]);
      tokens[static_cast<size_t>(j)] = w.tokens[g];
      labels[static_cast<size_t>(j)] = w.labels[g];
      positions[static_cast<size_t>(j)] = w.positions[g];
    }
  }
};

std::vector<double> values(const Arena& a) {
  const Tensor t = a.flat();
  return std::vector<double>(t.ptr<double>(), t.ptr<double>() + t.numel());
}

std::string model_cases(int rank, int P, int port) {
  openblas_set_num_threads(1);
  Distributed dist(test::loopback_world(rank, P, port), test::distributed_options(P));
  Communicator& sp = dist.sp();
  const model::LlamaConfig c = tiny_config();
  const model::Precision f64 = model::Precision::cpu(DType::f64);
  std::ostringstream rep;
  rep.precision(3);
  struct Run {
    Config cfg;
    model::CheckpointPolicy policy;
  };
  std::vector<Run> runs;
  for (const Config& cfg : kConfigs) runs.push_back({cfg, model::CheckpointPolicy::remat_aware});
  runs.push_back({{Schedule::zigzag, SeqLayout::zigzag}, model::CheckpointPolicy::full});
  runs.push_back({{Schedule::ring, SeqLayout::contiguous}, model::CheckpointPolicy::none});
  for (const DocSet& set : kDocSets) {
    if (std::string(set.name) == "whole") continue;  // the plain model's own tests cover one document
    const Documents docs = documents_of(set);
    const Window w(docs, c.vocab_size, 7 + set.lengths.size());
    // Each document alone: one rank, its tokens as a sequence of their own (positions 0..n-1, no
    // document mask), the loss summed and the gradients accumulated over the documents.
    model::LlamaModel ref(c, f64, model::CheckpointPolicy::remat_aware, kS);
    ref.initialize(3, 0.3);
    ref.zero_grads();
    double ref_sum = 0;
    for (int64_t d = 0; d < docs.count(); ++d) {
      const int64_t a = docs.offsets[static_cast<size_t>(d)], n = docs.offsets[static_cast<size_t>(d + 1)] - a;
      std::vector<int64_t> rows(static_cast<size_t>(n));
      std::iota(rows.begin(), rows.end(), a);
      const Shard alone(w, rows);
      ref_sum += ref.forward_backward({alone.tokens, alone.labels, alone.positions}, 1.0).sum;
    }
    for (const Run& run : runs) {
      for (bool direct : P == 1 ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
        const std::string name = fmt::format("model/{}{}/{}/{}", config_name(P, run.cfg), direct ? "/direct" : "",
                                             model::checkpoint_policy_name(run.policy), set.name);
        model::LlamaModel m(c, f64, run.policy, kS / P,
                            make_attention(sp, run.cfg, true, 1.0 / std::sqrt(static_cast<double>(c.head_dim)), direct));
        m.initialize(3, 0.3);
        m.zero_grads();
        const Shard mine(w, layout_global_indices(run.cfg.layout, kS, P, rank));
        model::TokenShard shard{mine.tokens, mine.labels, mine.positions, docs};
        double sum = m.forward_backward(shard, 1.0).sum;
        sp.all_reduce(Tensor(&sum, DType::f64, {1}));
        sp.all_reduce(m.grads().flat());
        rep << "CASE " << name << "/loss_sum " << test::scalar_relative_error(sum, ref_sum) << " 1e-12\n";
        rep << "CASE " << name << "/grads " << test::relative_error(values(m.grads()), values(ref.grads()))
            << " 1e-10\n";
      }
    }
  }
  return rep.str();
}

// ---- parent side ------------------------------------------------------------------------------------------

void expect_cases(const std::vector<test::RankOutcome>& out, int min_cases) {
  std::map<std::string, std::array<int64_t, 2>> pairs;  // name -> Σ ranks, expected
  std::map<std::string, double> worst;
  std::map<std::string, std::vector<int64_t>> per_rank;  // name -> pairs of rank 0, 1, ...
  for (size_t r = 0; r < out.size(); ++r) {
    ASSERT_TRUE(out[r].exited(0)) << "rank " << r << ":\n" << out[r].text;
    std::istringstream in(out[r].text);
    int cases = 0;
    for (std::string line; std::getline(in, line);) {
      std::istringstream ls(line);
      std::string word, name;
      ls >> word >> name;
      if (word == "CASE") {
        double err = 0, tol = 0;
        ASSERT_TRUE(test::read_fields(ls, err, tol)) << "rank " << r << ": malformed line: " << line;
        EXPECT_LE(err, tol) << "rank " << r << ": " << name;
        const std::string kind = name.substr(name.rfind('/') + 1);
        worst[kind] = std::max(worst[kind], err);
        ++cases;
      } else if (word == "PAIRS") {
        int64_t got = 0, want = 0;
        ASSERT_TRUE(test::read_fields(ls, got, want)) << "rank " << r << ": malformed line: " << line;
        pairs[name][0] += got;
        pairs[name][1] = want;
        per_rank[name].push_back(got);
      } else {
        ADD_FAILURE() << "rank " << r << ": unexpected line: " << line;
      }
    }
    EXPECT_GE(cases, min_cases) << "rank " << r << " reported too few cases:\n" << out[r].text;
  }
  for (const auto& [name, v] : pairs) EXPECT_EQ(v[0], v[1]) << name << ": pairs computed over the group";
  // How the work falls on the ranks with documents (the "mixed" set, causal, MHA), per schedule.
  for (const auto& [name, ranks] : per_rank) {
    if (ranks.size() < 2 || name.find("/causal/mha/mixed") == std::string::npos) continue;
    int64_t most = 0, total = 0;
    std::string row;
    for (int64_t x : ranks) {
      most = std::max(most, x);
      total += x;
      row += fmt::format(" {}", x);
    }
    std::cout << "  pairs per rank " << name << ":" << row
              << fmt::format("  (max/mean {:.2f})", static_cast<double>(most) * static_cast<double>(ranks.size()) /
                                                        static_cast<double>(total))
              << "\n";
  }
  for (const auto& [kind, err] : worst) std::cout << "  worst " << kind << ": " << err << "\n";
}

class DocumentMaskRanks : public testing::TestWithParam<int> {};

TEST_P(DocumentMaskRanks, AttentionEqualsEachDocumentAlone) {
  const int P = GetParam();
  const int port = parallel::net::pick_free_port();
  auto out = test::run_ranks(P, [&](int r) { return attention_cases(r, P, port); }, 120s);
  const int configs = static_cast<int>(kConfigs.size()) * (P == 1 ? 2 : 1);
  expect_cases(out, configs * 2 * 2 * static_cast<int>(kDocSets.size()) * 5);
}

TEST_P(DocumentMaskRanks, ModelLossAndGradientsEqualTheSumOverDocumentsAlone) {
  const int P = GetParam();
  const int port = parallel::net::pick_free_port();
  auto out = test::run_ranks(P, [&](int r) { return model_cases(r, P, port); }, 120s);
  const int runs = (static_cast<int>(kConfigs.size()) + 2) * (P == 1 ? 2 : 1);
  expect_cases(out, runs * (static_cast<int>(kDocSets.size()) - 1) * 2);
}

INSTANTIATE_TEST_SUITE_P(Gloo, DocumentMaskRanks, testing::Values(1, 2, 3, 4),
                         [](const testing::TestParamInfo<int>& i) { return std::to_string(i.param) + "ranks"; });

}  // namespace
}  // namespace longtrain::attn

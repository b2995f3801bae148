// cp_bench: sequence-parallel causal attention forward+backward on the GPUs of one node, one rank per
// GPU, through longtrain's distributed schedules (attention/distributed), at the shapes of
// bench/anchors/cp_anchor.py (PyTorch's context_parallel): one sequence of S tokens, each rank holding
// S/P, 32 query heads, 8 KV heads, head dim 128, bf16, causal. The anchor runs in the same command
// (torchrun) and --merge writes its numbers and the ratios beside ours.
//
//   longtrain-run --nproc-per-node 2 -- cp_bench [--lengths 65536,131072,262144]
//       [--schedules ring,zigzag,distflash,burst] [--warmup 2] [--reps 5] [--rep-seconds 10]
//       [--budget-s 0] [--out cp.json] [--commit SHA] [--chunk-calls merged|per_chunk]
//       [--qkv-layout fused|bhsd]
//   cp_bench --merge cp.json --anchor cp_anchor_w2.json [--out merged.json]
//
// Each rank's inputs are laid out as the model holds them: Q/K/V strided views of one fused
// [T, Hq + 2·Hkv, D] buffer, dQ/dK/dV written (overwritten) into a fused dQKV buffer, bf16 O, f32 LSE. Layouts: ring and distflash
// contiguous (ring shows the causal imbalance), zigzag and burst zigzag. burst gets the intra- and
// inter-node rings, as the trainer passes them.
//
// Timing (as cp_anchor.py): `warmup` untimed forward+backward calls (the first builds cuDNN's plans),
// a barrier, then `reps` back-to-back calls between CUDA events on the compute stream (reps is cut
// to what fits in --rep-seconds, at least 2); per-GPU TFLOP/s = 3.5 · (4·Hq·S²·D/2) / P / time, the
// time being the slowest rank's mean (the anchor's FLOP count). Busy time: CUDA events around each
// schedule step's block calls (DistributedAttention::set_compute_observer: the attention kernels,
// LSE merges and gradient accumulation); idle fraction = 1 - busy / wall, per rank: time spent
// waiting for transfers or for the other rank, and in packing, zeroing and final copies.
// --budget-s: a (length, schedule) whose predicted time (4x its time at half the length) would end
// past the budget is skipped on every rank. The JSON is rewritten after every row, so a run stopped
// from outside keeps what it measured.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "attention/distributed/distributed_attention.h"
#include "bench/bench_common.h"
#include "parallel/distributed.h"
#include "parallel/nccl_communicator.h"

using namespace longtrain;
using namespace longtrain::bench;

namespace {

constexpr int64_t kHq = 32, kHkv = 8, kD = 128, kW = kHq + 2 * kHkv;

struct Options : RunRecord {
  std::vector<int64_t> lengths{65536, 131072, 262144};
  std::vector<attn::Schedule> schedules{attn::Schedule::ring, attn::Schedule::zigzag, attn::Schedule::distflash,
                                        attn::Schedule::burst};
  int warmup = 2, reps = 5;
  double rep_seconds = 10, budget_s = 0;
  std::string merge;
  std::string qkv_layout = "fused";
  attn::ChunkCalls chunk_calls = attn::ChunkCalls::merged;
};

Options parse(int argc, char** argv) {
  Options o;
  o.command = command_line(argc, argv);
  for_each_flag(argc, argv, "cp_bench", [&](const std::string& a, const FlagValue& next) {
    if (record_flag(a, next, o)) return true;
    if (a == "--lengths") {
      o.lengths = next.integers();
    } else if (a == "--schedules") {
      o.schedules.clear();
      for (const std::string& x : split_list(next())) o.schedules.push_back(attn::parse_schedule(x));
    } else if (a == "--warmup") {
      o.warmup = next.int32();
    } else if (a == "--reps") {
      o.reps = next.int32();
    } else if (a == "--rep-seconds") {
      o.rep_seconds = next.number();
    } else if (a == "--chunk-calls") {
      o.chunk_calls = attn::parse_chunk_calls(next());
    } else if (a == "--qkv-layout") {
      o.qkv_layout = next();
      LT_CHECK(o.qkv_layout == "fused" || o.qkv_layout == "bhsd", "cp_bench: --qkv-layout takes fused or bhsd, got '{}'",
               o.qkv_layout);
    } else if (a == "--budget-s") {
      o.budget_s = next.number();
    } else if (a == "--merge") {
      o.merge = next();
    } else {
      return false;
    }
    return true;
  });
  LT_CHECK(o.warmup >= 1 && o.reps >= 1, "cp_bench: --warmup and --reps must be at least 1");
  return o;
}

SeqLayout layout_of(attn::Schedule s) {
  return s == attn::Schedule::zigzag || s == attn::Schedule::burst ? SeqLayout::zigzag : SeqLayout::contiguous;
}

// ---- device memory ----------------------------------------------------------------------------------

// Fills a bf16 buffer with N(0, 1)-like values (as torch.randn in the anchor): a block of ~1M values
// made on the host, repeated over the buffer by doubling device copies.
void fill_bf16(const Tensor& t, uint32_t seed) {
  const int64_t n = t.numel();
  const int64_t block = std::min<int64_t>(n, (int64_t{1} << 20) - 3);  // not a multiple of any row length
  const std::vector<bf16> host = normal_bf16(static_cast<size_t>(block), seed);
  char* base = static_cast<char*>(t.data);
  // All on the compute stream; the host block lives until the synchronisation below.
  LT_CUDA_CHECK(cudaMemcpyAsync(base, host.data(), static_cast<size_t>(block) * 2, cudaMemcpyHostToDevice,
                                cuda_stream()));
  for (int64_t done = block; done < n;) {
    const int64_t m = std::min(done, n - done);
    LT_CUDA_CHECK(cudaMemcpyAsync(base + done * 2, base, static_cast<size_t>(m) * 2, cudaMemcpyDeviceToDevice,
                                  cuda_stream()));
    done += m;
  }
  LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
}

// ---- busy time ----------------------------------------------------------------------------------------

// CUDA events on the compute stream around each step's block calls; pairs (begin, end).
class EventObserver final : public attn::ComputeObserver {
 public:
  ~EventObserver() override {
    for (cudaEvent_t e : events_) cudaEventDestroy(e);
  }
  void begin_compute() noexcept override { record(); }
  void end_compute() noexcept override { record(); }

  void reset() { used_ = 0; }
  size_t used() const { return used_; }
  void reserve(size_t n) {
    while (events_.size() < n) {
      cudaEvent_t e;
      LT_CUDA_CHECK(cudaEventCreate(&e));
      events_.push_back(e);
    }
  }
  // Σ (end - begin) over the pairs recorded in [first, last) (event indices), ms; the events must be
  // complete.
  double busy_ms(size_t first, size_t last) const {
    LT_CHECK(!failed_, "cp_bench: recording a busy-time event failed");
    double ms = 0;
    for (size_t i = first; i + 1 < last; i += 2) {
      float v = 0;
      LT_CUDA_CHECK(cudaEventElapsedTime(&v, events_[i], events_[i + 1]));
      ms += v;
    }
    return ms;
  }

 private:
  void record() noexcept {
    if (used_ == events_.size()) {
      cudaEvent_t e;
      if (cudaEventCreate(&e) != cudaSuccess) {
        failed_ = true;
        return;
      }
      events_.push_back(e);
    }
    if (cudaEventRecord(events_[used_++], cuda_stream()) != cudaSuccess) failed_ = true;
  }

  std::vector<cudaEvent_t> events_;
  size_t used_ = 0;
  bool failed_ = false;
};

// ---- small collectives on host values -------------------------------------------------------------------

std::vector<double> gather(parallel::Communicator& c, const std::vector<double>& mine) {
  const int64_t n = static_cast<int64_t>(mine.size());
  CudaBuffer in(mine), out(DType::f64, {n * c.size()});
  c.all_gather(out.t, in.t);
  std::vector<double> all(static_cast<size_t>(n * c.size()));
  copy(Tensor(all.data(), DType::f64, {n * c.size()}), out.t);
  return all;
}

// ---- one (length, schedule) ---------------------------------------------------------------------------

struct Measured {
  double fwdbwd_ms, fwd_ms, bwd_ms, busy_fwd_ms, busy_bwd_ms, fwd_bytes, bwd_bytes;
  int reps;
};

Measured measure(parallel::Distributed& d, attn::Schedule schedule, int64_t S, const Options& o) {
  parallel::Communicator& sp = d.sp();
  const int P = sp.size();
  const int64_t T = S / P;
  attn::SequenceAttentionSpec spec;
  spec.schedule = schedule;
  spec.causal = true;
  spec.scale = 1.0 / std::sqrt(static_cast<double>(kD));
  spec.layout = layout_of(schedule);
  spec.sp = &sp;
  spec.intra_node = &d.intra_node();
  spec.inter_node = &d.inter_node();
  spec.chunk_calls = o.chunk_calls;
  std::unique_ptr<attn::SequenceAttention> attention = attn::make_sequence_attention(spec);
  auto* da = dynamic_cast<attn::DistributedAttention*>(attention.get());
  LT_CHECK(da != nullptr, "cp_bench: {} ranks give no distributed attention", P);
  EventObserver observer;
  da->set_compute_observer(&observer);

  // fused: [T, Hq + 2·Hkv, D] buffers as the model's; bhsd: head-major [heads, T, D], as the anchor's.
  const bool bhsd = o.qkv_layout == "bhsd";
  auto heads_of = [&](const Tensor& t, int64_t h0, int64_t n) {
    if (!bhsd) return t.narrow(1, h0, n);
    const Tensor hm = t.narrow(0, h0, n);  // [n, T, D] seen as [T, n, D]
    Tensor v = hm;
    v.shape = {hm.shape[1], hm.shape[0], hm.shape[2], 0};
    v.stride = {hm.stride[1], hm.stride[0], hm.stride[2], 0};
    return v;
  };
  const int64_t rows_w = bhsd ? kW : T, cols_w = bhsd ? T : kW, rows_q = bhsd ? kHq : T, cols_q = bhsd ? T : kHq;
  CudaBuffer qkv(DType::bf16, {rows_w, cols_w, kD}), o_buf(DType::bf16, {rows_q, cols_q, kD}),
      lse(DType::f32, {T, kHq}), d_o(DType::bf16, {rows_q, cols_q, kD}), dqkv(DType::bf16, {rows_w, cols_w, kD});
  fill_bf16(qkv.t, 11 + 7 * static_cast<uint32_t>(sp.rank()));
  fill_bf16(d_o.t, 13 + 7 * static_cast<uint32_t>(sp.rank()));
  const Tensor q = heads_of(qkv.t, 0, kHq), k = heads_of(qkv.t, kHq, kHkv), v = heads_of(qkv.t, kHq + kHkv, kHkv);
  const Tensor dq = heads_of(dqkv.t, 0, kHq), dk = heads_of(dqkv.t, kHq, kHkv), dv = heads_of(dqkv.t, kHq + kHkv, kHkv);
  const Tensor ot = heads_of(o_buf.t, 0, kHq), dot = heads_of(d_o.t, 0, kHq);
  auto forward = [&] { attention->forward(ot, lse.t, q, k, v); };
  // backward overwrites dq/dk/dv (SequenceAttention's contract), as LlamaModel calls it.
  auto backward = [&] { attention->backward(dq, dk, dv, q, k, v, ot, lse.t, dot); };

  double last_warm_s = 0;
  for (int i = 0; i < o.warmup; ++i) {
    observer.reset();
    LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    const auto t0 = std::chrono::steady_clock::now();
    forward();
    backward();
    LT_CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    last_warm_s = seconds_since(t0);
  }
  // Every rank times the same number of calls.
  const double slowest_warm = all_max(sp, last_warm_s);
  const int reps = std::max(2, std::min(o.reps, static_cast<int>(o.rep_seconds / std::max(slowest_warm, 1e-6))));
  const size_t per_call = observer.used();
  observer.reserve(per_call * static_cast<size_t>(reps) + 16);
  observer.reset();

  // Event 2r: call r starts; 2r + 1: its forward ended; 2r + 2: its backward ended.
  CudaEvents ev(static_cast<size_t>(2 * reps + 1));
  std::vector<size_t> starts, mids;  // observer events at the start of each call and after its forward
  sp.barrier();  // both devices idle, both hosts here
  ev.record(0);
  for (int r = 0; r < reps; ++r) {
    starts.push_back(observer.used());
    forward();
    ev.record(static_cast<size_t>(2 * r + 1));
    mids.push_back(observer.used());
    backward();
    ev.record(static_cast<size_t>(2 * r + 2));
  }
  ev.synchronize(ev.size() - 1);
  Measured m{};
  m.reps = reps;
  m.fwdbwd_ms = ev.ms(0, ev.size() - 1) / reps;
  for (int r = 0; r < reps; ++r) {
    const auto i = static_cast<size_t>(r);
    m.fwd_ms += ev.ms(2 * i, 2 * i + 1) / reps;
    m.bwd_ms += ev.ms(2 * i + 1, 2 * i + 2) / reps;
    const size_t end = i + 1 < starts.size() ? starts[i + 1] : observer.used();
    m.busy_fwd_ms += observer.busy_ms(starts[i], mids[i]) / reps;
    m.busy_bwd_ms += observer.busy_ms(mids[i], end) / reps;
  }
  LT_CHECK(observer.used() == per_call * static_cast<size_t>(reps),
           "cp_bench: {} busy-time events in {} calls, {} per warm-up call", observer.used(), reps, per_call);
  m.fwd_bytes = static_cast<double>(da->last_forward().bytes_sent());
  m.bwd_bytes = static_cast<double>(da->last_backward().bytes_sent());
  return m;
}

// ---- output ----------------------------------------------------------------------------------------------

json machine_info(int ranks) {
  json m = machine_json();
  m["ranks"] = ranks;
  m["nccl"] = parallel::nccl_version();
  return m;
}

void write_result(const std::string& path, const json& result) {
  if (!path.empty()) write_json("cp_bench", path, result);
}

// The anchor's numbers (cp_anchor.py's JSON: {"world": P, "<S>": {"cudnn": {...}, "flash": {...}}})
// and the ratios beside each row.
int merge(const Options& o) {
  json result = read_json("cp_bench --merge", "the result", o.merge);
  json anchor = read_json("cp_bench --merge", "the anchor", o.anchor);
  result["anchor"] = {{"script", "bench/anchors/cp_anchor.py"},
                      {"file", o.anchor},
                      {"what", "PyTorch context_parallel (ring attention over NCCL, head-tail load balancing), "
                               "SDPA cuDNN and flash backends, same machine, same command"}};
  if (anchor.contains("world")) result["anchor"]["world"] = anchor["world"];
  std::printf("%-8s %-10s %10s %12s %12s %10s %10s\n", "S", "schedule", "ours", "torch cudnn", "ratio", "idle max",
              "torch flash");
  for (json& row : result["rows"]) {
    const std::string key = std::to_string(row["S"].get<int64_t>());
    if (!anchor.contains(key)) continue;
    for (const char* backend : {"cudnn", "flash"}) {
      if (!anchor[key].contains(backend)) continue;
      const json& a = anchor[key][backend];
      row[fmt::format("anchor_torch_cp_{}", backend)] = a;
      if (a.is_object() && row.contains("tflops_per_gpu") && a.contains("fwdbwd_tflops_per_gpu"))
        row[fmt::format("ratio_vs_torch_cp_{}", backend)] =
            round3(row["tflops_per_gpu"].get<double>() / a["fwdbwd_tflops_per_gpu"].get<double>());
    }
    auto num = [&](const char* k) { return row.contains(k) ? row[k].dump() : std::string("-"); };
    auto anum = [&](const char* b) {
      return anchor[key].contains(b) && anchor[key][b].is_object() ? anchor[key][b]["fwdbwd_tflops_per_gpu"].dump()
                                                                   : std::string("failed");
    };
    std::printf("%-8s %-10s %10s %12s %12s %10s %10s\n", key.c_str(), row["schedule"].get<std::string>().c_str(),
                num("tflops_per_gpu").c_str(), anum("cudnn").c_str(), num("ratio_vs_torch_cp_cudnn").c_str(),
                num("idle_fraction_max").c_str(), anum("flash").c_str());
  }
  write_result(o.out.empty() ? o.merge : o.out, result);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    if (!o.merge.empty()) return merge(o);

    const parallel::WorldInfo w = parallel::world_from_env();
    parallel::DistributedOptions dopt;
    dopt.backend = parallel::Backend::nccl;  // GPU LOCAL_RANK, one per rank
    dopt.sp_size = w.world_size;
    parallel::Distributed d(w, parallel::options_from_env(dopt));
    parallel::Communicator& sp = d.sp();
    const int P = sp.size();
    LT_CHECK(P >= 2, "cp_bench needs at least 2 ranks (start it with longtrain-run --nproc-per-node 2)");
    const bool main_rank = sp.rank() == 0;
    const auto start = std::chrono::steady_clock::now();
    auto elapsed_s = [&] { return seconds_since(start); };

    json result = {
        {"benchmark", fmt::format("sequence-parallel causal attention fwd+bwd, {} GPUs, one sequence of S tokens "
                                  "(S/{} per GPU), {} query heads, {} KV heads, head dim {}, bf16",
                                  P, P, kHq, kHkv, kD)},
        {"date", utc_date()},
        {"commit", o.commit},
        {"command", o.command},
        {"machine", machine_info(P)},
        {"ours", "longtrain make_sequence_attention (attention/distributed): forward(o, lse, q, k, v); "
                 "backward(dq, dk, dv, ...) with q/k/v and dq/dk/dv strided views of fused buffers, bf16 O, f32 "
                 "LSE and f32 accumulators; NCCL send/recv ordered by events, overlapped with the block calls"},
        {"qkv_layout", o.qkv_layout == "bhsd" ? "bhsd: separate head-major [heads, T, D] buffers, as the anchor's"
                                              : "fused: [T, Hq + 2 Hkv, D] buffers, as the model's"},
        {"chunk_calls", std::string(attn::chunk_calls_name(o.chunk_calls))},
        {"layouts", "ring, distflash: contiguous; zigzag, burst: zigzag"},
        {"flops", "per GPU: 3.5 * (4*Hq*S^2*D/2) / P (cp_anchor.py's count)"},
        {"timing", fmt::format("CUDA events around reps back-to-back fwd+bwd calls after {} warm-ups and a barrier "
                               "(reps <= {}, cut to ~{} s, at least 2); the slowest rank's mean",
                               o.warmup, o.reps, o.rep_seconds)},
        {"busy", "CUDA events around each schedule step's block calls (attention kernels, LSE merges, gradient "
                 "accumulation); idle_fraction = 1 - busy / wall per rank"},
        {"rows", json::array()}};
    std::map<std::pair<int, int64_t>, double> seconds_per_call;  // (schedule, S) -> fwd+bwd seconds

    for (int64_t S : o.lengths) {
      LT_CHECK(S % (2 * P) == 0, "cp_bench: S = {} must be a multiple of 2 x {} ranks", S, P);
      for (attn::Schedule s : o.schedules) {
        json row = {{"S", S},
                    {"schedule", std::string(attn::schedule_name(s))},
                    {"layout", std::string(layout_name(layout_of(s)))},
                    {"hq", kHq},
                    {"hkv", kHkv},
                    {"d", kD}};
        // Skip what would not fit the budget (decided alike on every rank).
        double predicted = 0;
        const auto half = seconds_per_call.find({static_cast<int>(s), S / 2});
        if (half != seconds_per_call.end()) {
          const double call = 4.0 * half->second;  // attention is quadratic in S
          const double reps = std::max(2.0, std::min<double>(o.reps, std::floor(o.rep_seconds / call)));
          predicted = call * (o.warmup + reps) + 5.0;  // + buffers, plans
        }
        const bool skip = o.budget_s > 0 && all_max(sp, elapsed_s() + predicted > o.budget_s ? 1.0 : 0.0) > 0;
        if (skip) {
          row["status"] = fmt::format("skipped: predicted {:.0f} s would pass the {:.0f} s budget", predicted,
                                      o.budget_s);
          if (main_rank) std::printf("S=%lld %s: %s\n", (long long)S, row["schedule"].get<std::string>().c_str(),
                                     row["status"].get<std::string>().c_str());
        } else {
          const Measured m = measure(d, s, S, o);
          const std::vector<double> all = gather(sp, {m.fwdbwd_ms, m.fwd_ms, m.bwd_ms, m.busy_fwd_ms, m.busy_bwd_ms,
                                                      m.fwd_bytes, m.bwd_bytes, static_cast<double>(m.reps)});
          const size_t n = 8;
          double wall = 0, fwd = 0, idle_max = 0;
          json ranks = json::array();
          for (int r = 0; r < P; ++r) {
            const double* x = all.data() + static_cast<size_t>(r) * n;
            wall = std::max(wall, x[0]);
            fwd = std::max(fwd, x[1]);
            const double busy = x[3] + x[4];
            const double idle = 1.0 - busy / x[0];
            idle_max = std::max(idle_max, idle);
            ranks.push_back({{"rank", r},
                             {"fwdbwd_ms", round3(x[0])},
                             {"fwd_ms", round3(x[1])},
                             {"bwd_ms", round3(x[2])},
                             {"busy_fwd_ms", round3(x[3])},
                             {"busy_bwd_ms", round3(x[4])},
                             {"idle_fraction", round4(idle)},
                             {"fwd_bytes_sent", static_cast<int64_t>(x[5])},
                             {"bwd_bytes_sent", static_cast<int64_t>(x[6])}});
          }
          const double fwd_flops = 4.0 * kHq * double(S) * double(S) * kD / 2.0;
          const double tflops = 3.5 * fwd_flops / P / wall / 1e9;
          row["status"] = "ok";
          row["reps"] = m.reps;
          row["fwdbwd_ms"] = round3(wall);
          row["fwd_ms"] = round3(fwd);
          row["tflops_per_gpu"] = round1(tflops);
          row["fwd_tflops_per_gpu"] = round1(fwd_flops / P / fwd / 1e9);
          row["idle_fraction_max"] = round4(idle_max);
          row["ranks"] = ranks;
          seconds_per_call[{static_cast<int>(s), S}] = wall / 1e3;
          if (main_rank) {
            std::string idles;
            for (const json& r : ranks) idles += fmt::format(" {:.1f}%", 100 * r["idle_fraction"].get<double>());
            std::printf("S=%-7lld %-9s fwd+bwd %9.2f ms  %6.1f TFLOP/s per GPU  (fwd %8.2f ms, %6.1f)  idle per "
                        "rank:%s  [%d reps, %.0f s]\n",
                        (long long)S, row["schedule"].get<std::string>().c_str(), wall, tflops, fwd,
                        fwd_flops / P / fwd / 1e9, idles.c_str(), m.reps, elapsed_s());
          }
        }
        if (main_rank) std::fflush(stdout);
        result["rows"].push_back(row);
        if (main_rank) write_result(o.out, result);
      }
    }
    sp.barrier();
    if (main_rank && !o.out.empty()) std::printf("wrote %s\n", o.out.c_str());
    return 0;
  } catch (const std::exception& e) {
    return report_failure("cp_bench", e);
  }
}

// comm_bench: all_reduce and send/recv bus bandwidth through longtrain's NCCL communicator on the
// GPUs of one node, written beside torch.distributed's numbers measured in the same run (the anchor
// JSON of a torch script started by torchrun on the same machine just before).
//
//   longtrain-run --nproc-per-node 2 -- comm_bench [--sizes-mib 1,2,4,...,1024] [--anchor torch.json]
//       [--out result.json] [--commit SHA] [--topology FILE] [--warmup 5]
//
// Sizes are bytes per rank in f32: the all_reduce buffer; the send buffer and the receive buffer of
// send/recv. Each rank sends to the next rank and receives from the previous one in one batch
// (nccl-tests' sendrecv; with 2 ranks both directions of the link are busy).
// Timing: after a barrier, CUDA events on the compute stream around `iters` back-to-back calls (each
// call makes the communication stream wait for the compute stream and the compute stream wait for
// it: the cost a trainer pays), iters = clamp(4 GiB / bytes, 20, 200) after `warmup` calls; an
// operation's time is the slowest rank's mean. algbw = bytes / time (GB/s = 1e9 B/s); busbw = algbw
// x 2(n-1)/n for all_reduce, = algbw for send/recv (nccl-tests' conventions). The torch anchor uses
// the same sizes, iteration counts and formulas.
#include <algorithm>
#include <cstdio>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>
#include <vector>

#include "bench/bench_common.h"
#include "parallel/distributed.h"
#include "parallel/nccl_communicator.h"

using namespace longtrain;
using namespace longtrain::bench;
using namespace longtrain::parallel;

namespace {

struct Options : RunRecord {
  std::vector<int64_t> sizes_mib{1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024};
  std::string topology;
  int warmup = 5;
};

Options parse(int argc, char** argv) {
  Options o;
  o.command = command_line(argc, argv);
  for_each_flag(argc, argv, "comm_bench", [&](const std::string& a, const FlagValue& next) {
    if (record_flag(a, next, o)) return true;
    if (a == "--sizes-mib") {
      o.sizes_mib = next.integers();
    } else if (a == "--topology") {
      o.topology = next();
    } else if (a == "--warmup") {
      o.warmup = next.int32();
    } else {
      return false;
    }
    return true;
  });
  return o;
}

int iterations(int64_t bytes) {
  return static_cast<int>(std::clamp<int64_t>((int64_t{4} << 30) / bytes, 20, 200));
}

struct Row {
  std::string op;
  int64_t bytes = 0;
  int iters = 0;
  double time_us = 0, algbw = 0, busbw = 0;
};

// Mean time of one call in microseconds, the slowest rank's.
double time_calls(NcclCommunicator& c, int warmup, int iters, const std::function<void()>& call) {
  for (int i = 0; i < warmup; ++i) call();
  c.barrier();
  CudaEvents ev(2);  // start, stop
  ev.record(0);
  for (int i = 0; i < iters; ++i) call();
  ev.record(1);
  ev.synchronize(1);
  const float us = ev.ms(0, 1) * 1000.0f / static_cast<float>(iters);
  return all_max(c, us);
}

json machine_info(const Options& o, int world_size) {
  json m = machine_json();
  m["ranks"] = world_size;
  m["nccl"] = nccl_version();
  if (!o.topology.empty()) {
    std::ifstream f(o.topology);
    std::stringstream ss;
    ss << f.rdbuf();
    m["topology"] = ss.str();
  }
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options o = parse(argc, argv);
    const WorldInfo w = world_from_env();
    DistributedOptions dopt;
    dopt.backend = Backend::nccl;
    Distributed d(w, options_from_env(dopt));
    auto& c = dynamic_cast<NcclCommunicator&>(d.world());
    const int n = c.size(), next = (c.rank() + 1) % n, prev = (c.rank() + n - 1) % n;
    LT_CHECK(n >= 2, "comm_bench needs at least 2 ranks (start it with longtrain-run --nproc-per-node 2)");

    const int64_t max_bytes = *std::max_element(o.sizes_mib.begin(), o.sizes_mib.end()) << 20;
    CudaBuffer reduce_buf(DType::f32, {max_bytes / 4}), send_buf(DType::f32, {max_bytes / 4}),
        recv_buf(DType::f32, {max_bytes / 4});
    LT_CUDA_CHECK(cudaMemset(reduce_buf.t.data, 0, max_bytes));
    LT_CUDA_CHECK(cudaMemset(send_buf.t.data, 0, max_bytes));

    std::vector<Row> rows;
    for (const std::string op : {"all_reduce", "sendrecv"}) {
      for (int64_t mib : o.sizes_mib) {
        const int64_t bytes = mib << 20, elems = bytes / 4;
        Row row{op, bytes, iterations(bytes)};
        const Tensor reduce = reduce_buf.t.narrow(0, elems), send = send_buf.t.narrow(0, elems),
                     recv = recv_buf.t.narrow(0, elems);
        const P2POp batch[] = {P2POp::send(send, next), P2POp::recv(recv, prev)};
        std::function<void()> call = [&] { c.all_reduce(reduce); };
        if (op == "sendrecv") call = [&] { c.start_p2p(batch)->wait(); };
        row.time_us = time_calls(c, o.warmup, row.iters, call);
        row.algbw = static_cast<double>(bytes) / row.time_us / 1e3;
        row.busbw = op == "all_reduce" ? row.algbw * 2.0 * (n - 1) / n : row.algbw;
        rows.push_back(row);
        if (c.rank() == 0) {
          std::printf("%-10s %7lld MiB  %9.1f us  algbw %7.1f GB/s  busbw %7.1f GB/s\n", op.c_str(),
                      static_cast<long long>(mib), row.time_us, row.algbw, row.busbw);
          std::fflush(stdout);
        }
      }
    }
    c.synchronize();
    if (c.rank() != 0 || o.out.empty()) return 0;

    json anchor = o.anchor.empty() ? json() : read_json("comm_bench", "the anchor", o.anchor);
    json out_rows = json::array();
    for (const Row& r : rows) {
      json row = {{"op", r.op},
                  {"bytes", r.bytes},
                  {"iters", r.iters},
                  {"ours",
                   {{"time_us", round1(r.time_us)}, {"algbw_GBps", round1(r.algbw)}, {"busbw_GBps", round1(r.busbw)}}}};
      for (const json& a : anchor.is_object() ? anchor.value("rows", json::array()) : json::array()) {
        if (a.at("op") != r.op || a.at("bytes").get<int64_t>() != r.bytes) continue;
        row["torch"] = {{"time_us", round1(a.at("time_us").get<double>())},
                        {"algbw_GBps", round1(a.at("algbw_GBps").get<double>())},
                        {"busbw_GBps", round1(a.at("busbw_GBps").get<double>())}};
        row["ratio_busbw_ours_over_torch"] = round3(r.busbw / a.at("busbw_GBps").get<double>());
      }
      out_rows.push_back(row);
    }
    json result = {
        {"benchmark", "all_reduce and send/recv bus bandwidth, f32, one rank per GPU, one node"},
        {"date", utc_date()},
        {"commit", o.commit},
        {"command", o.command},
        {"machine", machine_info(o, n)},
        {"ours", "longtrain NcclCommunicator (bench/comm_bench.cpp): all_reduce(t); start_p2p({send next, recv "
                 "prev})->wait(); each call ordered against the compute stream by events"},
        {"timing", "CUDA events on the compute stream around iters = clamp(4 GiB / bytes, 20, 200) back-to-back "
                   "calls after warmup calls and a barrier; the slowest rank's mean. algbw = bytes / time; busbw = "
                   "algbw * 2(n-1)/n (all_reduce), = algbw (sendrecv); GB/s = 1e9 B/s"},
        {"rows", out_rows}};
    if (!o.anchor.empty()) {
      result["anchor"] = {{"file", o.anchor}};
      for (const char* key : {"script", "command", "torch_version", "nccl_version", "note"}) {
        if (anchor.contains(key)) result["anchor"][key] = anchor[key];
      }
    }
    write_json("comm_bench", o.out, result);
    std::printf("wrote %s\n", o.out.c_str());
    return 0;
  } catch (const std::exception& e) {
    return report_failure("comm_bench", e);
  }
}

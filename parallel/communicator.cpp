#include "parallel/communicator.h"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "parallel/gloo_communicator.h"
#ifdef LONGTRAIN_HAS_CUDA
#include "parallel/nccl_communicator.h"
#endif
#include "runtime/arena.h"
#include "runtime/device.h"
#include "runtime/error.h"

namespace longtrain::parallel {

std::string_view reduce_op_name(ReduceOp op) { return op == ReduceOp::sum ? "sum" : "max"; }

Communicator::Communicator(std::string name, std::vector<int> ranks, int rank, Millis timeout)
    : name_(std::move(name)), ranks_(std::move(ranks)), rank_(rank), timeout_(timeout) {}

CommStats Communicator::stats() const {
  return CommStats{bytes_sent_.load(), bytes_received_.load(), collectives_.load(), p2p_messages_.load()};
}

void Communicator::reset_stats() {
  bytes_sent_ = 0;
  bytes_received_ = 0;
  collectives_ = 0;
  p2p_messages_ = 0;
}

std::string Communicator::describe_ranks(const std::vector<int>& group_ranks) const {
  std::vector<int> global;
  for (int r : group_ranks) global.push_back(ranks_.at(r));
  return fmt::format("{} {}", global.size() == 1 ? "rank" : "ranks", fmt::join(global, ", "));
}

std::string Communicator::describe_group() const {
  return fmt::format("'{}' (global ranks {})", name_, fmt::join(ranks_, ", "));
}

std::unique_ptr<P2PWork> Communicator::start_all_to_all(const std::vector<std::vector<Tensor>>& send,
                                                       const std::vector<std::vector<Tensor>>& recv) {
  LT_CHECK(static_cast<int>(send.size()) == size() && static_cast<int>(recv.size()) == size(),
           "all_to_all on {}: {} send lists and {} receive lists for {} ranks (one of each per rank)",
           describe_group(), send.size(), recv.size(), size());
  const auto& own_send = send[static_cast<size_t>(rank())];
  const auto& own_recv = recv[static_cast<size_t>(rank())];
  LT_CHECK(own_send.size() == own_recv.size(),
           "all_to_all on {}: rank {} sends itself {} tensors but receives {} from itself", describe_group(),
           ranks_[rank()], own_send.size(), own_recv.size());
  for (size_t j = 0; j < own_send.size(); ++j) {
    check_comm_tensor("all_to_all", own_send[j], device());
    check_comm_tensor("all_to_all", own_recv[j], device());
    LT_CHECK(own_send[j].dtype == own_recv[j].dtype && own_send[j].numel() == own_recv[j].numel(),
             "all_to_all on {}: this rank's own part {} does not fit its receive tensor {}", describe_group(),
             own_send[j].describe(), own_recv[j].describe());
  }
  std::vector<P2POp> ops;
  for (int r = 0; r < size(); ++r) {
    if (r == rank()) continue;
    // Sends before receives per peer; matching is per direction, so the order between peers is free.
    for (const Tensor& t : send[static_cast<size_t>(r)]) ops.push_back(P2POp::send(t, r));
    for (const Tensor& t : recv[static_cast<size_t>(r)]) ops.push_back(P2POp::recv(t, r));
  }
  // Post the transfers first, so the local copy overlaps them.
  std::unique_ptr<P2PWork> work = start_p2p(ops);
  for (size_t j = 0; j < own_send.size(); ++j)
    if (own_send[j].data != own_recv[j].data) copy(own_recv[j], own_send[j]);
  return work;
}

void Communicator::all_to_all(Tensor out, Tensor in) {
  check_comm_tensor("all_to_all", out, device());
  check_comm_tensor("all_to_all", in, device());
  LT_CHECK(in.dtype == out.dtype && in.numel() == out.numel() && in.numel() % size() == 0,
           "all_to_all on {}: input {} and output {} must share one dtype and size, a multiple of the {} ranks",
           describe_group(), in.describe(), out.describe(), size());
  const char* ib = static_cast<const char*>(in.data);
  const char* ob = static_cast<const char*>(out.data);
  LT_CHECK(in.numel() == 0 || ib + in.nbytes() <= ob || ob + out.nbytes() <= ib,
           "all_to_all on {}: input {} and output {} overlap", describe_group(), in.describe(), out.describe());
  const int64_t n = in.numel() / size();
  const Tensor flat_in = in.reshape({in.numel()}), flat_out = out.reshape({out.numel()});
  std::vector<std::vector<Tensor>> send(static_cast<size_t>(size())), recv(static_cast<size_t>(size()));
  for (int r = 0; r < size(); ++r) {
    send[static_cast<size_t>(r)] = {flat_in.narrow(r * n, n)};
    recv[static_cast<size_t>(r)] = {flat_out.narrow(r * n, n)};
  }
  start_all_to_all(send, recv)->wait();
}

void check_comm_tensor(const char* op, const Tensor& t, Device device) {
  LT_CHECK(t.is_contiguous(), "{}: the tensor {} is not contiguous; communicators take flat, contiguous ranges",
           op, t.describe());
  LT_CHECK(t.device == device, "{}: the tensor {} is on the wrong device for this communicator ({} expected)", op,
           t.describe(), device == Device::cpu ? "cpu: use the Gloo communicator for CPU tensors"
                                               : "cuda: use the NCCL communicator for CUDA tensors");
  LT_CHECK(t.numel() == 0 || t.data != nullptr, "{}: the tensor {} has no data", op, t.describe());
}

int64_t check_reduce_scatter(const Communicator& c, const Tensor& out, const Tensor& in, Device device) {
  check_comm_tensor("reduce_scatter", out, device);
  check_comm_tensor("reduce_scatter", in, device);
  LT_CHECK(in.dtype == out.dtype, "reduce_scatter on {}: input {} and output {} differ in dtype", c.describe_group(),
           in.describe(), out.describe());
  const int64_t n = out.numel();
  LT_CHECK(in.numel() == n * c.size(),
           "reduce_scatter on {}: the input {} must hold size x output = {} x {} = {} elements", c.describe_group(),
           in.describe(), c.size(), n, n * c.size());
  return n;
}

int64_t check_all_gather(const Communicator& c, const Tensor& out, const Tensor& in, Device device) {
  check_comm_tensor("all_gather", out, device);
  check_comm_tensor("all_gather", in, device);
  LT_CHECK(in.dtype == out.dtype, "all_gather on {}: input {} and output {} differ in dtype", c.describe_group(),
           in.describe(), out.describe());
  const int64_t n = in.numel();
  LT_CHECK(out.numel() == n * c.size(),
           "all_gather on {}: the output {} must hold size x input = {} x {} = {} elements", c.describe_group(),
           out.describe(), c.size(), n, n * c.size());
  return n;
}

int64_t check_reduce_scatter_range(const Communicator& c, const Tensor& flat, int64_t begin, int64_t end,
                                   Device device) {
  check_comm_tensor("reduce_scatter_range", flat, device);
  const int64_t total = flat.numel();
  LT_CHECK(total % c.size() == 0,
           "reduce_scatter_range on {}: the flat buffer {} does not split into {} equal shards; pad it to a multiple "
           "of the group size (Arena::pad_to_multiple)",
           c.describe_group(), flat.describe(), c.size());
  LT_CHECK(0 <= begin && begin <= end && end <= total,
           "reduce_scatter_range on {}: the range [{}, {}) is not inside the flat buffer {} (0 <= begin <= end <= {})",
           c.describe_group(), begin, end, flat.describe(), total);
  return total / c.size();
}

RangeShare shard_share(int64_t range_begin, int64_t range_end, int64_t n, int shard) {
  const int64_t b = std::clamp(shard * n, range_begin, range_end);
  const int64_t e = std::clamp((shard + 1) * n, range_begin, range_end);
  return {b, e};
}

RangeVolumes reduce_scatter_range_volumes(int64_t range_begin, int64_t range_end, int64_t n, int size, int rank) {
  // The ring reduce-scatter: rank q sends every chunk but its own and receives every chunk but that
  // of rank q - 1 (gloo_communicator.cpp, ring_reduce_scatter).
  RangeVolumes v;
  if (size == 1) return v;
  const int prev = (rank + size - 1) % size;
  for (int c = 0; c < size; ++c) {
    const RangeShare s = shard_share(range_begin, range_end, n, c);
    if (c != rank) v.sent += s.end - s.begin;
    if (c != prev) v.received += s.end - s.begin;
  }
  return v;
}

std::unique_ptr<Communicator> make_communicator(Backend backend, TcpStore& store, const std::string& name,
                                                const std::vector<int>& global_ranks, int my_global_rank,
                                                CommOptions options) {
  switch (backend) {
    case Backend::gloo:
      return std::make_unique<GlooCommunicator>(store, name, global_ranks, my_global_rank, options);
    case Backend::nccl:
#ifdef LONGTRAIN_HAS_CUDA
      return std::make_unique<NcclCommunicator>(store, name, global_ranks, my_global_rank, options);
#else
      LT_FAIL("communicator '{}': the NCCL backend is not in this build (longtrain was built without CUDA; "
              "configure with -DLONGTRAIN_CUDA=ON on a machine with CUDA and NCCL); use the Gloo backend with CPU "
              "tensors",
              name);
#endif
  }
  LT_FAIL("unknown communicator backend {}", static_cast<int>(backend));
}

Tensor Communicator::host_values_staging(int64_t n) {
  if (!host_values_ || host_values_->get("values").numel() < n) {
    host_values_ = std::make_unique<Arena>(fmt::format("host values of '{}'", name_), device());
    host_values_->add("values", {std::max<int64_t>(n, 16)}, DType::f64);
    host_values_->allocate();
  }
  return host_values_->get("values").narrow(0, n);
}

void all_reduce_host_values(Communicator& comm, double* values, int64_t n, ReduceOp op) {
  Tensor host(values, DType::f64, {n});
  if (comm.device() == Device::cpu) return comm.all_reduce(host, op);
  const Tensor staging = comm.host_values_staging(n);
  copy(staging, host);
  comm.all_reduce(staging, op);
  copy(host, staging);
}

}  // namespace longtrain::parallel

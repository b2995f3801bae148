#include "parallel/gloo_communicator.h"

#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <thread>
#include <type_traits>

#include <fmt/format.h>
#include <gloo/barrier.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include "parallel/comm_progress.h"
#include "parallel/store.h"
#include "runtime/error.h"

namespace longtrain::parallel {

namespace {

using Clock = std::chrono::steady_clock;
using gloo::transport::UnboundBuffer;

// Slots tell Gloo which send matches which receive between two ranks. Gloo's own collectives use
// prefixes 0x01..0x08 in the top byte; ours use two more, so they never collide.
constexpr uint64_t kP2PSlotPrefix = 0x10;
constexpr uint64_t kCollectiveSlotPrefix = 0x11;

// The k-th message (1-based) between an ordered pair of ranks.
uint64_t p2p_slot(uint64_t k) { return (kP2PSlotPrefix << 56) | (k & ((uint64_t{1} << 56) - 1)); }
// Step `step` of collective number `seq` on this communicator.
uint64_t collective_slot(uint64_t seq, uint64_t step) {
  return (kCollectiveSlotPrefix << 56) | ((seq & ((uint64_t{1} << 36) - 1)) << 20) | (step & 0xfffff);
}

Millis time_left(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<Millis>(deadline - Clock::now());
  return std::max(left, Millis(1));
}

// acc[i] := op(acc[i], in[i]) for i < n.
using ReduceFn = void (*)(void* acc, const void* in, size_t n);

template <class T>
void reduce_sum(void* acc_, const void* in_, size_t n) {
  T* acc = static_cast<T*>(acc_);
  const T* in = static_cast<const T*>(in_);
  if constexpr (std::is_same_v<T, int32_t>) {
    // Wrap around like NCCL instead of signed-overflow undefined behaviour.
    for (size_t i = 0; i < n; ++i)
      acc[i] = static_cast<int32_t>(static_cast<uint32_t>(acc[i]) + static_cast<uint32_t>(in[i]));
  } else {
    for (size_t i = 0; i < n; ++i) acc[i] += in[i];
  }
}

template <class T>
void reduce_max(void* acc_, const void* in_, size_t n) {
  T* acc = static_cast<T*>(acc_);
  const T* in = static_cast<const T*>(in_);
  for (size_t i = 0; i < n; ++i) {
    if constexpr (std::is_floating_point_v<T>) {
      // NaN wins, so a grad-norm or overflow check sees a NaN from any rank.
      if (!std::isnan(acc[i]) && (std::isnan(in[i]) || in[i] > acc[i])) acc[i] = in[i];
    } else {
      if (in[i] > acc[i]) acc[i] = in[i];
    }
  }
}

// The reduction in the dtype the ring computes in (bf16 computes in f32).
ReduceFn reduce_fn(DType compute, ReduceOp op) {
  const bool sum = op == ReduceOp::sum;
  switch (compute) {
    case DType::f32: return sum ? reduce_sum<float> : reduce_max<float>;
    case DType::f64: return sum ? reduce_sum<double> : reduce_max<double>;
    case DType::i32: return sum ? reduce_sum<int32_t> : reduce_max<int32_t>;
    case DType::bf16: break;
  }
  LT_FAIL("no reduction computes in {}", dtype_name(compute));
}

std::vector<float> widen_bf16(const Tensor& t) {
  std::vector<float> wide(static_cast<size_t>(t.numel()));
  const bf16* p = static_cast<const bf16*>(t.data);
  for (size_t i = 0; i < wide.size(); ++i) wide[i] = static_cast<float>(p[i]);
  return wide;
}

void narrow_to_bf16(const float* src, void* dst, size_t n) {
  bf16* p = static_cast<bf16*>(dst);
  for (size_t i = 0; i < n; ++i) p[i] = bf16(src[i]);
}

// One Gloo TCP device per address, shared by every communicator of the process (each device runs
// one I/O thread).
std::shared_ptr<gloo::transport::Device> shared_device(const std::string& host, const std::string& iface) {
  static std::mutex mu;
  static std::map<std::string, std::shared_ptr<gloo::transport::Device>> devices;
  std::lock_guard lock(mu);
  const std::string key = iface.empty() ? "host:" + host : "iface:" + iface;
  auto& dev = devices[key];
  if (!dev) {
    gloo::transport::tcp::attr attr;
    if (!iface.empty()) {
      attr.iface = iface;
    } else {
      attr.hostname = host;
    }
    try {
      dev = gloo::transport::tcp::CreateDevice(attr);
    } catch (const std::exception& e) {
      LT_FAIL("cannot create the Gloo TCP device on {} ({}); set LONGTRAIN_GLOO_IFNAME to the network interface or "
              "LONGTRAIN_GLOO_HOST to the address the ranks should use",
              iface.empty() ? host : "interface " + iface, e.what());
    }
  }
  return dev;
}

// Our TcpStore as Gloo's rendezvous store, under a per-communicator key prefix.
class StoreForGloo final : public gloo::rendezvous::Store {
 public:
  StoreForGloo(TcpStore& store, std::string prefix, Millis timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}
  void set(const std::string& key, const std::vector<char>& data) override {
    store_.set(prefix_ + key, std::string_view(data.data(), data.size()));
  }
  std::vector<char> get(const std::string& key) override {
    std::string v = store_.get(prefix_ + key, timeout_);
    return {v.begin(), v.end()};
  }
  void wait(const std::vector<std::string>& keys) override { wait(keys, timeout_); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(prefix_ + k);
    store_.wait(full, timeout);
  }

 private:
  TcpStore& store_;
  std::string prefix_;
  Millis timeout_;
};

}  // namespace

// ------------------------------------------------------------------------------------------------

struct GlooCommunicator::Impl {
  GlooCommunicator& self;
  TcpStore& store;
  const std::string prefix;  // "lt/comm/<name>/<generation>/"
  std::shared_ptr<gloo::rendezvous::Context> ctx;
  const int rank;
  const int size;

  uint64_t seq = 0;       // number of the current (last entered) collective, 1-based
  CommProgress progress;  // published through the store once the group is connected

  std::optional<std::string> broken;

  Impl(GlooCommunicator& s, TcpStore& st, std::string p)
      : self(s), store(st), prefix(std::move(p)), rank(s.rank()), size(s.size()), progress(s, st, prefix) {}

  void check_usable() const {
    LT_CHECK(!broken, "communicator {} is unusable after an earlier failure on this rank: {}", self.describe_group(),
             *broken);
  }

  // Runs one collective: numbers it, publishes progress, turns a transport failure into an error
  // naming the ranks that did not arrive.
  template <class Body>
  void collective(const char* op, const std::string& args, Body&& body) {
    check_usable();
    const uint64_t s = ++seq;
    progress.enter(op, s);
    self.count_collective();
    const auto start = Clock::now();
    try {
      body(s, start + self.timeout());
    } catch (const std::exception& e) {
      store.mark_failing();
      wait_for_peer_progress();
      const std::string diagnosis = progress.diagnose_collective(
          s, "every rank of the group reached this collective, so the connection between them failed");
      fail(fmt::format("{} #{} ({}) on communicator {}", op, s, args, self.describe_group()), start, e.what(),
           diagnosis);
    }
    progress.mark_completed(s);
  }

  [[noreturn]] void fail(const std::string& what, Clock::time_point start, const std::string& transport_error,
                         const std::string& diagnosis) {
    const auto ms = std::chrono::duration_cast<Millis>(Clock::now() - start).count();
    std::string message = fmt::format("{} failed on rank {} after {} ms (timeout {} ms): {}. Transport error: {}",
                                      what, self.ranks_[rank], ms, self.timeout().count(), diagnosis,
                                      transport_error);
    broken = message;
    store.report_failure(message);
    LT_FAIL("{}", message);
  }

  std::string diagnose_p2p(P2POp::Kind kind, int peer, uint64_t k) {
    wait_for_peer_progress();
    const int g = self.ranks_[peer];
    const int me = self.ranks_[rank];
    try {
      if (std::optional<std::string> missing = progress.missing_transfer(kind, peer, k)) return *missing;
    } catch (const std::exception& e) {
      return fmt::format("rank {}'s progress could not be read from the store ({}){}", g, e.what(),
                         progress.known_failure());
    }
    if (kind == P2POp::Kind::recv) {
      return fmt::format("rank {} posted send #{} to rank {}, so the connection between them failed{}", g, k, me,
                         progress.known_failure());
    }
    return fmt::format("rank {} posted receive #{} from rank {}, so the connection between them failed{}", g, k, me,
                       progress.known_failure());
  }

  [[noreturn]] void fail_p2p(P2POp::Kind kind, int peer, uint64_t k, Clock::time_point start,
                             const std::string& transport_error) {
    const bool recv = kind == P2POp::Kind::recv;
    store.mark_failing();
    const std::string diagnosis = diagnose_p2p(kind, peer, k);
    fail(fmt::format("{} #{} {} rank {} on communicator {}", recv ? "recv" : "send", k, recv ? "from" : "to",
                     self.ranks_[peer], self.describe_group()),
         start, transport_error, diagnosis);
  }

  std::unique_ptr<UnboundBuffer> buffer(void* data, size_t bytes) { return ctx->createUnboundBuffer(data, bytes); }

  // Ring reduce-scatter in place over `data` split at `begin` (element offsets): afterwards chunk
  // `rank` holds the reduction over all ranks; the other chunks hold partial sums.
  // Step s: send chunk (rank-s-1) to the next rank, receive chunk (rank-s-2) from the previous one
  // and reduce it into ours.
  void ring_reduce_scatter(char* data, size_t elem, const std::vector<int64_t>& begin, ReduceFn fn, uint64_t s,
                           Clock::time_point deadline) {
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    int64_t max_chunk = 0;
    for (int c = 0; c < size; ++c) max_chunk = std::max(max_chunk, begin[c + 1] - begin[c]);
    auto buf = buffer(data, static_cast<size_t>(begin[size]) * elem);
    std::vector<char> tmp(static_cast<size_t>(max_chunk) * elem);
    auto tmp_buf = buffer(tmp.data(), tmp.size());
    for (int step = 0; step < size - 1; ++step) {
      const int cs = ((rank - step - 1) % size + size) % size;
      const int cr = ((rank - step - 2) % size + size) % size;
      const size_t send_bytes = static_cast<size_t>(begin[cs + 1] - begin[cs]) * elem;
      const size_t recv_bytes = static_cast<size_t>(begin[cr + 1] - begin[cr]) * elem;
      const uint64_t slot = collective_slot(s, step);
      if (recv_bytes > 0) tmp_buf->recv(prev, slot, 0, recv_bytes);
      if (send_bytes > 0) {
        buf->send(next, slot, static_cast<size_t>(begin[cs]) * elem, send_bytes);
        self.count_sent(static_cast<int64_t>(send_bytes));
      }
      if (recv_bytes > 0) {
        tmp_buf->waitRecv(time_left(deadline));
        self.count_received(static_cast<int64_t>(recv_bytes));
        fn(data + static_cast<size_t>(begin[cr]) * elem, tmp.data(), recv_bytes / elem);
      }
      if (send_bytes > 0) buf->waitSend(time_left(deadline));
    }
  }

  // Ring all-gather in place: rank r starts with chunk r and ends with every chunk.
  // Step s: send chunk (rank-s) to the next rank, receive chunk (rank-s-1) from the previous one.
  void ring_all_gather(char* data, size_t elem, const std::vector<int64_t>& begin, uint64_t s, uint64_t step0,
                       Clock::time_point deadline) {
    const int next = (rank + 1) % size, prev = (rank + size - 1) % size;
    auto buf = buffer(data, static_cast<size_t>(begin[size]) * elem);
    for (int step = 0; step < size - 1; ++step) {
      const int cs = ((rank - step) % size + size) % size;
      const int cr = ((rank - step - 1) % size + size) % size;
      const size_t send_bytes = static_cast<size_t>(begin[cs + 1] - begin[cs]) * elem;
      const size_t recv_bytes = static_cast<size_t>(begin[cr + 1] - begin[cr]) * elem;
      const uint64_t slot = collective_slot(s, step0 + step);
      if (recv_bytes > 0) buf->recv(prev, slot, static_cast<size_t>(begin[cr]) * elem, recv_bytes);
      if (send_bytes > 0) {
        buf->send(next, slot, static_cast<size_t>(begin[cs]) * elem, send_bytes);
        self.count_sent(static_cast<int64_t>(send_bytes));
      }
      if (recv_bytes > 0) {
        buf->waitRecv(time_left(deadline));
        self.count_received(static_cast<int64_t>(recv_bytes));
      }
      if (send_bytes > 0) buf->waitSend(time_left(deadline));
    }
  }
};

// ------------------------------------------------------------------------------------------------

GlooCommunicator::GlooCommunicator(TcpStore& store, const std::string& name, std::vector<int> global_ranks,
                                   int my_global_rank, CommOptions options)
    : Communicator(name, global_ranks, -1, options.timeout) {
  rank_ = group_rank_of(*this, my_global_rank);
  impl_ = std::make_unique<Impl>(*this, store, communicator_prefix("lt/comm/", name));
  if (size() == 1) return;

  // A peer that died makes writes to its socket fail; that must be an error, not a SIGPIPE death.
  struct sigaction old{};
  if (::sigaction(SIGPIPE, nullptr, &old) == 0 && old.sa_handler == SIG_DFL) std::signal(SIGPIPE, SIG_IGN);

  // Join: every member announces itself, so a missing one is named before Gloo's own exchange.
  const auto start = Clock::now();
  join_group(*this, store, impl_->prefix, fmt::format("pid {}", ::getpid()), my_global_rank);

  const char* ifname = std::getenv("LONGTRAIN_GLOO_IFNAME");
  const char* host = std::getenv("LONGTRAIN_GLOO_HOST");
  auto device = shared_device(host && *host ? host : store.local_address(), ifname ? ifname : "");
  impl_->ctx = std::make_shared<gloo::rendezvous::Context>(rank_, size());
  const auto left = timeout_ - std::chrono::duration_cast<Millis>(Clock::now() - start);
  impl_->ctx->setTimeout(std::max(left, Millis(1000)));
  try {
    StoreForGloo gloo_store(store, impl_->prefix + "gloo/", timeout_);
    impl_->ctx->connectFullMesh(gloo_store, device);
  } catch (const std::exception& e) {
    LT_FAIL("creating communicator {} on rank {}: connecting the Gloo pairs failed: {}", describe_group(),
            my_global_rank, e.what());
  }
  impl_->ctx->setTimeout(timeout_);
  impl_->progress.publish();
}

GlooCommunicator::~GlooCommunicator() = default;  // ~CommProgress stops publishing

void GlooCommunicator::all_reduce(Tensor t, ReduceOp op) {
  check_comm_tensor("all_reduce", t, Device::cpu);
  const int64_t n = t.numel();
  impl_->collective("all_reduce", fmt::format("{}, {}", reduce_op_name(op), t.describe()),
                    [&](uint64_t s, Clock::time_point deadline) {
                      if (size() == 1 || n == 0) return;
                      const auto begin = balanced_split(n, size());
                      if (t.dtype == DType::bf16) {
                        std::vector<float> wide = widen_bf16(t);
                        char* data = reinterpret_cast<char*>(wide.data());
                        impl_->ring_reduce_scatter(data, sizeof(float), begin, reduce_fn(DType::f32, op), s, deadline);
                        impl_->ring_all_gather(data, sizeof(float), begin, s, size(), deadline);
                        narrow_to_bf16(wide.data(), t.data, wide.size());
                      } else {
                        char* data = static_cast<char*>(t.data);
                        const size_t elem = dtype_size(t.dtype);
                        impl_->ring_reduce_scatter(data, elem, begin, reduce_fn(t.dtype, op), s, deadline);
                        impl_->ring_all_gather(data, elem, begin, s, size(), deadline);
                      }
                    });
}

void GlooCommunicator::reduce_scatter(Tensor out, Tensor in, ReduceOp op) {
  const int64_t n = check_reduce_scatter(*this, out, in, Device::cpu);
  impl_->collective(
      "reduce_scatter", fmt::format("{}, {} -> {}", reduce_op_name(op), in.describe(), out.describe()),
      [&](uint64_t s, Clock::time_point deadline) {
        const size_t elem = dtype_size(in.dtype);
        if (size() == 1 || n == 0) {
          if (out.data != in.data) std::memmove(out.data, in.data, static_cast<size_t>(n) * elem);
          return;
        }
        const auto begin = balanced_split(n * size(), size());
        const size_t chunk_offset = static_cast<size_t>(begin[rank_]);
        if (in.dtype == DType::bf16) {
          std::vector<float> work = widen_bf16(in);
          impl_->ring_reduce_scatter(reinterpret_cast<char*>(work.data()), sizeof(float), begin,
                                     reduce_fn(DType::f32, op), s, deadline);
          narrow_to_bf16(work.data() + chunk_offset, out.data, static_cast<size_t>(n));
        } else {
          // The ring reduces in place, and the input must stay as it was: work on a copy.
          std::vector<char> work(static_cast<char*>(in.data), static_cast<char*>(in.data) + in.nbytes());
          impl_->ring_reduce_scatter(work.data(), elem, begin, reduce_fn(in.dtype, op), s, deadline);
          std::memcpy(out.data, work.data() + chunk_offset * elem, static_cast<size_t>(n) * elem);
        }
      });
}

void GlooCommunicator::all_gather(Tensor out, Tensor in) {
  const int64_t n = check_all_gather(*this, out, in, Device::cpu);
  impl_->collective("all_gather", fmt::format("{} -> {}", in.describe(), out.describe()),
                    [&](uint64_t s, Clock::time_point deadline) {
                      const size_t elem = dtype_size(in.dtype);
                      char* mine = static_cast<char*>(out.data) + static_cast<size_t>(rank_ * n) * elem;
                      if (mine != in.data) std::memmove(mine, in.data, static_cast<size_t>(n) * elem);
                      if (size() == 1 || n == 0) return;
                      impl_->ring_all_gather(static_cast<char*>(out.data), elem, balanced_split(n * size(), size()),
                                             s, 0, deadline);
                    });
}

namespace {

// Gloo's collectives complete before they return.
class DoneWork final : public CollectiveWork {
 public:
  void wait() override {}
};

}  // namespace

std::unique_ptr<CollectiveWork> GlooCommunicator::start_reduce_scatter_range(Tensor flat, int64_t begin, int64_t end,
                                                                             ReduceOp op) {
  const int64_t n = check_reduce_scatter_range(*this, flat, begin, end, Device::cpu);
  impl_->collective(
      "reduce_scatter_range",
      fmt::format("{}, [{}, {}) of {}", reduce_op_name(op), begin, end, flat.describe()),
      [&](uint64_t s, Clock::time_point deadline) {
        if (size() == 1 || begin == end) return;
        // The ring of reduce_scatter over the bucket: chunk c is the bucket's part of shard c (often
        // empty), so every element is summed in the same order as by reduce_scatter (bit for bit).
        std::vector<int64_t> chunk_begin(static_cast<size_t>(size()) + 1);
        for (int c = 0; c < size(); ++c) chunk_begin[c] = shard_share(begin, end, n, c).begin - begin;
        chunk_begin[size()] = end - begin;
        const RangeShare mine = shard_share(begin, end, n, rank_);
        const size_t elem = dtype_size(flat.dtype);
        const Tensor bucket = flat.narrow(0, begin, end - begin);
        if (flat.dtype == DType::bf16) {
          std::vector<float> work = widen_bf16(bucket);
          impl_->ring_reduce_scatter(reinterpret_cast<char*>(work.data()), sizeof(float), chunk_begin,
                                     reduce_fn(DType::f32, op), s, deadline);
          narrow_to_bf16(work.data() + (mine.begin - begin), static_cast<char*>(flat.data) + mine.begin * elem,
                         static_cast<size_t>(mine.end - mine.begin));
        } else {
          // The ring leaves partial sums in the other ranks' parts: it works on a copy, so they stay
          // as they were (as with NCCL's reduce).
          const char* src = static_cast<const char*>(bucket.data);
          std::vector<char> work(src, src + bucket.nbytes());
          impl_->ring_reduce_scatter(work.data(), elem, chunk_begin, reduce_fn(flat.dtype, op), s, deadline);
          std::memcpy(static_cast<char*>(flat.data) + mine.begin * elem, work.data() + (mine.begin - begin) * elem,
                      static_cast<size_t>(mine.end - mine.begin) * elem);
        }
      });
  return std::make_unique<DoneWork>();
}

void GlooCommunicator::broadcast(Tensor t, int root) {
  check_comm_tensor("broadcast", t, Device::cpu);
  LT_CHECK(root >= 0 && root < size(), "broadcast on {}: root {} is outside [0, {})", describe_group(), root, size());
  impl_->collective("broadcast", fmt::format("{}, root {}", t.describe(), root),
                    [&](uint64_t s, Clock::time_point deadline) {
                      const size_t bytes = t.nbytes();
                      if (size() == 1 || bytes == 0) return;
                      auto buf = impl_->buffer(t.data, bytes);
                      if (rank_ == root) {
                        for (int p = 0; p < size(); ++p) {
                          if (p == root) continue;
                          buf->send(p, collective_slot(s, p));
                          count_sent(static_cast<int64_t>(bytes));
                        }
                        for (int p = 0; p < size() - 1; ++p) buf->waitSend(time_left(deadline));
                      } else {
                        buf->recv(root, collective_slot(s, rank_));
                        buf->waitRecv(time_left(deadline));
                        count_received(static_cast<int64_t>(bytes));
                      }
                    });
}

void GlooCommunicator::barrier() {
  impl_->collective("barrier", "no data", [&](uint64_t s, Clock::time_point deadline) {
    if (size() == 1) return;
    gloo::BarrierOptions opts(impl_->ctx);
    opts.setTag(static_cast<uint32_t>(s));
    opts.setTimeout(time_left(deadline));
    gloo::barrier(opts);
  });
}

// ------------------------------------------------------------------------------------------------

namespace {

class GlooP2PWork final : public P2PWork {
 public:
  struct Item {
    P2POp::Kind kind;
    int peer;
    uint64_t k;  // message number between this rank and peer, in this direction
    std::unique_ptr<UnboundBuffer> buf;
  };

  explicit GlooP2PWork(GlooCommunicator::Impl* impl) : impl_(impl) {}
  ~GlooP2PWork() override {
    // After a failure of the communicator (this batch's or another call's), the error is on its way
    // up and the process will stop; waiting would only add the timeout.
    if (waited_ || impl_->broken) return;
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[longtrain] a send/recv batch destroyed without wait() failed: %s\n", e.what());
    }
  }

  void wait() override {
    if (waited_) return;
    waited_ = true;
    const auto start = Clock::now();
    const auto deadline = start + impl_->self.timeout();
    for (auto& item : items) {
      try {
        if (item.kind == P2POp::Kind::recv) {
          item.buf->waitRecv(time_left(deadline));
        } else {
          item.buf->waitSend(time_left(deadline));
        }
      } catch (const std::exception& e) {
        impl_->fail_p2p(item.kind, item.peer, item.k, start, e.what());
      }
    }
  }

  std::vector<Item> items;

 private:
  GlooCommunicator::Impl* impl_;
  bool waited_ = false;
};

}  // namespace

std::unique_ptr<P2PWork> GlooCommunicator::start_p2p(std::span<const P2POp> ops) {
  check_p2p_ops(*this, ops, Device::cpu);
  impl_->check_usable();
  auto work = std::make_unique<GlooP2PWork>(impl_.get());
  const auto start = Clock::now();
  for (const P2POp& op : ops) {
    const size_t bytes = op.tensor.nbytes();
    if (bytes == 0) continue;  // the matching side skips it too: sizes match
    const bool send = op.kind == P2POp::Kind::send;
    const uint64_t k = send ? impl_->progress.count_send(op.peer) : impl_->progress.count_recv(op.peer);
    try {
      // Posting fails at once when the connection to the peer is already broken.
      GlooP2PWork::Item item{op.kind, op.peer, k, impl_->buffer(op.tensor.data, bytes)};
      if (send) {
        item.buf->send(op.peer, p2p_slot(k));
      } else {
        item.buf->recv(op.peer, p2p_slot(k));
      }
      work->items.push_back(std::move(item));
    } catch (const std::exception& e) {
      impl_->fail_p2p(op.kind, op.peer, k, start, e.what());
    }
    if (send) {
      count_sent(static_cast<int64_t>(bytes));
    } else {
      count_received(static_cast<int64_t>(bytes));
    }
    count_p2p(1);
  }
  return work;
}

}  // namespace longtrain::parallel

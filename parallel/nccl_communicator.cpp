#include "parallel/nccl_communicator.h"

#include <cuda_runtime_api.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "parallel/comm_progress.h"
#include "parallel/store.h"
#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace longtrain::parallel {

namespace {

using Clock = std::chrono::steady_clock;

// How often the watchdog looks at the queued operations and NCCL's asynchronous error.
constexpr Millis kWatchdogInterval{5};

ncclDataType_t nccl_dtype(DType dtype) {
  switch (dtype) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::i32: return ncclInt32;
  }
  LT_FAIL("no NCCL type for dtype {}", dtype_name(dtype));
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::sum ? ncclSum : ncclMax; }

std::string nccl_error_text(ncclResult_t r, ncclComm_t comm) {
  const char* last = comm != nullptr ? ncclGetLastError(comm) : nullptr;
  return fmt::format("{} (ncclResult {}){}", ncclGetErrorString(r), static_cast<int>(r),
                     last != nullptr && *last != '\0' ? fmt::format(": {}", last) : "");
}

// Set once any NCCL communicator of this process failed: the others then abort at destruction
// instead of waiting for peers that may be gone.
std::atomic<bool> g_a_communicator_failed{false};

// A CUDA event without timing, shared by the watchdog's queue entry and a P2PWork.
struct Event {
  cudaEvent_t e = nullptr;
  Event() { LT_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  ~Event() {
    if (e != nullptr) cudaEventDestroy(e);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};
using EventPtr = std::shared_ptr<Event>;

// One transfer of a send/recv batch: its direction, group-rank peer and number k (the k-th message
// between this rank and the peer in that direction).
struct Transfer {
  P2POp::Kind kind;
  int peer;
  uint64_t k;
};

// One operation queued on the communication stream, as the watchdog follows it.
struct Queued {
  std::string what;                 // "all_reduce #3 (sum, f32[1031] cuda)"
  uint64_t seq = 0;                 // collective number; 0 for a send/recv batch
  std::vector<Transfer> transfers;  // of a send/recv batch
  EventPtr ready;                   // on the compute stream: the work queued before it is done
  EventPtr done;                    // on the communication stream: the operation is done
  Millis timeout{0};
  std::optional<Clock::time_point> started;  // when the watchdog saw that it could start
};

// The first failure of a communicator, shared with the thread that ends the process when no call
// collects it (that thread may outlive the communicator).
struct Failure {
  std::mutex mu;
  std::string message;
  std::atomic<bool> claimed{false};    // someone is reporting a failure (the first one wins)
  std::atomic<bool> written{false};    // message holds it
  std::atomic<bool> delivered{false};  // a call on this rank threw it
};

}  // namespace

// ------------------------------------------------------------------------------------------------

struct NcclCommunicator::Impl {
  NcclCommunicator& self;
  TcpStore& store;
  const std::string prefix;  // "lt/nccl/<name>/<generation>/"
  const int rank;
  const int size;
  int device = 0;

  ncclComm_t comm = nullptr;       // null for a group of one, and once aborted or destroyed
  cudaStream_t stream = nullptr;   // the communication stream
  int32_t* barrier_word = nullptr; // device int the barrier all-reduces

  // Every NCCL call on comm from the caller's thread, the watchdog's error poll, and the abort.
  std::mutex nccl_mu;
  std::mutex queue_mu;
  std::deque<Queued> queue;  // operations not yet seen complete, in stream order

  uint64_t seq = 0;      // number of the last collective entered, 1-based
  uint64_t batches = 0;  // send/recv batches started
  // Published through the store (the Gloo backend's format): entered counts collectives queued by
  // the host, completed those the watchdog saw finish on the device.
  CommProgress progress;

  std::shared_ptr<Failure> failure = std::make_shared<Failure>();

  std::thread watchdog;
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopping = false;

  Impl(NcclCommunicator& s, TcpStore& st, std::string p)
      : self(s), store(st), prefix(std::move(p)), rank(s.rank()), size(s.size()), progress(s, st, prefix) {}

  ~Impl() {
    stop_watchdog();
    progress.unpublish();
    if (comm != nullptr) ncclCommAbort(comm);  // orderly shutdown already happened when it could
    if (barrier_word != nullptr) cudaFree(barrier_word);
    if (stream != nullptr) cudaStreamDestroy(stream);
  }

  void mark_completed(uint64_t s) { progress.mark_completed(s); }

  // Numbers a collective and publishes that this rank entered it.
  Queued begin_collective(const char* op, const std::string& args) {
    const uint64_t s = ++seq;
    progress.enter(op, s);
    self.count_collective();
    Queued q;
    q.what = fmt::format("{} #{} ({})", op, s, args);
    q.seq = s;
    q.timeout = self.timeout();
    return q;
  }

  void check_device() const {
    int current = -1;
    LT_CUDA_CHECK(cudaGetDevice(&current));
    LT_CHECK(current == device,
             "communicator {}: the calling thread's current CUDA device is {}, but the communicator lives on device "
             "{}; call cudaSetDevice({}) in this thread first",
             self.describe_group(), current, device, device);
  }

  // ---- failures ---------------------------------------------------------------------------------

  // Throws the communicator's failure, if there is one (waiting for its message while the watchdog
  // is still writing it). The first throw on this rank carries the message itself.
  void throw_if_failed() {
    if (!failure->claimed.load()) return;
    while (!failure->written.load()) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    std::string message;
    {
      std::lock_guard lock(failure->mu);
      message = failure->message;
    }
    if (failure->delivered.exchange(true)) {
      LT_FAIL("communicator {} is unusable after an earlier failure on this rank: {}", self.describe_group(),
              message);
    }
    LT_FAIL("{}", message);
  }

  std::string diagnose_p2p(const std::vector<Transfer>& transfers) {
    std::vector<std::string> notes;
    try {
      for (const Transfer& t : transfers) {
        if (std::optional<std::string> note = progress.missing_transfer(t.kind, t.peer, t.k)) notes.push_back(*note);
      }
    } catch (const std::exception& e) {
      return fmt::format("the peers' progress could not be read from the store ({}){}", e.what(),
                         progress.known_failure());
    }
    if (notes.empty()) {
      return "every peer posted its side of these transfers, so they are stuck on a device or the connection "
             "between the GPUs failed" +
             progress.known_failure();
    }
    return fmt::format("{}", fmt::join(notes, "; "));
  }

  // The failure message for operation q; also tells the store this rank is failing on its own, so a
  // peer's report does not cut the message short.
  std::string describe_failure(const Queued& q, Clock::time_point start, const std::string& cause) {
    store.mark_failing();
    wait_for_peer_progress();
    const std::string diagnosis =
        q.seq > 0 ? progress.diagnose_collective(
                        q.seq, "every rank of the group queued this collective, so it is stuck on a device (a rank's "
                               "GPU work queued before it has not finished) or the connection between the GPUs failed")
        : !q.transfers.empty() ? diagnose_p2p(q.transfers)
                               : "no operation of this rank was in flight" + progress.known_failure();
    const auto ms = std::chrono::duration_cast<Millis>(Clock::now() - start).count();
    return fmt::format("{} on communicator {} failed on rank {} after {} ms (timeout {} ms): {}. {}", q.what,
                       self.describe_group(), self.ranks_[rank], ms, q.timeout.count(), diagnosis, cause);
  }

  void write_failure(const std::string& message) {
    g_a_communicator_failed = true;
    {
      std::lock_guard lock(failure->mu);
      failure->message = message;
    }
    failure->written = true;
    store.report_failure(message);
  }

  // Needs nccl_mu. Ends the stuck kernels and frees the communicator.
  void abort_locked() {
    if (comm == nullptr) return;
    ncclCommAbort(comm);
    comm = nullptr;
  }

  // The caller's thread, holding nccl_mu: fails the communicator and throws.
  [[noreturn]] void fail_now(const Queued& q, Clock::time_point start, const std::string& cause) {
    if (!failure->claimed.exchange(true)) {
      write_failure(describe_failure(q, start, cause));
      abort_locked();
    }
    throw_if_failed();
    LT_FAIL("communicator {} failed", self.describe_group());  // not reached: a failure was claimed
  }

  // ---- queueing ---------------------------------------------------------------------------------

  // Waits out ncclInProgress after a call on the non-blocking communicator (the operation is then
  // on the stream), bounded by the operation's timeout; an error fails the communicator. NCCL
  // launches every call of a non-blocking communicator from a thread of its own and answers
  // ncclInProgress until that thread is done (tens of microseconds), so the first milliseconds are
  // polled without sleeping: a sleep costs ~60 us (timer slack), as much as a 2 MiB all_reduce.
  void settle(ncclResult_t r, const Queued& q, Clock::time_point start) {
    while (r == ncclInProgress) {
      ncclResult_t state = ncclInProgress;
      const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
      if (got != ncclSuccess) {
        r = got;
        break;
      }
      r = state;
      if (r != ncclInProgress) break;
      if (Clock::now() - start > q.timeout) {
        fail_now(q, start,
                 "NCCL had not finished queueing it (still ncclInProgress, as when it waits for the peers to set up "
                 "connections); the communicator was aborted");
      }
      if (Clock::now() - start < std::chrono::milliseconds(2)) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(50));
      }
    }
    if (r != ncclSuccess) fail_now(q, start, "NCCL error: " + nccl_error_text(r, comm));
  }

  // Queues one operation: the communication stream waits for the compute stream, `launch` issues
  // the NCCL call(s) on the communication stream, and (when compute_waits) the compute stream waits
  // for them. Returns the operation's completion event.
  template <class Launch>
  EventPtr run(Queued q, bool compute_waits, Launch&& launch) {
    std::lock_guard lock(nccl_mu);
    throw_if_failed();
    LT_CHECK(comm != nullptr, "communicator {} was shut down", self.describe_group());
    check_device();
    const auto start = Clock::now();
    const cudaStream_t compute = cudaStreamPerThread;
    q.ready = std::make_shared<Event>();
    q.done = std::make_shared<Event>();
    LT_CUDA_CHECK(cudaEventRecord(q.ready->e, compute));
    LT_CUDA_CHECK(cudaStreamWaitEvent(stream, q.ready->e, 0));
    settle(launch(), q, start);
    LT_CUDA_CHECK(cudaEventRecord(q.done->e, stream));
    if (compute_waits) LT_CUDA_CHECK(cudaStreamWaitEvent(compute, q.done->e, 0));
    EventPtr done = q.done;
    std::lock_guard qlock(queue_mu);
    queue.push_back(std::move(q));
    return done;
  }

  // Blocks the host until `e` completed, throwing the communicator's failure instead if there is
  // one. The watchdog bounds it: a stuck operation fails the communicator within its timeout.
  void host_wait(cudaEvent_t e) {
    for (int i = 0;; ++i) {
      throw_if_failed();
      const cudaError_t q = cudaEventQuery(e);
      if (q == cudaSuccess) {
        throw_if_failed();  // an abort also completes the event: the failure, written first, wins
        return;
      }
      LT_CHECK(q == cudaErrorNotReady, "communicator {}: waiting for its operations failed: {}", self.describe_group(),
               cudaGetErrorString(q));
      if (i < 2000) {
        std::this_thread::yield();
      } else {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
      }
    }
  }

  // ---- watchdog ---------------------------------------------------------------------------------

  void start_watchdog() {
    watchdog = std::thread([this] {
      cudaSetDevice(device);
      std::unique_lock lock(stop_mu);
      while (!stopping) {
        stop_cv.wait_for(lock, kWatchdogInterval);
        if (stopping || failure->claimed.load()) continue;
        lock.unlock();
        poll();
        lock.lock();
      }
    });
  }

  void stop_watchdog() {
    {
      std::lock_guard lock(stop_mu);
      stopping = true;
    }
    stop_cv.notify_all();
    if (watchdog.joinable()) watchdog.join();
  }

  // One look: retire completed operations, start the clock of the one that can now run, and fail
  // the communicator when it ran past its timeout or NCCL reported an asynchronous error.
  void poll() {
    ncclResult_t async = ncclSuccess;
    {
      // The caller's thread holds nccl_mu while it queues; its own bound covers that time.
      std::unique_lock lock(nccl_mu, std::try_to_lock);
      if (lock.owns_lock() && comm != nullptr) {
        const ncclResult_t got = ncclCommGetAsyncError(comm, &async);
        if (got != ncclSuccess) async = got;
      }
    }
    std::optional<Queued> failing;
    std::string cause;
    Clock::time_point start = Clock::now();
    {
      std::lock_guard lock(queue_mu);
      const auto now = Clock::now();
      while (!queue.empty()) {
        Queued& head = queue.front();
        const cudaError_t d = cudaEventQuery(head.done->e);
        if (d == cudaSuccess) {
          if (head.seq > 0) mark_completed(head.seq);
          queue.pop_front();
          continue;
        }
        if (d != cudaErrorNotReady) {
          failing = head;
          cause = fmt::format("CUDA error while it ran: {}", cudaGetErrorString(d));
          start = head.started.value_or(now);
          break;
        }
        if (!head.started && cudaEventQuery(head.ready->e) == cudaSuccess) head.started = now;
        if (head.started && now - *head.started > head.timeout) {
          failing = head;
          cause = "It did not complete on the device in time; the communicator was aborted";
          start = *head.started;
        }
        break;
      }
      if (!failing && async != ncclSuccess && async != ncclInProgress) {
        if (!queue.empty()) {
          failing = queue.front();
          start = queue.front().started.value_or(now);
        } else {
          Queued none;
          none.what = "no operation in flight";
          none.timeout = self.timeout();
          failing = none;
        }
        cause = "NCCL reported an asynchronous error: " + nccl_error_text(async, nullptr) +
                "; the communicator was aborted";
      }
    }
    if (!failing || failure->claimed.exchange(true)) return;
    write_failure(describe_failure(*failing, start, cause));
    // After an abort the device has consumed garbage: the rank must not carry on unaware.
    std::thread([f = failure, me = self.ranks_[rank]] {
      std::this_thread::sleep_for(kUncollectedFailureGrace);
      if (f->delivered.load()) return;
      std::string message;
      {
        std::lock_guard lock(f->mu);
        message = f->message;
      }
      std::fprintf(stderr, "[longtrain] rank %d: %s\n[longtrain] rank %d: no call collected this failure within %lld ms; exiting\n",
                   me, message.c_str(), me, static_cast<long long>(kUncollectedFailureGrace.count()));
      std::fflush(stderr);
      std::_Exit(1);
    }).detach();
    std::lock_guard lock(nccl_mu);
    abort_locked();
  }

  // ---- shutdown ---------------------------------------------------------------------------------

  // Waits for the queued work (bounded by the timeout), then finalizes and destroys the NCCL
  // communicator; aborts it instead when that does not finish in time.
  void shut_down() {
    std::lock_guard lock(nccl_mu);
    if (comm == nullptr) return;
    const auto deadline = Clock::now() + self.timeout();
    auto abort_with = [&](const std::string& why) {
      std::fprintf(stderr, "[longtrain] rank %d: communicator %s: %s; aborting it\n", self.ranks_[rank],
                   self.describe_group().c_str(), why.c_str());
      abort_locked();
    };
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) return abort_with(fmt::format("its stream failed: {}", cudaGetErrorString(q)));
      if (Clock::now() > deadline) return abort_with("its queued operations did not finish within the timeout");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    ncclResult_t r = ncclCommFinalize(comm);
    while (r == ncclInProgress) {
      ncclResult_t state = ncclInProgress;
      const ncclResult_t got = ncclCommGetAsyncError(comm, &state);
      r = got != ncclSuccess ? got : state;
      if (r == ncclInProgress && Clock::now() > deadline) return abort_with("ncclCommFinalize did not finish in time");
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    if (r != ncclSuccess) return abort_with("ncclCommFinalize failed: " + nccl_error_text(r, comm));
    ncclCommDestroy(comm);
    comm = nullptr;
  }
};

// ------------------------------------------------------------------------------------------------

NcclCommunicator::NcclCommunicator(TcpStore& store, const std::string& name, std::vector<int> global_ranks,
                                   int my_global_rank, CommOptions options)
    : Communicator(name, global_ranks, -1, options.timeout) {
  rank_ = group_rank_of(*this, my_global_rank);
  impl_ = std::make_unique<Impl>(*this, store, communicator_prefix("lt/nccl/", name));
  LT_CUDA_CHECK(cudaGetDevice(&impl_->device));
  if (size() == 1) return;  // no NCCL communicator: every operation is local

  // Join: every member announces itself, so a missing one is named before NCCL's own exchange.
  const auto start = Clock::now();
  join_group(*this, store, impl_->prefix, fmt::format("pid {} gpu {}", ::getpid(), impl_->device), my_global_rank);

  // The unique id: created by group rank 0, one per communicator, handed over through the store.
  ncclUniqueId id;
  const std::string id_key = impl_->prefix + "id";
  // Several communicators of this process can have work in flight at once (the gradient reduction on
  // the world overlaps attention's transfers on the sequence-parallel group, each on its own stream).
  // NCCL kernels wait for their peers, so every GPU must run them in the same order: NCCL then orders
  // launches across communicators as the host issued them, which is the same on every rank. Set
  // before NCCL reads its environment (its first call) and only once, before any NCCL thread exists
  // that could read the environment concurrently; a user's own setting wins.
  static std::once_flag launch_order_once;
  std::call_once(launch_order_once, [] { ::setenv("NCCL_LAUNCH_ORDER_IMPLICIT", "1", /*overwrite=*/0); });
  if (rank_ == 0) {
    const ncclResult_t r = ncclGetUniqueId(&id);
    LT_CHECK(r == ncclSuccess, "creating communicator {}: ncclGetUniqueId failed: {}", describe_group(),
             nccl_error_text(r, nullptr));
    store.set(id_key, std::string_view(id.internal, sizeof(id.internal)));
  } else {
    const std::string v = store.get(id_key, timeout_);
    LT_CHECK(v.size() == sizeof(id.internal), "creating communicator {}: the NCCL unique id under '{}' has {} bytes, not {}",
             describe_group(), id_key, v.size(), sizeof(id.internal));
    std::memcpy(id.internal, v.data(), sizeof(id.internal));
  }

  // Communication gets the highest stream priority, so its kernels are scheduled ahead of compute
  // kernels waiting for SMs (it needs few of them, and everything else waits for it).
  int lowest = 0, highest = 0;
  LT_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
  LT_CUDA_CHECK(cudaStreamCreateWithPriority(&impl_->stream, cudaStreamNonBlocking, highest));
  LT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&impl_->barrier_word), sizeof(int32_t)));
  LT_CUDA_CHECK(cudaMemset(impl_->barrier_word, 0, sizeof(int32_t)));

  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // calls return at once; the watchdog keeps the timeouts
  ncclResult_t r = ncclCommInitRankConfig(&impl_->comm, size(), id, rank_, &config);
  while (r == ncclInProgress) {
    ncclResult_t state = ncclInProgress;
    const ncclResult_t got = ncclCommGetAsyncError(impl_->comm, &state);
    r = got != ncclSuccess ? got : state;
    if (r == ncclInProgress && Clock::now() - start > timeout_) {
      LT_FAIL("creating communicator {} on rank {}: NCCL did not finish initializing within {} ms although every "
              "rank joined (is every rank on its own GPU, and can the GPUs reach each other?)",
              describe_group(), my_global_rank, timeout_.count());  // ~Impl aborts the communicator
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  LT_CHECK(r == ncclSuccess, "creating communicator {} on rank {} (GPU {}): ncclCommInitRankConfig failed: {}",
           describe_group(), my_global_rank, impl_->device, nccl_error_text(r, impl_->comm));

  impl_->progress.publish();
  impl_->start_watchdog();
}

NcclCommunicator::~NcclCommunicator() {
  if (!impl_) return;
  impl_->stop_watchdog();
  // On an error path (an exception unwinding, this communicator or another rank failed) the peers
  // may never finish their side: abort (in ~Impl) rather than wait for them.
  const bool failing = std::uncaught_exceptions() > 0 || g_a_communicator_failed.load() ||
                       impl_->store.peer_failure().has_value();
  if (!failing) impl_->shut_down();
  impl_.reset();
}

int NcclCommunicator::cuda_device() const { return impl_->device; }

void NcclCommunicator::all_reduce(Tensor t, ReduceOp op) {
  check_comm_tensor("all_reduce", t, Device::cuda);
  const int64_t n = t.numel();
  Queued q = impl_->begin_collective("all_reduce", fmt::format("{}, {}", reduce_op_name(op), t.describe()));
  if (size() == 1 || n == 0) return impl_->mark_completed(q.seq);
  impl_->run(std::move(q), true, [&] {
    return ncclAllReduce(t.data, t.data, static_cast<size_t>(n), nccl_dtype(t.dtype), nccl_op(op), impl_->comm,
                         impl_->stream);
  });
  const auto begin = balanced_split(n, size());  // the Gloo ring's chunks: the same volumes
  const int64_t b = static_cast<int64_t>(dtype_size(t.dtype));
  auto chunk = [&](int c) { return begin[c + 1] - begin[c]; };
  count_sent(b * ((n - chunk(rank_)) + (n - chunk((rank_ + 1) % size()))));
  count_received(b * ((n - chunk((rank_ + size() - 1) % size())) + (n - chunk(rank_))));
}

void NcclCommunicator::reduce_scatter(Tensor out, Tensor in, ReduceOp op) {
  const int64_t n = check_reduce_scatter(*this, out, in, Device::cuda);
  const size_t elem = dtype_size(in.dtype);
  const char* in_begin = static_cast<const char*>(in.data);
  const char* mine = in_begin + static_cast<size_t>(rank_ * n) * elem;
  const char* out_begin = static_cast<const char*>(out.data);
  const bool overlap = out_begin < in_begin + in.nbytes() && in_begin < out_begin + out.nbytes();
  LT_CHECK(n == 0 || !overlap || out_begin == mine,
           "reduce_scatter on {}: the output {} overlaps the input {} without being this rank's slice of it (in place, "
           "the output must be in[rank * n, (rank + 1) * n))",
           describe_group(), out.describe(), in.describe());
  Queued q = impl_->begin_collective("reduce_scatter",
                                     fmt::format("{}, {} -> {}", reduce_op_name(op), in.describe(), out.describe()));
  if (size() == 1 || n == 0) {
    if (n > 0 && out.data != in.data) {
      LT_CUDA_CHECK(cudaMemcpyAsync(out.data, in.data, out.nbytes(), cudaMemcpyDeviceToDevice, cudaStreamPerThread));
    }
    return impl_->mark_completed(q.seq);
  }
  impl_->run(std::move(q), true, [&] {
    return ncclReduceScatter(in.data, out.data, static_cast<size_t>(n), nccl_dtype(in.dtype), nccl_op(op),
                             impl_->comm, impl_->stream);
  });
  const int64_t bytes = static_cast<int64_t>(size() - 1) * n * static_cast<int64_t>(elem);
  count_sent(bytes);
  count_received(bytes);
}

void NcclCommunicator::all_gather(Tensor out, Tensor in) {
  const int64_t n = check_all_gather(*this, out, in, Device::cuda);
  const size_t elem = dtype_size(in.dtype);
  char* out_begin = static_cast<char*>(out.data);
  char* mine = out_begin + static_cast<size_t>(rank_ * n) * elem;
  const char* in_begin = static_cast<const char*>(in.data);
  const bool overlap = in_begin < out_begin + out.nbytes() && out_begin < in_begin + in.nbytes();
  LT_CHECK(n == 0 || !overlap || in_begin == mine,
           "all_gather on {}: the input {} overlaps the output {} without being this rank's slice of it (in place, "
           "the input must be out[rank * n, (rank + 1) * n))",
           describe_group(), in.describe(), out.describe());
  Queued q = impl_->begin_collective("all_gather", fmt::format("{} -> {}", in.describe(), out.describe()));
  if (size() == 1 || n == 0) {
    if (n > 0 && mine != in.data) {
      LT_CUDA_CHECK(cudaMemcpyAsync(mine, in.data, in.nbytes(), cudaMemcpyDeviceToDevice, cudaStreamPerThread));
    }
    return impl_->mark_completed(q.seq);
  }
  impl_->run(std::move(q), true, [&] {
    return ncclAllGather(in.data, out.data, static_cast<size_t>(n), nccl_dtype(in.dtype), impl_->comm,
                         impl_->stream);
  });
  const int64_t bytes = static_cast<int64_t>(size() - 1) * n * static_cast<int64_t>(elem);
  count_sent(bytes);
  count_received(bytes);
}

void NcclCommunicator::broadcast(Tensor t, int root) {
  check_comm_tensor("broadcast", t, Device::cuda);
  LT_CHECK(root >= 0 && root < size(), "broadcast on {}: root {} is outside [0, {})", describe_group(), root, size());
  const int64_t n = t.numel();
  Queued q = impl_->begin_collective("broadcast", fmt::format("{}, root {}", t.describe(), root));
  if (size() == 1 || n == 0) return impl_->mark_completed(q.seq);
  impl_->run(std::move(q), true, [&] {
    return ncclBroadcast(t.data, t.data, static_cast<size_t>(n), nccl_dtype(t.dtype), root, impl_->comm,
                         impl_->stream);
  });
  const int64_t bytes = static_cast<int64_t>(t.nbytes());
  if (rank_ == root) {
    count_sent(static_cast<int64_t>(size() - 1) * bytes);
  } else {
    count_received(bytes);
  }
}

void NcclCommunicator::barrier() {
  Queued q = impl_->begin_collective("barrier", "no data");
  const uint64_t s = q.seq;
  if (size() == 1) return impl_->mark_completed(s);
  EventPtr done = impl_->run(std::move(q), true, [&] {
    return ncclAllReduce(impl_->barrier_word, impl_->barrier_word, 1, ncclInt32, ncclSum, impl_->comm, impl_->stream);
  });
  impl_->host_wait(done->e);
  impl_->mark_completed(s);
}

void NcclCommunicator::synchronize() {
  if (size() == 1) return;
  EventPtr last;
  {
    std::lock_guard lock(impl_->queue_mu);
    if (!impl_->queue.empty()) last = impl_->queue.back().done;
  }
  if (last) {
    impl_->host_wait(last->e);
  } else {
    impl_->throw_if_failed();
  }
}

// ------------------------------------------------------------------------------------------------

namespace {

// Makes the compute stream wait for `done` (null: nothing was queued).
void order_compute_after(NcclCommunicator::Impl* impl, const EventPtr& done) {
  impl->throw_if_failed();
  if (done) LT_CUDA_CHECK(cudaStreamWaitEvent(cudaStreamPerThread, done->e, 0));
}

// A queued collective or send/recv batch: wait() orders the compute stream after it (the host does
// not wait); dropping it unwaited orders it too, unless the communicator failed (the error is on its
// way up and the process will stop).
template <class Work>
class NcclWork final : public Work {
 public:
  NcclWork(NcclCommunicator::Impl* impl, EventPtr done, const char* what)
      : impl_(impl), done_(std::move(done)), what_(what) {}
  ~NcclWork() override {
    if (waited_ || !done_ || impl_->failure->claimed.load()) return;
    try {
      wait();
    } catch (const std::exception& e) {
      std::fprintf(stderr, "[longtrain] a %s destroyed without wait() failed: %s\n", what_, e.what());
    }
  }

  void wait() override {
    if (waited_) return;
    waited_ = true;
    order_compute_after(impl_, done_);
  }

 private:
  NcclCommunicator::Impl* impl_;
  EventPtr done_;
  const char* what_;
  bool waited_ = false;
};

}  // namespace

std::unique_ptr<CollectiveWork> NcclCommunicator::start_reduce_scatter_range(Tensor flat, int64_t begin, int64_t end,
                                                                             ReduceOp op) {
  const int64_t n = check_reduce_scatter_range(*this, flat, begin, end, Device::cuda);
  Queued q = impl_->begin_collective("reduce_scatter_range",
                                     fmt::format("{}, [{}, {}) of {}", reduce_op_name(op), begin, end, flat.describe()));
  if (size() == 1 || begin == end) {
    impl_->mark_completed(q.seq);
    return std::make_unique<NcclWork<CollectiveWork>>(impl_.get(), nullptr, "collective");
  }
  const size_t elem = dtype_size(flat.dtype);
  // Not ordered before compute queued later: that is the overlap (the caller's wait() orders it).
  EventPtr done = impl_->run(std::move(q), /*compute_waits=*/false, [&] {
    ncclResult_t first = ncclGroupStart();
    if (first != ncclSuccess) return first;
    for (int r = 0; r < size(); ++r) {
      const RangeShare s = shard_share(begin, end, n, r);
      if (s.begin == s.end) continue;
      // In place: the root's sendbuff is its recvbuff; the other ranks' buffers are only read.
      void* p = static_cast<char*>(flat.data) + static_cast<size_t>(s.begin) * elem;
      const ncclResult_t res = ncclReduce(p, p, static_cast<size_t>(s.end - s.begin), nccl_dtype(flat.dtype),
                                          nccl_op(op), r, impl_->comm, impl_->stream);
      if (first == ncclSuccess) first = res;
    }
    const ncclResult_t group_end = ncclGroupEnd();
    return first != ncclSuccess ? first : group_end;
  });
  const RangeVolumes v = reduce_scatter_range_volumes(begin, end, n, size(), rank_);
  count_sent(v.sent * static_cast<int64_t>(elem));
  count_received(v.received * static_cast<int64_t>(elem));
  return std::make_unique<NcclWork<CollectiveWork>>(impl_.get(), std::move(done), "collective");
}

// ------------------------------------------------------------------------------------------------

namespace {

const char* direction(P2POp::Kind kind) { return kind == P2POp::Kind::send ? "send" : "recv"; }

}  // namespace

std::unique_ptr<P2PWork> NcclCommunicator::start_p2p(std::span<const P2POp> ops) {
  check_p2p_ops(*this, ops, Device::cuda);
  Queued q;
  q.timeout = timeout();
  std::vector<std::string> parts;
  int64_t sent = 0, received = 0;
  for (const P2POp& op : ops) {
    if (op.tensor.nbytes() == 0) continue;  // the matching side skips it too: sizes match
    const bool send = op.kind == P2POp::Kind::send;
    const uint64_t k = send ? impl_->progress.count_send(op.peer) : impl_->progress.count_recv(op.peer);
    q.transfers.push_back({op.kind, op.peer, k});
    parts.push_back(fmt::format("{} #{} {} rank {}: {}", direction(op.kind), k, send ? "to" : "from", ranks_[op.peer],
                                op.tensor.describe()));
    (send ? sent : received) += static_cast<int64_t>(op.tensor.nbytes());
  }
  if (q.transfers.empty()) return std::make_unique<NcclWork<P2PWork>>(impl_.get(), nullptr, "send/recv batch");
  q.what = fmt::format("send/recv batch #{} ({})", ++impl_->batches, fmt::join(parts, ", "));
  const auto transfers = static_cast<int64_t>(q.transfers.size());
  // Bytes, not elements: a receive matches a send of the same byte size whatever the dtypes.
  EventPtr done = impl_->run(std::move(q), false, [&] {
    ncclResult_t first = ncclGroupStart();
    if (first != ncclSuccess) return first;
    for (const P2POp& op : ops) {
      const size_t bytes = op.tensor.nbytes();
      if (bytes == 0) continue;
      const ncclResult_t r = op.kind == P2POp::Kind::send
                                 ? ncclSend(op.tensor.data, bytes, ncclUint8, op.peer, impl_->comm, impl_->stream)
                                 : ncclRecv(op.tensor.data, bytes, ncclUint8, op.peer, impl_->comm, impl_->stream);
      if (first == ncclSuccess) first = r;
    }
    const ncclResult_t end = ncclGroupEnd();
    return first != ncclSuccess ? first : end;
  });
  count_sent(sent);
  count_received(received);
  count_p2p(transfers);
  return std::make_unique<NcclWork<P2PWork>>(impl_.get(), std::move(done), "send/recv batch");
}

// ------------------------------------------------------------------------------------------------

void select_local_cuda_device(int local_rank, int local_world_size) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  LT_CHECK(e == cudaSuccess, "the NCCL backend needs a GPU, but cudaGetDeviceCount failed: {}", cudaGetErrorString(e));
  LT_CHECK(n >= local_world_size,
           "{} ranks per node (LOCAL_WORLD_SIZE) but {} GPU(s) visible to this process: the NCCL backend needs one "
           "GPU per rank (start at most {} ranks per node, or check CUDA_VISIBLE_DEVICES)",
           local_world_size, n, n);
  LT_CHECK(local_rank >= 0 && local_rank < n, "LOCAL_RANK {} has no GPU ({} visible)", local_rank, n);
  LT_CUDA_CHECK(cudaSetDevice(local_rank));
}

int nccl_version() {
  int v = 0;
  const ncclResult_t r = ncclGetVersion(&v);
  LT_CHECK(r == ncclSuccess, "ncclGetVersion failed: {}", ncclGetErrorString(r));
  return v;
}

}  // namespace longtrain::parallel

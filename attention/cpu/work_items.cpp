// Threads for the CPU attention (attention/cpu/work_items.h).
//
// A small pool of helper threads that sleep on a condition variable between calls (they never spin,
// so they take no core from OpenBLAS between attention calls). The caller takes items too and returns
// as soon as every item has been taken and finished: it never waits for a helper that the scheduler has
// not run yet, which on a loaded machine would cost milliseconds per call. A helper that wakes late
// finds no job and sleeps again.
#include "attention/cpu/work_items.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <system_error>
#include <thread>

// OpenBLAS's thread controls. Its cblas.h declares them too; they are repeated here so that this file
// does not depend on which cblas.h the include path finds first (Debian can also install netlib's).
extern "C" {
void openblas_set_num_threads(int num_threads);
int openblas_get_num_threads(void);
}

namespace longtrain::attn::cpu {
namespace {

std::atomic<int> g_fixed_threads{0};  // set_attention_threads; 0 = follow OpenBLAS

// Holds OpenBLAS at one thread while any run_work_items is in progress and restores its count when the
// last one ends. openblas_set_num_threads is process-wide, hence the depth count: runs from two caller
// threads that overlap must not restore each other's "1".
class BlasHeldAtOneThread {
 public:
  BlasHeldAtOneThread() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (depth_++ == 0) {
      saved_ = openblas_get_num_threads();
      if (saved_ != 1) openblas_set_num_threads(1);
    }
  }
  ~BlasHeldAtOneThread() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (--depth_ == 0 && saved_ != 1) openblas_set_num_threads(saved_);
  }
  BlasHeldAtOneThread(const BlasHeldAtOneThread&) = delete;
  BlasHeldAtOneThread& operator=(const BlasHeldAtOneThread&) = delete;

 private:
  static inline std::mutex mutex_;
  static inline int depth_ = 0;
  static inline int saved_ = 1;
};

// One call of run_work_items as the pool sees it.
struct Job {
  const std::function<void(int64_t, int)>* body;
  int64_t n_items;
  int helpers_wanted;  // workers besides the caller
  std::atomic<int64_t> next{0};
  std::atomic<bool> failed{false};
  // Guarded by the pool's mutex:
  int helpers_joined = 0;  // helper k (1-based) is worker k
  int active = 0;          // helpers working on it now
  std::exception_ptr error;

  // Takes items until none is left (or one failed); records the first exception.
  void work(int worker, std::mutex& mutex) {
    try {
      while (!failed.load(std::memory_order_relaxed)) {
        const int64_t item = next.fetch_add(1, std::memory_order_relaxed);
        if (item >= n_items) break;
        (*body)(item, worker);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex);
      if (!error) error = std::current_exception();
      failed.store(true, std::memory_order_relaxed);
    }
  }
};

class WorkerPool {
 public:
  // Runs the job on the caller (worker 0) and up to job.helpers_wanted helper threads. Returns false,
  // having done nothing, when another run is in progress (a second caller thread, or a body that calls
  // run_work_items): the caller then runs its items alone.
  bool run(Job& job) {
    std::unique_lock<std::mutex> run_lock(run_mutex_, std::try_to_lock);
    if (!run_lock.owns_lock()) return false;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      while (started_ < job.helpers_wanted) {
        try {
          std::thread(&WorkerPool::helper_loop, this).detach();
        } catch (const std::system_error&) {
          break;  // no more threads to be had: fewer workers take every item
        }
        ++started_;
      }
      job_ = &job;
      ++generation_;
    }
    wake_.notify_all();
    job.work(0, mutex_);
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [&] { return job.active == 0; });
    job_ = nullptr;  // under the same lock as the check: no helper can join after this
    return true;
  }

 private:
  void helper_loop() {
    std::unique_lock<std::mutex> lock(mutex_);
    uint64_t seen = 0;
    for (;;) {
      wake_.wait(lock, [&] { return job_ != nullptr && generation_ != seen; });
      seen = generation_;
      Job& job = *job_;
      if (job.helpers_joined >= job.helpers_wanted) continue;
      const int worker = ++job.helpers_joined;
      ++job.active;
      lock.unlock();
      job.work(worker, mutex_);
      lock.lock();
      if (--job.active == 0) finished_.notify_all();
    }
  }

  std::mutex run_mutex_;  // one run at a time
  std::mutex mutex_;      // guards everything below and the Job fields marked so
  std::condition_variable wake_, finished_;
  Job* job_ = nullptr;
  uint64_t generation_ = 0;
  int started_ = 0;  // helper threads started (they live as long as the process)
};

// The process's pool. Never destroyed: its detached helpers wait on its members until the process
// exits. A child of fork() has none of the parent's helper threads, so it starts a pool of its own.
WorkerPool& pool() {
  static std::mutex mutex;
  static WorkerPool* instance = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(mutex);
  if (instance == nullptr || owner != ::getpid()) {
    instance = new WorkerPool;  // a parent's pool inherited through fork() is left behind, unusable
    owner = ::getpid();
  }
  return *instance;
}

}  // namespace

int attention_threads() {
  const int fixed = g_fixed_threads.load(std::memory_order_relaxed);
  return fixed > 0 ? fixed : std::max(1, openblas_get_num_threads());
}

void set_attention_threads(int n) { g_fixed_threads.store(std::max(0, n), std::memory_order_relaxed); }

int work_threads(int64_t n_items) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(attention_threads(), n_items)));
}

void run_work_items(int64_t n_items, int threads, const std::function<void(int64_t item, int worker)>& body) {
  if (n_items <= 0) return;
  threads = static_cast<int>(std::clamp<int64_t>(threads, 1, n_items));
  BlasHeldAtOneThread blas_one_thread;
  if (threads > 1) {
    Job job;
    job.body = &body;
    job.n_items = n_items;
    job.helpers_wanted = threads - 1;
    if (pool().run(job)) {
      if (job.error) std::rethrow_exception(job.error);
      return;
    }
  }
  for (int64_t item = 0; item < n_items; ++item) body(item, 0);
}

}  // namespace longtrain::attn::cpu

// Threads for the CPU attention (attention/cpu/local_attention.cpp): its work items (a query head ×
// a query tile in the forward, a KV head in the backward) run on a few threads, each item calling
// single-threaded OpenBLAS GEMMs. On the 2-core demo machine this was ~1.5x faster at T = 1024 (and
// ~1.1x at T = 256) than running the items on one thread and letting OpenBLAS thread each of their
// small GEMMs (64 query rows × keys × head_dim), since it also spreads the softmax's elementwise work;
// and OpenBLAS's threaded dgemm rounds differently from its single-threaded one, which would make
// results depend on the thread count.
//
// Results never depend on the thread count: every item writes outputs no other item touches, and an
// item's arithmetic does not depend on which thread runs it or when. The helper threads are a small
// pool that sleeps (never spins) between calls; a child of fork() starts its own.
#pragma once

#include <cstdint>
#include <functional>

namespace longtrain::attn::cpu {

// The threads the CPU attention may use: the last set_attention_threads(n) with n > 0, otherwise
// OpenBLAS's thread count (OPENBLAS_NUM_THREADS, OMP_NUM_THREADS, else the cores), so the setting
// that sizes the model's GEMMs sizes attention too.
int attention_threads();
// n > 0 fixes the count (tests compare 1, 2 and 3 threads); n <= 0 follows OpenBLAS again.
void set_attention_threads(int n);

// Threads that run_work_items uses for n_items items: min(attention_threads(), n_items), at least 1.
int work_threads(int64_t n_items);

// Calls body(item, worker) once for every item in [0, n_items) on `threads` threads, the calling
// thread being worker 0 and the others 1 .. threads-1 (a worker may index its own scratch by it).
// Items are taken in ascending order by whichever worker is free. OpenBLAS is held at one thread
// while the items run, with any number of workers: GEMMs inside items must not start threads of their
// own on top of the workers, and must round the same way whatever the thread count (OpenBLAS's
// threaded dgemm does not give the bits of its single-threaded one). The first exception an item throws is
// rethrown here once every worker has stopped; items not yet started are then skipped. Runs do not
// nest or overlap: a call made while another is running (from an item, or from another thread) runs
// its items on its own thread.
void run_work_items(int64_t n_items, int threads, const std::function<void(int64_t item, int worker)>& body);

}  // namespace longtrain::attn::cpu

// How many threads the CPU path uses: OpenBLAS's pool, which the CPU attention follows too.
#include <thread>

#include <cblas.h>

#include "kernels/ops.h"

namespace longtrain::ops {

void set_cpu_threads(int threads) {
  const int n = threads > 0 ? threads : static_cast<int>(std::thread::hardware_concurrency());
  openblas_set_num_threads(n > 0 ? n : 1);
}

int cpu_threads() { return openblas_get_num_threads(); }

}  // namespace longtrain::ops

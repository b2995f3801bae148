// Host-side helpers of the CUDA ops and the CUDA attention: argument checks, scratch buffers, the
// device-side "first bad index" flag, launch-size helpers. Plain C++ (no device code), so host-only
// translation units such as the cuDNN graph code (attention/cuda/cudnn_sdpa.cpp) can use it too.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "runtime/cuda_check.h"
#include "runtime/tensor.h"

namespace longtrain::cuda_util {

// ---- host-side argument checks ----------------------------------------------------------------

// t is a CUDA tensor with `ndim` dimensions whose last dimension is unit-stride.
inline void check_tensor(const Tensor& t, int ndim, const char* op, const char* name) {
  LT_CHECK(!t.empty(), "{}: {} is empty", op, name);
  LT_CHECK(t.device == Device::cuda, "{}: {} must be a CUDA tensor, got {}", op, name, t.describe());
  LT_CHECK(t.ndim == ndim, "{}: {} must have {} dimensions, got {}", op, name, ndim, t.describe());
  LT_CHECK(t.stride[ndim - 1] == 1, "{}: the last dimension of {} must be unit-stride, got {}", op, name,
           t.describe());
}

inline void check_dtype(const Tensor& t, DType dtype, const char* op, const char* name) {
  LT_CHECK(t.dtype == dtype, "{}: {} must be {}, got {}", op, name, dtype_name(dtype), t.describe());
}

// bf16 or f32 (the float types the CUDA ops store).
inline void check_float(const Tensor& t, const char* op, const char* name) {
  LT_CHECK(t.dtype == DType::bf16 || t.dtype == DType::f32, "{}: {} must be bf16 or f32 on CUDA, got {}", op,
           name, t.describe());
}

// ---- scratch memory ---------------------------------------------------------------------------

// Named, grow-only device buffers for intermediates (cuBLASLt workspace, logits chunks, partial sums,
// cuDNN workspaces). Everything runs on cuda_stream(), so a buffer can be reused by the next op
// without synchronisation; growing frees the old buffer (cudaFree waits for the device).
enum class Scratch : int {
  flag,             // the bad-index flag below
  cublas_workspace,
  logits,           // lm_head_cross_entropy: f32 logits of one chunk
  dlogits,          // lm_head_cross_entropy: d(loss)/d(logits) of one chunk
  partials,         // rmsnorm_backward: per-block dw partial sums; sum_squares, sum_into: per-block sums
  sum_result,       // sum_squares: the sum before it is read
  index_plan,       // embedding_backward: grouped token positions
  attn_workspace,   // cuDNN workspace
  attn_fwd_out,     // attention forward: bf16 O when the caller's O is f32
  attn_o_proxy,     // attention backward: the O stand-in built from delta, or an f32 O rounded to bf16
  attn_dq,          // attention backward: this block's dQ, dK, dV before they are accumulated
  attn_dk,
  attn_dv,
  attn_dq_accum,    // attention backward: the fp32 dQ accumulator (cuDNN's, or our Hopper kernel's)
  attn_softmax_sum, // attention backward: rowsum(dO * O) (cuDNN's, or the delta our Hopper kernel reads)
  attn_segments,    // segmented (document-masked) attention: per-segment lengths and ragged offsets
  count
};
void* scratch(Scratch which, size_t bytes);

// ---- the bad-index flag -----------------------------------------------------------------------

// Validation of token ids and labels happens on the device: a kernel atomicMin's the first bad
// position into a flag; the host reads it back once per call (one small synchronising copy).
constexpr int kNoBadIndex = 0x7f7f7f7f;  // what cudaMemset(0x7f) writes; larger than any position
int* reset_bad_index_flag();               // sets the flag to kNoBadIndex and returns it
int read_bad_index_flag();                 // waits for the stream; kNoBadIndex when all were valid

// Marks positions i in [0, n) whose values[i * stride] are outside [0, limit) and != allowed.
void find_bad_index(const int32_t* values, int64_t stride, int64_t n, int64_t limit, int32_t allowed,
                    int* flag);

// Reads one int32 from device memory (for error messages).
int32_t read_device_int(const int32_t* p);

inline int num_sms() {
  static int n = [] {
    int dev = 0, v = 0;
    LT_CUDA_CHECK(cudaGetDevice(&dev));
    LT_CUDA_CHECK(cudaDeviceGetAttribute(&v, cudaDevAttrMultiProcessorCount, dev));
    return v;
  }();
  return n;
}

// A grid for row-wise elementwise kernels that loop `for (r = blockIdx.y; r < rows; r += gridDim.y)` and
// `for (c = blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += gridDim.x * blockDim.x)`.
inline dim3 grid_2d(int64_t rows, int64_t cols, int threads) {
  int64_t gx = (cols + threads - 1) / threads;
  if (gx < 1) gx = 1;
  if (gx > 65536) gx = 65536;
  int64_t gy = rows < 1 ? 1 : (rows > 65535 ? 65535 : rows);
  return dim3(static_cast<unsigned>(gx), static_cast<unsigned>(gy));
}

// The widest vector access (elements per thread: 8 for bf16, 4 for f32; 16 bytes either way) that rows
// of `cols` columns allow in every tensor (2-d with unit column stride, or 1-d contiguous): cols, the
// row strides and the base addresses in multiples of it. 4 (8-byte bf16 accesses) when only that fits,
// 0 when not even 4 does (the scalar kernels).
inline int vector_width(int64_t cols, std::initializer_list<const Tensor*> tensors) {
  int width = 8;
  for (const Tensor* t : tensors)
    if (dtype_size(t->dtype) != 2) width = 4;
  for (; width >= 4; width /= 2) {
    bool ok = cols % width == 0;
    for (const Tensor* t : tensors) {
      const size_t align = static_cast<size_t>(width) * dtype_size(t->dtype);
      const bool rows_ok = t->ndim == 2 ? t->stride[0] % width == 0 && t->stride[1] == 1 : t->stride[0] == 1;
      ok = ok && rows_ok && reinterpret_cast<uintptr_t>(t->data) % align == 0;
    }
    if (ok) return width;
  }
  return 0;
}

inline unsigned blocks_for(int64_t n, int threads, int64_t cap = 65535LL * 16) {
  int64_t b = (n + threads - 1) / threads;
  if (b < 1) b = 1;
  return static_cast<unsigned>(b < cap ? b : cap);
}

}  // namespace longtrain::cuda_util

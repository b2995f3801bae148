// CUDA kernels of the distributed attention's buffer operations (distributed_buffers.h): fill, copy
// and add over two views of one shape, bf16 or f32 on either side, arithmetic in f32.
//
// The views are first collapsed: size-1 dims are dropped and a dim is merged into the one inside it
// when both views step over it contiguously, leaving rows of n contiguous elements indexed by up to
// three leading dims. A fully contiguous pair (zeroing an accumulator, adding one received
// accumulator into another) becomes one flat range and runs grid-stride; a strided one (packing K/V
// out of the fused QKV buffer, writing dQ into the fused dQKV buffer) runs one warp per row of
// head_dim elements (a block per row when rows are long). Four elements per access (8-byte bf16,
// 16-byte f32) when n, the strides and both base addresses allow it. Pure memory traffic.
#include "attention/cuda/distributed_buffers.h"

#include <algorithm>
#include <type_traits>

#include "kernels/cuda/cuda_common.cuh"

namespace longtrain::attn::dist::cuda {

using namespace longtrain::cuda_util;

namespace {

constexpr int kThreads = 256;

enum class Op { fill, copy, add };

// Rows of n contiguous elements; row = (i0·d1 + i1)·d2 + i2 starts at i0·s0 + i1·s1 + i2·s2.
struct Geom {
  int64_t rows = 1, n = 0;
  int64_t d1 = 1, d2 = 1;
  int64_t ds0 = 0, ds1 = 0, ds2 = 0;  // dst strides (elements)
  int64_t ss0 = 0, ss1 = 0, ss2 = 0;  // src strides
  int lanes = 32;                     // threads per row: 32 (a warp) or kThreads (a block)
};

// One access of 4 (VEC) or 1 element: d := value | s | d + s.
template <Op OP, bool VEC, class D, class S>
__device__ __forceinline__ void apply(D* d, const S* s, float value) {
  float y[4] = {value, value, value, value};
  if constexpr (VEC) {
    if constexpr (OP != Op::fill) load4(s, y);
    if constexpr (OP == Op::add) {
      float x[4];
      load4(d, x);
#pragma unroll
      for (int i = 0; i < 4; ++i) y[i] = x[i] + y[i];
    }
    store4(d, y);
  } else {
    if constexpr (OP != Op::fill) y[0] = to_float(s[0]);
    if constexpr (OP == Op::add) y[0] = to_float(d[0]) + y[0];
    d[0] = from_float<D>(y[0]);
  }
}

template <Op OP, bool VEC, class D, class S>
__global__ void flat_kernel(D* dst, const S* src, int64_t n, float value) {
  constexpr int64_t step = VEC ? 4 : 1;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x * step;
  for (int64_t i = (blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x) * step; i < n; i += stride)
    apply<OP, VEC>(dst + i, src + i, value);
}

template <Op OP, bool VEC, class D, class S>
__global__ void rows_kernel(D* dst, const S* src, Geom g, float value) {
  constexpr int64_t step = VEC ? 4 : 1;
  const int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  const int64_t row = t / g.lanes;
  if (row >= g.rows) return;
  const int64_t lane = t - row * g.lanes;
  const int64_t i2 = row % g.d2, r = row / g.d2, i1 = r % g.d1, i0 = r / g.d1;
  D* d = dst + i0 * g.ds0 + i1 * g.ds1 + i2 * g.ds2;
  const S* s = src + i0 * g.ss0 + i1 * g.ss1 + i2 * g.ss2;
  for (int64_t c = lane * step; c < g.n; c += g.lanes * step) apply<OP, VEC>(d + c, s + c, value);
}

// The views as collapsed groups, innermost first: (size, dst stride, src stride); group 0 has unit
// stride in both.
struct Group {
  int64_t size, ds, ss;
};

int collapse(const Tensor& dst, const Tensor& src, Group (&g)[kMaxDims]) {
  const int nd = dst.ndim;
  int n = 0;
  g[n++] = {dst.shape[nd - 1], 1, 1};  // a last dim of size 1 may have any stride: it is never stepped
  for (int d = nd - 2; d >= 0; --d) {
    const int64_t size = dst.shape[d];
    if (size == 1) continue;
    Group& in = g[n - 1];
    if (dst.stride[d] == in.ds * in.size && src.stride[d] == in.ss * in.size) {
      in.size *= size;
    } else {
      g[n++] = {size, dst.stride[d], src.stride[d]};
    }
  }
  return n;
}

template <Op OP, class D, class S>
void launch(const Tensor& dst, const Tensor& src, double value_d) {
  const float value = static_cast<float>(value_d);
  D* dp = static_cast<D*>(dst.data);
  const S* sp = static_cast<const S*>(src.data);
  Group g[kMaxDims];
  const int groups = collapse(dst, src, g);
  auto aligned = [](const void* p, size_t elem) { return reinterpret_cast<uintptr_t>(p) % (4 * elem) == 0; };
  bool vec = g[0].size % 4 == 0 && aligned(dp, sizeof(D)) && aligned(sp, sizeof(S));
  if (groups == 1) {
    const int64_t n = g[0].size;
    const int64_t threads_needed = (n + (vec ? 3 : 0)) / (vec ? 4 : 1);
    const unsigned blocks = blocks_for(threads_needed, kThreads, int64_t{num_sms()} * 32);
    if (vec) {
      flat_kernel<OP, true><<<blocks, kThreads, 0, cuda_stream()>>>(dp, sp, n, value);
    } else {
      flat_kernel<OP, false><<<blocks, kThreads, 0, cuda_stream()>>>(dp, sp, n, value);
    }
    LT_CUDA_LAUNCH_CHECK("distributed attention flat_kernel");
    return;
  }
  Geom geo;
  geo.n = g[0].size;
  // Leading groups outermost first into (i0, i1, i2); absent ones have size 1.
  int64_t size[3] = {1, 1, 1}, ds[3] = {0, 0, 0}, ss[3] = {0, 0, 0};
  for (int i = 1; i < groups; ++i) {
    const int slot = 3 - i;  // group 1 (innermost leading) -> i2
    size[slot] = g[i].size;
    ds[slot] = g[i].ds;
    ss[slot] = g[i].ss;
    vec = vec && g[i].ds % 4 == 0 && g[i].ss % 4 == 0;
  }
  geo.rows = size[0] * size[1] * size[2];
  geo.d1 = size[1];
  geo.d2 = size[2];
  geo.ds0 = ds[0], geo.ds1 = ds[1], geo.ds2 = ds[2];
  geo.ss0 = ss[0], geo.ss1 = ss[1], geo.ss2 = ss[2];
  geo.lanes = geo.n > 32 * 4 * 8 ? kThreads : 32;
  const int64_t total = geo.rows * geo.lanes;
  const auto blocks = static_cast<unsigned>((total + kThreads - 1) / kThreads);
  if (vec) {
    rows_kernel<OP, true><<<blocks, kThreads, 0, cuda_stream()>>>(dp, sp, geo, value);
  } else {
    rows_kernel<OP, false><<<blocks, kThreads, 0, cuda_stream()>>>(dp, sp, geo, value);
  }
  LT_CUDA_LAUNCH_CHECK("distributed attention rows_kernel");
}

template <Op OP>
void run(const char* op, const Tensor& dst, const Tensor& src, double value) {
  if (dst.numel() == 0) return;
  LT_CHECK(dst.device == Device::cuda && src.device == Device::cuda, "{}: {} and {} must both be CUDA tensors", op,
           dst.describe(), src.describe());
  dispatch_float(dst.dtype, op, [&](auto dt) {
    using D = typename decltype(dt)::type;
    if constexpr (OP == Op::fill) {
      launch<OP, D, D>(dst, dst, value);
    } else {
      dispatch_float(src.dtype, op, [&](auto st) { launch<OP, D, typename decltype(st)::type>(dst, src, value); });
    }
  });
}

}  // namespace

void fill_tensor(Tensor t, double value) { run<Op::fill>("fill_tensor", t, t, value); }
void copy_tensor(Tensor dst, Tensor src) { run<Op::copy>("copy_tensor", dst, src, 0.0); }
void add_tensor(Tensor dst, Tensor src) { run<Op::add>("add_tensor", dst, src, 0.0); }

}  // namespace longtrain::attn::dist::cuda

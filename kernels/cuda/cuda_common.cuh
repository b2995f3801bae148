// Device-side helpers shared by the CUDA ops (kernels/cuda/*.cu) and the CUDA attention kernels:
// the float/bf16 dispatch, conversions, 4-element vector accesses and block reductions. Host-side
// helpers are in cuda_host.h.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/cuda_host.h"

namespace longtrain::cuda_util {

// ---- dtype dispatch ---------------------------------------------------------------------------

template <class T> struct TypeTag {
  using type = T;
};

// Calls f(TypeTag<float>) or f(TypeTag<__nv_bfloat16>) by dtype.
template <class F> void dispatch_float(DType dtype, const char* op, F&& f) {
  switch (dtype) {
    case DType::f32: f(TypeTag<float>{}); return;
    case DType::bf16: f(TypeTag<__nv_bfloat16>{}); return;
    default: LT_FAIL("{}: dtype {} is not supported on CUDA (bf16 or f32)", op, dtype_name(dtype));
  }
}

// ---- device-side helpers ----------------------------------------------------------------------

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// Four consecutive elements as floats, in one 16-byte (f32) or 8-byte (bf16) access; p must be
// aligned to 4 elements.
__device__ __forceinline__ void load4(const float* p, float (&v)[4]) {
  const float4 x = *reinterpret_cast<const float4*>(p);
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w;
}
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float (&v)[4]) {
  const uint2 x = *reinterpret_cast<const uint2*>(p);
  const float2 a = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.x));
  const float2 b = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&x.y));
  v[0] = a.x, v[1] = a.y, v[2] = b.x, v[3] = b.y;
}
__device__ __forceinline__ void store4(float* p, const float (&v)[4]) {
  *reinterpret_cast<float4*>(p) = make_float4(v[0], v[1], v[2], v[3]);
}
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float (&v)[4]) {
  __nv_bfloat162 a = __floats2bfloat162_rn(v[0], v[1]), b = __floats2bfloat162_rn(v[2], v[3]);
  uint2 x;
  x.x = *reinterpret_cast<uint32_t*>(&a);
  x.y = *reinterpret_cast<uint32_t*>(&b);
  *reinterpret_cast<uint2*>(p) = x;
}

// N consecutive elements as floats in 16-byte accesses where that is N's width (N = 8 bf16 or 4 f32;
// N = 4 bf16 is one 8-byte access, N = 8 f32 two 16-byte ones); p must be aligned to N elements.
template <int N, class T> __device__ __forceinline__ void load_n(const T* p, float (&v)[N]) {
  static_assert(N == 4 || N == 8, "load_n: 4 or 8 elements");
  if constexpr (N == 4) {
    load4(p, v);
  } else if constexpr (sizeof(T) == 2) {
    const uint4 x = *reinterpret_cast<const uint4*>(p);
    const uint32_t w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[i]));
      v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
  } else {
    load4(p, *reinterpret_cast<float(*)[4]>(&v[0]));
    load4(p + 4, *reinterpret_cast<float(*)[4]>(&v[4]));
  }
}
template <int N, class T> __device__ __forceinline__ void store_n(T* p, const float (&v)[N]) {
  static_assert(N == 4 || N == 8, "store_n: 4 or 8 elements");
  if constexpr (N == 4) {
    store4(p, v);
  } else if constexpr (sizeof(T) == 2) {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      __nv_bfloat162 b = __floats2bfloat162_rn(v[2 * i], v[2 * i + 1]);
      w[i] = *reinterpret_cast<uint32_t*>(&b);
    }
    *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
  } else {
    store4(p, *reinterpret_cast<const float(*)[4]>(&v[0]));
    store4(p + 4, *reinterpret_cast<const float(*)[4]>(&v[4]));
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// The summation order is fixed, so results are bitwise reproducible. `scratch` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // scratch may still be read by a previous call
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : 0.0f;
  return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  v = warp_max(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  v = lane < nwarps ? scratch[lane] : -INFINITY;
  return warp_max(v);
}

}  // namespace longtrain::cuda_util

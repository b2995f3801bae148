// SwiGLU on CUDA: elementwise over the fused gate/up GEMM output, fp32 math, one thread per output.
#include "kernels/backends.h"
#include "kernels/cuda/cuda_common.cuh"

namespace longtrain::ops::cuda {

using namespace longtrain::cuda_util;

namespace {

// out [T, F] = silu(gate) * up, gate = gate_up[:, :F], up = gate_up[:, F:]
template <class T>
__global__ void swiglu_forward_kernel(T* out, int64_t out_rs, const T* gate_up, int64_t gu_rs, int64_t n_rows,
                                      int64_t F) {
  for (int64_t t = blockIdx.y; t < n_rows; t += gridDim.y)
  for (int64_t f = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; f < F; f += (int64_t)gridDim.x * blockDim.x) {
    const float g = to_float(gate_up[t * gu_rs + f]);
    const float u = to_float(gate_up[t * gu_rs + F + f]);
    out[t * out_rs + f] = from_float<T>(g / (1.0f + expf(-g)) * u);
  }
}

// d_gate = d_out * up * sig(g) * (1 + g * (1 - sig(g))),  d_up = d_out * silu(g)
template <class T>
__global__ void swiglu_backward_kernel(T* d_gate_up, int64_t dgu_rs, const T* d_out, int64_t do_rs, const T* gate_up,
                                       int64_t gu_rs, int64_t n_rows, int64_t F) {
  for (int64_t t = blockIdx.y; t < n_rows; t += gridDim.y)
  for (int64_t f = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; f < F; f += (int64_t)gridDim.x * blockDim.x) {
    const float g = to_float(gate_up[t * gu_rs + f]);
    const float u = to_float(gate_up[t * gu_rs + F + f]);
    const float d = to_float(d_out[t * do_rs + f]);
    const float sig = 1.0f / (1.0f + expf(-g));
    d_gate_up[t * dgu_rs + f] = from_float<T>(d * u * sig * (1.0f + g * (1.0f - sig)));
    d_gate_up[t * dgu_rs + F + f] = from_float<T>(d * g * sig);
  }
}

void check_pair(const char* op, const Tensor& half, const char* half_name, const Tensor& full, const char* full_name) {
  check_tensor(half, 2, op, half_name);
  check_tensor(full, 2, op, full_name);
  check_float(full, op, full_name);
  LT_CHECK(half.dtype == full.dtype, "{}: {} {} and {} {} must have the same dtype", op, half_name, half.describe(),
           full_name, full.describe());
  LT_CHECK(full.size(0) == half.size(0) && full.size(1) == 2 * half.size(1),
           "{}: {} {} must be [T, 2F] for {} {} [T, F]", op, full_name, full.describe(), half_name, half.describe());
}

}  // namespace

void swiglu_forward(Tensor out, Tensor gate_up) {
  const char* op = "swiglu_forward";
  check_pair(op, out, "out", gate_up, "gate_up");
  const int64_t T = out.size(0), F = out.size(1);
  if (T * F == 0) return;
  dispatch_float(out.dtype, op, [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    swiglu_forward_kernel<T_><<<grid_2d(T, F, 256), 256, 0, cuda_stream()>>>(
        static_cast<T_*>(out.data), out.stride[0], static_cast<const T_*>(gate_up.data), gate_up.stride[0], T, F);
  });
  LT_CUDA_LAUNCH_CHECK("swiglu_forward_kernel");
}

void swiglu_backward(Tensor d_gate_up, Tensor d_out, Tensor gate_up) {
  const char* op = "swiglu_backward";
  check_pair(op, d_out, "d_out", gate_up, "gate_up");
  check_tensor(d_gate_up, 2, op, "d_gate_up");
  check_same_shape(d_gate_up, gate_up, op);
  LT_CHECK(d_gate_up.dtype == gate_up.dtype, "{}: d_gate_up {} must have gate_up's dtype", op, d_gate_up.describe());
  const int64_t T = d_out.size(0), F = d_out.size(1);
  if (T * F == 0) return;
  dispatch_float(d_out.dtype, op, [&](auto tag) {
    using T_ = typename decltype(tag)::type;
    swiglu_backward_kernel<T_><<<grid_2d(T, F, 256), 256, 0, cuda_stream()>>>(
        static_cast<T_*>(d_gate_up.data), d_gate_up.stride[0], static_cast<const T_*>(d_out.data), d_out.stride[0],
        static_cast<const T_*>(gate_up.data), gate_up.stride[0], T, F);
  });
  LT_CUDA_LAUNCH_CHECK("swiglu_backward_kernel");
}

}  // namespace longtrain::ops::cuda

// Helpers of the GPU tests: owning device tensors, uploads that round to the device dtype (the CPU
// reference then computes in double on exactly the values the GPU saw), downloads to double, the one
// tolerance per dtype, and the skip when no GPU is present.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "attention/local_attention.h"
#include "kernels/ops.h"
#include "runtime/device.h"
#include "runtime/tensor.h"
#include "test_util.h"

namespace longtrain {
// Test parameters print as their names.
inline void PrintTo(DType d, std::ostream* os) { *os << dtype_name(d); }
}  // namespace longtrain

namespace longtrain::test {

// The error a CUDA op may have against the double-precision CPU reference on the same inputs,
// measured as max|gpu - ref| / max|ref| (test::relative_error):
// - bf16 storage: outputs are rounded to bf16 (unit roundoff 2^-9, ulp 2^-8 at the top of a binade)
//   and inputs of GEMMs and of cuDNN's second matmuls (P, dS) are bf16 too; measured errors sit at
//   2e-3 .. 7e-3 (attention, docs/cudnn-sdpa.md), so 4 bf16 ulps = 1.5625e-2 leaves a 2x margin.
// - f32 storage: fp32 math throughout (no TF32); differences from the double reference are
//   summation order and expf/logf ulps, ~1e-6 relative; 1e-4 leaves room for long reductions.
inline double gpu_tolerance(DType storage) { return storage == DType::bf16 ? 4.0 / 256.0 : 1e-4; }

// Skips the test when longtrain was built without CUDA or no GPU is visible (CI).
#define LT_REQUIRE_GPU()                                                             \
  do {                                                                               \
    if (!::longtrain::cuda_available()) GTEST_SKIP() << "no CUDA device available"; \
  } while (0)

// CUDA memory owned by the test.
struct DeviceTensor {
  Tensor view;

  DeviceTensor(DType dtype, std::initializer_list<int64_t> shape) {
    Tensor probe(nullptr, dtype, shape, Device::cuda);
    view = probe;
    view.data = device_alloc(Device::cuda, probe.nbytes());
  }
  ~DeviceTensor() { device_free(Device::cuda, view.data); }
  DeviceTensor(const DeviceTensor&) = delete;
  DeviceTensor& operator=(const DeviceTensor&) = delete;
  operator Tensor() const { return view; }
};

// Uniform random doubles in [lo, hi), rounded to `dtype`.
inline std::vector<double> random_values(size_t n, uint64_t seed, DType dtype, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> v(n);
  for (double& x : v) x = round_to(dist(rng), dtype);
  return v;
}

// Copies values (converted to t's dtype) into the contiguous device tensor t.
inline void upload(const Tensor& t, const std::vector<double>& values) {
  ASSERT_EQ(static_cast<size_t>(t.numel()), values.size());
  const size_t n = values.size();
  std::vector<unsigned char> host(n * dtype_size(t.dtype));
  for (size_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case DType::bf16: reinterpret_cast<bf16*>(host.data())[i] = bf16(static_cast<float>(values[i])); break;
      case DType::f32: reinterpret_cast<float*>(host.data())[i] = static_cast<float>(values[i]); break;
      case DType::f64: reinterpret_cast<double*>(host.data())[i] = values[i]; break;
      case DType::i32: reinterpret_cast<int32_t*>(host.data())[i] = static_cast<int32_t>(values[i]); break;
    }
  }
  Tensor src = t;
  src.data = host.data();
  src.device = Device::cpu;
  copy(t, src);
}

inline void upload_ints(const Tensor& t, const std::vector<int32_t>& values) {
  ASSERT_EQ(t.dtype, DType::i32);
  ASSERT_EQ(static_cast<size_t>(t.numel()), values.size());
  Tensor src = t;
  src.data = const_cast<int32_t*>(values.data());
  src.device = Device::cpu;
  copy(t, src);
}

// A [T, heads, D] view of columns [col0, col0 + heads·D) of a [T, W] buffer (a Q, K or V slice of a
// fused QKV buffer, as the model's attention gets them).
inline Tensor head_view(const Tensor& buf, int64_t col0, int64_t heads, int64_t D) {
  Tensor v = buf;
  v.data = static_cast<char*>(buf.data) + col0 * dtype_size(buf.dtype);
  v.ndim = 3;
  v.shape = {buf.shape[0], heads, D, 0};
  v.stride = {buf.stride[0], D, 1, 0};
  return v;
}

// A host f64 tensor holding `values`.
inline HostTensor<double> host_tensor(std::initializer_list<int64_t> shape, const std::vector<double>& values) {
  HostTensor<double> h(shape);
  EXPECT_EQ(h.size(), values.size());
  for (size_t i = 0; i < h.size() && i < values.size(); ++i) h[i] = values[i];
  return h;
}

inline const char* name_of(DType d) { return d == DType::bf16 ? "bf16" : (d == DType::f32 ? "f32" : "f64"); }

// The norm-wise bound ||gpu - ref|| / ||ref||, checked beside the max-normalised one. Rounding each
// element to bf16 moves it by at most 2^-9 of itself, so the norm-wise error of a once-rounded output
// is at most 2^-9 however its values are spread; the max-normalised error alone lets a wrong row or
// head of small values pass. Measured on an H200 (2026-12-02, cuDNN 9.19, every case of gpu_test):
// bf16 worst 3.37e-3 (attention's dK over several blocks, a few roundings deep), f32 worst 2.05e-7
// (linear_backward's dx). The bounds leave 2.3x and 50x above those: 4 x 2^-9 for bf16, 1e-5 for f32.
inline double gpu_norm_tolerance(DType storage) { return storage == DType::bf16 ? 4.0 / 512.0 : 1e-5; }

// Prints the measured errors (the evidence in the test log), records them in the XML output, and
// expects them within gpu_tolerance(storage) (max-normalised) and gpu_norm_tolerance(storage).
inline void expect_close(const std::string& what, DType storage, const std::vector<double>& got,
                         const std::vector<double>& reference) {
  ASSERT_EQ(got.size(), reference.size()) << what;
  const double error = relative_error(got, reference);
  const double norm_error = norm_relative_error(got, reference);
  const double tol = gpu_tolerance(storage), norm_tol = gpu_norm_tolerance(storage);
  std::printf("  %-48s %-4s max|err|/max|ref| = %.3e (tolerance %.1e), ||err||/||ref|| = %.3e (tolerance %.1e)\n",
              what.c_str(), name_of(storage), error, tol, norm_error, norm_tol);
  ::testing::Test::RecordProperty(what + " " + name_of(storage), std::to_string(error));
  ::testing::Test::RecordProperty(what + " " + name_of(storage) + " norm", std::to_string(norm_error));
  EXPECT_LT(error, tol) << what << " (" << name_of(storage) << ")";
  EXPECT_LT(norm_error, norm_tol) << what << " (" << name_of(storage) << ", norm-wise)";
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isfinite(got[i]) != std::isfinite(reference[i])) {
      ADD_FAILURE() << what << ": element " << i << " is " << got[i] << ", the reference " << reference[i];
      break;
    }
  }
}

// Sets the GEMM algorithm policy (heuristic, auto) for a scope and restores the one in force before it.
struct GemmPolicyScope {
  ops::GemmAlgoPolicy saved = ops::gemm_algo_policy();
  explicit GemmPolicyScope(ops::GemmAlgoPolicy p) { ops::set_gemm_algo_policy(p); }
  ~GemmPolicyScope() { ops::set_gemm_algo_policy(saved); }
  GemmPolicyScope(const GemmPolicyScope&) = delete;
  GemmPolicyScope& operator=(const GemmPolicyScope&) = delete;
};

// Sets the attention kernel policy (cudnn, hopper, auto) for a scope and restores the one in force
// before it (the policy is process-wide; a decided shape under auto stays decided).
struct PolicyScope {
  attn::KernelPolicy saved = attn::kernel_policy();
  explicit PolicyScope(attn::KernelPolicy p) { attn::set_kernel_policy(p); }
  ~PolicyScope() { attn::set_kernel_policy(saved); }
  PolicyScope(const PolicyScope&) = delete;
  PolicyScope& operator=(const PolicyScope&) = delete;
};

}  // namespace longtrain::test

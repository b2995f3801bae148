#include "attention/cuda/hopper_host.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>

#include "runtime/cuda_check.h"
#include "runtime/error.h"

namespace longtrain::attn::hopper::host {

namespace {

using EncodeTiledFn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                                   const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                                   CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// cuTensorMapEncodeTiled from the driver through the runtime, so longtrain does not link libcuda.
EncodeTiledFn encode_tiled() {
  static const EncodeTiledFn fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    LT_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found));
    LT_CHECK(found == cudaDriverEntryPointSuccess && f != nullptr,
             "hopper attention: the CUDA driver does not provide cuTensorMapEncodeTiled (a CUDA 12 or newer driver "
             "is needed); unset LONGTRAIN_ATTENTION_KERNEL to use cuDNN");
    return reinterpret_cast<EncodeTiledFn>(f);
  }();
  return fn;
}

}  // namespace

CUtensorMap tile_map(const View& v, int rows, const char* name) {
  CUtensorMap map;
  const cuuint64_t dims[3] = {static_cast<cuuint64_t>(v.dim), static_cast<cuuint64_t>(v.heads),
                              static_cast<cuuint64_t>(v.tokens)};
  // With one head its stride is never used; any multiple of 16 bytes satisfies the encoder.
  const int64_t head_bytes = v.heads > 1 ? v.head_stride * 2 : v.dim * 2;
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_bytes), static_cast<cuuint64_t>(v.token_stride * 2)};
  const cuuint32_t box[3] = {64u, 1u, static_cast<cuuint32_t>(rows)};
  const cuuint32_t elem_strides[3] = {1u, 1u, 1u};
  const CUresult r = encode_tiled()(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 3, v.data, dims, strides, box,
                                    elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                    CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  LT_CHECK(r == CUDA_SUCCESS,
           "hopper attention: cuTensorMapEncodeTiled rejected {} (tokens {}, heads {}, dim {}, token stride {}, head "
           "stride {} elements, address {}): CUresult {}",
           name, v.tokens, v.heads, v.dim, v.token_stride, v.head_stride, v.data, static_cast<int>(r));
  return map;
}

bool sm90_device() {
  static const bool yes = [] {
    int dev = 0, major = 0, minor = 0;
    if (cudaGetDevice(&dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) return false;
    if (cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev) != cudaSuccess) return false;
    return major == 9 && minor == 0;
  }();
  return yes;
}

std::string check_tma_input(const View& v, const char* name) {
  if (v.data == nullptr) return fmt::format("{} has no data", name);
  if (reinterpret_cast<uintptr_t>(v.data) % 16 != 0)
    return fmt::format("{} must start at a 16-byte aligned address for TMA, got {}", name, v.data);
  if (v.token_stride % 8 != 0 || (v.heads > 1 && v.head_stride % 8 != 0))
    return fmt::format("{}'s token stride {} and head stride {} (elements) must be multiples of 8 (16 bytes) for TMA",
                       name, v.token_stride, v.head_stride);
  if (v.token_stride <= 0 || (v.heads > 1 && v.head_stride <= 0))
    return fmt::format("{}'s strides must be positive, got token stride {} and head stride {}", name, v.token_stride,
                       v.head_stride);
  return {};
}

int section_from_env(const char* env, int64_t fallback, int64_t kv_heads) {
  int64_t n = fallback;
  const char* value = std::getenv(env);
  if (value != nullptr && *value != '\0') {
    char* end = nullptr;
    const long long parsed = std::strtoll(value, &end, 10);
    LT_CHECK(*end == '\0' && parsed > 0,
             "{} must be a positive integer (kv heads per launch-order section of the hopper attention kernels), "
             "got '{}'; unset it for the default",
             env, value);
    n = parsed;
  }
  return static_cast<int>(std::clamp<int64_t>(n, 1, std::max<int64_t>(kv_heads, 1)));
}

}  // namespace longtrain::attn::hopper::host

#include "attention/cuda/hopper_host.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <queue>
#include <tuple>
#include <vector>

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

int section_from_env(const char* env, int64_t kv_heads) {
  const char* value = std::getenv(env);
  if (value == nullptr || *value == '\0') return 0;
  char* end = nullptr;
  const long long parsed = std::strtoll(value, &end, 10);
  LT_CHECK(*end == '\0' && parsed > 0,
           "{} must be a positive integer (kv heads per launch-order section of the hopper attention kernels), "
           "got '{}'; unset it for the default",
           env, value);
  return static_cast<int>(std::clamp<int64_t>(parsed, 1, std::max<int64_t>(kv_heads, 1)));
}

namespace {
// List scheduling of the CTAs in launch order (launch_makespan's model): returns the makespan and,
// given `starts`, appends each CTA's start.
int64_t list_schedule(const std::vector<int64_t>& tile_work, int64_t units_per_kv, int64_t kv_heads, int64_t section,
                      int64_t slots, std::vector<int64_t>* starts, const char* caller) {
  LT_CHECK(units_per_kv > 0 && kv_heads > 0 && section > 0 && slots > 0,
           "{}: units per kv head {}, kv heads {}, section {} and slots {} must be positive", caller, units_per_kv,
           kv_heads, section, slots);
  // Each slot's finishing time; a CTA starts on the earliest-free slot, in launch order.
  std::priority_queue<int64_t, std::vector<int64_t>, std::greater<>> free_at;
  for (int64_t s = 0; s < slots; ++s) free_at.push(0);
  int64_t end = 0;
  for (int64_t first = 0; first < kv_heads; first += section) {
    const int64_t units = std::min(section, kv_heads - first) * units_per_kv;
    for (const int64_t work : tile_work) {
      for (int64_t u = 0; u < units; ++u) {
        const int64_t start = free_at.top();
        free_at.pop();
        free_at.push(start + work);
        end = std::max(end, start + work);
        if (starts != nullptr) starts->push_back(start);
      }
    }
  }
  return end;
}
}  // namespace

double launch_makespan(const std::vector<int64_t>& tile_work, int64_t units_per_kv, int64_t kv_heads, int64_t section,
                       int64_t slots) {
  return static_cast<double>(list_schedule(tile_work, units_per_kv, kv_heads, section, slots, nullptr, "launch_makespan"));
}

std::vector<int64_t> launch_starts(const std::vector<int64_t>& tile_work, int64_t units_per_kv, int64_t kv_heads,
                                   int64_t section, int64_t slots) {
  std::vector<int64_t> starts;
  list_schedule(tile_work, units_per_kv, kv_heads, section, slots, &starts, "launch_starts");
  return starts;
}

std::vector<bool> streamed_ctas(const std::vector<int64_t>& starts, int64_t tolerance) {
  const size_t n = starts.size();
  std::vector<bool> streamed(n, false);
  auto near = [&](size_t a, size_t b) { return std::llabs(starts[a] - starts[b]) <= tolerance; };
  for (size_t i = 0; i < n; ++i) streamed[i] = !((i > 0 && near(i, i - 1)) || (i + 1 < n && near(i, i + 1)));
  return streamed;
}

int section_for_tail(const std::vector<int64_t>& tile_work, int64_t units_per_kv, int64_t kv_heads, int64_t slots,
                     double tolerance) {
  LT_CHECK(!tile_work.empty() && kv_heads > 0 && units_per_kv > 0 && slots > 0,
           "section_for_tail: no tiles, or kv heads {} / units {} / slots {} not positive", kv_heads, units_per_kv, slots);
  int64_t total = 0, longest = 0;
  for (const int64_t w : tile_work) {
    total += w;
    longest = std::max(longest, w);
  }
  const double ideal = std::max(static_cast<double>(total * units_per_kv * kv_heads) / static_cast<double>(slots),
                                static_cast<double>(longest));
  int best = 1;
  double best_span = 0;
  for (int64_t section = 1; section <= kv_heads; ++section) {
    // Every size, the smallest first (kv heads are few; a size that does not divide them leaves a
    // smaller last section, a schedule of its own).
    const double span = launch_makespan(tile_work, units_per_kv, kv_heads, section, slots);
    if (span <= ideal * (1.0 + tolerance)) return static_cast<int>(section);
    if (section == 1 || span < best_span) {
      best = static_cast<int>(section);
      best_span = span;
    }
  }
  return best;
}

int sm_count() {
  int device = 0;
  LT_CUDA_CHECK(cudaGetDevice(&device));
  static Memo<int, int> counts;
  return counts.get(device, [device] {
    int n = 0;
    LT_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return std::max(n, 1);
  });
}

int cached_section_for_tail(const char* kernel, const std::vector<int64_t>& tile_work, int64_t units_per_kv,
                            int64_t kv_heads) {
  const int slots = sm_count();
  static Memo<std::tuple<std::string, std::vector<int64_t>, int64_t, int64_t, int>, int> sections;
  return sections.get({kernel, tile_work, units_per_kv, kv_heads, slots},
                      [&] { return section_for_tail(tile_work, units_per_kv, kv_heads, slots); });
}

}  // namespace longtrain::attn::hopper::host

// A safetensors file: the header is validated and every tensor it describes is read (converted to
// f32 where the format allows), as resume and init_from do.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "fuzz_util.h"
#include "model/safetensors.h"
#include "runtime/tensor.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const auto path = longtrain::fuzz::scratch_dir() / "input.safetensors";
  longtrain::fuzz::write_bytes(path, data, size);
  longtrain::fuzz::expect_clean([&] {
    longtrain::model::SafetensorsFile f(path.string());
    for (const auto& t : f.tensors()) {
      if (t.numel > (1 << 20)) continue;  // a valid but large tensor: its reading is not what is fuzzed
      if (t.shape.size() > static_cast<size_t>(longtrain::kMaxDims)) continue;
      std::vector<float> out(static_cast<size_t>(std::max<int64_t>(t.numel, 1)));
      // A contiguous f32 view of the tensor's own shape.
      longtrain::Tensor dst;
      dst.data = out.data();
      dst.ndim = static_cast<int>(t.shape.size());
      int64_t stride = 1;
      for (int d = dst.ndim - 1; d >= 0; --d) {
        dst.shape[static_cast<size_t>(d)] = t.shape[static_cast<size_t>(d)];
        dst.stride[static_cast<size_t>(d)] = stride;
        stride *= std::max<int64_t>(t.shape[static_cast<size_t>(d)], 1);
      }
      longtrain::fuzz::expect_clean(
          [&] { f.read(t.name, dst, longtrain::model::DTypeConversion::rounding); });
    }
  });
  return 0;
}

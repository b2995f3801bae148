// A Megatron-LM indexed dataset (MMIDIDX .idx and its .bin), cut from the input, opened and read the
// way the loader does: every malformed file must end in longtrain::Error.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <string>
#include <vector>

#include "data/shards.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const auto prefix = longtrain::fuzz::scratch_dir() / "megatron";
  const std::vector<uint8_t> idx = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 4096));
  const std::vector<uint8_t> bin = in.ConsumeRemainingBytes<uint8_t>();
  longtrain::fuzz::write_bytes(prefix.string() + ".idx", idx.data(), idx.size());
  longtrain::fuzz::write_bytes(prefix.string() + ".bin", bin.data(), bin.size());
  longtrain::fuzz::expect_clean([&] {
    longtrain::data::TokenCorpus corpus(prefix.string(), "train", 1 << 20);
    const int64_t n = std::min<int64_t>(corpus.num_tokens(), 4096);
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    if (n > 0) corpus.read(0, std::span<int32_t>(tokens.data(), tokens.size()));
    for (int64_t d = 0; d <= std::min<int64_t>(corpus.num_documents(), 64); ++d) (void)corpus.document_offset(d);
    (void)corpus.document_starts(0, n);
  });
  return 0;
}

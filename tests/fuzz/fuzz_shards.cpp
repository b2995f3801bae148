// A prepared shard set: manifest.json, one .idx and one .bin, cut from the input (FuzzedDataProvider),
// opened and read the way the loader does.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <string>
#include <vector>

#include "data/shards.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const auto dir = longtrain::fuzz::scratch_dir() / "shards";
  std::filesystem::create_directories(dir);
  const std::string manifest = in.ConsumeRandomLengthString(4096);
  const std::vector<uint8_t> idx = in.ConsumeBytes<uint8_t>(in.ConsumeIntegralInRange<size_t>(0, 4096));
  const std::vector<uint8_t> bin = in.ConsumeRemainingBytes<uint8_t>();
  longtrain::fuzz::write_bytes(dir / "manifest.json", manifest.data(), manifest.size());
  longtrain::fuzz::write_bytes(dir / "train-00000.idx", idx.data(), idx.size());
  longtrain::fuzz::write_bytes(dir / "train-00000.bin", bin.data(), bin.size());
  longtrain::fuzz::expect_clean([&] {
    longtrain::data::TokenCorpus corpus(dir.string(), "train");
    const int64_t n = std::min<int64_t>(corpus.num_tokens(), 4096);
    std::vector<int32_t> tokens(static_cast<size_t>(n));
    if (n > 0) corpus.read(0, std::span<int32_t>(tokens.data(), tokens.size()));
    for (int64_t d = 0; d <= std::min<int64_t>(corpus.num_documents(), 64); ++d) (void)corpus.document_offset(d);
    (void)corpus.document_starts(0, n);
  });
  return 0;
}

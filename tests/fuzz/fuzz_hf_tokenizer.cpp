// A tokenizer.json and a text, cut from the input: the file is loaded, the text encoded (with and
// without special tokens) and decoded back. Bad files must end in longtrain::Error; any text must
// encode, and decoding what was encoded must not fail.
#include <fuzzer/FuzzedDataProvider.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "data/hf_tokenizer.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  FuzzedDataProvider in(data, size);
  const std::string text = in.ConsumeRandomLengthString(1024);
  const std::vector<char> rest = in.ConsumeRemainingBytes<char>();
  const std::string json(rest.begin(), rest.end());
  const auto path = longtrain::fuzz::scratch_dir() / "tokenizer.json";
  longtrain::fuzz::write_bytes(path, json.data(), json.size());
  std::unique_ptr<longtrain::data::HfTokenizer> tok;
  longtrain::fuzz::expect_clean([&] { tok = std::make_unique<longtrain::data::HfTokenizer>(path.string()); });
  if (!tok) return 0;
  longtrain::fuzz::expect_clean([&] {
    const std::vector<int32_t> ids = tok->encode(text, true);
    (void)tok->decode(ids, false);
    (void)tok->decode(ids, true);
    (void)tok->encode_tokens(text);
  });
  return 0;
}

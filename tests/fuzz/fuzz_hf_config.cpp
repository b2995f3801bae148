// A Hugging Face config.json, as init_from, eval and generate read it.
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "model/hf_export.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  longtrain::fuzz::expect_clean([&] {
    const longtrain::model::HfLlamaConfig c = longtrain::model::parse_hf_config(text, "fuzz/config.json");
    (void)longtrain::model::hf_config_json(c);  // and what we would write back
  });
  return 0;
}

// The YAML config with --set overrides: the input's first line holds the overrides (separated by ';'),
// the rest is the YAML document.
#include <cstdint>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "trainer/config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  const size_t eol = text.find('\n');
  std::vector<std::string> overrides;
  std::string yaml = text;
  if (eol != std::string::npos) {
    const std::string first = text.substr(0, eol);
    yaml = text.substr(eol + 1);
    for (size_t begin = 0; begin <= first.size();) {
      const size_t end = std::min(first.find(';', begin), first.size());
      if (end > begin) overrides.push_back(first.substr(begin, end - begin));
      begin = end + 1;
    }
  }
  longtrain::fuzz::expect_clean([&] {
    longtrain::trainer::TrainConfig c = longtrain::trainer::config_from_yaml_string(yaml, overrides, "fuzz.yaml");
    // What a loaded config is used for before training: its YAML, its hash, the schema text.
    (void)longtrain::trainer::resolved_yaml(c);
    (void)longtrain::trainer::config_hash(c);
  });
  return 0;
}

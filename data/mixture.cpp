#include "data/mixture.h"

#include <cmath>

#include <nlohmann/json.hpp>

#include "runtime/error.h"

namespace longtrain::data {

namespace {

uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

}  // namespace

bool is_mixture_spec(const std::string& spec) {
  const size_t first = spec.find_first_not_of(" \t\r\n");
  return first != std::string::npos && spec[first] == '[';
}

std::vector<DataSource> parse_data_sources(const std::string& spec, const std::string& what) {
  LT_CHECK(!spec.empty(), "{} is empty: give a shard directory, a Megatron dataset prefix, or a list of "
           "{{path, weight}}", what);
  if (!is_mixture_spec(spec)) return {DataSource{spec, 1.0}};
  nlohmann::json list;
  try {
    list = nlohmann::json::parse(spec);
  } catch (const nlohmann::json::exception& e) {
    LT_FAIL("{}: the mixture '{}' is not a list of {{path, weight}}: {}", what, spec, e.what());
  }
  LT_CHECK(list.is_array() && !list.empty(), "{}: a mixture must be a non-empty list of {{path, weight}}", what);
  std::vector<DataSource> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& e = list[i];
    LT_CHECK(e.is_object(), "{}[{}]: expected {{path: ..., weight: ...}}, got {}", what, i, e.dump());
    for (auto it = e.begin(); it != e.end(); ++it)
      LT_CHECK(it.key() == "path" || it.key() == "weight", "{}[{}]: unknown field '{}' (a source has path and "
               "weight)", what, i, it.key());
    LT_CHECK(e.contains("path") && e["path"].is_string() && !e["path"].get<std::string>().empty(),
             "{}[{}]: path must be a non-empty string (a shard directory or a Megatron dataset prefix)", what, i);
    LT_CHECK(e.contains("weight") && e["weight"].is_number(),
             "{}[{}] ({}): weight must be a number, the source's share of the windows", what, i,
             e["path"].get<std::string>());
    const double w = e["weight"].get<double>();
    LT_CHECK(std::isfinite(w) && w > 0, "{}[{}] ({}): weight {} must be positive and finite", what, i,
             e["path"].get<std::string>(), w);
    out.push_back({e["path"].get<std::string>(), w});
  }
  return out;
}

std::string data_sources_text(const std::vector<DataSource>& sources) {
  if (sources.size() == 1 && sources[0].weight == 1.0 && !is_mixture_spec(sources[0].path)) return sources[0].path;
  nlohmann::json list = nlohmann::json::array();
  for (const DataSource& s : sources) list.push_back({{"path", s.path}, {"weight", s.weight}});
  return list.dump();
}

int draw_source(uint64_t seed, int64_t draw, const std::vector<double>& cumulative) {
  if (cumulative.size() <= 1) return 0;
  const uint64_t bits = splitmix64(splitmix64(seed ^ 0x6d69787475726521ull) ^ static_cast<uint64_t>(draw));
  const double u = static_cast<double>(bits >> 11) * 0x1.0p-53;  // uniform in [0, 1)
  for (size_t i = 0; i < cumulative.size(); ++i)
    if (u < cumulative[i]) return static_cast<int>(i);
  return static_cast<int>(cumulative.size()) - 1;
}

}  // namespace longtrain::data

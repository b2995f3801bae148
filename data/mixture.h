// Weighted mixtures of corpora: what data.train names.
//
// A data source spec is either one path (a shard set written by `longtrain prepare`, or a Megatron
// indexed dataset: shards.h) or a mixture, written in the config as a list of {path, weight}:
//
//   data:
//     train:
//       - {path: data/code, weight: 0.3}
//       - {path: data/books, weight: 0.3}
//       - {path: data/short/docs_text_document, weight: 0.4}   # a Megatron .bin/.idx prefix
//
// and carried as text in canonical JSON, [{"path": "data/code", "weight": 0.3}, ...] (a path that
// starts with '[' must be written as ./[...). Weights are positive and finite; they need not sum to
// one (they are normalised). The loader (loader.h) draws each step's source from them.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace longtrain::data {

struct DataSource {
  std::string path;
  double weight = 1.0;
};

// Parses a spec (a path or the JSON list above). `what` names it in errors (e.g. "data.train").
// A malformed list, a missing path, or a weight that is not a positive finite number is an error.
std::vector<DataSource> parse_data_sources(const std::string& spec, const std::string& what = "data.train");

// The canonical spec text: the path itself for one source of weight 1, else the JSON list.
std::string data_sources_text(const std::vector<DataSource>& sources);

// Whether a spec is a list rather than one path.
bool is_mixture_spec(const std::string& spec);

// The source of draw `draw`: index i with probability weight_i / sum(weights), independent across
// draws, a pure function of (seed, draw) so that any draw can be recomputed on resume.
// `cumulative` holds the normalised running sums of the weights (the last is exactly 1).
int draw_source(uint64_t seed, int64_t draw, const std::vector<double>& cumulative);

}  // namespace longtrain::data

// Sharding layouts of one sequence over a sequence-parallel group: which global token indices rank r
// of P holds, in the order the rank stores them. Header-only, so the data loader (which hands each
// rank its tokens) and the distributed attention (which must know where each rank's queries and
// keys sit in the causal order) share one definition.
//
//   contiguous: S tokens cut into P chunks of S/P; rank r holds chunk r.
//               P = 2, S = 8:  rank 0: 0 1 2 3          rank 1: 4 5 6 7
//   zigzag:     S tokens cut into 2P chunks of S/(2P); rank r holds chunk r then chunk 2P-1-r, so
//               every rank has one early and one late chunk and equal causal-attention work.
//               P = 2, S = 8:  rank 0: 0 1 | 6 7        rank 1: 2 3 | 4 5
//
// A rank's local token i (0 <= i < S/P) sits at global index layout_global_index(...). The data
// loader gives each local token its global position, so RoPE, masks and labels are correct whatever
// the layout.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/error.h"

namespace longtrain {

enum class SeqLayout : uint8_t { contiguous, zigzag };

inline std::string_view layout_name(SeqLayout layout) {
  return layout == SeqLayout::contiguous ? "contiguous" : "zigzag";
}

// "contiguous" or "zigzag"; anything else is an error naming the accepted values.
inline SeqLayout parse_layout(std::string_view name) {
  if (name == "contiguous") return SeqLayout::contiguous;
  if (name == "zigzag") return SeqLayout::zigzag;
  LT_FAIL("unknown sequence layout '{}': use 'contiguous' or 'zigzag'", name);
}

// Number of chunks the sequence is cut into: P (contiguous) or 2P (zigzag).
inline int64_t layout_chunk_count(SeqLayout layout, int sp_size) {
  return layout == SeqLayout::contiguous ? sp_size : 2 * int64_t{sp_size};
}

// Throws unless S tokens can be split over P ranks in this layout (S divisible by P or 2P).
inline void check_layout(SeqLayout layout, int64_t seq_len, int sp_size, int sp_rank = 0) {
  LT_CHECK(sp_size >= 1, "sequence-parallel size must be >= 1, got {}", sp_size);
  LT_CHECK(sp_rank >= 0 && sp_rank < sp_size, "sequence-parallel rank {} is outside [0, {})", sp_rank,
           sp_size);
  const int64_t chunks = layout_chunk_count(layout, sp_size);
  LT_CHECK(seq_len > 0 && seq_len % chunks == 0,
           "sequence length {} cannot be split over {} ranks with the {} layout: it must be a positive "
           "multiple of {} ({} chunks)",
           seq_len, sp_size, layout_name(layout), chunks, chunks);
}

// Tokens each rank holds: S / P.
inline int64_t layout_local_len(int64_t seq_len, int sp_size) { return seq_len / sp_size; }

// One run of consecutive global indices held by a rank: local [local_start, local_start + length)
// holds global [global_start, global_start + length).
struct LayoutRun {
  int64_t global_start;
  int64_t local_start;
  int64_t length;
};

// The runs rank r holds, in local order: one run (contiguous) or two (zigzag).
inline std::vector<LayoutRun> layout_runs(SeqLayout layout, int64_t seq_len, int sp_size, int sp_rank) {
  check_layout(layout, seq_len, sp_size, sp_rank);
  if (layout == SeqLayout::contiguous) {
    const int64_t n = seq_len / sp_size;
    return {{sp_rank * n, 0, n}};
  }
  const int64_t c = seq_len / (2 * int64_t{sp_size});  // chunk length
  const int64_t late_chunk = 2 * int64_t{sp_size} - 1 - sp_rank;
  return {{sp_rank * c, 0, c}, {late_chunk * c, c, c}};
}

// Global index of rank r's local token i (0 <= i < S/P).
inline int64_t layout_global_index(SeqLayout layout, int64_t seq_len, int sp_size, int sp_rank,
                                   int64_t local_index) {
  if (layout == SeqLayout::contiguous) return sp_rank * (seq_len / sp_size) + local_index;
  const int64_t c = seq_len / (2 * int64_t{sp_size});
  if (local_index < c) return sp_rank * c + local_index;
  return (2 * int64_t{sp_size} - 1 - sp_rank) * c + (local_index - c);
}

// Global indices of all of rank r's tokens, in local order: [S/P].
inline std::vector<int64_t> layout_global_indices(SeqLayout layout, int64_t seq_len, int sp_size,
                                                  int sp_rank) {
  std::vector<int64_t> indices;
  indices.reserve(static_cast<size_t>(seq_len / sp_size));
  for (const LayoutRun& run : layout_runs(layout, seq_len, sp_size, sp_rank))
    for (int64_t i = 0; i < run.length; ++i) indices.push_back(run.global_start + i);
  return indices;
}

}  // namespace longtrain

// Which local blocks a distributed schedule computes when the queries of one rank meet the keys of
// another. Positions are global and the layout says which global chunks each rank holds, so the
// mask of a (query chunk i, key chunk j) pair follows from the chunk indices alone:
//   causal: j < i -> BlockMask::none, j == i -> causal_diagonal, j > i -> skipped;
//   full attention: none everywhere.
// The pairs are then merged into as few block calls as possible: the zigzag rules of
// docs/distributed-attention.md §1.4 fall out (rank r meeting source j < r: both local query chunks
// × the source's first chunk, one call; j > r: the late query chunk × both source chunks, one call;
// a rank meeting itself: one causal call over its 2c tokens, valid because its chunks are stored in
// ascending global order).
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "attention/local_attention.h"
#include "parallel/layout.h"

namespace longtrain::attn {

// One local block call: queries [q_start, q_start + q_len) of the query rank's local tokens against
// keys [k_start, k_start + k_len) of the key rank's local tokens.
struct BlockCall {
  int64_t q_start, q_len;
  int64_t k_start, k_len;
  BlockMask mask;
  // Query-key pairs it covers: q_len·k_len, or n(n+1)/2 for a causal diagonal block of n rows.
  int64_t pairs() const;
};

// How the chunk pairs of two different ranks become calls: merged into as few calls as possible (the
// default), or one call per (query chunk, key chunk) pair. A rank meeting itself is one causal call
// either way. On 2 H200s (cp_bench, zigzag, 32 / 8 heads, head_dim 128) per_chunk was 0.9% faster at
// 256K tokens in one run and 0.2% faster (0.4% slower at 128K) in the next, beside a spread of about
// 1% between runs: no measurable difference, so the fewer, larger calls stay the default.
enum class ChunkCalls { merged, per_chunk };

// The calls for the queries of SP rank `q_rank` against the keys of SP rank `kv_rank`, each holding
// `local_len` tokens of a sequence split over `sp_size` ranks in `layout`. Empty when causal masking
// hides every pair. local_len must split into the layout's chunks (checked).
std::vector<BlockCall> plan_block_calls(SeqLayout layout, int sp_size, int64_t local_len, int q_rank, int kv_rank,
                                        bool causal, ChunkCalls calls = ChunkCalls::merged);

// "merged", "per_chunk" (benchmark flags); parsing throws naming the accepted values.
ChunkCalls parse_chunk_calls(std::string_view name);
std::string_view chunk_calls_name(ChunkCalls calls);

}  // namespace longtrain::attn

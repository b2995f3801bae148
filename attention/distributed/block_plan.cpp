#include "attention/distributed/block_plan.h"

namespace longtrain::attn {

int64_t BlockCall::pairs() const {
  return mask == BlockMask::causal_diagonal ? q_len * (q_len + 1) / 2 : q_len * k_len;
}

namespace {

// A run of local key positions [start, start + len).
struct KeyRange {
  int64_t start, len;
  bool operator==(const KeyRange&) const = default;
};

}  // namespace

ChunkCalls parse_chunk_calls(std::string_view name) {
  if (name == "merged") return ChunkCalls::merged;
  if (name == "per_chunk") return ChunkCalls::per_chunk;
  LT_FAIL("unknown chunk calls '{}': use merged or per_chunk", name);
}

std::string_view chunk_calls_name(ChunkCalls calls) {
  return calls == ChunkCalls::per_chunk ? "per_chunk" : "merged";
}

std::vector<BlockCall> plan_block_calls(SeqLayout layout, int sp_size, int64_t local_len, int q_rank, int kv_rank,
                                        bool causal, ChunkCalls calls) {
  const bool merge = calls == ChunkCalls::merged;
  LT_CHECK(local_len > 0, "a sequence-parallel shard needs at least one token, got {}", local_len);
  const int64_t seq_len = local_len * sp_size;
  check_layout(layout, seq_len, sp_size, q_rank);
  check_layout(layout, seq_len, sp_size, kv_rank);
  const std::vector<LayoutRun> q_runs = layout_runs(layout, seq_len, sp_size, q_rank);
  const std::vector<LayoutRun> k_runs = layout_runs(layout, seq_len, sp_size, kv_rank);

  if (q_rank == kv_rank) {
    // A rank's runs are stored in ascending global order, so one causal block over its local tokens
    // is the causal mask over their global positions.
    for (size_t i = 1; i < q_runs.size(); ++i)
      LT_CHECK(q_runs[i].global_start > q_runs[i - 1].global_start,
               "layout {} stores rank {}'s chunks out of global order", layout_name(layout), q_rank);
    return {{0, local_len, 0, local_len, causal ? BlockMask::causal_diagonal : BlockMask::none}};
  }
  if (!causal) return {{0, local_len, 0, local_len, BlockMask::none}};

  // Two ranks hold disjoint chunks: a key chunk is either wholly before a query chunk (no mask) or
  // wholly after it (skipped). Visible key chunks of each query run, merged where adjacent locally.
  std::vector<std::vector<KeyRange>> visible(q_runs.size());
  for (size_t i = 0; i < q_runs.size(); ++i) {
    for (const LayoutRun& k : k_runs) {
      const bool before = k.global_start + k.length <= q_runs[i].global_start;
      const bool after = k.global_start >= q_runs[i].global_start + q_runs[i].length;
      LT_CHECK(before || after, "layout {}: ranks {} and {} hold overlapping chunks", layout_name(layout), q_rank,
               kv_rank);
      if (!before) continue;
      std::vector<KeyRange>& v = visible[i];
      if (merge && !v.empty() && v.back().start + v.back().len == k.local_start) {
        v.back().len += k.length;
      } else {
        v.push_back({k.local_start, k.length});
      }
    }
  }
  // Consecutive query runs that see the same keys become one call (merged).
  std::vector<BlockCall> out;
  for (size_t i = 0; i < q_runs.size();) {
    size_t end = i + 1;
    int64_t q_len = q_runs[i].length;
    while (merge && end < q_runs.size() && visible[end] == visible[i] &&
           q_runs[end].local_start == q_runs[i].local_start + q_len) {
      q_len += q_runs[end].length;
      ++end;
    }
    for (const KeyRange& r : visible[i]) out.push_back({q_runs[i].local_start, q_len, r.start, r.len, BlockMask::none});
    i = end;
  }
  return out;
}

}  // namespace longtrain::attn

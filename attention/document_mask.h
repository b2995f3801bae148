// Document masks: a window packs several documents, and with document masking a token attends only
// to the earlier tokens of its own document.
//
// The description is cu_seqlens-style offsets in *global* token coordinates of the whole window
// (before sequence-parallel sharding): document d is window tokens [offsets[d], offsets[d+1]), with
// offsets[0] = 0, offsets.back() = S, strictly ascending. Every rank of a sequence-parallel group
// holds the same offsets (they are a handful of integers per window), so any rank can tell which
// documents any other rank's chunks hold, through the layout alone. This is the form a fused kernel
// takes too: cuDNN's ragged offsets / padding masks and flash-attention's varlen cu_seqlens are the
// offsets of the documents inside one block, which document_block_calls below computes.
//
// Masking works by refining block calls (block_plan.h): a (query range, key range) call of a schedule
// is split into one call per document the two ranges share, each with the mask the original call
// implies for it (the causal diagonal where the query and key pieces are the same tokens, no mask
// where the keys are wholly earlier). A block pair that shares no document gives no call at all, so
// it is skipped without computing; K/V are read through the same un-expanded views (GQA).
//
// The fused GPU path: the calls that document_block_calls makes of one block are its segments.
// segment_calls groups them by mask into sets whose query runs and key runs do not overlap, and each
// set is one attention_segments_forward/backward call (local_attention.h): on CUDA one cuDNN call over
// ragged rows, whose q_start/q_len and k_start/k_len are the ragged offsets and per-segment lengths
// (RAGGED_OFFSET and SEQ_LEN_Q/SEQ_LEN_KV with a padding mask), causal_diagonal segments with the
// causal mask (their query and key rows are the same tokens, so top-left and bottom-right alignment
// agree), none segments without one.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "attention/distributed/block_plan.h"
#include "parallel/layout.h"

namespace longtrain::attn {

struct Documents {
  std::vector<int64_t> offsets;  // [D + 1]; empty = no document masking

  bool empty() const { return offsets.empty(); }
  int64_t count() const { return offsets.empty() ? 0 : static_cast<int64_t>(offsets.size()) - 1; }
  int64_t seq_len() const { return offsets.empty() ? 0 : offsets.back(); }
  // Index of the document holding global token g (0 <= g < seq_len).
  int64_t document_of(int64_t g) const;
  // "3 documents over 48 tokens: [0, 5) [5, 22) [22, 48)"-style text for messages (shortened).
  std::string describe() const;
};

// From the positions p in [0, S] where a document starts (data::Batch::doc_starts): a document that
// crosses the window start is cut there (offset 0), p = 0 and p = S add nothing.
Documents documents_from_starts(std::span<const int32_t> starts, int64_t seq_len);

// Throws unless `docs` is empty or describes a window of exactly `seq_len` tokens (offsets start at 0,
// end at seq_len, strictly ascending). `where` names the caller in the message.
void check_documents(const Documents& docs, int64_t seq_len, const std::string& where);

// The calls of `calls` (from plan_block_calls(layout, sp_size, local_len, q_rank, kv_rank, causal))
// restricted to the documents of `docs`: one call per (call, query run, key run, shared document),
// in order. `causal` is the schedule's: with causal = false a shared document is seen whole (no
// mask); with causal = true, keys after the queries are not seen. Query-key pairs that lie in
// different documents are in no call. With empty `docs` the calls are returned as they are.
std::vector<BlockCall> document_block_calls(const std::vector<BlockCall>& calls, const Documents& docs,
                                            SeqLayout layout, int sp_size, int64_t local_len, int q_rank,
                                            int kv_rank, bool causal);

// One segmented call: segments of one mask whose query runs, and whose key runs, do not overlap.
struct SegmentCall {
  BlockMask mask;
  std::vector<Segment> segments;
  int64_t pairs = 0;  // query-key pairs its segments cover
};

// `calls` (of document_block_calls) as few segmented calls as the overlaps allow, in order: usually one
// per mask; a query run that meets two key runs (a document spanning two of the key rank's chunks)
// goes to a second call.
std::vector<SegmentCall> segment_calls(const std::vector<BlockCall>& calls);

// Query-key pairs that document-masked attention computes over the whole window: Σ_d n_d(n_d+1)/2
// causal, Σ_d n_d² full (with empty docs: the whole window as one document).
int64_t document_pairs(const Documents& docs, int64_t seq_len, bool causal);

}  // namespace longtrain::attn

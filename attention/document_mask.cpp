#include "attention/document_mask.h"

#include <algorithm>

#include <fmt/format.h>

#include "runtime/error.h"

namespace longtrain::attn {

int64_t Documents::document_of(int64_t g) const {
  // The last offset <= g: offsets[0] = 0 <= g < offsets.back().
  const auto it = std::upper_bound(offsets.begin(), offsets.end(), g);
  return static_cast<int64_t>(it - offsets.begin()) - 1;
}

std::string Documents::describe() const {
  if (empty()) return "no document mask";
  std::string s = fmt::format("{} document(s) over {} tokens:", count(), seq_len());
  const int64_t shown = std::min<int64_t>(count(), 8);
  for (int64_t d = 0; d < shown; ++d)
    s += fmt::format(" [{}, {})", offsets[static_cast<size_t>(d)], offsets[static_cast<size_t>(d + 1)]);
  if (shown < count()) s += " ...";
  return s;
}

Documents documents_from_starts(std::span<const int32_t> starts, int64_t seq_len) {
  LT_CHECK(seq_len > 0, "document mask: a window needs at least one token, got {}", seq_len);
  Documents docs;
  docs.offsets.push_back(0);
  for (int32_t p : starts) {
    LT_CHECK(p >= 0 && p <= seq_len, "document mask: a document start {} lies outside the window [0, {}]", p,
             seq_len);
    LT_CHECK(p >= docs.offsets.back(), "document mask: document starts must ascend, got {} after {}", p,
             docs.offsets.back());
    if (p > docs.offsets.back() && p < seq_len) docs.offsets.push_back(p);
  }
  docs.offsets.push_back(seq_len);
  return docs;
}

void check_documents(const Documents& docs, int64_t seq_len, const std::string& where) {
  if (docs.empty()) return;
  LT_CHECK(docs.offsets.size() >= 2 && docs.offsets.front() == 0 && docs.offsets.back() == seq_len,
           "{}: the document offsets must run from 0 to the window's {} tokens, got {}", where, seq_len,
           docs.describe());
  for (size_t d = 1; d < docs.offsets.size(); ++d)
    LT_CHECK(docs.offsets[d] > docs.offsets[d - 1], "{}: document offsets must ascend strictly (no empty document), "
             "got {} then {}", where, docs.offsets[d - 1], docs.offsets[d]);
}

namespace {

// The part of local range [start, start + len) that lies in one layout run: global [g0, g1) at local
// index local0.
struct Piece {
  int64_t g0, g1, local0;
};

std::vector<Piece> pieces(const std::vector<LayoutRun>& runs, int64_t start, int64_t len) {
  std::vector<Piece> out;
  for (const LayoutRun& r : runs) {
    const int64_t lo = std::max(start, r.local_start), hi = std::min(start + len, r.local_start + r.length);
    if (lo >= hi) continue;
    out.push_back({r.global_start + (lo - r.local_start), r.global_start + (hi - r.local_start), lo});
  }
  return out;
}

}  // namespace

std::vector<BlockCall> document_block_calls(const std::vector<BlockCall>& calls, const Documents& docs,
                                            SeqLayout layout, int sp_size, int64_t local_len, int q_rank,
                                            int kv_rank, bool causal) {
  if (docs.empty()) return calls;
  const int64_t S = local_len * sp_size;
  check_documents(docs, S, "document mask");
  const std::vector<LayoutRun> q_runs = layout_runs(layout, S, sp_size, q_rank);
  const std::vector<LayoutRun> k_runs = layout_runs(layout, S, sp_size, kv_rank);
  const std::vector<int64_t>& off = docs.offsets;
  std::vector<BlockCall> out;
  for (const BlockCall& c : calls) {
    for (const Piece& qp : pieces(q_runs, c.q_start, c.q_len)) {
      for (const Piece& kp : pieces(k_runs, c.k_start, c.k_len)) {
        BlockMask mask = BlockMask::none;
        if (c.mask == BlockMask::causal_diagonal) {
          // One rank meeting itself: its runs ascend globally, so a key piece is the query piece, or
          // wholly before it (seen), or wholly after it (not seen).
          if (qp.g0 == kp.g0) {
            mask = BlockMask::causal_diagonal;
          } else if (kp.g1 > qp.g0) {
            continue;
          }
        } else if (causal) {
          LT_CHECK(kp.g1 <= qp.g0, "document mask: a causal unmasked block has keys [{}, {}) after queries [{}, {})",
                   kp.g0, kp.g1, qp.g0, qp.g1);
        }
        // The documents both pieces hold.
        const int64_t first = std::max(docs.document_of(qp.g0), docs.document_of(kp.g0));
        const int64_t last = std::min(docs.document_of(qp.g1 - 1), docs.document_of(kp.g1 - 1));
        for (int64_t d = first; d <= last; ++d) {
          const int64_t d0 = off[static_cast<size_t>(d)], d1 = off[static_cast<size_t>(d + 1)];
          const int64_t q0 = std::max(qp.g0, d0), q1 = std::min(qp.g1, d1);
          const int64_t k0 = std::max(kp.g0, d0), k1 = std::min(kp.g1, d1);
          out.push_back({qp.local0 + (q0 - qp.g0), q1 - q0, kp.local0 + (k0 - kp.g0), k1 - k0, mask});
        }
      }
    }
  }
  return out;
}

std::vector<SegmentCall> segment_calls(const std::vector<BlockCall>& calls) {
  auto overlap = [](int64_t a0, int64_t a1, int64_t b0, int64_t b1) { return a0 < b1 && b0 < a1; };
  std::vector<SegmentCall> out;
  for (const BlockCall& c : calls) {
    SegmentCall* home = nullptr;
    for (SegmentCall& g : out) {
      if (g.mask != c.mask) continue;
      bool clash = false;
      for (const Segment& s : g.segments)
        clash = clash || overlap(s.q_start, s.q_start + s.q_len, c.q_start, c.q_start + c.q_len) ||
                overlap(s.k_start, s.k_start + s.k_len, c.k_start, c.k_start + c.k_len);
      if (!clash) {
        home = &g;
        break;
      }
    }
    if (home == nullptr) {
      out.push_back({c.mask, {}, 0});
      home = &out.back();
    }
    home->segments.push_back({c.q_start, c.q_len, c.k_start, c.k_len});
    home->pairs += c.pairs();
  }
  return out;
}

int64_t document_pairs(const Documents& docs, int64_t seq_len, bool causal) {
  auto pairs = [causal](int64_t n) { return causal ? n * (n + 1) / 2 : n * n; };
  if (docs.empty()) return pairs(seq_len);
  int64_t total = 0;
  for (size_t d = 0; d + 1 < docs.offsets.size(); ++d) total += pairs(docs.offsets[d + 1] - docs.offsets[d]);
  return total;
}

}  // namespace longtrain::attn

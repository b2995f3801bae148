#include "model/step_graphs.h"

#include <fmt/format.h>

namespace longtrain::model {

const StepGraphs::Entry* StepGraphs::find(const StepGraphKey& key, int64_t frees) {
  if (!entries_.empty() && frees != frees_at_capture_) drop_all();
  for (const Entry& e : entries_)
    if (e.key == key) return &e;
  return nullptr;
}

bool StepGraphs::ready_to_capture(const StepGraphKey& key) const {
  for (const auto& [k, clean] : eager_calls_)
    if (k == key) return clean;
  return false;
}

void StepGraphs::record_eager_call(const StepGraphKey& key, bool clean) {
  for (auto& [k, c] : eager_calls_) {
    if (k == key) {
      c = clean;
      return;
    }
  }
  eager_calls_.emplace_back(key, clean);
  if (eager_calls_.size() > 2 * kMaxGraphs) eager_calls_.pop_front();
}

const StepGraphs::Entry& StepGraphs::add(StepGraphKey key, CudaGraph graph, StepGraphEffects effects, int64_t frees) {
  if (entries_.size() == kMaxGraphs) {
    entries_.pop_front();
    ++stats_.dropped;
  }
  frees_at_capture_ = frees;
  entries_.push_back({std::move(key), std::move(graph), std::move(effects)});
  ++stats_.captures;
  if (stats_.captures >= kMaxUnpaidCaptures && stats_.replays < 2 * stats_.captures) {
    turn_off(fmt::format("the step's calls kept changing ({} captures, {} replays): a graph is replayed only for a "
                         "call with the same token count, buffers, gradients to overwrite and kernel choices",
                         stats_.captures, stats_.replays));
  }
  return entries_.back();  // kept even when turned off: the caller launches it once
}

void StepGraphs::drop_all() {
  stats_.dropped += static_cast<int64_t>(entries_.size());
  entries_.clear();
}

void StepGraphs::turn_off(std::string reason) {
  stats_.off_reason = std::move(reason);
  eager_calls_.clear();  // the graphs stay (the caller may still launch the last one made) and are never looked up again
}

}  // namespace longtrain::model

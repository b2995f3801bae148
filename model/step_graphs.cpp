#include "model/step_graphs.h"

#include <algorithm>

#include <fmt/format.h>

namespace longtrain::model {

const StepGraphs::Entry* StepGraphs::find(const StepGraphKey& key, int64_t frees) {
  if (!entries_.empty() && frees != frees_at_capture_) drop_all();
  for (const Entry& e : entries_)
    if (e.key == key) return &e;
  return nullptr;
}

bool StepGraphs::seen_before(const StepGraphKey& key) {
  if (std::find(seen_.begin(), seen_.end(), key) != seen_.end()) return true;
  seen_.push_back(key);
  if (seen_.size() > 2 * kMaxGraphs) seen_.pop_front();
  return false;
}

const StepGraphs::Entry& StepGraphs::add(StepGraphKey key, CudaGraph graph, StepGraphEffects effects, int64_t frees) {
  if (entries_.size() == kMaxGraphs) {
    entries_.pop_front();
    ++stats_.dropped;
  }
  frees_at_capture_ = frees;
  entries_.push_back({std::move(key), std::move(graph), std::move(effects)});
  ++stats_.captures;
  if (stats_.captures >= kMaxUnpaidCaptures && stats_.replays < stats_.captures) {
    turn_off(fmt::format("the step's calls kept changing ({} captures, {} replays): a graph is replayed only for a "
                         "call with the same token count, buffers, grad_scale (1 / the valid labels of the step) and "
                         "gradients to overwrite",
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
  seen_.clear();  // the graphs stay (the caller may still launch the last one made) and are never looked up again
}

}  // namespace longtrain::model

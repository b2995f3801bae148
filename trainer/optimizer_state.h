// The ZeRO-1 optimizer state in a checkpoint, and its re-sharding for a resume on another number of
// ranks.
//
// A run on W ranks splits the flat parameter buffer (padded to a multiple of W) into W equal shards;
// rank r keeps AdamW's m, v (and the f32 master weights under bf16) for elements
// [r·s, (r+1)·s), s = padded / W, and writes them to optimizer.rank<r>.safetensors with its place
// in the metadata (world_size, rank, shard_begin, shard_end). Elements past the parameters
// (the padding) have m = v = 0 and stay so.
//
// Resume on W' ranks: rank r' needs [r'·s', (r'+1)·s'). It reads exactly that range from the saved
// shards that overlap it (a copy of bytes, so the state is bit-identical to what was saved);
// positions beyond the saved padded length are padding and start at zero; saved positions beyond
// this run's padded length are padding too and must be zero (checked: anything else means another
// model). So a checkpoint of any world size resumes on any other.
#pragma once

#include <filesystem>
#include <string>

#include "trainer/optimizer.h"

namespace longtrain::trainer {

// "optimizer.rank<R>.safetensors".
std::string optimizer_state_file(int rank);

// Writes this rank's shard of `opt` (device state goes through a host copy).
void save_optimizer_state(const std::filesystem::path& path, AdamW& opt, int world_size, int rank);

// What load_optimizer_state found in the checkpoint.
struct SavedOptimizerLayout {
  int world_size = 0;         // ranks the checkpoint was written by
  int64_t shard_numel = 0;    // elements per saved shard
  int files_read = 0;         // saved shards this rank read from
};

// Fills opt's shard [shard_begin, shard_end) of a flat buffer of `buffer_numel` elements (the padded
// parameter buffer of this run) of m, v (and master) from the optimizer files in `dir`,
// whatever world size wrote them. Errors name the checkpoint and the file: a missing or damaged
// shard, shards that do not tile the buffer, a dtype or tensor that differs (another precision), or
// non-zero state where this run has padding (another model).
SavedOptimizerLayout load_optimizer_state(const std::filesystem::path& dir, AdamW& opt, int64_t buffer_numel);

}  // namespace longtrain::trainer

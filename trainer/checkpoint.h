// Checkpoint directories: how a checkpoint appears on disk atomically, how old ones go away, and
// how `--resume auto` finds the newest one that is whole. What the files hold (model.safetensors,
// optimizer state, trainer_state.json) is the caller's business; this layer never looks inside.
//
// Layout under the checkpoint root:
//   step_N/                        a committed checkpoint (N = optimizer steps taken, no padding)
//     <files the writer wrote>     any names, subdirectories allowed; regular files only
//     MANIFEST.json                written last: step, and every file's size and CRC-32
//   .tmp-step_N-<host>-<pid>/      a checkpoint being written (or left by a writer that died)
//   .tmp-old_step_N-<host>-<pid>/  a checkpoint being deleted
//
// The commit protocol (save_checkpoint_dir):
//   1. create root/.tmp-step_N-<host>-<pid>/ and let the writer fill it;
//   2. fsync every file and directory in it; compute each file's size and CRC-32;
//   3. write MANIFEST.json, fsync it and the temporary directory;
//   4. rename the temporary directory to root/step_N (atomic within one filesystem); fsync root;
//   5. delete complete checkpoints beyond keep_last (never the one just written).
// So step_N exists only once every byte of it, its manifest included, is durable: a kill (or power
// loss) at any moment leaves either no step_N or a complete one. Leftover temporaries are never
// read; the next save removes those of dead processes on this host.
//
// What "complete" means (verify_checkpoint): MANIFEST.json parses, names the directory's step, and
// every file it lists exists with the listed size: a stat per file, so listing checkpoints stays
// instant for 100 GB checkpoints. The CRC-32 (zlib's crc32, the same as Python's zlib.crc32) is
// checked only for the checkpoint chosen to resume from (resolve_resume): one sequential read
// at ~3 GB/s, which also warms the page cache for the load that follows. It catches files damaged
// after the commit (a bad copy, bit rot), which the protocol above cannot.
//
// Multi-rank use: one rank (rank 0) runs the protocol. When every rank writes its own files (sharded
// optimizer state), use begin_checkpoint on rank 0, broadcast pending.tmp_dir, let every rank write
// into it, barrier, then commit_checkpoint on rank 0. The directory must be on a filesystem every
// writing rank sees.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace longtrain::trainer {

inline constexpr const char* kCheckpointManifest = "MANIFEST.json";

struct CheckpointRef {
  std::filesystem::path path;  // root/step_N
  int64_t step = 0;
};

struct CheckpointSaveOptions {
  // Keep the newest `keep_last` complete checkpoints (by step) after each save; 0 keeps all. The one
  // just written is always kept, even when older than keep_last others (a run resumed from an old
  // checkpoint). Directories that are not complete are neither counted nor deleted.
  int keep_last = 0;
  // Record each file's CRC-32 in the manifest (one extra read of what was written, from the page
  // cache). Without it resume verifies sizes only.
  bool checksums = true;
};

// A checkpoint being written: begin_checkpoint made tmp_dir; commit or abort it.
struct PendingCheckpoint {
  std::filesystem::path root;
  int64_t step = 0;
  std::filesystem::path tmp_dir;
};

// Creates root (if needed) and root/.tmp-step_N-<host>-<pid>/, first removing leftover temporaries
// of dead processes on this host. Throws if this process is already writing step N.
PendingCheckpoint begin_checkpoint(const std::filesystem::path& root, int64_t step);
// Steps 2-5 above. If root/step_N already exists (step N saved again) the new one replaces it.
CheckpointRef commit_checkpoint(const PendingCheckpoint& pending, const CheckpointSaveOptions& options = {});
// Removes the temporary directory; never throws.
void abort_checkpoint(const PendingCheckpoint& pending) noexcept;

// begin, write_files(tmp_dir), commit. If write_files (or the commit) throws, the temporary directory
// is removed, no step_N appears, earlier checkpoints are untouched, and the exception propagates.
CheckpointRef save_checkpoint_dir(const std::filesystem::path& root, int64_t step,
                                  const std::function<void(const std::filesystem::path& tmp_dir)>& write_files,
                                  const CheckpointSaveOptions& options = {});

enum class CheckpointVerify {
  sizes,      // manifest valid, every listed file present with its size
  checksums,  // also every file's CRC-32 (when the manifest records them)
};

// Why `dir` is not a complete checkpoint ("" when it is): names the missing manifest, the file whose
// size or checksum differs, and so on.
std::string verify_checkpoint(const std::filesystem::path& dir, CheckpointVerify level = CheckpointVerify::sizes);

// The step of a directory named step_N, or nullopt for any other name.
std::optional<int64_t> checkpoint_step_from_name(const std::string& name);

// Complete checkpoints under root (verified at `level`), oldest first. A missing root has none.
// Every step_N directory that fails verification is described in *skipped when given.
std::vector<CheckpointRef> list_complete_checkpoints(const std::filesystem::path& root,
                                                      CheckpointVerify level = CheckpointVerify::sizes,
                                                      std::vector<std::string>* skipped = nullptr);

// The complete checkpoint with the highest step, or nullopt. Incomplete step_N directories and
// temporaries are ignored (and described in *skipped when given).
std::optional<CheckpointRef> find_latest_complete(const std::filesystem::path& root,
                                                  CheckpointVerify level = CheckpointVerify::sizes,
                                                  std::vector<std::string>* skipped = nullptr);

// What `--resume SPEC` means:
//   "" or "none"  no resume (nullopt);
//   "auto"        the newest checkpoint under root that verifies with checksums, or nullopt (a fresh
//                 start) when there is none; newer ones that fail are described in *skipped;
//   DIR           that checkpoint directory (as given, or relative to root: "step_300"); an error
//                 naming it when it does not exist or is not complete (with the reason, and the
//                 complete checkpoints under root to choose from instead).
std::optional<CheckpointRef> resolve_resume(const std::filesystem::path& root, const std::string& spec,
                                            std::vector<std::string>* skipped = nullptr);

}  // namespace longtrain::trainer

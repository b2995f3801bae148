#include "trainer/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "runtime/error.h"

namespace longtrain::trainer {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr const char* kManifestFormat = "longtrain-checkpoint";
constexpr int kManifestVersion = 1;
constexpr const char* kTmpPrefix = ".tmp-";

// Temporary directories this process is writing or deleting right now: the stale-temporary sweep
// must not take them for leftovers of a dead process that had our pid (containers reuse pids).
std::mutex g_active_mutex;
std::set<std::string> g_active;

void mark_active(const fs::path& p, bool active) {
  std::lock_guard<std::mutex> lock(g_active_mutex);
  if (active)
    g_active.insert(p.filename().string());
  else
    g_active.erase(p.filename().string());
}

bool is_active(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_active_mutex);
  return g_active.count(name) != 0;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == '\0') return "localhost";
  std::string h(buf);
  for (char& c : h)  // keep the directory name plain
    if (c == '/' || c == ' ') c = '_';
  return h;
}

std::string step_name(int64_t step) { return fmt::format("step_{}", step); }

std::string tmp_name(const std::string& what) {
  return fmt::format("{}{}-{}-{}", kTmpPrefix, what, host_name(), static_cast<long>(::getpid()));
}

// fsync a file or directory. Some filesystems refuse fsync on directories (EINVAL); there is nothing
// more we can do there, so that alone is not an error.
void fsync_path(const fs::path& p, bool directory) {
  int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC | (directory ? O_DIRECTORY : 0));
  LT_CHECK(fd >= 0, "checkpoint: cannot open '{}' to fsync it: {}", p.string(), std::strerror(errno));
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  LT_CHECK(rc == 0 || (directory && (err == EINVAL || err == ENOTSUP)), "checkpoint: fsync of '{}' failed: {}",
           p.string(), std::strerror(err));
}

uint32_t file_crc32(const fs::path& p) {
  int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  LT_CHECK(fd >= 0, "checkpoint: cannot open '{}': {}", p.string(), std::strerror(errno));
  std::vector<unsigned char> buf(4 << 20);
  uLong crc = crc32_z(0L, Z_NULL, 0);
  for (;;) {
    ssize_t n = ::read(fd, buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      LT_FAIL("checkpoint: reading '{}' failed: {}", p.string(), std::strerror(err));
    }
    if (n == 0) break;
    crc = crc32_z(crc, buf.data(), static_cast<size_t>(n));
  }
  ::close(fd);
  return static_cast<uint32_t>(crc);
}

void write_file_durably(const fs::path& p, const std::string& text) {
  int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  LT_CHECK(fd >= 0, "checkpoint: cannot create '{}': {}", p.string(), std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      int err = errno;
      ::close(fd);
      LT_FAIL("checkpoint: writing '{}' failed: {}", p.string(), std::strerror(err));
    }
    done += static_cast<size_t>(n);
  }
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  LT_CHECK(rc == 0, "checkpoint: fsync of '{}' failed: {}", p.string(), std::strerror(err));
}

std::optional<std::string> read_small_file(const fs::path& p) {
  std::FILE* f = std::fopen(p.c_str(), "rb");
  if (f == nullptr) return std::nullopt;
  std::string text;
  char buf[65536];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), f)) > 0) text.append(buf, n);
  bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) return std::nullopt;
  return text;
}

struct ParsedTmpName {
  std::string host;
  long pid = 0;
};

// ".tmp-<what>-<host>-<pid>" where <what> has no '-' (host names may).
std::optional<ParsedTmpName> parse_tmp_name(const std::string& name) {
  if (name.rfind(kTmpPrefix, 0) != 0) return std::nullopt;
  std::string rest = name.substr(std::strlen(kTmpPrefix));
  size_t first = rest.find('-'), last = rest.rfind('-');
  if (first == std::string::npos || last == first) return std::nullopt;
  ParsedTmpName out;
  out.host = rest.substr(first + 1, last - first - 1);
  const std::string pid = rest.substr(last + 1);
  auto [ptr, ec] = std::from_chars(pid.data(), pid.data() + pid.size(), out.pid);
  if (ec != std::errc() || ptr != pid.data() + pid.size() || out.pid <= 0) return std::nullopt;
  return out;
}

bool process_alive(long pid) { return ::kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM; }

// Removes temporaries left by processes of this host that no longer run. Those of other hosts are
// left alone: their writer may be alive (a shared filesystem), and a pid means nothing here.
void remove_stale_temporaries(const fs::path& root) {
  std::error_code ec;
  const std::string me = host_name();
  const long my_pid = static_cast<long>(::getpid());
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    const std::string name = e.path().filename().string();
    std::optional<ParsedTmpName> t = parse_tmp_name(name);
    if (!t || t->host != me) continue;
    bool stale = t->pid == my_pid ? !is_active(name) : !process_alive(t->pid);
    if (stale) fs::remove_all(e.path(), ec);  // best effort: a failure leaves it for the next sweep
  }
}

// Moves `dir` out of the namespace first (one atomic rename), then deletes it: a kill during the
// deletion leaves a temporary, never a half-deleted step_N.
void delete_checkpoint_dir(const fs::path& dir, int64_t step) {
  const fs::path trash = dir.parent_path() / tmp_name("old_" + step_name(step));
  mark_active(trash, true);
  std::error_code ec;
  fs::remove_all(trash, ec);
  fs::rename(dir, trash, ec);
  if (ec) {
    mark_active(trash, false);
    LT_FAIL("checkpoint: cannot move '{}' aside to delete it: {}", dir.string(), ec.message());
  }
  fs::remove_all(trash, ec);
  mark_active(trash, false);
  LT_CHECK(!ec, "checkpoint: deleting old checkpoint '{}' (moved to '{}') failed: {}", dir.string(), trash.string(),
           ec.message());
}

struct FileRecord {
  std::string path;  // relative to the checkpoint directory, '/'-separated
  uint64_t bytes = 0;
  std::optional<uint32_t> crc32;
};

std::string describe_list(const std::vector<CheckpointRef>& refs) {
  if (refs.empty()) return "none";
  std::string s;
  for (auto it = refs.rbegin(); it != refs.rend() && it - refs.rbegin() < 5; ++it)
    s += (s.empty() ? "" : ", ") + it->path.filename().string();
  if (refs.size() > 5) s += fmt::format(" (and {} older)", refs.size() - 5);
  return s;
}

}  // namespace

std::optional<int64_t> checkpoint_step_from_name(const std::string& name) {
  const std::string prefix = "step_";
  if (name.rfind(prefix, 0) != 0 || name.size() == prefix.size()) return std::nullopt;
  const char* begin = name.data() + prefix.size();
  const char* end = name.data() + name.size();
  if (!std::all_of(begin, end, [](char c) { return c >= '0' && c <= '9'; })) return std::nullopt;
  int64_t step = 0;
  auto [ptr, ec] = std::from_chars(begin, end, step);
  if (ec != std::errc() || ptr != end) return std::nullopt;
  return step;
}

PendingCheckpoint begin_checkpoint(const fs::path& root, int64_t step) {
  LT_CHECK(step >= 0, "checkpoint: step must be non-negative (got {})", step);
  std::error_code ec;
  fs::create_directories(root, ec);
  LT_CHECK(!ec, "checkpoint: cannot create checkpoint root '{}': {}", root.string(), ec.message());
  remove_stale_temporaries(root);
  PendingCheckpoint p{root, step, root / tmp_name(step_name(step))};
  LT_CHECK(!is_active(p.tmp_dir.filename().string()),
           "checkpoint: this process is already writing step {} into '{}'", step, p.tmp_dir.string());
  fs::remove_all(p.tmp_dir, ec);  // our own leftover of an earlier failed attempt
  fs::create_directory(p.tmp_dir, ec);
  LT_CHECK(!ec, "checkpoint: cannot create '{}': {}", p.tmp_dir.string(), ec.message());
  mark_active(p.tmp_dir, true);
  return p;
}

void abort_checkpoint(const PendingCheckpoint& pending) noexcept {
  std::error_code ec;
  fs::remove_all(pending.tmp_dir, ec);
  mark_active(pending.tmp_dir, false);
}

CheckpointRef commit_checkpoint(const PendingCheckpoint& pending, const CheckpointSaveOptions& options) {
  const fs::path& tmp = pending.tmp_dir;
  LT_CHECK(fs::is_directory(tmp), "checkpoint: '{}' does not exist (not begun, or already committed)", tmp.string());

  // Every file the writer left, made durable, with its size and checksum; then the directories.
  std::vector<FileRecord> files;
  std::vector<fs::path> dirs;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(tmp)) {
    const std::string rel = e.path().lexically_relative(tmp).generic_string();
    if (e.is_symlink())
      LT_FAIL("checkpoint: the writer left a symbolic link '{}' in '{}'; checkpoints hold regular files only", rel,
              tmp.string());
    if (e.is_directory()) {
      dirs.push_back(e.path());
      continue;
    }
    LT_CHECK(e.is_regular_file(), "checkpoint: '{}' in '{}' is not a regular file", rel, tmp.string());
    LT_CHECK(rel != kCheckpointManifest, "checkpoint: the writer wrote '{}', which is reserved for the manifest",
             kCheckpointManifest);
    fsync_path(e.path(), false);
    FileRecord r{rel, static_cast<uint64_t>(e.file_size()), std::nullopt};
    if (options.checksums) r.crc32 = file_crc32(e.path());
    files.push_back(std::move(r));
  }
  for (const fs::path& d : dirs) fsync_path(d, true);
  std::sort(files.begin(), files.end(), [](const FileRecord& a, const FileRecord& b) { return a.path < b.path; });

  // The manifest is the commit record: written last, durable before the rename publishes it.
  json manifest;
  manifest["format"] = kManifestFormat;
  manifest["version"] = kManifestVersion;
  manifest["step"] = pending.step;
  manifest["files"] = json::array();
  for (const FileRecord& f : files) {
    json r = {{"path", f.path}, {"bytes", f.bytes}};
    if (f.crc32) r["crc32"] = *f.crc32;
    manifest["files"].push_back(r);
  }
  write_file_durably(tmp / kCheckpointManifest, manifest.dump(2) + "\n");
  fsync_path(tmp, true);

  const fs::path final_dir = pending.root / step_name(pending.step);
  std::error_code ec;
  if (fs::exists(fs::symlink_status(final_dir))) {
    // Step N saved again: swap atomically where the filesystem can (the old one is then at tmp),
    // otherwise move the old one aside first. Either way it is deleted below.
    if (::renameat2(AT_FDCWD, tmp.c_str(), AT_FDCWD, final_dir.c_str(), RENAME_EXCHANGE) == 0) {
      std::error_code ignored;
      fs::remove_all(tmp, ignored);  // a failure leaves a temporary for a later sweep
    } else {
      delete_checkpoint_dir(final_dir, pending.step);
      fs::rename(tmp, final_dir, ec);
    }
  } else {
    fs::rename(tmp, final_dir, ec);
  }
  LT_CHECK(!ec, "checkpoint: renaming '{}' to '{}' failed: {}", tmp.string(), final_dir.string(), ec.message());
  mark_active(tmp, false);
  fsync_path(pending.root, true);

  if (options.keep_last > 0) {
    std::vector<CheckpointRef> complete = list_complete_checkpoints(pending.root);
    std::sort(complete.begin(), complete.end(), [](const CheckpointRef& a, const CheckpointRef& b) { return a.step > b.step; });
    for (size_t i = static_cast<size_t>(options.keep_last); i < complete.size(); ++i) {
      if (complete[i].step == pending.step) continue;
      try {
        delete_checkpoint_dir(complete[i].path, complete[i].step);
      } catch (const Error& e) {
        LT_FAIL("checkpoint '{}' was saved, but removing old checkpoints (keep_last {}) failed: {}",
                final_dir.string(), options.keep_last, e.what());
      }
    }
    fsync_path(pending.root, true);
  }
  return {final_dir, pending.step};
}

CheckpointRef save_checkpoint_dir(const fs::path& root, int64_t step,
                                  const std::function<void(const fs::path& tmp_dir)>& write_files,
                                  const CheckpointSaveOptions& options) {
  PendingCheckpoint pending = begin_checkpoint(root, step);
  try {
    write_files(pending.tmp_dir);
    return commit_checkpoint(pending, options);
  } catch (...) {
    abort_checkpoint(pending);
    throw;
  }
}

std::string verify_checkpoint(const fs::path& dir, CheckpointVerify level) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return fmt::format("'{}' is not a directory", dir.string());
  const fs::path manifest_path = dir / kCheckpointManifest;
  if (!fs::is_regular_file(manifest_path, ec))
    return fmt::format("'{}' has no {} (its write was interrupted, or it is not a longtrain checkpoint)", dir.string(),
                       kCheckpointManifest);
  std::optional<std::string> text = read_small_file(manifest_path);
  if (!text) return fmt::format("cannot read '{}': {}", manifest_path.string(), std::strerror(errno));
  json m;
  try {
    m = json::parse(*text);
  } catch (const json::exception& e) {
    return fmt::format("'{}' is not valid JSON: {}", manifest_path.string(), e.what());
  }
  try {
    if (!m.is_object() || m.value("format", "") != kManifestFormat)
      return fmt::format("'{}' is not a longtrain checkpoint manifest", manifest_path.string());
    if (m.at("version").get<int>() != kManifestVersion)
      return fmt::format("'{}' has manifest version {}; this build reads version {}", manifest_path.string(),
                         m.at("version").dump(), kManifestVersion);
    const int64_t step = m.at("step").get<int64_t>();
    std::optional<int64_t> named = checkpoint_step_from_name(dir.filename().string());
    if (named && *named != step)
      return fmt::format("'{}' records step {} but the directory is named for step {}", manifest_path.string(), step,
                         *named);
    for (const json& r : m.at("files")) {
      const std::string rel = r.at("path").get<std::string>();
      const uint64_t bytes = r.at("bytes").get<uint64_t>();
      const fs::path rel_path(rel);
      if (rel.empty() || rel_path.is_absolute() ||
          std::any_of(rel_path.begin(), rel_path.end(), [](const fs::path& part) { return part == ".."; }))
        return fmt::format("'{}' lists '{}', which is not a path inside the checkpoint", manifest_path.string(), rel);
      const fs::path file = dir / rel;
      if (!fs::is_regular_file(file, ec))
        return fmt::format("'{}' lists '{}', which is missing", manifest_path.string(), rel);
      const uint64_t actual = fs::file_size(file, ec);
      if (ec || actual != bytes)
        return fmt::format("'{}' is {} bytes but the manifest records {} (truncated or changed after the save)",
                           file.string(), actual, bytes);
      if (level == CheckpointVerify::checksums && r.contains("crc32")) {
        const uint32_t want = r.at("crc32").get<uint32_t>();
        const uint32_t got = file_crc32(file);
        if (got != want)
          return fmt::format("'{}' has CRC-32 {:08x} but the manifest records {:08x} (the file was damaged after the "
                             "save)",
                             file.string(), got, want);
      }
    }
  } catch (const json::exception& e) {
    return fmt::format("'{}' is malformed: {}", manifest_path.string(), e.what());
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<CheckpointRef> list_complete_checkpoints(const fs::path& root, CheckpointVerify level,
                                                      std::vector<std::string>* skipped) {
  std::vector<CheckpointRef> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    std::optional<int64_t> step = checkpoint_step_from_name(e.path().filename().string());
    if (!step || !e.is_directory(ec)) continue;
    std::string problem = verify_checkpoint(e.path(), level);
    if (problem.empty())
      out.push_back({e.path(), *step});
    else if (skipped)
      skipped->push_back(fmt::format("skipped {}: {}", e.path().filename().string(), problem));
  }
  std::sort(out.begin(), out.end(), [](const CheckpointRef& a, const CheckpointRef& b) { return a.step < b.step; });
  return out;
}

std::optional<CheckpointRef> find_latest_complete(const fs::path& root, CheckpointVerify level,
                                                  std::vector<std::string>* skipped) {
  std::vector<CheckpointRef> all = list_complete_checkpoints(root, level, skipped);
  if (all.empty()) return std::nullopt;
  return all.back();
}

std::optional<CheckpointRef> resolve_resume(const fs::path& root, const std::string& spec,
                                            std::vector<std::string>* skipped) {
  if (spec.empty() || spec == "none") return std::nullopt;
  if (spec == "auto") {
    // Sizes first for every candidate (cheap), then checksums newest-first until one passes.
    std::vector<CheckpointRef> complete = list_complete_checkpoints(root, CheckpointVerify::sizes, skipped);
    for (auto it = complete.rbegin(); it != complete.rend(); ++it) {
      std::string problem = verify_checkpoint(it->path, CheckpointVerify::checksums);
      if (problem.empty()) return *it;
      if (skipped) skipped->push_back(fmt::format("skipped {}: {}", it->path.filename().string(), problem));
    }
    return std::nullopt;
  }

  fs::path dir(spec);
  std::error_code ec;
  if (!fs::exists(dir, ec) && dir.is_relative() && fs::exists(root / dir, ec)) dir = root / dir;
  if (!fs::exists(dir, ec)) {
    LT_FAIL("--resume {}: no checkpoint at '{}'{}; complete checkpoints under '{}': {}", spec, spec,
            dir.is_relative() ? fmt::format(" (nor at '{}')", (root / dir).string()) : "", root.string(),
            describe_list(list_complete_checkpoints(root)));
  }
  std::string problem = verify_checkpoint(dir, CheckpointVerify::checksums);
  if (!problem.empty()) {
    // A checkpoint root named by mistake: say so, rather than only "no manifest".
    std::vector<CheckpointRef> inside = list_complete_checkpoints(dir);
    if (!inside.empty())
      LT_FAIL("--resume {}: '{}' is a checkpoint root, not a checkpoint; name one of its checkpoints ({}) or use "
              "--resume auto",
              spec, dir.string(), describe_list(inside));
    LT_FAIL("--resume {}: '{}' is not a complete checkpoint: {}; complete checkpoints under '{}': {}", spec,
            dir.string(), problem, root.string(), describe_list(list_complete_checkpoints(root)));
  }
  std::optional<int64_t> step = checkpoint_step_from_name(dir.filename().string());
  if (!step) {
    // A renamed or copied checkpoint: the manifest knows its step.
    std::optional<std::string> text = read_small_file(dir / kCheckpointManifest);
    LT_CHECK(text.has_value(), "--resume {}: cannot reread the manifest of '{}'", spec, dir.string());
    step = json::parse(*text).at("step").get<int64_t>();
  }
  return CheckpointRef{dir, *step};
}

}  // namespace longtrain::trainer

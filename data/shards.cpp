#include "data/shards.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <type_traits>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "data/documents.h"
#include "runtime/error.h"

namespace longtrain::data {

// Shards are little-endian on disk and read through a memory map without conversion.
static_assert(std::endian::native == std::endian::little, "shard I/O assumes a little-endian host");

namespace fs = std::filesystem;

// ---------------------------------------------------------------------------------------------
// writing

void write_idx(const std::string& path, int64_t vocab_size, std::span<const uint64_t> offsets) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  LT_CHECK(f, "cannot create '{}': {}", path, std::strerror(errno));
  const uint32_t version = kIdxVersion, dtype = kIdxDtypeU32;
  const uint64_t vocab = static_cast<uint64_t>(vocab_size);
  const uint64_t documents = offsets.size() - 1, tokens = offsets.back();
  bool ok = std::fwrite(kIdxMagic, 1, 8, f) == 8 && std::fwrite(&version, 4, 1, f) == 1 &&
            std::fwrite(&dtype, 4, 1, f) == 1 && std::fwrite(&vocab, 8, 1, f) == 1 &&
            std::fwrite(&documents, 8, 1, f) == 1 && std::fwrite(&tokens, 8, 1, f) == 1 &&
            std::fwrite(offsets.data(), 8, offsets.size(), f) == offsets.size();
  ok = (std::fclose(f) == 0) && ok;
  LT_CHECK(ok, "error writing '{}': {}", path, std::strerror(errno));
}

ShardWriter::ShardWriter(std::string dir, std::string split, int64_t vocab_size, int64_t max_shard_tokens)
    : dir_(std::move(dir)), split_(std::move(split)), vocab_size_(vocab_size),
      max_shard_tokens_(max_shard_tokens) {
  LT_CHECK(max_shard_tokens_ > 0, "shard size must be positive, got {} tokens", max_shard_tokens_);
}

ShardWriter::~ShardWriter() {
  if (bin_) std::fclose(bin_);
}

void ShardWriter::open_shard() {
  ShardInfo info;
  const int n = static_cast<int>(shards_.size());
  info.bin = fmt::format("{}-{:05d}.bin", split_, n);
  info.idx = fmt::format("{}-{:05d}.idx", split_, n);
  const std::string path = (fs::path(dir_) / info.bin).string();
  bin_ = std::fopen(path.c_str(), "wb");
  LT_CHECK(bin_, "cannot create '{}': {}", path, std::strerror(errno));
  shards_.push_back(info);
  offsets_.assign(1, 0);
}

void ShardWriter::close_shard() {
  if (!bin_) return;
  ShardInfo& info = shards_.back();
  const int rc = std::fclose(bin_);
  bin_ = nullptr;
  LT_CHECK(rc == 0, "error writing '{}': {}", (fs::path(dir_) / info.bin).string(), std::strerror(errno));
  write_idx((fs::path(dir_) / info.idx).string(), vocab_size_, offsets_);
  info.documents = static_cast<int64_t>(offsets_.size()) - 1;
  info.tokens = static_cast<int64_t>(offsets_.back());
}

void ShardWriter::add_document(std::span<const uint32_t> tokens) {
  if (tokens.empty()) return;
  const int64_t n = static_cast<int64_t>(tokens.size());
  if (bin_ && static_cast<int64_t>(offsets_.back()) > 0 &&
      static_cast<int64_t>(offsets_.back()) + n > max_shard_tokens_)
    close_shard();
  if (!bin_) open_shard();
  const size_t written = std::fwrite(tokens.data(), 4, tokens.size(), bin_);
  LT_CHECK(written == tokens.size(), "error writing '{}': {}", (fs::path(dir_) / shards_.back().bin).string(),
           std::strerror(errno));
  offsets_.push_back(offsets_.back() + static_cast<uint64_t>(n));
  ++total_documents_;
  total_tokens_ += n;
}

std::vector<ShardInfo> ShardWriter::finish() {
  close_shard();
  return shards_;
}

// ---------------------------------------------------------------------------------------------
// reading

MappedFile::MappedFile(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  LT_CHECK(fd >= 0, "cannot open '{}': {}", path, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int e = errno;
    ::close(fd);
    LT_FAIL("cannot stat '{}': {}", path, std::strerror(e));
  }
  size_ = static_cast<int64_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, static_cast<size_t>(size_), PROT_READ, MAP_PRIVATE, fd, 0);
    const int e = errno;
    ::close(fd);
    LT_CHECK(p != MAP_FAILED, "cannot memory-map '{}' ({} bytes): {}", path, size_, std::strerror(e));
    data_ = static_cast<const unsigned char*>(p);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  if (data_) ::munmap(const_cast<unsigned char*>(data_), static_cast<size_t>(size_));
}

MappedFile::MappedFile(MappedFile&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

MappedFile& MappedFile::operator=(MappedFile&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(const_cast<unsigned char*>(data_), static_cast<size_t>(size_));
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

nlohmann::json read_manifest(const std::string& dir) {
  LT_CHECK(fs::is_directory(dir), "shard directory '{}' does not exist (make it with `longtrain prepare`)",
           dir);
  const std::string path = (fs::path(dir) / kManifestName).string();
  LT_CHECK(fs::exists(path),
           "'{}' not found: '{}' is not a complete shard set (run `longtrain prepare`; an interrupted "
           "prepare leaves no manifest)", path, dir);
  nlohmann::json m;
  try {
    m = nlohmann::json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    LT_FAIL("'{}' is not valid JSON: {}", path, e.what());
  }
  // Checked by type before any value is read: json::value() throws its own exception when a field
  // holds another type (found by the shards fuzz target).
  LT_CHECK(m.is_object() && m.contains("format") && m["format"].is_string() &&
               m["format"].get<std::string>() == "longtrain-shards",
           "'{}' is not a longtrain shard manifest (\"format\" must be \"longtrain-shards\")", path);
  LT_CHECK(m.contains("version") && m["version"].is_number_integer(),
           "'{}' has no integer \"version\": not a manifest this build can read; prepare the shards again", path);
  const int64_t version = m["version"].get<int64_t>();
  LT_CHECK(version == kManifestVersion,
           "'{}' has manifest version {}, this build reads version {}: prepare the shards again", path,
           version, kManifestVersion);
  LT_CHECK(m.contains("vocab_size") && m["vocab_size"].is_number_integer() && m.contains("splits") &&
               m["splits"].is_object(),
           "'{}' lacks \"vocab_size\" or \"splits\"", path);
  return m;
}

std::string megatron_prefix(const std::string& path) {
  std::error_code ec;
  if (path.empty() || fs::is_directory(path, ec)) return "";
  std::string prefix = path;
  const std::string ext = fs::path(path).extension().string();
  if ((ext == ".bin" || ext == ".idx") && fs::is_regular_file(path, ec))
    prefix = path.substr(0, path.size() - 4);
  if (fs::is_regular_file(prefix + ".idx", ec) && fs::is_regular_file(prefix + ".bin", ec)) return prefix;
  return "";
}

namespace {

// Megatron's DType table (indexed_dataset.py): code -> bytes per token; 0 for codes that hold no
// token ids (floats) or do not exist.
int megatron_itemsize(int code) {
  switch (code) {
    case 1: case 2: return 1;  // uint8, int8
    case 3: case 8: return 2;  // int16, uint16
    case 4: return 4;          // int32
    case 5: return 8;          // int64
    default: return 0;
  }
}

const char* megatron_dtype_name(int code) {
  static const char* names[] = {"?", "uint8", "int8", "int16", "int32", "int64", "float64", "float32", "uint16"};
  return code >= 1 && code <= 8 ? names[code] : "unknown";
}

}  // namespace

void TokenCorpus::open_megatron(const std::string& prefix, int64_t expected_vocab_size) {
  megatron_ = true;
  Shard s;
  s.idx_path = prefix + ".idx";
  s.bin_path = prefix + ".bin";
  s.idx = MappedFile(s.idx_path);
  s.bin = MappedFile(s.bin_path);
  const unsigned char* h = s.idx.data();
  const int64_t idx_size = s.idx.size();
  LT_CHECK(idx_size >= 9 && std::memcmp(h, kMegatronMagic, 9) == 0,
           "index '{}' does not start with the Megatron magic \"MMIDIDX\\0\\0\": not a Megatron-LM/NeMo indexed "
           "dataset{}", s.idx_path,
           idx_size >= 8 && std::memcmp(h, kIdxMagic, 8) == 0
               ? " but one of our shards: point data.train at the shard set's directory"
               : "");
  LT_CHECK(idx_size >= kMegatronHeaderBytes, "index '{}' is truncated: {} bytes, its header needs {}", s.idx_path,
           idx_size, kMegatronHeaderBytes);
  uint64_t version = 0, sequences = 0, doc_count = 0;
  std::memcpy(&version, h + 9, 8);
  const int dtype = h[17];
  std::memcpy(&sequences, h + 18, 8);
  std::memcpy(&doc_count, h + 26, 8);
  LT_CHECK(version == 1, "index '{}' has Megatron index version {}; this build reads version 1", s.idx_path,
           version);
  const int itemsize = megatron_itemsize(dtype);
  LT_CHECK(itemsize > 0, "index '{}' has dtype code {} ({}): token ids must be an integer dtype (codes 1-5, 8: "
           "uint8, int8, int16, int32, int64, uint16)", s.idx_path, dtype, megatron_dtype_name(dtype));
  // Sizes as unsigned 128-bit-safe arithmetic: counts from a damaged header must not overflow.
  const uint64_t limit = static_cast<uint64_t>(idx_size);
  LT_CHECK(sequences <= limit / 12 && doc_count <= limit / 8,
           "index '{}' is truncated or damaged: its header claims {} sequences and a document index of {} "
           "entries, more than its {} bytes hold", s.idx_path, sequences, doc_count, idx_size);
  const int64_t N = static_cast<int64_t>(sequences), M = static_cast<int64_t>(doc_count);
  const int64_t want = kMegatronHeaderBytes + 12 * N + 8 * M;
  LT_CHECK(idx_size >= want, "index '{}' is truncated: {} bytes, but {} sequences and {} document-index "
           "entries need {}", s.idx_path, idx_size, N, M, want);
  LT_CHECK(idx_size == want, "index '{}' is {} bytes, {} more than {} sequences and {} document-index entries "
           "need: a multimodal dataset (sequence modes) or a damaged file; this build reads text datasets only",
           s.idx_path, idx_size, idx_size - want, N, M);
  LT_CHECK(M >= 1, "index '{}' has an empty document index (it needs at least the entry 0)", s.idx_path);

  // Sequences must tile the .bin in order: then the .bin is one stream of tokens.
  const unsigned char* lengths = h + kMegatronHeaderBytes;
  const unsigned char* pointers = lengths + 4 * N;
  const unsigned char* doc_index = pointers + 8 * N;
  std::vector<int64_t> seq_start(static_cast<size_t>(N) + 1, 0);  // in tokens
  int64_t expect_pointer = 0;
  for (int64_t i = 0; i < N; ++i) {
    int32_t len = 0;
    int64_t ptr = 0;
    std::memcpy(&len, lengths + 4 * i, 4);
    std::memcpy(&ptr, pointers + 8 * i, 8);
    LT_CHECK(len >= 0, "index '{}': sequence {} has a negative length {}", s.idx_path, i, len);
    LT_CHECK(ptr == expect_pointer,
             "index '{}': sequence {} starts at byte {} of '{}', but the sequences before it end at byte {}: the "
             "sizes and pointers are inconsistent (the index is damaged or belongs to another .bin)",
             s.idx_path, i, ptr, s.bin_path, expect_pointer);
    seq_start[static_cast<size_t>(i)] = expect_pointer / itemsize;
    expect_pointer += static_cast<int64_t>(len) * itemsize;
    // Checked as it grows, so that a damaged index cannot overflow the sum.
    LT_CHECK(expect_pointer <= s.bin.size(),
             "token file '{}' is {} bytes but sequence {} of its index '{}' ends at byte {}: the .bin is truncated "
             "(or the index belongs to another .bin)", s.bin_path, s.bin.size(), i, s.idx_path, expect_pointer);
  }
  seq_start[static_cast<size_t>(N)] = expect_pointer / itemsize;
  LT_CHECK(s.bin.size() == expect_pointer,
           "token file '{}' is {} bytes but its index '{}' describes {} sequences of {} tokens ({} bytes of {}){}",
           s.bin_path, s.bin.size(), s.idx_path, N, expect_pointer / itemsize, expect_pointer,
           megatron_dtype_name(dtype), s.bin.size() < expect_pointer ? ": the .bin is truncated" : "");
  // Document d starts at its first sequence's token; documents with no tokens would make two start
  // at one position, so only strictly rising offsets are kept (the last is the total, as ours).
  s.megatron_offsets.assign(1, 0);
  int64_t prev = 0;
  for (int64_t d = 0; d < M; ++d) {
    int64_t seq = 0;
    std::memcpy(&seq, doc_index + 8 * d, 8);
    LT_CHECK(seq >= prev && seq <= N && (d > 0 || seq == 0) && (d + 1 < M || seq == N),
             "index '{}': document index entry {} is {}; entries must rise from 0 to the sequence count {}",
             s.idx_path, d, seq, N);
    prev = seq;
    const uint64_t offset = static_cast<uint64_t>(seq_start[static_cast<size_t>(seq)]);
    if (offset > s.megatron_offsets.back()) s.megatron_offsets.push_back(offset);
  }
  s.dtype = dtype;
  s.tokens = expect_pointer / itemsize;
  s.documents = static_cast<int64_t>(s.megatron_offsets.size()) - 1;
  // No vocabulary in the file: the model's when given, else every id the dtype can hold that fits int32.
  vocab_size_ = expected_vocab_size > 0 ? expected_vocab_size : int64_t{1} << std::min(31, 8 * itemsize);
  num_tokens_ = s.tokens;
  num_documents_ = s.documents;
  shards_.push_back(std::move(s));
  LT_CHECK(num_tokens_ > 0, "Megatron dataset '{}' holds no tokens", prefix);
}

TokenCorpus::TokenCorpus(const std::string& dir, const std::string& split, int64_t expected_vocab_size)
    : dir_(dir), split_(split) {
  if (const std::string prefix = megatron_prefix(dir); !prefix.empty()) {
    open_megatron(prefix, expected_vocab_size);
    return;
  }
  if (!fs::is_directory(dir) && fs::exists(dir + ".idx") != fs::exists(dir + ".bin"))
    LT_FAIL("'{}' looks like a Megatron dataset prefix but '{}' is missing", dir,
            fs::exists(dir + ".idx") ? dir + ".bin" : dir + ".idx");
  manifest_ = read_manifest(dir);
  const std::string manifest_path = (fs::path(dir) / kManifestName).string();
  vocab_size_ = manifest_["vocab_size"].get<int64_t>();
  LT_CHECK(expected_vocab_size <= 0 || expected_vocab_size == vocab_size_,
           "vocabulary mismatch: the tokenizer/model has {} tokens but the shards in '{}' were made with "
           "a vocabulary of {} (recorded in '{}'): prepare the shards again with this tokenizer",
           expected_vocab_size, dir, vocab_size_, manifest_path);
  const auto& splits = manifest_["splits"];
  LT_CHECK(splits.contains(split), "'{}' has no \"{}\" split (it has: {}){}", manifest_path, split,
           [&] {
             std::string names;
             for (auto it = splits.begin(); it != splits.end(); ++it)
               names += (names.empty() ? "" : ", ") + it.key();
             return names.empty() ? std::string("none") : names;
           }(),
           split == "val" ? "; run prepare with --val-fraction to make one" : "");

  const nlohmann::json& entries = splits[split].is_object() ? splits[split].value("shards", nlohmann::json())
                                                             : nlohmann::json();
  LT_CHECK(entries.is_array(), "'{}': split \"{}\" has no \"shards\" list", manifest_path, split);
  for (const auto& entry : entries) {
    Shard s;
    int64_t want_docs = 0, want_tokens = 0;
    try {
      s.bin_path = (fs::path(dir) / entry.at("bin").get<std::string>()).string();
      s.idx_path = (fs::path(dir) / entry.at("idx").get<std::string>()).string();
      // Integers only: json's get<int64_t>() casts a float (1e300, say) unchecked (found by the shards
      // fuzz target).
      auto count = [&](const char* key) {
        const nlohmann::json& v = entry.at(key);
        LT_CHECK(v.is_number_integer(), "'{}': a shard entry of split \"{}\" has a non-integer \"{}\" ({}): "
                 "prepare the shards again", manifest_path, split, key, v.dump());
        return v.get<int64_t>();
      };
      want_docs = count("documents");
      want_tokens = count("tokens");
    } catch (const nlohmann::json::exception& e) {
      LT_FAIL("'{}': a shard entry of split \"{}\" is malformed ({}): prepare the shards again", manifest_path,
              split, e.what());
    }
    LT_CHECK(fs::exists(s.idx_path), "index '{}' listed in '{}' is missing", s.idx_path, manifest_path);
    LT_CHECK(fs::exists(s.bin_path), "token file '{}' listed in '{}' is missing", s.bin_path, manifest_path);
    s.idx = MappedFile(s.idx_path);
    s.bin = MappedFile(s.bin_path);

    // The .idx header.
    const unsigned char* h = s.idx.data();
    LT_CHECK(s.idx.size() >= kIdxHeaderBytes, "index '{}' is truncated: {} bytes, a header needs {}",
             s.idx_path, s.idx.size(), kIdxHeaderBytes);
    LT_CHECK(std::memcmp(h, kIdxMagic, 8) == 0,
             "index '{}' has a wrong magic number: not a longtrain .idx file", s.idx_path);
    uint32_t version, dtype;
    uint64_t vocab, documents, tokens;
    std::memcpy(&version, h + 8, 4);
    std::memcpy(&dtype, h + 12, 4);
    std::memcpy(&vocab, h + 16, 8);
    std::memcpy(&documents, h + 24, 8);
    std::memcpy(&tokens, h + 32, 8);
    LT_CHECK(version == kIdxVersion, "index '{}' has format version {}, this build reads version {}: "
             "prepare the shards again", s.idx_path, version, kIdxVersion);
    LT_CHECK(dtype == kIdxDtypeU32, "index '{}' has token dtype code {}, expected {} (uint32)", s.idx_path,
             dtype, kIdxDtypeU32);
    LT_CHECK(static_cast<int64_t>(vocab) == vocab_size_,
             "vocabulary mismatch: index '{}' records vocabulary size {} but '{}' says {}", s.idx_path,
             vocab, manifest_path, vocab_size_);
    LT_CHECK(static_cast<int64_t>(documents) == want_docs && static_cast<int64_t>(tokens) == want_tokens,
             "index '{}' holds {} documents and {} tokens but '{}' lists {} and {}: the set is "
             "inconsistent, prepare it again", s.idx_path, documents, tokens, manifest_path, want_docs,
             want_tokens);
    const int64_t idx_bytes = kIdxHeaderBytes + 8 * (static_cast<int64_t>(documents) + 1);
    LT_CHECK(s.idx.size() == idx_bytes, "index '{}' is {} bytes, expected {} for {} documents{}",
             s.idx_path, s.idx.size(), idx_bytes, documents,
             s.idx.size() < idx_bytes ? " (truncated)" : "");
    const int64_t bin_bytes = 4 * static_cast<int64_t>(tokens);
    LT_CHECK(s.bin.size() == bin_bytes,
             "token file '{}' is {} bytes but its index '{}' says {} tokens ({} bytes){}", s.bin_path,
             s.bin.size(), s.idx_path, tokens, bin_bytes,
             s.bin.size() < bin_bytes ? ": the file is truncated, prepare the shards again" : "");
    const uint64_t* off = s.offsets();
    LT_CHECK(off[0] == 0 && off[documents] == tokens,
             "index '{}': document offsets run from {} to {}, expected 0 to {}", s.idx_path, off[0],
             off[documents], tokens);
    for (uint64_t d = 0; d < documents; ++d)
      LT_CHECK(off[d] <= off[d + 1], "index '{}': document offsets decrease at document {}", s.idx_path, d);

    s.tokens = static_cast<int64_t>(tokens);
    s.documents = static_cast<int64_t>(documents);
    s.first_token = num_tokens_;
    s.first_document = num_documents_;
    num_tokens_ += s.tokens;
    num_documents_ += s.documents;
    shards_.push_back(std::move(s));
  }
  LT_CHECK(num_tokens_ > 0, "the \"{}\" split of '{}' holds no tokens", split, dir);
}

template <class T>
void TokenCorpus::copy_checked(const Shard& sh, int64_t local, int64_t n, int32_t* out) const {
  // Megatron's pointers are byte offsets of any alignment in principle: read through memcpy.
  const unsigned char* src = sh.bin.data() + local * static_cast<int64_t>(sizeof(T));
  for (int64_t i = 0; i < n; ++i) {
    T v;
    std::memcpy(&v, src + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
    bool negative = false;
    if constexpr (std::is_signed_v<T>) negative = v < 0;
    if (negative || static_cast<int64_t>(v) >= vocab_size_) {
      if (megatron_)
        LT_FAIL("token file '{}' token {} has id {}, outside the vocabulary [0, {}): the dataset was made with "
                "another tokenizer, or the model's vocab_size is too small", sh.bin_path, local + i,
                static_cast<int64_t>(v), vocab_size_);
      LT_FAIL("token file '{}' token {} has id {}, not below the vocabulary size {}: the file is "
              "corrupt, prepare the shards again", sh.bin_path, local + i, static_cast<int64_t>(v), vocab_size_);
    }
    out[i] = static_cast<int32_t>(v);
  }
}

size_t TokenCorpus::shard_of_token(int64_t t) const {
  // The last shard whose first token is <= t.
  auto it = std::upper_bound(shards_.begin(), shards_.end(), t,
                             [](int64_t v, const Shard& s) { return v < s.first_token; });
  return static_cast<size_t>(it - shards_.begin()) - 1;
}

void TokenCorpus::read(int64_t start, std::span<int32_t> out) const {
  const int64_t count = static_cast<int64_t>(out.size());
  LT_CHECK(start >= 0 && start + count <= num_tokens_, "read of tokens [{}, {}) outside the {} tokens "
           "of split \"{}\" in '{}'", start, start + count, num_tokens_, split_, dir_);
  int64_t done = 0;
  size_t s = count > 0 ? shard_of_token(start) : 0;
  while (done < count) {
    const Shard& sh = shards_[s];
    const int64_t local = start + done - sh.first_token;
    const int64_t n = std::min(count - done, sh.tokens - local);
    int32_t* dst = out.data() + done;
    switch (sh.dtype) {
      case 0: copy_checked<uint32_t>(sh, local, n, dst); break;
      case 1: copy_checked<uint8_t>(sh, local, n, dst); break;
      case 2: copy_checked<int8_t>(sh, local, n, dst); break;
      case 3: copy_checked<int16_t>(sh, local, n, dst); break;
      case 4: copy_checked<int32_t>(sh, local, n, dst); break;
      case 5: copy_checked<int64_t>(sh, local, n, dst); break;
      case 8: copy_checked<uint16_t>(sh, local, n, dst); break;
      default: LT_FAIL("token file '{}' has an unreadable dtype code {}", sh.bin_path, sh.dtype);
    }
    done += n;
    ++s;
  }
}

int64_t TokenCorpus::document_offset(int64_t d) const {
  LT_CHECK(d >= 0 && d <= num_documents_, "document {} outside [0, {}]", d, num_documents_);
  if (d == num_documents_) return num_tokens_;
  auto it = std::upper_bound(shards_.begin(), shards_.end(), d,
                             [](int64_t v, const Shard& s) { return v < s.first_document; });
  const Shard& sh = *(it - 1);
  return sh.first_token + static_cast<int64_t>(sh.offsets()[d - sh.first_document]);
}

std::vector<int64_t> TokenCorpus::document_starts(int64_t begin, int64_t end) const {
  std::vector<int64_t> starts;
  if (begin >= end) return starts;
  for (size_t s = shard_of_token(std::max<int64_t>(begin, 0)); s < shards_.size(); ++s) {
    const Shard& sh = shards_[s];
    if (sh.first_token >= end) break;
    const uint64_t* off = sh.offsets();
    // Document starts of this shard are off[0..D-1] (off[D] is the end of its last document).
    const uint64_t lo = static_cast<uint64_t>(std::max<int64_t>(begin - sh.first_token, 0));
    const uint64_t* first = std::lower_bound(off, off + sh.documents, lo);
    for (const uint64_t* p = first; p < off + sh.documents; ++p) {
      const int64_t t = sh.first_token + static_cast<int64_t>(*p);
      if (t >= end) break;
      // Empty documents are never written, so starts are distinct.
      starts.push_back(t);
    }
  }
  return starts;
}

}  // namespace longtrain::data

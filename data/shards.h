// Token shards: what `longtrain prepare` writes and the loader memory-maps.
//
// A shard set is a directory:
//
//   manifest.json          written last; its presence marks a complete set (see below)
//   train-00000.bin/.idx   the training split, cut into shards of at most --shard-tokens tokens
//   val-00000.bin/.idx     the validation split (--val-fraction), when there is one
//
// A .bin is the tokens of whole documents, back to back, each a little-endian uint32 (BOS/EOS
// already inserted as `prepare` was told). Its .idx, all fields little-endian:
//
//   offset  size      field
//   0       8         magic "LTIDX\0\0\0"
//   8       4         uint32 version (1)
//   12      4         uint32 dtype: 4 = uint32 tokens (the byte size of one token)
//   16      8         uint64 vocabulary size V (every token id is < V)
//   24      8         uint64 document count D
//   32      8         uint64 token count T (the .bin is exactly 4*T bytes)
//   40      8*(D+1)   uint64 document offsets, in tokens: document d is .bin tokens
//                     [offsets[d], offsets[d+1]); offsets[0] = 0, offsets[D] = T, non-decreasing
//
// manifest.json records the format version, the vocabulary size, the tokenizer (path, CRC-32 of the
// .model, BOS/EOS ids and whether each was added), the inputs, and per split its shards with their
// document and token counts. Opening a set checks every one of these against the files.
//
// Megatron-LM / NeMo indexed datasets (MMIDIDX) are read as they are, with no conversion: a pair
// PREFIX.bin / PREFIX.idx, named by PREFIX (as Megatron's --data-path does) or by either file. The
// .idx, little-endian, as megatron/core/datasets/indexed_dataset.py writes it:
//
//   offset     size      field
//   0          9         magic "MMIDIDX\0\0"
//   9          8         uint64 version (1)
//   17         1         uint8 dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
//                        7 float32, 8 uint16 (Megatron's DType table; the float codes hold no token ids
//                        and are refused)
//   18         8         uint64 sequence count N
//   26         8         uint64 document count M (the length of the document index: documents + 1)
//   34         4*N       int32 sequence lengths, in tokens
//   34+4N      8*N       int64 sequence pointers: byte offset of each sequence in the .bin
//   34+12N     8*M       int64 document index: document d is sequences [doc[d], doc[d+1]); doc[0] = 0,
//                        doc[M-1] = N, non-decreasing
//
// The .bin is the sequences back to back (pointer[i+1] = pointer[i] + itemsize*length[i], as every
// Megatron writer makes them) and exactly as long as they are; anything else is refused. Document
// boundaries are the document index's (a document of several sentence sequences is one document).
// The file has no vocabulary size: ids are checked against the model's when one is given. Such a
// dataset has no splits: any split name reads the whole of it, so a validation set must be named
// separately (data.val).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace longtrain::data {

inline constexpr char kIdxMagic[8] = {'L', 'T', 'I', 'D', 'X', '\0', '\0', '\0'};
inline constexpr uint32_t kIdxVersion = 1;
inline constexpr uint32_t kIdxDtypeU32 = 4;
inline constexpr int64_t kIdxHeaderBytes = 40;
inline constexpr int kManifestVersion = 1;
inline constexpr const char* kManifestName = "manifest.json";
inline constexpr char kMegatronMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr int64_t kMegatronHeaderBytes = 34;

// The .bin/.idx prefix when `path` names a Megatron indexed dataset (PREFIX, PREFIX.bin or
// PREFIX.idx, with both files present); "" otherwise (a shard-set directory, or nothing).
std::string megatron_prefix(const std::string& path);

struct ShardInfo {
  std::string bin;  // file names inside the set's directory
  std::string idx;
  int64_t documents = 0;
  int64_t tokens = 0;
};

// Writes one split ("train" or "val") as shards of at most `max_shard_tokens` tokens; a document is
// never cut (a document longer than the limit gets a shard of its own).
class ShardWriter {
 public:
  ShardWriter(std::string dir, std::string split, int64_t vocab_size, int64_t max_shard_tokens);
  ~ShardWriter();
  void add_document(std::span<const uint32_t> tokens);
  // Writes the last shard's index; returns every shard written.
  std::vector<ShardInfo> finish();
  int64_t documents() const { return total_documents_; }
  int64_t tokens() const { return total_tokens_; }

 private:
  void open_shard();
  void close_shard();

  std::string dir_, split_;
  int64_t vocab_size_, max_shard_tokens_;
  std::vector<ShardInfo> shards_;
  std::FILE* bin_ = nullptr;
  std::vector<uint64_t> offsets_;  // of the open shard
  int64_t total_documents_ = 0, total_tokens_ = 0;
};

// Writes an .idx file (the format above).
void write_idx(const std::string& path, int64_t vocab_size, std::span<const uint64_t> offsets);

// A read-only memory map of a whole file.
class MappedFile {
 public:
  MappedFile() = default;
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(MappedFile&& o) noexcept;
  MappedFile& operator=(MappedFile&& o) noexcept;
  const unsigned char* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  const unsigned char* data_ = nullptr;
  int64_t size_ = 0;
};

// One split of a shard set, memory-mapped, read as one stream of tokens: the shards back to back.
class TokenCorpus {
 public:
  // Opens `split` of the set in `dir` and validates it: manifest present and of our version, every
  // .idx (magic, version, dtype, vocabulary, offsets) and .bin (its size) as the manifest says.
  // `expected_vocab_size` > 0 also checks the set was made with a tokenizer of that vocabulary.
  // `dir` may also name a Megatron indexed dataset (see above; `split` is then not used): its .idx is
  // validated against its .bin, and ids against `expected_vocab_size` (when > 0) as they are read.
  TokenCorpus(const std::string& dir, const std::string& split, int64_t expected_vocab_size = 0);

  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_documents() const { return num_documents_; }
  int64_t vocab_size() const { return vocab_size_; }
  const nlohmann::json& manifest() const { return manifest_; }
  const std::string& dir() const { return dir_; }
  const std::string& split() const { return split_; }
  bool is_megatron() const { return megatron_; }

  // Copies stream tokens [start, start + out.size()) into out; checks every id is < vocab size.
  void read(int64_t start, std::span<int32_t> out) const;
  // Stream positions p in [begin, end) where a document starts, ascending.
  std::vector<int64_t> document_starts(int64_t begin, int64_t end) const;
  // Stream offset of document d's first token (d in [0, D]; d = D gives num_tokens()).
  int64_t document_offset(int64_t d) const;

 private:
  struct Shard {
    std::string bin_path, idx_path;
    MappedFile bin, idx;
    int64_t first_token = 0;     // stream offset of its first token
    int64_t first_document = 0;  // stream index of its first document
    int64_t tokens = 0, documents = 0;
    int dtype = 0;                            // a Megatron dtype code, or 0: our uint32
    std::vector<uint64_t> megatron_offsets;   // document token offsets (D+1) of a Megatron dataset
    const uint64_t* offsets() const {
      if (!megatron_offsets.empty()) return megatron_offsets.data();
      return reinterpret_cast<const uint64_t*>(idx.data() + kIdxHeaderBytes);
    }
  };
  size_t shard_of_token(int64_t t) const;
  void open_megatron(const std::string& prefix, int64_t expected_vocab_size);
  template <class T>
  void copy_checked(const Shard& sh, int64_t local, int64_t n, int32_t* out) const;
  bool megatron_ = false;

  std::string dir_, split_;
  nlohmann::json manifest_;
  std::vector<Shard> shards_;
  int64_t num_tokens_ = 0, num_documents_ = 0, vocab_size_ = 0;
};

// Reads and checks manifest.json of a shard set (error names the file and what is wrong).
nlohmann::json read_manifest(const std::string& dir);

}  // namespace longtrain::data

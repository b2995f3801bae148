// safetensors I/O: named tensors to and from the Hugging Face safetensors format, the format of our
// checkpoints' model.safetensors and of every Hugging Face Llama checkpoint.
//
// File layout (huggingface/safetensors README):
//   [8 bytes]  N, the header length, unsigned little-endian
//   [N bytes]  UTF-8 JSON object: {"__metadata__": {str: str}, "NAME": {"dtype": "BF16",
//              "shape": [V, C], "data_offsets": [BEGIN, END]}, ...}, padded with spaces
//   [rest]     the tensors, C order, little-endian; offsets are relative to the start of this
//              buffer and tile it exactly: sorted by offset, each tensor begins where the previous
//              one ends, the first at 0, the last at the end of the file.
//
// The reader is as strict as the reference reader (safetensors/src/tensor.rs): every rule above is
// checked before any tensor is read, and every error names the file and, where there is one, the
// tensor. The writer pads the header to a multiple of 8 bytes and orders tensors by decreasing
// element size, so every tensor lies at an offset that is a multiple of its element size (what the
// reference writer does; a memory-mapped reader can use the data in place).
//
// Everything here works on host memory: callers copy GPU arenas to a host arena before saving and
// load into a host arena before copying to the GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "runtime/arena.h"
#include "runtime/tensor.h"

namespace longtrain::model {

// ---------------------------------------------------------------------------------------------
// Writing

struct NamedTensor {
  std::string name;
  Tensor tensor;  // contiguous, on the CPU
};

struct SafetensorsSaveOptions {
  // Store every floating-point tensor with this dtype (f32 master weights as bf16: round to nearest,
  // ties to even; bf16 as f32: exact). Unset: each tensor keeps its own dtype. Integer tensors are
  // never converted.
  std::optional<DType> dtype;
  // Extra "__metadata__" entries. "format": "pt" is always written: transformers refuses files
  // without it.
  std::map<std::string, std::string> metadata;
};

// Writes `tensors` to `path` (replacing it). Throws longtrain::Error naming the file and tensor when a
// tensor is not on the CPU or not contiguous, a name repeats, or the write fails (the partial file is
// removed). The file is not fsynced: trainer/checkpoint.h makes whole checkpoint directories durable.
void save_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                      const SafetensorsSaveOptions& options = {});
// Every entry of an allocated host arena, under its entry name.
void save_safetensors(const std::string& path, const Arena& arena, const SafetensorsSaveOptions& options = {});

// The safetensors name of a dtype: "F32", "F64", "BF16", "I32".
const char* safetensors_dtype_name(DType dtype);

// ---------------------------------------------------------------------------------------------
// Reading

// How a stored dtype may become the arena's dtype.
enum class DTypeConversion {
  exact,     // the same dtype, or a widening that loses nothing: BF16/F16 -> f32/f64, F32 -> f64
  rounding,  // also narrowing float conversions (F32 -> bf16, F64 -> f32), round to nearest even
};

// What to do with tensors in the file(s) that the arena has no entry for.
enum class ExtraTensors {
  error,   // a file that does not match the model exactly is an error (resume from our own checkpoint)
  ignore,  // skip them (HF checkpoints can carry buffers such as rotary_emb.inv_freq)
};

// One tensor as described by the header.
struct SafetensorsTensor {
  std::string name;
  std::string dtype;  // as written: "F32", "BF16", "F16", "I8", ...
  std::vector<int64_t> shape;
  int64_t numel = 0;
  uint64_t begin = 0, end = 0;      // data_offsets, relative to the start of the data buffer
  const std::byte* data = nullptr;  // into the mapped file; not necessarily aligned
};

// A memory-mapped, fully validated safetensors file.
class SafetensorsFile {
 public:
  // Maps `path` and validates the header and the layout; throws longtrain::Error naming the file
  // (and the tensor) on any violation of the format.
  explicit SafetensorsFile(std::string path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;
  SafetensorsFile(SafetensorsFile&& other) noexcept;
  SafetensorsFile& operator=(SafetensorsFile&& other) noexcept;

  const std::string& path() const { return path_; }
  const std::vector<SafetensorsTensor>& tensors() const { return tensors_; }  // in data-offset order
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  const SafetensorsTensor* find(const std::string& name) const;  // nullptr when absent

  // Copies tensor `name` into `dst` (CPU, contiguous), converting its dtype as `conversion` allows.
  // Throws naming the file and tensor when it is absent, its shape differs from dst's (both shapes
  // shown) or its dtype cannot become dst's.
  void read(const std::string& name, const Tensor& dst, DTypeConversion conversion = DTypeConversion::exact) const;

 private:
  void unmap();

  std::string path_;
  void* map_ = nullptr;
  size_t size_ = 0;
  std::vector<SafetensorsTensor> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

struct SafetensorsLoadReport {
  std::vector<std::string> ignored;  // tensors of the files the arena has no entry for
};

// Loads every entry of an allocated host arena from the tensor of the same name. A tensor the arena
// needs and the file lacks is an error (every missing name counted, the first ones listed); so is a
// shape mismatch (file, tensor, expected and found shapes) or a dtype the conversion does not allow.
SafetensorsLoadReport load_safetensors(const std::string& path, const Arena& arena,
                                       ExtraTensors extra = ExtraTensors::error,
                                       DTypeConversion conversion = DTypeConversion::exact);
// The same over several files holding disjoint sets of tensors (a sharded Hugging Face checkpoint);
// a name found in two files is an error.
SafetensorsLoadReport load_safetensors(const std::vector<std::string>& paths, const Arena& arena,
                                       ExtraTensors extra = ExtraTensors::error,
                                       DTypeConversion conversion = DTypeConversion::exact);

struct SafetensorsLoadOptions {
  ExtraTensors extra = ExtraTensors::error;
  DTypeConversion conversion = DTypeConversion::exact;
  int threads = 1;  // threads converting from the mapped files; 0 = one per core
  // Called after each converted piece (up to 4M elements) with the bytes read so far and in all, under
  // a lock (so it may log), from whichever thread converted it.
  std::function<void(uint64_t done_bytes, uint64_t total_bytes)> progress;
};
// Everything is checked before anything is converted, as above; then the tensors are converted in
// pieces by `threads` threads straight from the memory-mapped files.
SafetensorsLoadReport load_safetensors(const std::vector<std::string>& paths, const Arena& arena,
                                       const SafetensorsLoadOptions& options);

}  // namespace longtrain::model

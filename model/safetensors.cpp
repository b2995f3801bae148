#include "model/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <exception>
#include <mutex>
#include <thread>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "runtime/error.h"

namespace longtrain::model {

namespace {

using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;

// The reference reader's limit (safetensors/src/tensor.rs, MAX_HEADER_SIZE): a larger header is a
// corrupt length field, not a real header.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// Every dtype of the format, with its size in bits (the reference enum, in its order). Files with
// any of them validate; only the ones that Elem below knows can be loaded.
struct FileDType {
  const char* name;
  int bits;
};
constexpr FileDType kFileDTypes[] = {
    {"BOOL", 8},  {"F4", 4},       {"F6_E2M3", 6},     {"F6_E3M2", 6},     {"U8", 8},   {"I8", 8},
    {"F8_E5M2", 8}, {"F8_E4M3", 8}, {"F8_E8M0", 8},   {"F8_E4M3FNUZ", 8}, {"F8_E5M2FNUZ", 8},
    {"I16", 16},  {"U16", 16},     {"F16", 16},        {"BF16", 16},       {"I32", 32}, {"U32", 32},
    {"F32", 32},  {"C64", 64},     {"F64", 64},        {"I64", 64},        {"U64", 64},
};

const FileDType* find_file_dtype(const std::string& name) {
  for (const FileDType& d : kFileDTypes)
    if (name == d.name) return &d;
  return nullptr;
}

std::string known_dtype_list() {
  std::string s;
  for (const FileDType& d : kFileDTypes) s += (s.empty() ? "" : ", ") + std::string(d.name);
  return s;
}

std::string shape_string(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::vector<int64_t> tensor_shape(const Tensor& t) { return std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim); }

// ---------------------------------------------------------------------------------------------
// Element encodings we convert between: the four runtime dtypes, plus F16 as a file dtype (many
// Hugging Face Llama checkpoints are float16).

enum class Elem { f32, f64, bf16, f16, i32 };

size_t elem_size(Elem e) {
  switch (e) {
    case Elem::f32: return 4;
    case Elem::f64: return 8;
    case Elem::bf16: return 2;
    case Elem::f16: return 2;
    case Elem::i32: return 4;
  }
  return 0;
}

const char* elem_name(Elem e) {
  switch (e) {
    case Elem::f32: return "F32";
    case Elem::f64: return "F64";
    case Elem::bf16: return "BF16";
    case Elem::f16: return "F16";
    case Elem::i32: return "I32";
  }
  return "?";
}

Elem elem_of(DType d) {
  switch (d) {
    case DType::f32: return Elem::f32;
    case DType::f64: return Elem::f64;
    case DType::bf16: return Elem::bf16;
    case DType::i32: return Elem::i32;
  }
  return Elem::f32;
}

std::optional<Elem> elem_of_file(const std::string& name) {
  if (name == "F32") return Elem::f32;
  if (name == "F64") return Elem::f64;
  if (name == "BF16") return Elem::bf16;
  if (name == "F16") return Elem::f16;
  if (name == "I32") return Elem::i32;
  return std::nullopt;
}

bool is_float(Elem e) { return e != Elem::i32; }

// Exact: the value set of `from` is contained in that of `to`.
bool widens_exactly(Elem from, Elem to) {
  if (from == to) return true;
  if (!is_float(from) || !is_float(to)) return false;
  if (to == Elem::f64) return true;
  return to == Elem::f32 && (from == Elem::bf16 || from == Elem::f16);
}

bool conversion_allowed(Elem from, Elem to, DTypeConversion conversion) {
  if (widens_exactly(from, to)) return true;
  return conversion == DTypeConversion::rounding && is_float(from) && is_float(to);
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  uint32_t bits;
  if (exponent == 0) {
    if (mantissa == 0) {
      bits = sign;
    } else {  // subnormal: mantissa · 2^-24, exact in float
      float f = std::ldexp(static_cast<float>(mantissa), -24);
      return sign ? -f : f;
    }
  } else if (exponent == 31) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // inf or NaN (payload kept)
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);  // rebias 15 -> 127
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// double -> float rounding to odd: the truncated value with its last bit forced to 1 when inexact.
// Rounding that to bf16 (16 fewer mantissa bits) to nearest even then gives the correctly rounded
// bf16 of the double; rounding f64 -> f32 -> bf16 to nearest twice would not, at ties.
float round_to_odd_float(double d) {
  float t = static_cast<float>(d);
  if (static_cast<double>(t) == d || std::isnan(d)) return t;
  if (std::fabs(static_cast<double>(t)) > std::fabs(d)) t = std::nextafter(t, 0.0f);
  uint32_t bits;
  std::memcpy(&bits, &t, 4);
  bits |= 1u;
  std::memcpy(&t, &bits, 4);
  return t;
}

template <class T>
T load_raw(const std::byte* p, int64_t i) {
  T v;
  std::memcpy(&v, p + static_cast<size_t>(i) * sizeof(T), sizeof(T));  // the data may be unaligned
  return v;
}

template <class T>
void store_raw(std::byte* p, int64_t i, T v) {
  std::memcpy(p + static_cast<size_t>(i) * sizeof(T), &v, sizeof(T));
}

// Converts n elements. Floating sources are read exactly as float (bf16, f16, f32) or double (f64);
// every rounding happens once, to nearest even.
void convert(const std::byte* src, Elem from, std::byte* dst, Elem to, int64_t n) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(n) * elem_size(from));
    return;
  }
  auto read_float = [&](int64_t i) -> float {
    switch (from) {
      case Elem::f32: return load_raw<float>(src, i);
      case Elem::bf16: return bf16::to_float(load_raw<uint16_t>(src, i));
      case Elem::f16: return half_to_float(load_raw<uint16_t>(src, i));
      default: return 0.0f;
    }
  };
  if (to == Elem::f64) {
    for (int64_t i = 0; i < n; ++i) store_raw<double>(dst, i, static_cast<double>(read_float(i)));
  } else if (to == Elem::f32) {
    if (from == Elem::f64) {
      for (int64_t i = 0; i < n; ++i) store_raw<float>(dst, i, static_cast<float>(load_raw<double>(src, i)));
    } else {
      for (int64_t i = 0; i < n; ++i) store_raw<float>(dst, i, read_float(i));
    }
  } else if (to == Elem::bf16) {
    if (from == Elem::f64) {
      for (int64_t i = 0; i < n; ++i)
        store_raw<uint16_t>(dst, i, bf16::from_float(round_to_odd_float(load_raw<double>(src, i))));
    } else {
      for (int64_t i = 0; i < n; ++i) store_raw<uint16_t>(dst, i, bf16::from_float(read_float(i)));
    }
  } else {
    LT_FAIL("no conversion from {} to {}", elem_name(from), elem_name(to));
  }
}

bool checked_numel(const std::vector<int64_t>& shape, int64_t* numel) {
  int64_t n = 1;
  for (int64_t s : shape)
    if (s < 0 || __builtin_mul_overflow(n, s, &n)) return false;
  *numel = n;
  return true;
}

// Why `t` cannot be read into a tensor of `shape` and `dtype`, or "" when it can.
std::string read_problem(const SafetensorsTensor& t, const std::vector<int64_t>& shape, DType dtype,
                         DTypeConversion conversion) {
  if (t.shape != shape)
    return fmt::format("tensor '{}' has shape {} in the file, expected {}", t.name, shape_string(t.shape),
                       shape_string(shape));
  std::optional<Elem> from = elem_of_file(t.dtype);
  if (!from)
    return fmt::format("tensor '{}' is stored as {}, which longtrain cannot load (F32, F64, BF16, F16 and I32 can be)",
                       t.name, t.dtype);
  Elem to = elem_of(dtype);
  if (!conversion_allowed(*from, to, conversion)) {
    if (is_float(*from) && is_float(to))
      return fmt::format("tensor '{}' is stored as {} but the destination is {}: narrowing loses precision; load "
                         "with DTypeConversion::rounding to round to nearest even",
                         t.name, t.dtype, dtype_name(dtype));
    return fmt::format("tensor '{}' is stored as {} and cannot become {}", t.name, t.dtype, dtype_name(dtype));
  }
  return "";
}

// Removes the partial file on every exit but a successful commit().
struct OutputFile {
  std::string path;
  std::FILE* f = nullptr;

  explicit OutputFile(std::string p) : path(std::move(p)) {
    f = std::fopen(path.c_str(), "wb");
    LT_CHECK(f != nullptr, "safetensors file '{}': cannot create it: {}", path, std::strerror(errno));
  }
  void write(const void* data, size_t bytes) {
    if (bytes == 0) return;
    LT_CHECK(std::fwrite(data, 1, bytes, f) == bytes, "safetensors file '{}': write failed: {}", path,
             std::strerror(errno));
  }
  void commit() {
    std::FILE* g = std::exchange(f, nullptr);
    LT_CHECK(std::fclose(g) == 0, "safetensors file '{}': write failed when closing: {}", path, std::strerror(errno));
    path.clear();
  }
  ~OutputFile() {
    if (f) std::fclose(f);
    if (!path.empty()) std::remove(path.c_str());
  }
};

}  // namespace

const char* safetensors_dtype_name(DType dtype) { return elem_name(elem_of(dtype)); }

// ---------------------------------------------------------------------------------------------
// Writing

void save_safetensors(const std::string& path, const std::vector<NamedTensor>& tensors,
                      const SafetensorsSaveOptions& options) {
  // Stored dtype of each tensor, and the write order: larger elements first (stable, so equal sizes
  // keep the caller's order), which keeps every tensor at an offset that is a multiple of its
  // element size once the header is padded to a multiple of 8.
  std::vector<Elem> stored(tensors.size());
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const NamedTensor& nt = tensors[i];
    LT_CHECK(nt.name != "__metadata__", "safetensors file '{}': '__metadata__' is reserved and cannot name a tensor",
             path);
    LT_CHECK(names.insert(nt.name).second, "safetensors file '{}': tensor '{}' is given twice", path, nt.name);
    LT_CHECK(nt.tensor.device == Device::cpu,
             "safetensors file '{}': tensor '{}' is on the GPU; copy it to a host arena before saving", path, nt.name);
    LT_CHECK(nt.tensor.is_contiguous(), "safetensors file '{}': tensor '{}' ({}) is not contiguous", path, nt.name,
             nt.tensor.describe());
    LT_CHECK(nt.tensor.numel() == 0 || nt.tensor.data != nullptr, "safetensors file '{}': tensor '{}' has no data",
             path, nt.name);
    Elem own = elem_of(nt.tensor.dtype);
    stored[i] = (options.dtype && is_float(own)) ? elem_of(*options.dtype) : own;
    LT_CHECK(is_float(own) == is_float(stored[i]),
             "safetensors file '{}': tensor '{}' is {} and cannot be saved as {}", path, nt.name,
             dtype_name(nt.tensor.dtype), elem_name(stored[i]));
  }
  std::vector<size_t> order(tensors.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return elem_size(stored[a]) > elem_size(stored[b]); });

  ordered_json header = ordered_json::object();
  ordered_json metadata = ordered_json::object();
  metadata["format"] = "pt";
  for (const auto& [k, v] : options.metadata) metadata[k] = v;
  header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (size_t i : order) {
    const Tensor& t = tensors[i].tensor;
    uint64_t bytes = static_cast<uint64_t>(t.numel()) * elem_size(stored[i]);
    header[tensors[i].name] = {{"dtype", elem_name(stored[i])},
                               {"shape", tensor_shape(t)},
                               {"data_offsets", {offset, offset + bytes}}};
    offset += bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');

  OutputFile out(path);
  unsigned char length[8];
  for (int b = 0; b < 8; ++b) length[b] = static_cast<unsigned char>(static_cast<uint64_t>(text.size()) >> (8 * b));
  out.write(length, 8);
  out.write(text.data(), text.size());
  constexpr int64_t kChunk = 1 << 20;  // elements converted per write
  std::vector<std::byte> buffer;
  for (size_t i : order) {
    const Tensor& t = tensors[i].tensor;
    const Elem own = elem_of(t.dtype), to = stored[i];
    const auto* src = static_cast<const std::byte*>(t.data);
    if (own == to) {
      out.write(src, t.nbytes());
      continue;
    }
    buffer.resize(static_cast<size_t>(kChunk) * elem_size(to));
    for (int64_t start = 0; start < t.numel(); start += kChunk) {
      int64_t n = std::min(kChunk, t.numel() - start);
      convert(src + static_cast<size_t>(start) * elem_size(own), own, buffer.data(), to, n);
      out.write(buffer.data(), static_cast<size_t>(n) * elem_size(to));
    }
  }
  out.commit();
}

void save_safetensors(const std::string& path, const Arena& arena, const SafetensorsSaveOptions& options) {
  LT_CHECK(arena.allocated(), "safetensors file '{}': arena '{}' is not allocated", path, arena.kind());
  LT_CHECK(arena.device() == Device::cpu,
           "safetensors file '{}': arena '{}' is on the GPU; copy it to a host arena before saving", path,
           arena.kind());
  std::vector<NamedTensor> tensors;
  tensors.reserve(arena.table().size());
  for (size_t i = 0; i < arena.table().size(); ++i) tensors.push_back({arena.table()[i].name, arena.at(i)});
  save_safetensors(path, tensors, options);
}

// ---------------------------------------------------------------------------------------------
// Reading

SafetensorsFile::SafetensorsFile(std::string path) : path_(std::move(path)) {
  const std::string& p = path_;
  int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  LT_CHECK(fd >= 0, "safetensors file '{}': cannot open it: {}", p, std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    LT_FAIL("safetensors file '{}': cannot stat it: {}", p, std::strerror(err));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ < 8) {
    ::close(fd);
    LT_FAIL("safetensors file '{}' is {} bytes: too short for the 8-byte header length (truncated or not a "
            "safetensors file)",
            p, size_);
  }
  map_ = ::mmap(nullptr, size_, PROT_READ, MAP_PRIVATE, fd, 0);
  int map_errno = errno;
  ::close(fd);
  if (map_ == MAP_FAILED) {
    map_ = nullptr;
    LT_FAIL("safetensors file '{}': cannot map it: {}", p, std::strerror(map_errno));
  }
  // From here the destructor will not run if we throw: unmap on every failure.
  try {
    const auto* bytes = static_cast<const unsigned char*>(map_);
    uint64_t n = 0;
    for (int b = 7; b >= 0; --b) n = (n << 8) | bytes[b];
    LT_CHECK(n <= kMaxHeaderBytes,
             "safetensors file '{}': header length {} exceeds the format's limit of {} bytes (corrupt length field or "
             "not a safetensors file)",
             p, n, kMaxHeaderBytes);
    LT_CHECK(8 + n <= size_,
             "safetensors file '{}': header length {} runs past the end of the file ({} bytes): the file is "
             "truncated or not a safetensors file",
             p, n, size_);
    const char* text = reinterpret_cast<const char*>(bytes + 8);

    // Parse, noting repeated top-level keys: JSON parsers keep one of them silently, the format
    // forbids them.
    std::set<std::string> keys;
    std::string repeated;
    auto note_keys = [&](int depth, json::parse_event_t event, json& parsed) {
      if (event == json::parse_event_t::key && depth == 1 && !keys.insert(parsed.get<std::string>()).second &&
          repeated.empty())
        repeated = parsed.get<std::string>();
      return true;
    };
    json header;
    try {
      header = json::parse(text, text + n, note_keys);
    } catch (const json::exception& e) {
      LT_FAIL("safetensors file '{}': the header is not valid JSON: {}", p, e.what());
    }
    LT_CHECK(header.is_object(), "safetensors file '{}': the header is JSON {} but must be an object", p,
             header.type_name());
    LT_CHECK(repeated.empty(), "safetensors file '{}': the header names '{}' twice", p, repeated);

    const uint64_t data_bytes = size_ - 8 - n;
    for (auto it = header.begin(); it != header.end(); ++it) {
      const std::string& name = it.key();
      const json& v = it.value();
      if (name == "__metadata__") {
        LT_CHECK(v.is_object(), "safetensors file '{}': __metadata__ must be an object of strings", p);
        for (auto m = v.begin(); m != v.end(); ++m) {
          LT_CHECK(m.value().is_string(), "safetensors file '{}': __metadata__ value of '{}' is {}; only strings are "
                   "allowed", p, m.key(), m.value().type_name());
          metadata_[m.key()] = m.value().get<std::string>();
        }
        continue;
      }
      LT_CHECK(v.is_object(), "safetensors file '{}': tensor '{}': its entry is {}, not an object", p, name,
               v.type_name());
      SafetensorsTensor t;
      t.name = name;
      auto dtype_it = v.find("dtype");
      LT_CHECK(dtype_it != v.end() && dtype_it->is_string(), "safetensors file '{}': tensor '{}' has no string dtype",
               p, name);
      t.dtype = dtype_it->get<std::string>();
      const FileDType* fdt = find_file_dtype(t.dtype);
      LT_CHECK(fdt != nullptr, "safetensors file '{}': tensor '{}' has unknown dtype '{}' (the format knows {})", p,
               name, t.dtype, known_dtype_list());
      auto shape_it = v.find("shape");
      LT_CHECK(shape_it != v.end() && shape_it->is_array(), "safetensors file '{}': tensor '{}' has no shape array",
               p, name);
      for (const json& s : *shape_it) {
        LT_CHECK(s.is_number_unsigned() && s.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX),
                 "safetensors file '{}': tensor '{}' has shape entry {}; shapes are non-negative integers", p, name,
                 s.dump());
        t.shape.push_back(s.get<int64_t>());
      }
      auto off_it = v.find("data_offsets");
      LT_CHECK(off_it != v.end() && off_it->is_array() && off_it->size() == 2 && (*off_it)[0].is_number_unsigned() &&
                   (*off_it)[1].is_number_unsigned(),
               "safetensors file '{}': tensor '{}' needs data_offsets [BEGIN, END] of two non-negative integers", p,
               name);
      t.begin = (*off_it)[0].get<uint64_t>();
      t.end = (*off_it)[1].get<uint64_t>();
      LT_CHECK(t.end >= t.begin, "safetensors file '{}': tensor '{}' has data_offsets [{}, {}] that end before they "
               "begin", p, name, t.begin, t.end);
      int64_t numel = 0;
      uint64_t bits = 0;
      bool fits = checked_numel(t.shape, &numel) &&
                  !__builtin_mul_overflow(static_cast<uint64_t>(numel), static_cast<uint64_t>(fdt->bits), &bits);
      LT_CHECK(fits, "safetensors file '{}': tensor '{}' shape {} overflows", p, name, shape_string(t.shape));
      LT_CHECK(bits % 8 == 0, "safetensors file '{}': tensor '{}' of {} x {} ends inside a byte", p, name,
               shape_string(t.shape), t.dtype);
      t.numel = numel;
      LT_CHECK(bits / 8 == t.end - t.begin,
               "safetensors file '{}': tensor '{}' is {} {} = {} bytes but its data_offsets [{}, {}] span {} bytes", p,
               name, t.dtype, shape_string(t.shape), bits / 8, t.begin, t.end, t.end - t.begin);
      tensors_.push_back(std::move(t));
    }

    // The tensors must tile the data buffer: sorted by offset, each begins where the previous ends.
    std::sort(tensors_.begin(), tensors_.end(), [](const SafetensorsTensor& a, const SafetensorsTensor& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    uint64_t expected = 0;
    const SafetensorsTensor* previous = nullptr;
    for (const SafetensorsTensor& t : tensors_) {
      if (t.begin < expected)
        LT_FAIL("safetensors file '{}': tensor '{}' data_offsets [{}, {}] overlap tensor '{}' [{}, {}]", p, t.name,
                t.begin, t.end, previous->name, previous->begin, previous->end);
      if (t.begin > expected)
        LT_FAIL("safetensors file '{}': tensor '{}' begins at {} leaving a hole of {} bytes after {} (the format "
                "forbids holes)",
                p, t.name, t.begin, t.begin - expected, previous ? "tensor '" + previous->name + "'" : "the header");
      LT_CHECK(t.end <= data_bytes,
               "safetensors file '{}': tensor '{}' data_offsets [{}, {}] run past the end of the data ({} bytes after "
               "the header): the file is truncated",
               p, t.name, t.begin, t.end, data_bytes);
      expected = t.end;
      previous = &t;
    }
    LT_CHECK(expected == data_bytes,
             "safetensors file '{}': {} bytes follow the last tensor{} (the data must end the file)", p,
             data_bytes - expected, previous ? " '" + previous->name + "'" : "");

    const auto* data = reinterpret_cast<const std::byte*>(bytes + 8 + n);
    for (size_t i = 0; i < tensors_.size(); ++i) {
      tensors_[i].data = data + tensors_[i].begin;
      index_[tensors_[i].name] = i;
    }
  } catch (...) {
    unmap();
    throw;
  }
}

void SafetensorsFile::unmap() {
  if (map_ != nullptr) ::munmap(map_, size_);
  map_ = nullptr;
}

SafetensorsFile::~SafetensorsFile() { unmap(); }

SafetensorsFile::SafetensorsFile(SafetensorsFile&& o) noexcept
    : path_(std::move(o.path_)), map_(std::exchange(o.map_, nullptr)), size_(o.size_), tensors_(std::move(o.tensors_)),
      index_(std::move(o.index_)), metadata_(std::move(o.metadata_)) {}

SafetensorsFile& SafetensorsFile::operator=(SafetensorsFile&& o) noexcept {
  if (this != &o) {
    unmap();
    path_ = std::move(o.path_);
    map_ = std::exchange(o.map_, nullptr);
    size_ = o.size_;
    tensors_ = std::move(o.tensors_);
    index_ = std::move(o.index_);
    metadata_ = std::move(o.metadata_);
  }
  return *this;
}

const SafetensorsTensor* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

void SafetensorsFile::read(const std::string& name, const Tensor& dst, DTypeConversion conversion) const {
  const SafetensorsTensor* t = find(name);
  LT_CHECK(t != nullptr, "safetensors file '{}' has no tensor '{}'", path_, name);
  LT_CHECK(dst.device == Device::cpu && dst.is_contiguous(),
           "safetensors file '{}': tensor '{}' must be read into contiguous host memory, not {}", path_, name,
           dst.describe());
  std::string problem = read_problem(*t, tensor_shape(dst), dst.dtype, conversion);
  LT_CHECK(problem.empty(), "safetensors file '{}': {}", path_, problem);
  convert(t->data, *elem_of_file(t->dtype), static_cast<std::byte*>(dst.data), elem_of(dst.dtype), t->numel);
}

SafetensorsLoadReport load_safetensors(const std::string& path, const Arena& arena, ExtraTensors extra,
                                       DTypeConversion conversion) {
  return load_safetensors(std::vector<std::string>{path}, arena, extra, conversion);
}

SafetensorsLoadReport load_safetensors(const std::vector<std::string>& paths, const Arena& arena, ExtraTensors extra,
                                       DTypeConversion conversion) {
  SafetensorsLoadOptions options;
  options.extra = extra;
  options.conversion = conversion;
  return load_safetensors(paths, arena, options);
}

SafetensorsLoadReport load_safetensors(const std::vector<std::string>& paths, const Arena& arena,
                                       const SafetensorsLoadOptions& options) {
  const ExtraTensors extra = options.extra;
  const DTypeConversion conversion = options.conversion;
  LT_CHECK(!paths.empty(), "load_safetensors: no file given for arena '{}'", arena.kind());
  std::string files = paths.size() == 1 ? fmt::format("'{}'", paths[0]) : fmt::format("'{}' (and {} more)", paths[0], paths.size() - 1);
  LT_CHECK(arena.allocated(), "loading {}: arena '{}' is not allocated", files, arena.kind());
  LT_CHECK(arena.device() == Device::cpu, "loading {}: arena '{}' is on the GPU; load into a host arena and copy it",
           files, arena.kind());

  std::vector<SafetensorsFile> opened;
  opened.reserve(paths.size());
  std::map<std::string, size_t> owner;  // tensor name -> index into opened
  for (const std::string& path : paths) {
    opened.emplace_back(path);
    for (const SafetensorsTensor& t : opened.back().tensors()) {
      auto [it, inserted] = owner.emplace(t.name, opened.size() - 1);
      LT_CHECK(inserted, "safetensors files '{}' and '{}' both hold tensor '{}'", opened[it->second].path(), path,
               t.name);
    }
  }

  // Check everything before copying anything, and report every problem at once: a model that does
  // not match its checkpoint usually mismatches in many tensors, and the pattern tells why.
  std::vector<std::string> problems;
  std::vector<std::string> missing;
  std::set<std::string> wanted;
  for (const ArenaEntry& e : arena.table()) {
    wanted.insert(e.name);
    auto it = owner.find(e.name);
    if (it == owner.end()) {
      missing.push_back(e.name);
      continue;
    }
    const SafetensorsFile& f = opened[it->second];
    std::string problem = read_problem(*f.find(e.name), e.shape, e.dtype, conversion);
    if (!problem.empty()) problems.push_back(fmt::format("'{}': {}", f.path(), problem));
  }
  if (!missing.empty()) {
    std::string list;
    for (size_t i = 0; i < missing.size() && i < 8; ++i) list += (i ? ", " : "") + missing[i];
    if (missing.size() > 8) list += ", ...";
    problems.insert(problems.begin(), fmt::format("{}: {} tensor(s) of arena '{}' are missing: {}", files,
                                                  missing.size(), arena.kind(), list));
  }
  SafetensorsLoadReport report;
  for (const auto& [name, file] : owner) {
    if (wanted.count(name)) continue;
    if (extra == ExtraTensors::ignore)
      report.ignored.push_back(name);
    else
      problems.push_back(fmt::format("'{}': tensor '{}' is not part of arena '{}' (unexpected extra tensor)",
                                     opened[file].path(), name, arena.kind()));
  }
  if (!problems.empty()) {
    std::string text;
    for (size_t i = 0; i < problems.size() && i < 12; ++i) text += "\n  " + problems[i];
    if (problems.size() > 12) text += fmt::format("\n  ... and {} more", problems.size() - 12);
    LT_FAIL("cannot load arena '{}' from safetensors {}: {} problem(s):{}", arena.kind(), files, problems.size(), text);
  }

  // Everything checked: convert in pieces of up to 4M elements spread over the threads, straight
  // from the mapped files (the page cache is read once, by whichever thread converts the piece).
  struct Piece {
    const std::byte* src;
    Elem from;
    std::byte* dst;
    Elem to;
    int64_t n;
    uint64_t bytes;  // read from the file
  };
  constexpr int64_t kPieceElements = int64_t{1} << 22;
  std::vector<Piece> pieces;
  uint64_t total_bytes = 0;
  for (size_t i = 0; i < arena.table().size(); ++i) {
    const std::string& name = arena.table()[i].name;
    const SafetensorsTensor& t = *opened[owner.at(name)].find(name);
    const Tensor dst = arena.at(i);
    const Elem from = *elem_of_file(t.dtype), to = elem_of(dst.dtype);
    for (int64_t b = 0; b < t.numel; b += kPieceElements) {
      const int64_t n = std::min(kPieceElements, t.numel - b);
      const uint64_t bytes = static_cast<uint64_t>(n) * elem_size(from);
      pieces.push_back({t.data + static_cast<size_t>(b) * elem_size(from), from,
                        static_cast<std::byte*>(dst.data) + static_cast<size_t>(b) * elem_size(to), to, n, bytes});
      total_bytes += bytes;
    }
  }
  const int threads = static_cast<int>(std::clamp<size_t>(
      options.threads > 0 ? static_cast<size_t>(options.threads) : std::max(1u, std::thread::hardware_concurrency()),
      1, std::max<size_t>(1, pieces.size())));
  std::atomic<size_t> next{0};
  std::mutex progress_mutex;
  uint64_t done_bytes = 0;
  std::exception_ptr failure;
  auto work = [&] {
    try {
      for (size_t k = next++; k < pieces.size(); k = next++) {
        const Piece& p = pieces[k];
        convert(p.src, p.from, p.dst, p.to, p.n);
        std::lock_guard<std::mutex> lock(progress_mutex);
        done_bytes += p.bytes;
        if (options.progress) options.progress(done_bytes, total_bytes);
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(progress_mutex);
      if (!failure) failure = std::current_exception();
      next = pieces.size();
    }
  };
  std::vector<std::thread> pool;
  for (int t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
  if (failure) std::rethrow_exception(failure);
  return report;
}

}  // namespace longtrain::model

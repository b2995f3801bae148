#include "data/rdata.h"

#include <cctype>
#include <cstring>
#include <fstream>
#include <iterator>

#include <zlib.h>

#include "runtime/error.h"

namespace longtrain::data {

namespace {

// R's SEXP type codes and CHARSXP encoding levels (R's Defn.h / serialize.c).
constexpr int kCharSxp = 9;
constexpr int kStrSxp = 16;
constexpr int kHasAttributesBit = 1 << 9;
constexpr int kLatin1Level = 1 << 2;
constexpr int kUtf8Level = 1 << 3;
constexpr int kAsciiLevel = 1 << 6;
constexpr int kBytesLevel = 1 << 1;

std::string read_whole_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LT_CHECK(in.good(), "cannot open '{}': {} (fetch the corpus with scripts/fetch-corpus.sh?)", path,
           std::strerror(errno));
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

uint32_t read_be32(const unsigned char* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}

// A cursor over XDR (big-endian) serialization bytes that reports where it ran out.
struct XdrReader {
  const std::string& bytes;
  const std::string& what;
  size_t pos = 0;

  void need(size_t n, const char* field) {
    LT_CHECK(pos + n <= bytes.size(), "{}: truncated R serialization: {} needs {} bytes at offset {}, "
             "only {} left", what, field, n, pos, bytes.size() - pos);
  }
  int32_t int32(const char* field) {
    need(4, field);
    uint32_t v = read_be32(reinterpret_cast<const unsigned char*>(bytes.data() + pos));
    pos += 4;
    return static_cast<int32_t>(v);
  }
  std::string raw(size_t n, const char* field) {
    need(n, field);
    std::string s = bytes.substr(pos, n);
    pos += n;
    return s;
  }
};

std::string latin1_to_utf8(const std::string& s) {
  std::string out;
  out.reserve(s.size() + s.size() / 8);
  for (unsigned char c : s) {
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
    } else {
      out.push_back(static_cast<char>(0xC0 | (c >> 6)));
      out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
    }
  }
  return out;
}

bool is_latin1_name(std::string name) {
  for (char& c : name) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return name == "latin1" || name == "iso-8859-1" || name == "iso8859-1" || name == "iso_8859-1";
}

}  // namespace

std::vector<RdbRecord> read_rdb_records(const std::string& path) {
  const std::string file = read_whole_file(path);
  LT_CHECK(!file.empty(), "'{}' is empty: expected R lazy-load records (4-byte length + zlib stream)",
           path);
  const auto* data = reinterpret_cast<const unsigned char*>(file.data());
  std::vector<RdbRecord> records;
  size_t pos = 0;
  while (pos < file.size()) {
    const int index = static_cast<int>(records.size());
    LT_CHECK(pos + 5 <= file.size(), "'{}' record {} at offset {}: truncated header ({} bytes left)",
             path, index, pos, file.size() - pos);
    const uint32_t expected = read_be32(data + pos);
    // R writes zlib streams directly (first byte 0x78); bzip2/xz records carry a type byte '2'/'Z'.
    LT_CHECK(data[pos + 4] == 0x78,
             "'{}' record {} at offset {}: not a zlib stream (byte 0x{:02x}); only zlib-compressed "
             "lazy-load databases are supported", path, index, pos, data[pos + 4]);
    RdbRecord record;
    record.file_offset = static_cast<int64_t>(pos);
    record.bytes.resize(expected);

    z_stream zs{};
    LT_CHECK(inflateInit(&zs) == Z_OK, "zlib inflateInit failed");
    zs.next_in = const_cast<Bytef*>(data + pos + 4);
    zs.avail_in = static_cast<uInt>(file.size() - pos - 4);
    zs.next_out = reinterpret_cast<Bytef*>(record.bytes.data());
    zs.avail_out = expected;
    int rc = inflate(&zs, Z_FINISH);
    const size_t produced = zs.total_out, consumed = zs.total_in;
    inflateEnd(&zs);
    LT_CHECK(rc == Z_STREAM_END,
             "'{}' record {} at offset {}: zlib stream {} (zlib code {}, {} of {} bytes produced): the "
             "file is truncated or corrupt; fetch it again", path, index, pos,
             rc == Z_BUF_ERROR ? "longer than its recorded length or cut short" : "is corrupt", rc,
             produced, expected);
    LT_CHECK(produced == expected, "'{}' record {}: inflated to {} bytes but its header says {}", path,
             index, produced, expected);
    records.push_back(std::move(record));
    pos += 4 + consumed;
  }
  return records;
}

std::vector<std::optional<std::string>> unserialize_character_vector(const std::string& bytes,
                                                                     const std::string& what) {
  XdrReader in{bytes, what};
  const std::string format = in.raw(2, "format");
  LT_CHECK(format == "X\n", "{}: R serialization format '{}' is not XDR ('X\\n'); ascii and native "
           "binary formats are not supported", what, format[0] == '\n' ? std::string("\\n") : format);
  const int32_t version = in.int32("version");
  LT_CHECK(version == 2 || version == 3, "{}: R serialization version {} is not supported (2 or 3)",
           what, version);
  in.int32("writer version");
  in.int32("minimal reader version");
  std::string native_encoding = "UTF-8";
  if (version == 3) {
    const int32_t n = in.int32("native encoding length");
    LT_CHECK(n >= 0 && n < 256, "{}: bad native encoding length {}", what, n);
    native_encoding = in.raw(static_cast<size_t>(n), "native encoding");
  }
  const bool native_latin1 = is_latin1_name(native_encoding);

  const int32_t flags = in.int32("object flags");
  LT_CHECK((flags & 0xFF) == kStrSxp, "{}: the object is of R type {}, not a character vector (16)",
           what, flags & 0xFF);
  LT_CHECK((flags & kHasAttributesBit) == 0,
           "{}: the character vector carries attributes (names, class, ...); only plain vectors are "
           "supported", what);
  int64_t length = in.int32("vector length");
  if (length == -1) {  // long vector: two more int32, upper and lower halves
    const uint32_t upper = static_cast<uint32_t>(in.int32("long length (upper)"));
    const uint32_t lower = static_cast<uint32_t>(in.int32("long length (lower)"));
    length = static_cast<int64_t>((uint64_t{upper} << 32) | lower);
  }
  // Every element takes at least 8 bytes (flags and length), which bounds a corrupt length.
  LT_CHECK(length >= 0 && static_cast<uint64_t>(length) <= (bytes.size() - in.pos) / 8,
           "{}: vector length {} does not fit in the {} bytes left", what, length, bytes.size() - in.pos);

  std::vector<std::optional<std::string>> out;
  out.reserve(static_cast<size_t>(length));
  for (int64_t i = 0; i < length; ++i) {
    const int32_t eflags = in.int32("element flags");
    LT_CHECK((eflags & 0xFF) == kCharSxp, "{}: element {} is of R type {}, not a string (CHARSXP 9)",
             what, i, eflags & 0xFF);
    const int levels = eflags >> 12;
    const int32_t n = in.int32("string length");
    if (n == -1) {
      out.emplace_back(std::nullopt);
      continue;
    }
    LT_CHECK(n >= 0, "{}: element {} has length {}", what, i, n);
    std::string s = in.raw(static_cast<size_t>(n), "string bytes");
    const bool latin1 = (levels & kLatin1Level) != 0 ||
                        (native_latin1 && (levels & (kUtf8Level | kAsciiLevel | kBytesLevel)) == 0);
    out.emplace_back(latin1 ? latin1_to_utf8(s) : std::move(s));
  }
  LT_CHECK(in.pos == bytes.size(), "{}: {} bytes left after the {} strings of the vector", what,
           bytes.size() - in.pos, length);
  return out;
}

std::string slugify(const std::string& title, size_t max_length) {
  std::string slug;
  bool dash = false;
  for (unsigned char c : title) {
    if (std::isalnum(c)) {
      if (dash && !slug.empty()) slug.push_back('-');
      slug.push_back(static_cast<char>(std::tolower(c)));
      dash = false;
    } else {
      dash = true;
    }
    if (slug.size() >= max_length) break;
  }
  return slug;
}

std::vector<RdbText> read_rdb_texts(const std::string& path) {
  std::vector<RdbText> texts;
  const std::vector<RdbRecord> records = read_rdb_records(path);
  for (size_t r = 0; r < records.size(); ++r) {
    const std::string what = fmt::format("'{}' record {} (offset {})", path, r, records[r].file_offset);
    const auto lines = unserialize_character_vector(records[r].bytes, what);
    RdbText t;
    size_t bytes = 0;
    for (const auto& line : lines) bytes += (line ? line->size() : 0) + 1;
    t.text.reserve(bytes);
    for (const auto& line : lines) {
      if (line) {
        t.text += *line;
        if (t.title.empty() && line->find_first_not_of(" \t\r") != std::string::npos) t.title = *line;
      } else {
        ++t.na_lines;
      }
      t.text.push_back('\n');
    }
    t.lines = static_cast<int64_t>(lines.size());
    t.slug = slugify(t.title);
    if (t.slug.empty()) t.slug = fmt::format("record-{:02d}", r);
    texts.push_back(std::move(t));
  }
  return texts;
}

}  // namespace longtrain::data

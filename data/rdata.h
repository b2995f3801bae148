// Reading R's serialized data without R: the demo corpus (Jane Austen's six novels) ships in Debian's
// r-cran-janeaustenr package as data/Rdata.rdb, a lazy-load database. Each record is
//
//   [4 bytes: uncompressed length, big-endian] [zlib stream]
//
// and the zlib stream holds one R serialization (format 'X', XDR big-endian, version 2 or 3) of a
// character vector (STRSXP), one element per line of the book:
//
//   "X\n"                                     format: XDR
//   int32 version (2 or 3), int32 writer R version, int32 minimal reader R version
//   version 3 only: int32 n, n bytes          native encoding name (e.g. "UTF-8")
//   int32 flags                               low 8 bits: SEXP type (16 = STRSXP); bit 9: attributes
//   int32 length                              -1: a long vector, then two int32 (upper, lower)
//   per element:
//     int32 flags                             type 9 (CHARSXP); levels = flags >> 12 hold the
//                                             encoding: 4 LATIN1, 8 UTF8, 64 ASCII, 2 BYTES
//     int32 length                            -1: NA_character_; else the byte count that follows
//     length bytes                            the string, not NUL-terminated
//
// Only what the corpus needs is parsed; anything else (other types, attributes, other compression)
// is a clear error naming the file and the record.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace longtrain::data {

// One decompressed record of an .rdb file (its R serialization bytes).
struct RdbRecord {
  int64_t file_offset = 0;  // where the record starts in the .rdb
  std::string bytes;        // the uncompressed serialization
};

// Splits an .rdb file into its zlib-compressed records and inflates each. Throws longtrain::Error
// naming `path` on a missing file, a truncated record or a length that does not match.
std::vector<RdbRecord> read_rdb_records(const std::string& path);

// Parses one R serialization of a character vector. NA elements are std::nullopt; Latin-1 strings
// are converted to UTF-8. `what` names the source in error messages ("Rdata.rdb record 3").
std::vector<std::optional<std::string>> unserialize_character_vector(const std::string& bytes,
                                                                     const std::string& what);

// A book: a character vector joined into text, one line per element (NA lines become empty).
struct RdbText {
  std::string title;  // the first non-empty line, as written in the book
  std::string slug;   // file-name form of the title: "pride-and-prejudice"
  std::string text;   // lines joined with '\n', ending in '\n'
  int64_t lines = 0;
  int64_t na_lines = 0;
};

// Every record of an .rdb as text, in file order.
std::vector<RdbText> read_rdb_texts(const std::string& path);

// "Pride and Prejudice!" -> "pride-and-prejudice"; empty when nothing alphanumeric is left.
std::string slugify(const std::string& title, size_t max_length = 48);

}  // namespace longtrain::data

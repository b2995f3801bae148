// Text inputs for `prepare` and `tokenizer train`: .txt files (the whole file is one document) and
// .jsonl files (one JSON object per line; its text field, "text" by default, is one document).
// Directories are walked recursively and their .txt/.jsonl files taken in sorted path order, so the
// same inputs always give the same document order.
#pragma once

#include <cstdint>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace longtrain::data {

enum class InputKind : uint8_t { txt, jsonl };

struct InputFile {
  std::string path;
  InputKind kind = InputKind::txt;
  int64_t bytes = 0;      // file size
  int64_t documents = 0;  // filled by count_documents()
};

// Expands FILES|DIRS into input files. Errors: a path that does not exist, a file that is neither
// .txt nor .jsonl, a directory with no .txt/.jsonl file in it, no inputs at all.
std::vector<InputFile> list_inputs(const std::vector<std::string>& paths);

// Counts the documents of each input (1 for a non-empty .txt; non-blank lines of a .jsonl) without
// parsing them; an input with none is an error naming the file ("is empty").
void count_documents(std::vector<InputFile>& inputs);

// Reads documents one at a time, file after file, in order.
class DocumentReader {
 public:
  DocumentReader(std::vector<InputFile> inputs, std::string text_key = "text");
  // Fills `text` with the next document and returns true; false after the last one. A .jsonl line
  // that is not an object with a string field `text_key` is an error naming file, line and key.
  bool next(std::string& text);
  // The file and (for .jsonl) line of the document last returned, for messages.
  std::string where() const;
  // Bytes of input consumed so far (for progress).
  int64_t bytes_read() const { return bytes_done_ + line_bytes_; }

 private:
  std::vector<InputFile> inputs_;
  std::string text_key_;
  size_t file_ = 0;
  bool file_open_ = false;
  std::ifstream jsonl_;
  int64_t line_number_ = 0;
  int64_t bytes_done_ = 0;  // bytes of files finished
  int64_t line_bytes_ = 0;  // bytes of the current .jsonl read so far
  size_t last_file_ = static_cast<size_t>(-1);  // where the last document came from
  int64_t last_line_ = 0;
};

// Reads a whole file into memory; a missing or unreadable file is an error naming it.
std::string read_file(const std::string& path);

}  // namespace longtrain::data

#include "data/documents.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <iterator>

#include <nlohmann/json.hpp>

#include "runtime/error.h"

namespace longtrain::data {

namespace fs = std::filesystem;

namespace {

bool kind_of(const fs::path& p, InputKind& kind) {
  const std::string ext = p.extension().string();
  if (ext == ".txt") kind = InputKind::txt;
  else if (ext == ".jsonl") kind = InputKind::jsonl;
  else return false;
  return true;
}

bool is_blank(const std::string& s) {
  return std::all_of(s.begin(), s.end(), [](char c) { return c == ' ' || c == '\t' || c == '\r'; });
}

}  // namespace

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  LT_CHECK(in.good(), "cannot open '{}': {}", path, std::strerror(errno));
  std::string s((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  LT_CHECK(!in.bad(), "error reading '{}': {}", path, std::strerror(errno));
  return s;
}

std::vector<InputFile> list_inputs(const std::vector<std::string>& paths) {
  LT_CHECK(!paths.empty(), "no input files given: pass .txt/.jsonl files or directories");
  std::vector<InputFile> inputs;
  for (const std::string& path : paths) {
    std::error_code ec;
    const fs::file_status st = fs::status(path, ec);
    LT_CHECK(fs::exists(st), "input '{}' does not exist", path);
    if (fs::is_directory(st)) {
      std::vector<fs::path> found;
      for (auto it = fs::recursive_directory_iterator(path, fs::directory_options::follow_directory_symlink);
           it != fs::recursive_directory_iterator(); ++it) {
        InputKind kind;
        if (it->is_regular_file() && kind_of(it->path(), kind)) found.push_back(it->path());
      }
      LT_CHECK(!found.empty(), "input directory '{}' holds no .txt or .jsonl file", path);
      std::sort(found.begin(), found.end());
      for (const fs::path& p : found) {
        InputFile f;
        f.path = p.string();
        kind_of(p, f.kind);
        f.bytes = static_cast<int64_t>(fs::file_size(p));
        inputs.push_back(f);
      }
    } else {
      InputFile f;
      f.path = path;
      LT_CHECK(kind_of(path, f.kind), "input '{}' is neither .txt nor .jsonl (one JSON object per line "
               "with a text field)", path);
      f.bytes = static_cast<int64_t>(fs::file_size(path));
      inputs.push_back(f);
    }
  }
  return inputs;
}

void count_documents(std::vector<InputFile>& inputs) {
  for (InputFile& f : inputs) {
    if (f.kind == InputKind::txt) {
      f.documents = f.bytes > 0 ? 1 : 0;
    } else {
      std::ifstream in(f.path, std::ios::binary);
      LT_CHECK(in.good(), "cannot open '{}': {}", f.path, std::strerror(errno));
      std::string line;
      f.documents = 0;
      while (std::getline(in, line))
        if (!is_blank(line)) ++f.documents;
    }
    LT_CHECK(f.documents > 0, "input '{}' is empty: it holds no text", f.path);
  }
}

DocumentReader::DocumentReader(std::vector<InputFile> inputs, std::string text_key)
    : inputs_(std::move(inputs)), text_key_(std::move(text_key)) {}

std::string DocumentReader::where() const {
  if (last_file_ >= inputs_.size()) return "(no document read yet)";
  const InputFile& f = inputs_[last_file_];
  if (f.kind == InputKind::jsonl) return fmt::format("'{}' line {}", f.path, last_line_);
  return fmt::format("'{}'", f.path);
}

bool DocumentReader::next(std::string& text) {
  while (file_ < inputs_.size()) {
    const InputFile& f = inputs_[file_];
    if (f.kind == InputKind::txt) {
      text = read_file(f.path);
      last_file_ = file_;
      last_line_ = 0;
      bytes_done_ += f.bytes;
      ++file_;
      if (!text.empty()) return true;
      continue;
    }
    if (!file_open_) {
      jsonl_ = std::ifstream(f.path, std::ios::binary);
      LT_CHECK(jsonl_.good(), "cannot open '{}': {}", f.path, std::strerror(errno));
      file_open_ = true;
      line_number_ = 0;
      line_bytes_ = 0;
    }
    std::string line;
    if (!std::getline(jsonl_, line)) {
      LT_CHECK(!jsonl_.bad(), "error reading '{}': {}", f.path, std::strerror(errno));
      jsonl_.close();
      file_open_ = false;
      bytes_done_ += f.bytes;
      line_bytes_ = 0;
      ++file_;
      continue;
    }
    ++line_number_;
    line_bytes_ += static_cast<int64_t>(line.size()) + 1;
    if (is_blank(line)) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception& e) {
      LT_FAIL("'{}' line {}: not valid JSON ({})", f.path, line_number_, e.what());
    }
    LT_CHECK(j.is_object(), "'{}' line {}: expected a JSON object with a \"{}\" field", f.path,
             line_number_, text_key_);
    auto it = j.find(text_key_);
    LT_CHECK(it != j.end(), "'{}' line {}: no \"{}\" field (choose the field with --text-key)", f.path,
             line_number_, text_key_);
    LT_CHECK(it->is_string(), "'{}' line {}: field \"{}\" is {}, not a string", f.path, line_number_,
             text_key_, it->type_name());
    text = it->get<std::string>();
    last_file_ = file_;
    last_line_ = line_number_;
    return true;
  }
  return false;
}

}  // namespace longtrain::data

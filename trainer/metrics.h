// What a run leaves beside its checkpoints: metrics.jsonl (one JSON object per logged step or
// evaluation, appended and flushed) and loss.svg (the loss curve, rewritten atomically as the run
// goes, so a browser or an image viewer always finds a whole picture).
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace longtrain::trainer {

class MetricsLog {
 public:
  // Appends to `path` (a resumed run continues the same file).
  explicit MetricsLog(const std::filesystem::path& path);
  void write(const nlohmann::json& record);

 private:
  std::filesystem::path path_;
  std::ofstream out_;
};

// The loss curve: training loss per step (a line) and validation loss (points).
class LossPlot {
 public:
  void add_train(int64_t step, double loss) { train_.emplace_back(step, loss); }
  void add_val(int64_t step, double loss) { val_.emplace_back(step, loss); }
  std::string svg(const std::string& title) const;
  // Writes svg(title) to `path` through a temporary file and a rename.
  void save(const std::filesystem::path& path, const std::string& title) const;

 private:
  std::vector<std::pair<int64_t, double>> train_, val_;
};

// Writes `text` to `path` via `path`.tmp and a rename: readers never see half a file.
void write_file_atomically(const std::filesystem::path& path, const std::string& text);

}  // namespace longtrain::trainer

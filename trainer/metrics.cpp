#include "trainer/metrics.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "runtime/error.h"

namespace longtrain::trainer {

MetricsLog::MetricsLog(const std::filesystem::path& path) : path_(path), out_(path, std::ios::app) {
  LT_CHECK(out_.good(), "cannot open {} for writing", path.string());
}

void MetricsLog::write(const nlohmann::json& record) {
  out_ << record.dump() << '\n';
  out_.flush();
  LT_CHECK(out_.good(), "writing {} failed (disk full?)", path_.string());
}

void write_file_atomically(const std::filesystem::path& path, const std::string& text) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    LT_CHECK(out.good(), "cannot open {} for writing", tmp.string());
    out << text;
    out.flush();
    LT_CHECK(out.good(), "writing {} failed (disk full?)", tmp.string());
  }
  std::filesystem::rename(tmp, path);
}

std::string LossPlot::svg(const std::string& title) const {
  const double W = 720, H = 420, left = 64, right = 20, top = 36, bottom = 48;
  int64_t s0 = INT64_MAX, s1 = INT64_MIN;
  double lo = INFINITY, hi = -INFINITY;
  for (const auto* series : {&train_, &val_})
    for (const auto& [s, v] : *series) {
      if (!std::isfinite(v)) continue;
      s0 = std::min(s0, s);
      s1 = std::max(s1, s);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
  std::string out = fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{}\" height=\"{}\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{}\" y=\"22\" font-size=\"14\">{}</text>\n",
      W, H, left, title);
  if (s0 > s1) return out + "<text x=\"64\" y=\"80\">no data yet</text>\n</svg>\n";
  if (s1 == s0) s1 = s0 + 1;
  if (hi - lo < 1e-9) hi = lo + 1e-9;
  auto x = [&](int64_t s) { return left + (W - left - right) * static_cast<double>(s - s0) / static_cast<double>(s1 - s0); };
  auto y = [&](double v) { return top + (H - top - bottom) * (hi - v) / (hi - lo); };
  // Axes with five ticks each.
  out += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"black\"/>\n", left, top, H - bottom);
  out += fmt::format("<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"black\"/>\n", left, H - bottom, W - right);
  for (int i = 0; i <= 4; ++i) {
    double v = lo + (hi - lo) * i / 4.0;
    int64_t s = s0 + (s1 - s0) * i / 4;
    out += fmt::format("<text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\">{:.3f}</text>\n", left - 6, y(v) + 4, v);
    out += fmt::format("<text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", x(s), H - bottom + 18, s);
  }
  out += fmt::format("<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">step</text>\n", (W + left) / 2, H - 8);
  std::string points;
  for (const auto& [s, v] : train_)
    if (std::isfinite(v)) points += fmt::format("{:.1f},{:.1f} ", x(s), y(v));
  out += fmt::format("<polyline fill=\"none\" stroke=\"#1f77b4\" stroke-width=\"1.5\" points=\"{}\"/>\n", points);
  for (const auto& [s, v] : val_)
    if (std::isfinite(v)) out += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"3.5\" fill=\"#d62728\"/>\n", x(s), y(v));
  out += fmt::format("<text x=\"{}\" y=\"{}\" fill=\"#1f77b4\">train loss</text>\n", W - 180, top + 4);
  out += fmt::format("<text x=\"{}\" y=\"{}\" fill=\"#d62728\">validation loss</text>\n", W - 180, top + 20);
  return out + "</svg>\n";
}

void LossPlot::save(const std::filesystem::path& path, const std::string& title) const {
  write_file_atomically(path, svg(title));
}

}  // namespace longtrain::trainer

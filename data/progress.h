// A one-line progress bar on stderr for long jobs (`prepare`): bytes done of the total, MB/s and the
// time left. It draws only on a terminal (redirected logs stay clean) and at most ten times a second.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>

#include <unistd.h>

#include <fmt/format.h>

namespace longtrain::data {

class ProgressBar {
 public:
  ProgressBar(std::string label, int64_t total, bool enabled)
      : label_(std::move(label)), total_(total), enabled_(enabled && ::isatty(2)),
        start_(std::chrono::steady_clock::now()) {}

  // Sets the amount done (same unit as total: bytes) and redraws if due.
  void update(int64_t done) {
    done_ = done;
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (now - last_draw_ < std::chrono::milliseconds(100) && done < total_) return;
    last_draw_ = now;
    draw(now);
  }

  void finish() {
    if (!enabled_) return;
    draw(std::chrono::steady_clock::now());
    std::fputc('\n', stderr);
    enabled_ = false;
  }

  double seconds() const {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  }

 private:
  void draw(std::chrono::steady_clock::time_point now) {
    const double secs = std::chrono::duration<double>(now - start_).count();
    const double frac = total_ > 0 ? std::min(1.0, static_cast<double>(done_) / total_) : 1.0;
    constexpr int kWidth = 30;
    const int filled = static_cast<int>(frac * kWidth);
    const double mbps = secs > 0 ? done_ / 1e6 / secs : 0.0;
    const double eta = (frac > 0 && frac < 1) ? secs * (1 - frac) / frac : 0.0;
    std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '.');
    std::fprintf(stderr, "\r%s [%s] %5.1f%%  %.1f/%.1f MB  %.1f MB/s  eta %.0fs   ", label_.c_str(),
                 bar.c_str(), 100 * frac, done_ / 1e6, total_ / 1e6, mbps, eta);
    std::fflush(stderr);
  }

  std::string label_;
  int64_t total_, done_ = 0;
  bool enabled_;
  std::chrono::steady_clock::time_point start_, last_draw_{};
};

}  // namespace longtrain::data

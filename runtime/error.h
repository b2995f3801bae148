// Checked errors. Every failure becomes a longtrain::Error. Its message (what()) is for the user: what
// was wrong and what to do; callers that know the file, key or rank add it to the message. The source
// location that raised it is kept apart (where()), for a debug log and for tests, and is never part of
// what a user reads.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace longtrain {

struct Error : std::runtime_error {
  explicit Error(const std::string& message, std::string where = {})
      : std::runtime_error(message), where_(std::move(where)) {}
  // "file:line" of the check that failed ("" when the error was built by hand).
  const std::string& where() const noexcept { return where_; }

 private:
  std::string where_;
};

[[noreturn]] inline void raise_error(const char* file, int line, const std::string& message) {
  throw Error(message, fmt::format("{}:{}", file, line));
}

}  // namespace longtrain

// LT_CHECK(cond, "format {}", args...): throws longtrain::Error when cond is false.
#define LT_CHECK(cond, ...)                                                                         \
  do {                                                                                              \
    if (!(cond)) ::longtrain::raise_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__));          \
  } while (0)

// LT_FAIL("format {}", args...): always throws.
#define LT_FAIL(...) ::longtrain::raise_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__))

// Checked errors. Every failure becomes a longtrain::Error whose message starts with file:line, so a
// user sees where it was raised and a test can assert on the text. Messages say what was wrong and
// what to do; callers that know the file, key or rank add it to the message.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace longtrain {

struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void raise_error(const char* file, int line, const std::string& message) {
  throw Error(fmt::format("{}:{}: {}", file, line, message));
}

}  // namespace longtrain

// LT_CHECK(cond, "format {}", args...): throws longtrain::Error when cond is false.
#define LT_CHECK(cond, ...)                                                                         \
  do {                                                                                              \
    if (!(cond)) ::longtrain::raise_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__));          \
  } while (0)

// LT_FAIL("format {}", args...): always throws.
#define LT_FAIL(...) ::longtrain::raise_error(__FILE__, __LINE__, ::fmt::format(__VA_ARGS__))

// Numbers and words from user text (config values, command-line flags), read whole: a value with
// anything left over is not a number, so "3x" never passes as 3.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace longtrain {

// `s` without leading and trailing white space.
std::string trimmed(std::string_view s);

// A finite number (surrounding white space and a leading '+' allowed); false otherwise.
bool parse_double(std::string_view text, double& out);

// A whole number within int64 (as parse_double, and 1e6 or 4096.0, which name one exactly; not 2.5);
// false otherwise.
bool parse_int(std::string_view text, int64_t& out);

}  // namespace longtrain

#include "runtime/text.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <system_error>

namespace longtrain {

std::string trimmed(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

bool parse_double(std::string_view text, double& out) {
  std::string s = trimmed(text);
  std::string_view v = s;
  if (!v.empty() && v.front() == '+') v.remove_prefix(1);
  if (v.empty()) return false;
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  return ec == std::errc() && ptr == v.data() + v.size() && std::isfinite(out);
}

bool parse_int(std::string_view text, int64_t& out) {
  std::string s = trimmed(text);
  std::string_view v = s;
  if (!v.empty() && v.front() == '+') v.remove_prefix(1);
  if (v.empty()) return false;
  auto [ptr, ec] = std::from_chars(v.data(), v.data() + v.size(), out);
  if (ec == std::errc() && ptr == v.data() + v.size()) return true;
  // 1e6 or 4096.0 name an integer exactly; 2.5 does not.
  double d = 0.0;
  if (!parse_double(v, d) || d != std::floor(d) || std::abs(d) > 9.0e15) return false;
  out = static_cast<int64_t>(d);
  return true;
}

}  // namespace longtrain

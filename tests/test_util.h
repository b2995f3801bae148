// Helpers shared by the tests: owning host tensors, seeded random fill, rounding to a dtype, reading
// a (device) tensor back as doubles or bytes, error norms and central finite differences.
#pragma once

#include <gtest/gtest.h>
#include <sys/wait.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <initializer_list>
#include <istream>
#include <iterator>
#include <optional>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "runtime/device.h"
#include "runtime/error.h"
#include "runtime/tensor.h"

namespace longtrain::test {

// A contiguous host tensor that owns its storage.
template <class T>
struct HostTensor {
  std::vector<T> values;
  Tensor view;

  HostTensor() = default;
  explicit HostTensor(std::initializer_list<int64_t> shape) {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    values.assign(static_cast<size_t>(n), T{});
    view = Tensor(values.data(), dtype_of<T>(), shape);
  }
  HostTensor(const HostTensor& o) : values(o.values), view(o.view) { view.data = values.data(); }
  HostTensor& operator=(const HostTensor& o) {
    values = o.values;
    view = o.view;
    view.data = values.data();
    return *this;
  }
  T& operator[](size_t i) { return values[i]; }
  const T& operator[](size_t i) const { return values[i]; }
  size_t size() const { return values.size(); }
  operator Tensor() const { return view; }
};

// Fills with uniform values in [lo, hi) from a fixed seed.
template <class T>
void fill_uniform(HostTensor<T>& t, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (auto& v : t.values) v = static_cast<T>(dist(rng));
}

// Every comparison below scores a NaN or an infinity in either argument, or two lengths that differ,
// as an infinite error, so that `EXPECT_LT(error, tol)` fails on them: std::max(0.0, NaN) is 0, and a
// NaN-blind maximum would let an all-NaN result pass as exact.
template <class A, class B>
bool comparable(const std::vector<A>& a, const std::vector<B>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (!std::isfinite(static_cast<double>(a[i])) || !std::isfinite(static_cast<double>(b[i]))) return false;
  return true;
}

// max |a - b| / max |b|: the error of a relative to the reference b, in b's scale (the absolute
// error when b is all zeros).
template <class A, class B>
double relative_error(const std::vector<A>& a, const std::vector<B>& b) {
  if (!comparable(a, b)) return INFINITY;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    num = std::max(num, std::abs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
    den = std::max(den, std::abs(static_cast<double>(b[i])));
  }
  return den > 0.0 ? num / den : num;
}

// ||a - b||_2 / ||b||_2: the norm-wise error, which a few wrong small entries (a row or a head of
// small values) move even when they stay far below the largest magnitude.
template <class A, class B>
double norm_relative_error(const std::vector<A>& a, const std::vector<B>& b) {
  if (!comparable(a, b)) return INFINITY;
  double num = 0.0, den = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - static_cast<double>(b[i]);
    num += d * d;
    den += static_cast<double>(b[i]) * static_cast<double>(b[i]);
  }
  return den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
}

// |a - b| / |b| for two scalars (|a - b| when b is 0); infinite when either is not finite.
inline double scalar_relative_error(double a, double b) {
  if (!std::isfinite(a) || !std::isfinite(b)) return INFINITY;
  return b != 0.0 ? std::abs(a - b) / std::abs(b) : std::abs(a - b);
}

// Reads the next whitespace-separated fields of a line that a worker process printed into `outs`,
// in order. Each field must parse whole (strtod / strtoll), and a double must be finite: `ls >> x`
// would leave x at 0 on "nan" or a missing field, and a check of a zero error would then pass.
template <class... Out>
::testing::AssertionResult read_fields(std::istream& in, Out&... outs) {
  std::string failure;
  auto read_one = [&](auto& out) {
    if (!failure.empty()) return;
    std::string field;
    if (!(in >> field)) {
      failure = "a field is missing";
      return;
    }
    char* end = nullptr;
    errno = 0;
    if constexpr (std::is_floating_point_v<std::remove_reference_t<decltype(out)>>) {
      const double v = std::strtod(field.c_str(), &end);
      if (end != field.c_str() + field.size() || errno != 0) {
        failure = "'" + field + "' is not a number";
      } else if (!std::isfinite(v)) {
        failure = "'" + field + "' is not finite";
      } else {
        out = static_cast<std::remove_reference_t<decltype(out)>>(v);
      }
    } else {
      const long long v = std::strtoll(field.c_str(), &end, 10);
      if (end != field.c_str() + field.size() || errno != 0) {
        failure = "'" + field + "' is not an integer";
      } else {
        out = static_cast<std::remove_reference_t<decltype(out)>>(v);
      }
    }
  };
  (read_one(outs), ...);
  if (!failure.empty()) return ::testing::AssertionFailure() << failure;
  return ::testing::AssertionSuccess();
}

// One "CASE <name> <error> <tolerance>" line of a worker's report.
struct CaseLine {
  std::string name;
  double error = 0, tolerance = 0;
};

// Every CASE line of a worker's output `text`; a malformed or non-finite one fails the test (naming
// `who`, e.g. the rank) instead of reading as a zero error.
inline std::vector<CaseLine> case_lines(const std::string& text, const std::string& who) {
  std::vector<CaseLine> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    std::istringstream ls(line);
    std::string word;
    if (!(ls >> word) || word != "CASE") continue;
    CaseLine c;
    const bool named = static_cast<bool>(ls >> c.name);
    const ::testing::AssertionResult read = named ? read_fields(ls, c.error, c.tolerance)
                                                  : ::testing::AssertionFailure() << "no case name";
    EXPECT_TRUE(read) << who << ": malformed line: " << line;
    if (read) out.push_back(std::move(c));
  }
  return out;
}

// The whole content of the file at `path`. A file that is missing or cannot be read is an error: a
// comparison of two unreadable files as "" == "" would pass whatever the code under test wrote.
inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("test: cannot read '" + path.string() + "' (missing or unreadable)");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) throw std::runtime_error("test: reading '" + path.string() + "' failed");
  return text;
}

// Runs the shell command `cmd` (stderr joined to stdout: end it with 2>&1) and returns its exit code,
// with everything it printed in `output`. A command that cannot be started, or does not exit
// normally, fails the calling test and returns -1: never a code a test expects.
inline int run_command(const std::string& cmd, std::string& output) {
  output.clear();
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) {
    ADD_FAILURE() << "cannot run " << cmd;
    return -1;
  }
  char buf[4096];
  while (size_t n = fread(buf, 1, sizeof buf, pipe)) output.append(buf, n);
  const int status = pclose(pipe);
  if (status == -1 || !WIFEXITED(status)) {
    ADD_FAILURE() << "did not exit normally (status " << status << "): " << cmd << "\n" << output;
    return -1;
  }
  return WEXITSTATUS(status);
}

// For polling a file another process is about to write: its content, or nothing while it is missing.
inline std::optional<std::string> read_file_if_exists(const std::filesystem::path& path) {
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) return std::nullopt;
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// Rounds v to what `dtype` stores (bf16 round-to-nearest-even, f32, or unchanged for f64).
inline double round_to(double v, DType dtype) {
  if (dtype == DType::bf16) return static_cast<float>(bf16(static_cast<float>(v)));
  if (dtype == DType::f32) return static_cast<float>(v);
  return v;
}

inline std::vector<double> round_all(std::vector<double> v, DType dtype) {
  for (double& x : v) x = round_to(x, dtype);
  return v;
}

// The contiguous tensor t (on any device) as doubles.
inline std::vector<double> download(const Tensor& t) {
  const size_t n = static_cast<size_t>(t.numel());
  std::vector<unsigned char> host(n * dtype_size(t.dtype));
  Tensor dst = t;
  dst.data = host.data();
  dst.device = Device::cpu;
  copy(dst, t);
  std::vector<double> out(n);
  for (size_t i = 0; i < n; ++i) {
    switch (t.dtype) {
      case DType::bf16: out[i] = static_cast<float>(reinterpret_cast<const bf16*>(host.data())[i]); break;
      case DType::f32: out[i] = reinterpret_cast<const float*>(host.data())[i]; break;
      case DType::f64: out[i] = reinterpret_cast<const double*>(host.data())[i]; break;
      case DType::i32: out[i] = reinterpret_cast<const int32_t*>(host.data())[i]; break;
    }
  }
  return out;
}

// The raw bytes of a contiguous tensor on any device (for bitwise run-twice comparisons).
inline std::vector<unsigned char> download_bytes(const Tensor& t) {
  std::vector<unsigned char> host(t.nbytes());
  Tensor dst = t;
  dst.data = host.data();
  dst.device = Device::cpu;
  copy(dst, t);
  return host;
}

// Central differences (f(x + h e_i) - f(x - h e_i)) / 2h for every element of x, restoring x.
inline std::vector<double> finite_difference(std::vector<double>& x, const std::function<double()>& f,
                                             double h = 1e-6) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double saved = x[i];
    x[i] = saved + h;
    double up = f();
    x[i] = saved - h;
    double down = f();
    x[i] = saved;
    g[i] = (up - down) / (2.0 * h);
  }
  return g;
}

// The message of the longtrain::Error that f throws, for a test to check; when f throws none, the
// test fails and the message is "".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no longtrain::Error thrown";
  return "";
}

// Runs f, which must throw longtrain::Error whose message contains every one of `parts` (a
// message names the file, key or value a user has to fix).
template <class F>
void expect_error(F&& f, std::initializer_list<std::string> parts) {
  try {
    f();
    ADD_FAILURE() << "expected a longtrain::Error mentioning '" << *parts.begin() << "'";
  } catch (const Error& e) {
    const std::string message = e.what();
    for (const std::string& part : parts)
      EXPECT_NE(message.find(part), std::string::npos) << "missing \"" << part << "\" in: " << message;
  }
}

// Runs body with the environment variable `name` set to value (unset for nullptr), then puts back what
// the process had, also when body throws.
template <class F>
void with_env(const char* name, const char* value, F&& body) {
  const char* had = std::getenv(name);
  const std::optional<std::string> before = had ? std::optional<std::string>(had) : std::nullopt;
  struct Restore {
    const char* name;
    const std::optional<std::string>& before;
    ~Restore() {
      if (before) {
        ::setenv(name, before->c_str(), 1);
      } else {
        ::unsetenv(name);
      }
    }
  } restore{name, before};
  if (value) {
    ::setenv(name, value, 1);
  } else {
    ::unsetenv(name);
  }
  body();
}

}  // namespace longtrain::test

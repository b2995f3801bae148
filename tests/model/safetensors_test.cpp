// safetensors I/O: bitwise round trips per dtype, write-time bf16 rounding, the written layout
// checked by an independent parser below, every corruption the reference reader rejects, and the
// arena loader's missing / extra / shape / dtype checks.
#include "model/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>

#include <nlohmann/json.hpp>

#include "model/llama_config.h"
#include "model/parameters.h"
#include "test_util.h"

namespace longtrain::model {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using test::HostTensor;

// A fresh directory per test (ctest runs each TEST in its own process: the pid keeps them apart).
class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("longtrain_safetensors_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  fs::path dir_;
};

std::vector<unsigned char> read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::vector<unsigned char>(std::istreambuf_iterator<char>(in), {});
}

void write_bytes(const std::string& path, const std::vector<unsigned char>& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

// A file by hand: 8-byte little-endian length (or `length_field` when given), header, data.
void write_raw(const std::string& path, const std::string& header, size_t data_bytes,
               std::optional<uint64_t> length_field = std::nullopt) {
  std::vector<unsigned char> bytes(8);
  uint64_t n = length_field.value_or(header.size());
  for (int b = 0; b < 8; ++b) bytes[b] = static_cast<unsigned char>(n >> (8 * b));
  bytes.insert(bytes.end(), header.begin(), header.end());
  for (size_t i = 0; i < data_bytes; ++i) bytes.push_back(static_cast<unsigned char>(i * 37 + 1));
  write_bytes(path, bytes);
}

// Expects SafetensorsFile(path) to throw a message containing every one of `parts`.
void expect_open_error(const std::string& path, std::initializer_list<std::string> parts) {
  try {
    SafetensorsFile f(path);
    ADD_FAILURE() << "opening " << path << " did not throw";
  } catch (const Error& e) {
    std::string msg = e.what();
    for (const std::string& p : parts) EXPECT_NE(msg.find(p), std::string::npos) << "missing '" << p << "' in: " << msg;
  }
}

using ::longtrain::test::error_of;

uint32_t float_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float bits_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// The independent check of a file we wrote: the format's rules re-derived from the bytes, plus our
// writer's promises (header padded to 8, every tensor aligned to its element size, "format": "pt").
void check_layout(const std::string& path, const std::map<std::string, std::pair<std::string, std::vector<int64_t>>>& expected) {
  std::vector<unsigned char> bytes = read_bytes(path);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int b = 7; b >= 0; --b) n = (n << 8) | bytes[b];
  ASSERT_LE(8 + n, bytes.size());
  EXPECT_EQ((8 + n) % 8, 0u) << "data must start 8-byte aligned";
  std::string header(bytes.begin() + 8, bytes.begin() + 8 + static_cast<std::ptrdiff_t>(n));
  EXPECT_EQ(header.front(), '{');
  size_t last = header.find_last_not_of(' ');
  EXPECT_EQ(header[last], '}') << "only spaces may pad the header";
  json h = json::parse(header);  // throws (fails the test) when not JSON
  ASSERT_TRUE(h.contains("__metadata__"));
  EXPECT_EQ(h["__metadata__"]["format"], "pt");
  const std::map<std::string, uint64_t> sizes = {{"F32", 4}, {"F64", 8}, {"BF16", 2}, {"I32", 4}};
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  size_t count = 0;
  for (auto it = h.begin(); it != h.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    ++count;
    ASSERT_TRUE(expected.count(it.key())) << "unexpected tensor " << it.key();
    const auto& [dtype, shape] = expected.at(it.key());
    EXPECT_EQ(it.value()["dtype"], dtype) << it.key();
    EXPECT_EQ(it.value()["shape"].get<std::vector<int64_t>>(), shape) << it.key();
    uint64_t begin = it.value()["data_offsets"][0], end = it.value()["data_offsets"][1];
    uint64_t numel = 1;
    for (int64_t s : shape) numel *= static_cast<uint64_t>(s);
    EXPECT_EQ(end - begin, numel * sizes.at(dtype)) << it.key();
    EXPECT_EQ(begin % sizes.at(dtype), 0u) << it.key() << " is not aligned to its element size";
    spans.push_back({begin, end});
  }
  EXPECT_EQ(count, expected.size());
  std::sort(spans.begin(), spans.end());
  uint64_t at = 0;
  for (auto [b, e] : spans) {
    EXPECT_EQ(b, at) << "hole or overlap";
    at = e;
  }
  EXPECT_EQ(8 + n + at, bytes.size()) << "the data must end the file";
}

// ---------------------------------------------------------------------------------------------

TEST_F(SafetensorsTest, RoundTripIsBitwiseForEveryDtype) {
  // Odd shapes, a scalar, an empty tensor, and the values that trip careless code: NaN payloads,
  // infinities, -0, subnormals.
  HostTensor<float> f32({7, 13});
  test::fill_uniform(f32, 1);
  f32[0] = std::numeric_limits<float>::quiet_NaN();
  f32[1] = bits_float(0x7fc01234u);  // NaN with a payload
  f32[2] = -std::numeric_limits<float>::infinity();
  f32[3] = -0.0f;
  f32[4] = std::numeric_limits<float>::denorm_min();
  HostTensor<double> f64({3, 5, 11});
  test::fill_uniform(f64, 2);
  f64[0] = std::numeric_limits<double>::denorm_min();
  HostTensor<bf16> b16({29});
  for (size_t i = 0; i < b16.size(); ++i) b16[i].bits = static_cast<uint16_t>(i * 2654435761u >> 7);
  HostTensor<int32_t> i32({2, 3, 5, 7});
  for (size_t i = 0; i < i32.size(); ++i) i32[i] = static_cast<int32_t>(i * 2654435761u);
  HostTensor<float> scalar({});
  scalar[0] = 3.25f;
  HostTensor<float> empty({0, 5});

  const std::string file = path("all.safetensors");
  SafetensorsSaveOptions options;
  options.metadata["step"] = "17";
  save_safetensors(file,
                   {{"f32", f32}, {"f64", f64}, {"bf16", b16}, {"i32", i32}, {"scalar", scalar}, {"empty", empty}},
                   options);
  check_layout(file, {{"f32", {"F32", {7, 13}}},
                      {"f64", {"F64", {3, 5, 11}}},
                      {"bf16", {"BF16", {29}}},
                      {"i32", {"I32", {2, 3, 5, 7}}},
                      {"scalar", {"F32", {}}},
                      {"empty", {"F32", {0, 5}}}});

  SafetensorsFile st(file);
  EXPECT_EQ(st.metadata().at("format"), "pt");
  EXPECT_EQ(st.metadata().at("step"), "17");
  HostTensor<float> f32_back({7, 13});
  HostTensor<double> f64_back({3, 5, 11});
  HostTensor<bf16> b16_back({29});
  HostTensor<int32_t> i32_back({2, 3, 5, 7});
  HostTensor<float> scalar_back({});
  HostTensor<float> empty_back({0, 5});
  st.read("f32", f32_back);
  st.read("f64", f64_back);
  st.read("bf16", b16_back);
  st.read("i32", i32_back);
  st.read("scalar", scalar_back);
  st.read("empty", empty_back);
  EXPECT_EQ(std::memcmp(f32.values.data(), f32_back.values.data(), f32.size() * 4), 0);
  EXPECT_EQ(std::memcmp(f64.values.data(), f64_back.values.data(), f64.size() * 8), 0);
  EXPECT_EQ(std::memcmp(b16.values.data(), b16_back.values.data(), b16.size() * 2), 0);
  EXPECT_EQ(std::memcmp(i32.values.data(), i32_back.values.data(), i32.size() * 4), 0);
  EXPECT_EQ(scalar_back[0], 3.25f);
}

TEST_F(SafetensorsTest, ArenaRoundTripGivesIdenticalParameters) {
  LlamaConfig c;
  c.vocab_size = 97;
  c.dim = 24;
  c.n_layers = 2;
  c.n_heads = 3;
  c.n_kv_heads = 1;
  c.head_dim = 8;
  c.ffn_dim = 37;
  for (DType dtype : {DType::f32, DType::f64, DType::bf16}) {
    SCOPED_TRACE(std::string(dtype_name(dtype)));
    Arena params("params", Device::cpu), loaded("loaded", Device::cpu);
    add_parameter_entries(params, c, dtype);
    add_parameter_entries(loaded, c, dtype);
    params.allocate();
    loaded.allocate();
    initialize_parameters(params, 1234);
    const std::string file = path(std::string("params_") + std::string(dtype_name(dtype)) + ".safetensors");
    save_safetensors(file, params);
    std::map<std::string, std::pair<std::string, std::vector<int64_t>>> expected;
    for (const ArenaEntry& e : params.table()) expected[e.name] = {safetensors_dtype_name(dtype), e.shape};
    check_layout(file, expected);
    SafetensorsLoadReport report = load_safetensors(file, loaded);
    EXPECT_TRUE(report.ignored.empty());
    for (size_t i = 0; i < params.table().size(); ++i)
      EXPECT_EQ(std::memcmp(params.at(i).data, loaded.at(i).data, params.at(i).nbytes()), 0)
          << params.table()[i].name;
  }
}

TEST_F(SafetensorsTest, F32SavedAsBf16EqualsBf16Rounding) {
  HostTensor<float> x({101, 3});
  test::fill_uniform(x, 7, -100.0, 100.0);
  // Exact ties go to even, hand-checked: 1 + 2^-8 lies halfway between bf16 1.0 (0x3f80) and
  // 1 + 2^-7 (0x3f81): even is 0x3f80. 1 + 3·2^-8 lies between 0x3f81 and 0x3f82: even is 0x3f82.
  // Just above a tie rounds up.
  const std::vector<std::pair<uint32_t, uint16_t>> hand = {
      {0x3f808000u, 0x3f80}, {0x3f818000u, 0x3f82}, {0x3f808001u, 0x3f81}, {0xbf808000u, 0xbf80},
      {0x7f7fffffu, 0x7f80} /* FLT_MAX rounds to inf */, {0x00000001u, 0x0000} /* tiny subnormal */};
  for (size_t i = 0; i < hand.size(); ++i) x[i] = bits_float(hand[i].first);

  const std::string file = path("bf16.safetensors");
  SafetensorsSaveOptions options;
  options.dtype = DType::bf16;
  save_safetensors(file, {{"x", x}}, options);
  check_layout(file, {{"x", {"BF16", {101, 3}}}});

  HostTensor<float> back({101, 3});
  SafetensorsFile(file).read("x", back);  // BF16 -> f32 widens exactly: allowed by default
  double worst = 0.0;
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_EQ(float_bits(back[i]), float_bits(static_cast<float>(bf16(x[i])))) << i;
    if (i >= hand.size())  // the random normal values; hand cases include overflow and underflow
      worst = std::max(worst, std::abs((static_cast<double>(back[i]) - x[i]) / x[i]));
  }
  for (size_t i = 0; i < hand.size(); ++i)
    EXPECT_EQ(float_bits(back[i]) >> 16, hand[i].second) << "hand case " << i;
  EXPECT_LE(worst, 1.0 / 256) << "bf16 rounding of a normal number is within half an ulp, 2^-8 relative";
  std::printf("f32 -> BF16 -> f32: worst relative error %.3g (bound 2^-8 = %.3g)\n", worst, 1.0 / 256);
}

TEST_F(SafetensorsTest, F64SavedAsBf16RoundsOnce) {
  // 1 + 2^-8 + 2^-30 is just above the bf16 tie 1 + 2^-8: the correct bf16 is 1 + 2^-7 (0x3f81).
  // Rounding to f32 first lands exactly on the tie, and the second rounding would give 1.0.
  HostTensor<double> x({2});
  x[0] = 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30);
  x[1] = -(1.0 + std::ldexp(1.0, -8) - std::ldexp(1.0, -30));  // just below the tie: rounds to -1.0
  const std::string file = path("f64.safetensors");
  SafetensorsSaveOptions options;
  options.dtype = DType::bf16;
  save_safetensors(file, {{"x", x}}, options);
  HostTensor<bf16> back({2});
  SafetensorsFile(file).read("x", back);
  EXPECT_EQ(back[0].bits, 0x3f81);
  EXPECT_EQ(back[1].bits, 0xbf80);
}

TEST_F(SafetensorsTest, ReadsUnalignedForeignLayoutAndF16) {
  // Another writer's file: a BF16 tensor first so the F32 one sits at an odd-of-4 offset, and an F16
  // tensor (what many Hugging Face Llama checkpoints hold): 1, -2, 65504 (max), 2^-24 (smallest
  // subnormal), inf, 0x3555 = 0.333251953125, -0.
  const std::vector<uint16_t> halves = {0x3c00, 0xc000, 0x7bff, 0x0001, 0x7c00, 0x3555, 0x8000};
  const std::vector<float> want = {1.0f, -2.0f, 65504.0f, std::ldexp(1.0f, -24),
                                   std::numeric_limits<float>::infinity(), 0.333251953125f, -0.0f};
  const float f32_value = 1.5f;
  std::string header = R"({"b":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},)"
                       R"("f":{"dtype":"F32","shape":[1],"data_offsets":[6,10]},)"
                       R"("h":{"dtype":"F16","shape":[7],"data_offsets":[10,24]}})";
  std::vector<unsigned char> bytes(8);
  for (int b = 0; b < 8; ++b) bytes[b] = static_cast<unsigned char>(header.size() >> (8 * b));
  bytes.insert(bytes.end(), header.begin(), header.end());
  for (uint16_t v : {0x3f80, 0x4000, 0xc040}) bytes.insert(bytes.end(), {uint8_t(v & 0xff), uint8_t(v >> 8)});
  uint32_t fb = float_bits(f32_value);
  for (int b = 0; b < 4; ++b) bytes.push_back(static_cast<unsigned char>(fb >> (8 * b)));
  for (uint16_t v : halves) bytes.insert(bytes.end(), {uint8_t(v & 0xff), uint8_t(v >> 8)});
  const std::string file = path("foreign.safetensors");
  write_bytes(file, bytes);

  SafetensorsFile st(file);
  HostTensor<float> b({3}), f({1}), h({7});
  st.read("b", b);
  st.read("f", f);
  st.read("h", h);
  EXPECT_EQ(b.values, (std::vector<float>{1.0f, 2.0f, -3.0f}));
  EXPECT_EQ(f[0], f32_value);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(float_bits(h[i]), float_bits(want[i])) << i;
}

// ---------------------------------------------------------------------------------------------
// Corrupt files: every one is rejected with the file named, and the tensor where there is one.

TEST_F(SafetensorsTest, RejectsTruncatedFiles) {
  HostTensor<float> x({5, 7});
  test::fill_uniform(x, 3);
  const std::string good = path("good.safetensors");
  save_safetensors(good, {{"weight", x}});
  std::vector<unsigned char> bytes = read_bytes(good);

  const std::string cut = path("cut.safetensors");
  write_bytes(cut, std::vector<unsigned char>(bytes.begin(), bytes.end() - 1));
  expect_open_error(cut, {cut, "'weight'", "truncated"});

  const std::string tiny = path("tiny.safetensors");
  write_bytes(tiny, std::vector<unsigned char>(bytes.begin(), bytes.begin() + 5));
  expect_open_error(tiny, {tiny, "5 bytes", "too short"});

  const std::string empty = path("empty.safetensors");
  write_bytes(empty, {});
  expect_open_error(empty, {empty, "0 bytes"});

  const std::string header_cut = path("header_cut.safetensors");
  write_bytes(header_cut, std::vector<unsigned char>(bytes.begin(), bytes.begin() + 20));
  expect_open_error(header_cut, {header_cut, "runs past the end of the file"});

  const std::string trailing = path("trailing.safetensors");
  std::vector<unsigned char> longer = bytes;
  longer.push_back(0);
  write_bytes(trailing, longer);
  expect_open_error(trailing, {trailing, "1 bytes follow the last tensor 'weight'"});

  expect_open_error(path("absent.safetensors"), {path("absent.safetensors"), "cannot open"});
}

TEST_F(SafetensorsTest, RejectsBadHeaderLengthAndJson) {
  const std::string huge = path("huge.safetensors");
  write_raw(huge, "{}", 0, uint64_t{1} << 40);
  expect_open_error(huge, {huge, "exceeds the format's limit"});

  const std::string beyond = path("beyond.safetensors");
  write_raw(beyond, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 4, 5000);
  expect_open_error(beyond, {beyond, "header length 5000 runs past the end"});

  const std::string bad = path("bad_json.safetensors");
  write_raw(bad, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]})", 4);  // one brace short
  expect_open_error(bad, {bad, "not valid JSON"});

  const std::string array = path("array.safetensors");
  write_raw(array, "[1, 2]   ", 0);
  expect_open_error(array, {array, "must be an object"});

  const std::string utf8 = path("utf8.safetensors");
  write_raw(utf8, "{\"a\xff\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}", 4);
  expect_open_error(utf8, {utf8, "not valid JSON"});

  const std::string twice = path("twice.safetensors");
  write_raw(twice, R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                   R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", 8);
  expect_open_error(twice, {twice, "names 'a' twice"});

  const std::string meta = path("meta.safetensors");
  write_raw(meta, R"({"__metadata__":{"format":"pt","step":3}})", 0);
  expect_open_error(meta, {meta, "__metadata__", "'step'", "only strings"});
}

TEST_F(SafetensorsTest, RejectsBadOffsetsDtypesAndShapes) {
  const std::string oob = path("oob.safetensors");
  write_raw(oob, R"({"w":{"dtype":"F32","shape":[250],"data_offsets":[0,1000]}})", 16);
  expect_open_error(oob, {oob, "tensor 'w'", "[0, 1000]", "truncated"});

  const std::string overlap = path("overlap.safetensors");
  write_raw(overlap, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                     R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
  expect_open_error(overlap, {overlap, "tensor 'b'", "overlap tensor 'a'"});

  const std::string hole = path("hole.safetensors");
  write_raw(hole, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[12,20]}})", 20);
  expect_open_error(hole, {hole, "tensor 'b'", "hole of 4 bytes after tensor 'a'"});

  const std::string late = path("late.safetensors");
  write_raw(late, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
  expect_open_error(late, {late, "tensor 'a'", "hole of 4 bytes after the header"});

  const std::string backwards = path("backwards.safetensors");
  write_raw(backwards, R"({"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}})", 8);
  expect_open_error(backwards, {backwards, "tensor 'a'", "end before they begin"});

  const std::string dtype = path("dtype.safetensors");
  write_raw(dtype, R"({"a":{"dtype":"F17","shape":[2],"data_offsets":[0,8]}})", 8);
  expect_open_error(dtype, {dtype, "tensor 'a'", "unknown dtype 'F17'"});

  const std::string span = path("span.safetensors");
  write_raw(span, R"({"a":{"dtype":"BF16","shape":[3,5],"data_offsets":[0,32]}})", 32);
  expect_open_error(span, {span, "tensor 'a'", "30 bytes", "span 32 bytes"});

  const std::string negative = path("negative.safetensors");
  write_raw(negative, R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", 8);
  expect_open_error(negative, {negative, "tensor 'a'", "shape entry -2"});

  const std::string overflow = path("overflow.safetensors");
  write_raw(overflow, R"({"a":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8);
  expect_open_error(overflow, {overflow, "tensor 'a'", "overflows"});

  const std::string subbyte = path("subbyte.safetensors");
  write_raw(subbyte, R"({"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2);
  expect_open_error(subbyte, {subbyte, "tensor 'a'", "inside a byte"});

  const std::string no_offsets = path("no_offsets.safetensors");
  write_raw(no_offsets, R"({"a":{"dtype":"F32","shape":[2]}})", 0);
  expect_open_error(no_offsets, {no_offsets, "tensor 'a'", "data_offsets"});

  // A dtype the format knows but longtrain cannot load: the file is valid, the read names it.
  const std::string int8 = path("int8.safetensors");
  write_raw(int8, R"({"q":{"dtype":"I8","shape":[4],"data_offsets":[0,4]}})", 4);
  SafetensorsFile st(int8);
  HostTensor<float> dst({4});
  std::string msg = error_of([&] { st.read("q", dst); });
  EXPECT_NE(msg.find(int8), std::string::npos) << msg;
  EXPECT_NE(msg.find("'q' is stored as I8"), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------------
// Loading into an arena: names, shapes and dtypes checked before anything is copied.

TEST_F(SafetensorsTest, ArenaLoadChecksNamesShapesAndDtypes) {
  HostTensor<float> a({3, 5}), b({7}), c({2, 2});
  test::fill_uniform(a, 11);
  test::fill_uniform(b, 12);
  test::fill_uniform(c, 13);
  const std::string file = path("model.safetensors");
  save_safetensors(file, {{"a", a}, {"b", b}, {"c", c}});

  {  // missing tensor
    Arena arena("params", Device::cpu);
    arena.add("a", {3, 5}, DType::f32);
    arena.add("b", {7}, DType::f32);
    arena.add("d", {4}, DType::f32);
    arena.allocate();
    std::string msg = error_of([&] { load_safetensors(file, arena, ExtraTensors::ignore); });
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find("1 tensor(s) of arena 'params' are missing: d"), std::string::npos) << msg;
  }
  {  // extra tensor: an error by policy, or ignored and reported
    Arena arena("params", Device::cpu);
    arena.add("a", {3, 5}, DType::f32);
    arena.add("b", {7}, DType::f32);
    arena.allocate();
    std::string msg = error_of([&] { load_safetensors(file, arena, ExtraTensors::error); });
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find("tensor 'c' is not part of arena 'params'"), std::string::npos) << msg;
    SafetensorsLoadReport report = load_safetensors(file, arena, ExtraTensors::ignore);
    EXPECT_EQ(report.ignored, std::vector<std::string>{"c"});
    EXPECT_EQ(std::memcmp(arena.get("a").data, a.values.data(), a.size() * 4), 0);
    EXPECT_EQ(std::memcmp(arena.get("b").data, b.values.data(), b.size() * 4), 0);
  }
  {  // shape mismatch: expected and found shapes, and nothing copied
    Arena arena("params", Device::cpu);
    arena.add("a", {5, 3}, DType::f32);
    arena.add("b", {7}, DType::f32);
    arena.add("c", {2, 2}, DType::f32);
    arena.allocate();
    std::string msg = error_of([&] { load_safetensors(file, arena); });
    EXPECT_NE(msg.find(file), std::string::npos) << msg;
    EXPECT_NE(msg.find("tensor 'a' has shape [3, 5] in the file, expected [5, 3]"), std::string::npos) << msg;
    EXPECT_EQ(arena.get("b").ptr<float>()[0], 0.0f) << "a failed load must not copy anything";
  }
  {  // dtypes: F32 into bf16 needs rounding to be asked for; F32 into i32 never
    Arena arena("params", Device::cpu);
    arena.add("a", {3, 5}, DType::bf16);
    arena.add("b", {7}, DType::f32);
    arena.add("c", {2, 2}, DType::i32);
    arena.allocate();
    std::string msg = error_of([&] { load_safetensors(file, arena); });
    EXPECT_NE(msg.find("'a' is stored as F32 but the destination is bf16"), std::string::npos) << msg;
    EXPECT_NE(msg.find("'c' is stored as F32 and cannot become i32"), std::string::npos) << msg;
    EXPECT_NE(msg.find("2 problem(s)"), std::string::npos) << msg;
  }
  {  // rounding allowed: bf16 values are the RNE rounding of the file's f32
    Arena arena("params", Device::cpu);
    arena.add("a", {3, 5}, DType::bf16);
    arena.add("b", {7}, DType::f64);
    arena.add("c", {2, 2}, DType::f32);
    arena.allocate();
    load_safetensors(file, arena, ExtraTensors::error, DTypeConversion::rounding);
    for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(arena.get("a").ptr<bf16>()[i].bits, bf16(a[i]).bits);
    for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(arena.get("b").ptr<double>()[i], static_cast<double>(b[i]));
  }
}

TEST_F(SafetensorsTest, ShardedLoadRejectsATensorInTwoFiles) {
  HostTensor<float> a({3}), b({4});
  save_safetensors(path("one.safetensors"), {{"a", a}, {"b", b}});
  save_safetensors(path("two.safetensors"), {{"b", b}});
  Arena arena("params", Device::cpu);
  arena.add("a", {3}, DType::f32);
  arena.add("b", {4}, DType::f32);
  arena.allocate();
  std::string msg = error_of([&] { load_safetensors({path("one.safetensors"), path("two.safetensors")}, arena); });
  EXPECT_NE(msg.find("both hold tensor 'b'"), std::string::npos) << msg;
}

TEST_F(SafetensorsTest, WriterRejectsBadInput) {
  HostTensor<float> a({4, 6});
  const std::string file = path("w.safetensors");
  std::string msg = error_of([&] { save_safetensors(file, {{"a", a}, {"a", a}}); });
  EXPECT_NE(msg.find("tensor 'a' is given twice"), std::string::npos) << msg;
  msg = error_of([&] { save_safetensors(file, {{"a", Tensor(a).narrow(1, 1, 3)}}); });
  EXPECT_NE(msg.find("not contiguous"), std::string::npos) << msg;
  HostTensor<int32_t> ids({3});
  SafetensorsSaveOptions as_bf16;
  as_bf16.dtype = DType::bf16;
  save_safetensors(file, {{"ids", ids}}, as_bf16);  // integer tensors keep their dtype
  EXPECT_EQ(SafetensorsFile(file).find("ids")->dtype, "I32");

  // A file that cannot be created: the error names it.
  msg = error_of([&] { save_safetensors(path("no_such_dir/x.safetensors"), {{"a", a}}); });
  EXPECT_NE(msg.find("no_such_dir/x.safetensors"), std::string::npos) << msg;
  EXPECT_NE(msg.find("cannot create"), std::string::npos) << msg;
}

}  // namespace
}  // namespace longtrain::model

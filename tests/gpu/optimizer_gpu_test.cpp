// The flat-range optimizer ops on CUDA (kernels/cuda/optimizer.cu) against the CPU reference
// (kernels/cpu/optimizer.cpp): convert, adamw_update and sum_squares. Sizes are odd (vector tails)
// and some views start one element into a buffer (unaligned, the scalar path).
//
// Tolerances: convert is exact (both round to nearest even). adamw_update does the reference's double
// arithmetic in its order with every operation rounded alone, so f32 master weights and moments are
// expected bit-identical; the assertion allows one f32 ulp (float rounding, as the contract promises)
// and the test prints how many elements are bit-identical. sum_squares accumulates in double in
// another order than the CPU: relative 1e-11.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "gpu_test_util.h"
#include "kernels/ops.h"
#include "runtime/error.h"

namespace longtrain::test {
namespace {

// A view of `n` elements starting `skip` elements into the device buffer `buf`.
Tensor sub(const DeviceTensor& buf, int64_t skip, int64_t n) {
  Tensor t = buf.view;
  t.data = static_cast<char*>(buf.view.data) + skip * dtype_size(buf.view.dtype);
  t.shape[0] = n;
  return t;
}

// A host tensor of `dtype` holding `values` (which are already representable in it).
struct HostBuffer {
  std::vector<unsigned char> bytes;
  Tensor view;
  HostBuffer(DType dtype, const std::vector<double>& values) : bytes(values.size() * dtype_size(dtype)) {
    view = Tensor(bytes.data(), dtype, {static_cast<int64_t>(values.size())});
    for (size_t i = 0; i < values.size(); ++i) {
      switch (dtype) {
        case DType::bf16: reinterpret_cast<bf16*>(bytes.data())[i] = bf16(static_cast<float>(values[i])); break;
        case DType::f32: reinterpret_cast<float*>(bytes.data())[i] = static_cast<float>(values[i]); break;
        default: reinterpret_cast<double*>(bytes.data())[i] = values[i]; break;
      }
    }
  }
  std::vector<double> values() const {
    std::vector<double> out(static_cast<size_t>(view.numel()));
    for (size_t i = 0; i < out.size(); ++i)
      out[i] = view.dtype == DType::bf16 ? static_cast<float>(reinterpret_cast<const bf16*>(bytes.data())[i])
                                         : reinterpret_cast<const float*>(bytes.data())[i];
    return out;
  }
};

// Copies `values` into the n elements of device view t (t may be unaligned inside its buffer).
void upload_view(const Tensor& t, const std::vector<double>& values) {
  HostBuffer h(t.dtype, values);
  copy(t, h.view);
}

std::vector<double> download_view(const Tensor& t) {
  std::vector<unsigned char> host(t.nbytes());
  Tensor dst = t;
  dst.data = host.data();
  dst.device = Device::cpu;
  copy(dst, t);
  HostBuffer h(t.dtype, std::vector<double>(static_cast<size_t>(t.numel())));
  h.bytes = host;
  h.view.data = h.bytes.data();
  return h.values();
}

// Number of elements that differ from the reference by more than `ulps` units in the last place of
// f32, and the number that are bit-identical.
struct UlpReport {
  int64_t beyond = 0, identical = 0;
};
UlpReport compare_f32(const std::vector<double>& got, const std::vector<double>& ref, double ulps) {
  UlpReport r;
  for (size_t i = 0; i < got.size(); ++i) {
    const float g = static_cast<float>(got[i]), e = static_cast<float>(ref[i]);
    if (std::memcmp(&g, &e, sizeof(float)) == 0) {
      ++r.identical;
      continue;
    }
    const double ulp = std::ldexp(1.0, std::ilogb(std::max(std::abs(ref[i]), 1e-38)) - 23);
    if (!(std::abs(got[i] - ref[i]) <= ulps * ulp)) ++r.beyond;
  }
  return r;
}

TEST(GpuOptimizerOps, ConvertMatchesTheCpuBitForBit) {
  LT_REQUIRE_GPU();
  const int64_t n = 1001;
  // Values with more than bf16's 8 significant bits, ties included (x.5 ulp cases come from the
  // random draws' low bits), plus signed zeros, large and tiny magnitudes.
  std::vector<double> src = random_values(n, 11, DType::f32, -3.0, 3.0);
  src[0] = -0.0;
  src[1] = 1e30;
  src[2] = 1e-30;
  src[3] = static_cast<float>(1.0 + std::ldexp(1.0, -8));  // exactly halfway between two bf16 values: to even
  for (const auto& [to, from] : {std::pair{DType::bf16, DType::f32}, std::pair{DType::f32, DType::bf16},
                                 std::pair{DType::f32, DType::f32}, std::pair{DType::bf16, DType::bf16}}) {
    for (int64_t skip : {0, 1}) {
      const std::vector<double> in = round_all(src, from);
      HostBuffer cpu_src(from, in), cpu_dst(to, std::vector<double>(n));
      ops::convert(cpu_dst.view, cpu_src.view);
      DeviceTensor s(from, {n + 1}), d(to, {n + 1});
      upload_view(sub(s, skip, n), in);
      ops::convert(sub(d, skip, n), sub(s, skip, n));
      const std::vector<double> got = download_view(sub(d, skip, n)), ref = cpu_dst.values();
      int64_t differ = 0;
      for (int64_t i = 0; i < n; ++i) differ += std::memcmp(&got[i], &ref[i], sizeof(double)) != 0;
      EXPECT_EQ(differ, 0) << dtype_name(from) << " -> " << dtype_name(to) << ", offset " << skip;
    }
  }
}

// fill on the device writes what the CPU's fill writes, in every float dtype (the value rounded on the
// host: ties to even for bf16), over a vector tail and a one-element tensor. The device tensor starts
// zeroed, so a fill that wrote nothing differs from the CPU's bytes (-0.0 included).
TEST(GpuOptimizerOps, FillMatchesTheCpuBitForBit) {
  LT_REQUIRE_GPU();
  for (DType dt : {DType::f32, DType::bf16, DType::f64}) {
    for (double value : {1.0 / 3.0, -0.0, 1e30, 1.0 + std::ldexp(1.0, -8), 1.0 / 45.0}) {
      for (int64_t n : {int64_t{1}, int64_t{1001}}) {
        std::vector<unsigned char> host(static_cast<size_t>(n) * dtype_size(dt));
        const Tensor cpu(host.data(), dt, {n});
        ops::fill(cpu, value);
        DeviceTensor d(dt, {n});
        zero(d);
        ops::fill(d, value);
        EXPECT_EQ(download_bytes(d), host) << dtype_name(dt) << " " << value << " n " << n;
      }
    }
  }
}

struct AdamWCase {
  DType param, grad;
  bool master;
};

// Three consecutive steps (moments start at zero, then carry), with clipping scale and weight decay,
// on GPU and CPU from the same state.
TEST(GpuOptimizerOps, AdamWUpdateMatchesTheCpuWithinFloatRounding) {
  LT_REQUIRE_GPU();
  const int64_t n = 4099;
  for (const AdamWCase c : {AdamWCase{DType::bf16, DType::bf16, true}, AdamWCase{DType::bf16, DType::f32, true},
                            AdamWCase{DType::f32, DType::f32, false}, AdamWCase{DType::f32, DType::bf16, false}}) {
    for (int64_t skip : {0, 1}) {
      const std::string what = fmt::format("param {} grad {}{} offset {}", dtype_name(c.param), dtype_name(c.grad),
                                           c.master ? " + f32 master" : "", skip);
      const std::vector<double> w0 = random_values(n, 21, DType::f32, -0.1, 0.1);
      std::vector<double> m = std::vector<double>(n, 0.0), v = m, w = w0, p = round_all(w0, c.param);

      DeviceTensor pd(c.param, {n + 1}), md(DType::f32, {n + 1}), vd(DType::f32, {n + 1}), gd(c.grad, {n + 1}),
          wd(DType::f32, {n + 1});
      upload_view(sub(pd, skip, n), p);
      upload_view(sub(md, skip, n), m);
      upload_view(sub(vd, skip, n), v);
      if (c.master) upload_view(sub(wd, skip, n), w);

      for (int step = 1; step <= 3; ++step) {
        // Gradients spanning several binades, and a few zeros.
        std::vector<double> g = random_values(n, 100 + step, c.grad, -1.0, 1.0);
        for (int64_t i = 0; i < n; i += 97) g[i] = 0.0;
        for (int64_t i = 5; i < n; i += 13) g[i] = round_to(g[i] * 1e-4, c.grad);
        ops::AdamWParams prm;
        prm.lr = 1e-3 * step;
        prm.beta1 = 0.9;
        prm.beta2 = 0.95;
        prm.eps = 1e-8;
        prm.weight_decay = 0.1;
        prm.bias_correction1 = 1.0 - std::pow(prm.beta1, step);
        prm.bias_correction2 = 1.0 - std::pow(prm.beta2, step);
        prm.grad_scale = 0.7;
        // 300 no-decay ranges of 1-5 elements at odd offsets: more than one launch holds (128), and
        // boundaries inside 4- and 8-element vector groups.
        for (int64_t r = 0; r < 300; ++r) prm.no_decay.push_back({3 + 13 * r, 3 + 13 * r + 1 + r % 5});

        HostBuffer cp(c.param, p), cm(DType::f32, m), cv(DType::f32, v), cg(c.grad, g), cw(DType::f32, w);
        ops::adamw_update(cp.view, c.master ? cw.view : Tensor{}, cm.view, cv.view, cg.view, prm);
        upload_view(sub(gd, skip, n), g);
        ops::adamw_update(sub(pd, skip, n), c.master ? sub(wd, skip, n) : Tensor{}, sub(md, skip, n),
                          sub(vd, skip, n), sub(gd, skip, n), prm);
        p = cp.values();
        m = cm.values();
        v = cv.values();
        if (c.master) w = cw.values();
      }
      const std::vector<double> gp = download_view(sub(pd, skip, n)), gm = download_view(sub(md, skip, n)),
                                gv = download_view(sub(vd, skip, n));
      const std::vector<double> gw = c.master ? download_view(sub(wd, skip, n)) : gp;
      const std::vector<double>& rw = c.master ? w : p;
      const UlpReport rm = compare_f32(gm, m, 1), rv = compare_f32(gv, v, 1), rww = compare_f32(gw, rw, 1);
      std::printf("  adamw %-40s bit-identical: m %lld/%lld, v %lld/%lld, w %lld/%lld\n", what.c_str(),
                  (long long)rm.identical, (long long)n, (long long)rv.identical, (long long)n,
                  (long long)rww.identical, (long long)n);
      EXPECT_EQ(rm.beyond, 0) << what << ": m beyond one f32 ulp";
      EXPECT_EQ(rv.beyond, 0) << what << ": v beyond one f32 ulp";
      EXPECT_EQ(rww.beyond, 0) << what << ": weights beyond one f32 ulp";
      if (c.master) {
        // The bf16 parameter is the GPU's own master weight rounded to nearest even.
        int64_t not_rounded = 0;
        for (int64_t i = 0; i < n; ++i) not_rounded += gp[i] != round_to(gw[i], DType::bf16);
        EXPECT_EQ(not_rounded, 0) << what << ": bf16 parameters are not the rounded master weights";
      }
    }
  }
}

TEST(GpuOptimizerOps, AdamWRejectsBf16MomentsNamingThem) {
  LT_REQUIRE_GPU();
  DeviceTensor p(DType::bf16, {8}), m(DType::bf16, {8}), v(DType::f32, {8}), g(DType::bf16, {8}), w(DType::f32, {8});
  try {
    ops::adamw_update(p, w, m, v, g, ops::AdamWParams{});
    ADD_FAILURE() << "bf16 moments accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("moments"), std::string::npos) << e.what();
  }
}

// Σx² against the CPU's double sum; the same bits on every run (fixed-order reduction); NaN and Inf
// propagate (global_norm relies on it to catch bad gradients).
TEST(GpuOptimizerOps, SumSquaresMatchesTheCpuAndIsDeterministic) {
  LT_REQUIRE_GPU();
  for (DType dt : {DType::bf16, DType::f32}) {
    // 5 elements (one block), 3,000,017 (more than one pass of the 1024-block grid), odd offsets.
    for (int64_t n : {int64_t{5}, int64_t{3000017}}) {
      for (int64_t skip : {0, 1}) {
        const std::vector<double> x = random_values(n, 31 + n, dt, -2.0, 2.0);
        HostBuffer hx(dt, x);
        const double ref = ops::sum_squares(hx.view);
        DeviceTensor d(dt, {n + 1});
        upload_view(sub(d, skip, n), x);
        const double a = ops::sum_squares(sub(d, skip, n)), b = ops::sum_squares(sub(d, skip, n));
        EXPECT_NEAR(a, ref, 1e-11 * ref) << dtype_name(dt) << " n=" << n;
        EXPECT_EQ(std::memcmp(&a, &b, sizeof(double)), 0) << "two runs differ: " << a << " vs " << b;
        std::printf("  sum_squares %-4s n=%-8lld offset %lld: relative error %.2e\n", name_of(dt), (long long)n,
                    (long long)skip, std::abs(a - ref) / ref);
      }
    }
    const int64_t n = 70001;
    std::vector<double> x = random_values(n, 41, dt);
    DeviceTensor d(dt, {n});
    x[12345] = std::numeric_limits<double>::infinity();
    upload(d, x);
    EXPECT_TRUE(std::isinf(ops::sum_squares(d)));
    x[54321] = std::numeric_limits<double>::quiet_NaN();
    upload(d, x);
    EXPECT_TRUE(std::isnan(ops::sum_squares(d)));
  }
}

// sum_into (the training step's device sums): Σx and Σx² left on the device, added to what the slot
// holds or replacing it, against the CPU's double sums; the same bits on every run; NaN propagates.
TEST(GpuOptimizerOps, SumIntoAddsOnTheDeviceAsTheCpuDoes) {
  LT_REQUIRE_GPU();
  for (DType dt : {DType::bf16, DType::f32}) {
    for (int64_t n : {int64_t{5}, int64_t{3000017}}) {
      const std::vector<double> x = random_values(n, 7 + n, dt, -2.0, 2.0);
      HostBuffer hx(dt, x);
      DeviceTensor d(dt, {n});
      upload(d, x);
      for (ops::SumOf what : {ops::SumOf::values, ops::SumOf::squares}) {
        double ref = 0.25;
        ops::sum_into(Tensor(&ref, DType::f64, {1}), hx.view, what, /*accumulate=*/true);
        DeviceTensor slot(DType::f64, {2});
        upload(slot, {0.25, 0.25});
        ops::sum_into(slot.view.narrow(0, 0, 1), d, what, /*accumulate=*/true);
        ops::sum_into(slot.view.narrow(0, 1, 1), d, what, /*accumulate=*/true);
        const std::vector<double> got = download(slot);
        const char* name = what == ops::SumOf::values ? "values" : "squares";
        EXPECT_NEAR(got[0], ref, 1e-11 * std::max(1.0, std::abs(ref))) << name_of(dt) << " " << name << " n=" << n;
        EXPECT_EQ(std::memcmp(&got[0], &got[1], sizeof(double)), 0) << "two runs differ";
        ops::sum_into(slot.view.narrow(0, 1, 1), d, what, /*accumulate=*/false);
        EXPECT_NEAR(download(slot)[1], ref - 0.25, 1e-11 * std::max(1.0, std::abs(ref))) << name << ": overwrite";
      }
    }
    std::vector<double> x = random_values(1001, 3, dt);
    x[500] = std::numeric_limits<double>::quiet_NaN();
    DeviceTensor d(dt, {1001}), slot(DType::f64, {1});
    upload(d, x);
    upload(slot, {0.0});
    ops::sum_into(slot, d, ops::SumOf::values, /*accumulate=*/true);
    EXPECT_TRUE(std::isnan(download(slot)[0]));
  }
}

}  // namespace
}  // namespace longtrain::test

// Residual add on CUDA: y += x, fp32 math. y and x may differ in dtype (a bf16 branch added into an
// fp32 accumulator); views may be row-strided 2-d or contiguous of any rank.
#include "kernels/backends.h"
#include "kernels/cuda/cuda_common.cuh"

namespace longtrain::ops::cuda {

using namespace longtrain::cuda_util;

namespace {

// Rows of `cols` elements; a contiguous tensor is one row-strided matrix with row stride = cols.
template <class Y, class X>
__global__ void add_inplace_kernel(Y* y, int64_t y_rs, const X* x, int64_t x_rs, int64_t rows, int64_t cols) {
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y)
  for (int64_t c = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; c < cols; c += (int64_t)gridDim.x * blockDim.x) {
    Y* p = y + r * y_rs + c;
    *p = from_float<Y>(to_float(*p) + to_float(x[r * x_rs + c]));
  }
}

}  // namespace

void add_inplace(Tensor y, Tensor x) {
  const char* op = "add_inplace";
  LT_CHECK(!y.empty() && !x.empty(), "{}: empty tensor", op);
  LT_CHECK(y.device == Device::cuda && x.device == Device::cuda, "{}: y {} and x {} must be CUDA tensors", op,
           y.describe(), x.describe());
  check_float(y, op, "y");
  check_float(x, op, "x");
  check_same_shape(y, x, op);
  int64_t rows, cols, y_rs, x_rs;
  if (y.is_contiguous() && x.is_contiguous()) {
    rows = 1;
    cols = y.numel();
    y_rs = x_rs = cols;
  } else {
    LT_CHECK(y.ndim == 2 && y.stride[1] == 1 && x.stride[1] == 1,
             "{}: strided views must be 2-d with a unit-stride last dimension, got y {} and x {}", op, y.describe(),
             x.describe());
    rows = y.size(0);
    cols = y.size(1);
    y_rs = y.stride[0];
    x_rs = x.stride[0];
  }
  if (rows * cols == 0) return;
  dispatch_float(y.dtype, op, [&](auto ytag) {
    using Y = typename decltype(ytag)::type;
    dispatch_float(x.dtype, op, [&](auto xtag) {
      using X = typename decltype(xtag)::type;
      add_inplace_kernel<Y, X><<<grid_2d(rows, cols, 256), 256, 0, cuda_stream()>>>(
          static_cast<Y*>(y.data), y_rs, static_cast<const X*>(x.data), x_rs, rows, cols);
    });
  });
  LT_CUDA_LAUNCH_CHECK("add_inplace_kernel");
}

}  // namespace longtrain::ops::cuda

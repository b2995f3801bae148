#include "attention/distributed/buffers.h"

#include <cstring>

#include <fmt/format.h>

#ifdef LONGTRAIN_HAS_CUDA
#include "attention/cuda/distributed_buffers.h"
#endif

namespace longtrain::attn::dist {

DType accumulator_dtype(DType t) { return t == DType::bf16 ? DType::f32 : t; }

namespace {

double load(const void* p, DType t) {
  switch (t) {
    case DType::f32: return *static_cast<const float*>(p);
    case DType::f64: return *static_cast<const double*>(p);
    case DType::bf16: return static_cast<float>(*static_cast<const bf16*>(p));
    case DType::i32: break;
  }
  LT_FAIL("distributed attention buffers hold float tensors, got {}", dtype_name(t));
}

void store(void* p, DType t, double v) {
  switch (t) {
    case DType::f32: *static_cast<float*>(p) = static_cast<float>(v); return;
    case DType::f64: *static_cast<double*>(p) = v; return;
    case DType::bf16: *static_cast<bf16*>(p) = bf16(static_cast<float>(v)); return;
    case DType::i32: break;
  }
  LT_FAIL("distributed attention buffers hold float tensors, got {}", dtype_name(t));
}

void check_elementwise(const char* op, const Tensor& t) {
  LT_CHECK(t.ndim >= 1 && t.ndim <= kMaxDims, "{}: {} must have 1 to {} dims", op, t.describe(), kMaxDims);
  LT_CHECK(t.shape[t.ndim - 1] <= 1 || t.stride[t.ndim - 1] == 1, "{}: {} must be unit-stride in its last dim", op,
           t.describe());
  LT_CHECK(t.numel() == 0 || t.data != nullptr, "{}: {} has no memory", op, t.describe());
}

// Checks a pair of views for an elementwise op. True when they are CUDA tensors (the caller hands
// them to attention/cuda/distributed_buffers.cu), false for CPU tensors.
bool check_pair(const char* op, const Tensor& dst, const Tensor& src) {
  check_elementwise(op, dst);
  check_elementwise(op, src);
  check_same_shape(dst, src, op);
  LT_CHECK(dst.device == src.device, "{}: {} and {} are on different devices", op, dst.describe(), src.describe());
  if (dst.device == Device::cpu) return false;
#ifdef LONGTRAIN_HAS_CUDA
  return true;
#else
  LT_FAIL("{}: {} is a CUDA tensor but longtrain was built without CUDA", op, dst.describe());
#endif
}

// Calls f(dst_element, src_element) over every element of two same-shape CPU views, row by row.
template <class F>
void for_each_pair(const Tensor& dst, const Tensor& src, F&& f) {
  const int nd = dst.ndim;
  const int64_t n_last = dst.shape[nd - 1];
  const size_t ds = dtype_size(dst.dtype), ss = dtype_size(src.dtype);
  int64_t rows = 1;
  for (int d = 0; d < nd - 1; ++d) rows *= dst.shape[d];
  if (rows == 0 || n_last == 0) return;
  for (int64_t row = 0; row < rows; ++row) {
    int64_t rem = row, doff = 0, soff = 0;
    for (int d = nd - 2; d >= 0; --d) {
      const int64_t i = rem % dst.shape[d];
      rem /= dst.shape[d];
      doff += i * dst.stride[d];
      soff += i * src.stride[d];
    }
    char* dp = static_cast<char*>(dst.data) + doff * static_cast<int64_t>(ds);
    const char* sp = static_cast<const char*>(src.data) + soff * static_cast<int64_t>(ss);
    f(dp, sp, n_last, ds, ss);
  }
}

template <class D, class S>
void add_row(void* dst, const void* src, int64_t n) {
  D* d = static_cast<D*>(dst);
  const S* s = static_cast<const S*>(src);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<D>(d[i] + static_cast<D>(s[i]));
}

}  // namespace

void fill_tensor(Tensor t, double value) {
  if (check_pair("fill_tensor", t, t)) {
#ifdef LONGTRAIN_HAS_CUDA
    cuda::fill_tensor(t, value);
#endif
    return;
  }
  for_each_pair(t, t, [&](char* dp, const char*, int64_t n, size_t ds, size_t) {
    for (int64_t i = 0; i < n; ++i) store(dp + i * ds, t.dtype, value);
  });
}

void copy_tensor(Tensor dst, Tensor src) {
  if (check_pair("copy_tensor", dst, src)) {
#ifdef LONGTRAIN_HAS_CUDA
    cuda::copy_tensor(dst, src);
#endif
    return;
  }
  for_each_pair(dst, src, [&](char* dp, const char* sp, int64_t n, size_t ds, size_t ss) {
    if (dst.dtype == src.dtype) {
      std::memcpy(dp, sp, static_cast<size_t>(n) * ds);
    } else {
      for (int64_t i = 0; i < n; ++i) store(dp + i * ds, dst.dtype, load(sp + i * ss, src.dtype));
    }
  });
}

void add_tensor(Tensor dst, Tensor src) {
  if (check_pair("add_tensor", dst, src)) {
#ifdef LONGTRAIN_HAS_CUDA
    cuda::add_tensor(dst, src);
#endif
    return;
  }
  for_each_pair(dst, src, [&](char* dp, const char* sp, int64_t n, size_t ds, size_t ss) {
    // Same-dtype sums in that dtype (one rounding per add, as a GPU accumulator would); mixed ones
    // through double.
    if (dst.dtype == DType::f64 && src.dtype == DType::f64) {
      add_row<double, double>(dp, sp, n);
    } else if (dst.dtype == DType::f32 && src.dtype == DType::f32) {
      add_row<float, float>(dp, sp, n);
    } else {
      for (int64_t i = 0; i < n; ++i)
        store(dp + i * ds, dst.dtype, load(dp + i * ds, dst.dtype) + load(sp + i * ss, src.dtype));
    }
  });
}

int64_t message_bytes(const Message& m) {
  int64_t b = 0;
  for (const Tensor& t : m) b += static_cast<int64_t>(t.nbytes());
  return b;
}

void copy_message(const Message& dst, const Message& src) {
  LT_CHECK(dst.size() == src.size(), "copy_message: {} parts into {}", src.size(), dst.size());
  for (size_t i = 0; i < dst.size(); ++i) copy_tensor(dst[i], src[i]);
}

void add_message(const Message& dst, const Message& src) {
  LT_CHECK(dst.size() == src.size(), "add_message: {} parts into {}", src.size(), dst.size());
  for (size_t i = 0; i < dst.size(); ++i) add_tensor(dst[i], src[i]);
}

void fill_message(const Message& m, double value) {
  for (const Tensor& t : m) fill_tensor(t, value);
}

void append_sends(std::vector<parallel::P2POp>& ops, const Message& m, int peer) {
  for (const Tensor& t : m) ops.push_back(parallel::P2POp::send(t, peer));
}

void append_recvs(std::vector<parallel::P2POp>& ops, const Message& m, int peer) {
  for (const Tensor& t : m) ops.push_back(parallel::P2POp::recv(t, peer));
}

int64_t send_bytes(const std::vector<parallel::P2POp>& ops) {
  int64_t b = 0;
  for (const parallel::P2POp& op : ops)
    if (op.kind == parallel::P2POp::Kind::send) b += static_cast<int64_t>(op.tensor.nbytes());
  return b;
}

void MessageSlots::ensure(const MessageSpec& spec, int count, Device device) {
  if (arena_.allocated() && spec == spec_ && count == static_cast<int>(slots_.size()) && device == device_) return;
  spec_ = spec;
  device_ = device;
  arena_ = Arena(name_, device);
  for (int s = 0; s < count; ++s)
    for (size_t p = 0; p < spec.size(); ++p)
      arena_.add(fmt::format("slot{}.part{}", s, p), spec[p].shape, spec[p].dtype);
  slots_.assign(static_cast<size_t>(count), Message{});
  if (count == 0 || spec.empty()) return;
  arena_.allocate();
  size_t index = 0;
  for (int s = 0; s < count; ++s)
    for (size_t p = 0; p < spec.size(); ++p) slots_[static_cast<size_t>(s)].push_back(arena_.at(index++));
}

}  // namespace longtrain::attn::dist

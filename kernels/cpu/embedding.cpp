// CPU reference for the token embedding: forward gathers table rows, backward scatter-adds the
// gradient rows back in token order (serial, so the result is deterministic bit for bit).
#include <algorithm>

#include "kernels/backends.h"

namespace longtrain::ops::cpu {
namespace {

bool last_dim_unit_stride(const Tensor& t) {
  return t.ndim > 0 && (t.shape[t.ndim - 1] <= 1 || t.stride[t.ndim - 1] == 1);
}

// Checks shared by forward and backward; `rows` is out or d_out [T, C], table is table or d_table
// [V, C]. Every id is checked before anything is written, so a bad batch leaves the outputs as
// they were.
void check_embedding(const char* op, const char* rows_name, const Tensor& rows, const char* table_name,
                     const Tensor& table, const Tensor& tokens) {
  LT_CHECK(tokens.ndim == 1 && tokens.dtype == DType::i32, "{}: tokens must be i32 [T], got {}", op,
           tokens.describe());
  LT_CHECK(rows.ndim == 2 && table.ndim == 2, "{}: {} must be [T, C] and {} [V, C], got {} and {}", op,
           rows_name, table_name, rows.describe(), table.describe());
  LT_CHECK(rows.shape[0] == tokens.shape[0] && rows.shape[1] == table.shape[1],
           "{}: shapes disagree: {} {}, tokens {}, {} {} (expected {} [T, C], tokens [T], {} [V, C])", op,
           rows_name, rows.describe(), tokens.describe(), table_name, table.describe(), rows_name,
           table_name);
  LT_CHECK(rows.dtype == table.dtype, "{}: {} {} and {} {} must have the same dtype", op, rows_name,
           rows.describe(), table_name, table.describe());
  LT_CHECK(last_dim_unit_stride(rows) && last_dim_unit_stride(table) && last_dim_unit_stride(tokens),
           "{}: the last dimension must be unit-stride ({} stride {}, {} stride {}, tokens stride {})", op,
           rows_name, rows.stride[1], table_name, table.stride[1], tokens.stride[0]);

  const int32_t* ids = tokens.ptr<int32_t>();
  const int64_t vocab = table.shape[0];
  for (int64_t t = 0; t < tokens.shape[0]; ++t) {
    LT_CHECK(ids[t] >= 0 && ids[t] < vocab,
             "{}: token id {} at token index {} is outside the vocabulary [0, {}) of {} {}; the data was "
             "tokenized for another vocabulary (check model.vocab_size and the tokenizer)",
             op, ids[t], t, vocab, table_name, table.describe());
  }
}

template <class T>
void embedding_forward_impl(const Tensor& out, const Tensor& tokens, const Tensor& table) {
  // out [T, C], tokens [T], table [V, C]
  const int64_t n_tokens = out.shape[0], C = out.shape[1];
  const int32_t* ids = tokens.ptr<int32_t>();
  const T* tab = table.ptr<T>();
  T* o = out.ptr<T>();
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* src = tab + ids[t] * table.stride[0];
    std::copy(src, src + C, o + t * out.stride[0]);
  }
}

template <class T>
void embedding_backward_impl(const Tensor& d_table, const Tensor& tokens, const Tensor& d_out) {
  // d_table [V, C] (+=), tokens [T], d_out [T, C]
  const int64_t n_tokens = d_out.shape[0], C = d_out.shape[1];
  const int32_t* ids = tokens.ptr<int32_t>();
  const T* dout = d_out.ptr<T>();
  T* dtab = d_table.ptr<T>();
  // Token order, one row at a time: a repeated id always receives its rows in the same order.
  for (int64_t t = 0; t < n_tokens; ++t) {
    const T* src = dout + t * d_out.stride[0];
    T* dst = dtab + ids[t] * d_table.stride[0];
    for (int64_t c = 0; c < C; ++c) dst[c] += src[c];
  }
}

}  // namespace

void embedding_forward(Tensor out, Tensor tokens, Tensor table, bool /*ids_checked: the host check is free*/) {
  check_embedding("embedding_forward", "out", out, "table", table, tokens);
  switch (table.dtype) {
    case DType::f32: return embedding_forward_impl<float>(out, tokens, table);
    case DType::f64: return embedding_forward_impl<double>(out, tokens, table);
    default:
      LT_FAIL("embedding_forward: dtype {} is not supported by the CPU backend (use f32 or f64): table {}",
              dtype_name(table.dtype), table.describe());
  }
}

void embedding_backward(Tensor d_table, Tensor tokens, Tensor d_out) {
  check_embedding("embedding_backward", "d_out", d_out, "d_table", d_table, tokens);
  switch (d_table.dtype) {
    case DType::f32: return embedding_backward_impl<float>(d_table, tokens, d_out);
    case DType::f64: return embedding_backward_impl<double>(d_table, tokens, d_out);
    default:
      LT_FAIL("embedding_backward: dtype {} is not supported by the CPU backend (use f32 or f64): d_table {}",
              dtype_name(d_table.dtype), d_table.describe());
  }
}

}  // namespace longtrain::ops::cpu

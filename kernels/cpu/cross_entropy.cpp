// CPU fused LM head + cross-entropy. The logits of chunk_tokens rows at a time are formed by a
// GEMM into one [chunk, V] buffer, reduced to a loss per token with a stable log-sum-exp, turned
// into their gradient in place, and sent back through two GEMMs (dx for the chunk, dw += for all),
// so the [T, V] logits never exist. The GEMMs are this backend's linear_forward/linear_backward.
#include <algorithm>
#include <cmath>

#include "kernels/backends.h"
#include "runtime/device.h"

namespace longtrain::ops::cpu {
namespace {

void check_cross_entropy(const Tensor& losses, const Tensor& dx, const Tensor& dw, const Tensor& x,
                         const Tensor& w, const Tensor& labels, const CrossEntropyParams& p) {
  const char* op = "lm_head_cross_entropy";
  LT_CHECK(x.ndim == 2 && w.ndim == 2 && w.shape[1] == x.shape[1],
           "{}: expected x [T, C] and w [V, C], got x {} and w {}", op, x.describe(), w.describe());
  LT_CHECK(x.dtype == DType::f32 || x.dtype == DType::f64,
           "{}: dtype {} is not supported by the CPU backend (use f32 or f64): x {}", op, dtype_name(x.dtype),
           x.describe());
  LT_CHECK(w.dtype == x.dtype, "{}: w {} and x {} must have the same dtype", op, w.describe(), x.describe());
  LT_CHECK(losses.ndim == 1 && losses.shape[0] == x.shape[0] && losses.dtype == x.dtype,
           "{}: losses must be [T] of the dtype of x {}, got {}", op, x.describe(), losses.describe());
  LT_CHECK(losses.shape[0] <= 1 || losses.stride[0] == 1, "{}: losses {} must be contiguous (stride {})", op,
           losses.describe(), losses.stride[0]);
  LT_CHECK(labels.ndim == 1 && labels.dtype == DType::i32 && labels.shape[0] == x.shape[0],
           "{}: labels must be i32 [T] with T = {} (tokens of x {}), got {}", op, x.shape[0], x.describe(),
           labels.describe());
  LT_CHECK(labels.shape[0] <= 1 || labels.stride[0] == 1, "{}: labels {} must be contiguous (stride {})", op,
           labels.describe(), labels.stride[0]);
  LT_CHECK(p.chunk_tokens >= 1, "{}: chunk_tokens must be >= 1, got {}", op, p.chunk_tokens);
  if (!dx.empty()) {
    LT_CHECK(dx.ndim == 2 && dx.shape[0] == x.shape[0] && dx.shape[1] == x.shape[1] && dx.dtype == x.dtype,
             "{}: dx {} must have the shape and dtype of x {}", op, dx.describe(), x.describe());
    LT_CHECK(!dw.empty() && dw.ndim == 2 && dw.shape[0] == w.shape[0] && dw.shape[1] == w.shape[1] &&
                 dw.dtype == w.dtype,
             "{}: with dx given (training), dw {} must have the shape and dtype of w {}", op,
             dw.empty() ? "(empty)" : dw.describe(), w.describe());
  }
  // Every label is checked before anything is written, so a bad batch leaves dw as it was.
  const int32_t* lab = labels.ptr<int32_t>();
  const int64_t vocab = w.shape[0];
  for (int64_t t = 0; !p.labels_checked && t < labels.shape[0]; ++t) {
    LT_CHECK(lab[t] == p.ignore_index || (lab[t] >= 0 && lab[t] < vocab),
             "{}: label {} at token index {} is outside the vocabulary [0, {}) of the LM head {} and is not "
             "ignore_index ({}); the data was tokenized for another vocabulary (check model.vocab_size)",
             op, lab[t], t, vocab, w.describe(), p.ignore_index);
  }
}

template <class T>
void cross_entropy_impl(const Tensor& losses, const Tensor& dx, const Tensor& dw, const Tensor& x, const Tensor& w,
                        const Tensor& labels, const CrossEntropyParams& p) {
  // losses [T], dx [T, C] (overwritten; empty in eval), dw [V, C] (+=, or = under p.dw_write), x [T, C],
  // w [V, C], labels [T]
  const int64_t n_tokens = x.shape[0], V = w.shape[0];
  const bool backward = !dx.empty();
  const int64_t chunk = std::max<int64_t>(1, std::min(p.chunk_tokens, n_tokens));
  const int32_t* lab = labels.ptr<int32_t>();
  T* loss = losses.ptr<T>();

  // Logits, then their gradient, of one chunk; through device_alloc so that allocation_stats() (the
  // step log's peak, checked against the memory plan) sees it.
  struct Scratch {
    void* p;
    ~Scratch() { device_free(Device::cpu, p); }
  } scratch{device_alloc(Device::cpu, static_cast<size_t>(chunk * V) * sizeof(T))};
  T* const buffer = static_cast<T*>(scratch.p);
  if (backward && n_tokens == 0 && p.dw_write == GradWrite::overwrite) {  // no rows: dw = the empty sum
    cpu::linear_backward(Tensor(), dw, Tensor(buffer, dtype_of<T>(), {0, V}), x, w, GradWrite::overwrite);
  }
  for (int64_t t0 = 0; t0 < n_tokens; t0 += chunk) {
    const int64_t n = std::min(chunk, n_tokens - t0);
    const Tensor x_chunk = x.narrow(t0, n);                            // [n, C]
    const Tensor logits(buffer, dtype_of<T>(), {n, V});                // [n, V]
    linear_forward(logits, x_chunk, w);

    for (int64_t r = 0; r < n; ++r) {
      T* row = buffer + r * V;
      const int32_t label = lab[t0 + r];
      if (label == p.ignore_index) {
        loss[t0 + r] = T(0);
        if (backward) std::fill(row, row + V, T(0));
        continue;
      }
      // lse = m + log Σ_v exp(logit_v - m), m the row maximum: no exp ever overflows.
      double m = -INFINITY;
      for (int64_t v = 0; v < V; ++v) m = std::max(m, static_cast<double>(row[v]));
      double sum = 0.0;
      for (int64_t v = 0; v < V; ++v) sum += std::exp(static_cast<double>(row[v]) - m);
      const double lse = m + std::log(sum);
      loss[t0 + r] = static_cast<T>(lse - static_cast<double>(row[label]));
      if (backward) {
        // d loss / d logit_v = softmax_v - [v == label], scaled by grad_scale.
        for (int64_t v = 0; v < V; ++v) {
          const double prob = std::exp(static_cast<double>(row[v]) - lse);
          row[v] = static_cast<T>(p.grad_scale * (prob - (v == label ? 1.0 : 0.0)));
        }
      }
    }

    if (backward) {
      // dx[chunk] = dlogits [n, V] · w [V, C];  dw [V, C] += dlogitsᵀ · x[chunk]
      cpu::linear_backward(dx.narrow(t0, n), dw, logits, x_chunk, w, t0 == 0 ? p.dw_write : GradWrite::accumulate);
    }
  }
}

}  // namespace

void lm_head_cross_entropy(Tensor losses, Tensor dx, Tensor dw, Tensor x, Tensor w, Tensor labels,
                           const CrossEntropyParams& p) {
  check_cross_entropy(losses, dx, dw, x, w, labels, p);
  CrossEntropyParams q = p;
  if (!p.grad_scale_from.empty()) {  // the factor as it is now (ops.h)
    const Tensor& g = p.grad_scale_from;
    LT_CHECK(g.dtype == DType::f32 || g.dtype == DType::f64,
             "lm_head_cross_entropy: grad_scale_from must be f32 or f64, got {}", g.describe());
    q.grad_scale = g.dtype == DType::f32 ? static_cast<double>(*g.ptr<float>()) : *g.ptr<double>();
  }
  if (x.dtype == DType::f32) return cross_entropy_impl<float>(losses, dx, dw, x, w, labels, q);
  return cross_entropy_impl<double>(losses, dx, dw, x, w, labels, q);
}

}  // namespace longtrain::ops::cpu

// Every model op, declared once for both backends. Each function checks its arguments and runs on
// the device its tensors live on: kernels/cpu/<op>.cpp (the reference, templated on float/double,
// OpenBLAS for float GEMMs) or kernels/cuda/<op>.cu (bf16 storage, fp32 accumulation).
//
// Conventions
// - Token-major layouts: activations are [T, C] (T tokens of the local shard), attention tensors
//   [T, H, D]. Views may be strided (see runtime/tensor.h); the last dimension is unit-stride.
// - Activation gradients are written (overwritten) unless the comment says "+=".
//   Parameter gradients (dW, d_table, dw) are accumulated (+=), so micro-batches and token chunks
//   add into the same buffer; the GEMM and norm weight gradients can instead be overwritten by a
//   step's first contribution (GradWrite), which spares the step a zeroing pass and a read of zeros.
// - On CPU every float tensor of one call has the same dtype (f32 or f64); per-token statistics
//   (rstd) use that dtype too. On CUDA, activations and weights are bf16 and statistics are f32.
// - Integer inputs (token ids, positions, labels) are i32.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "runtime/tensor.h"

namespace longtrain::ops {

// ---- embedding -----------------------------------------------------------------------------
// out[t, :] = table[tokens[t], :]             tokens [T] i32, table [V, C], out [T, C]
// A token id outside [0, V) is an error naming the id and position. ids_checked: the caller has checked
// every id on the host when it made the batch (model::check_token_ids), so the CUDA backend skips its
// device check and the host read it costs (the CPU checks anyway: it is free there).
void embedding_forward(Tensor out, Tensor tokens, Tensor table, bool ids_checked = false);
// d_table[tokens[t], :] += d_out[t, :]        (deterministic: rows are added in token order)
// The ids are those embedding_forward checked (the same batch): CUDA groups them on the device, with
// no host read.
void embedding_backward(Tensor d_table, Tensor tokens, Tensor d_out);
// The device scratch embedding_backward takes on `device` for `tokens` ids below `vocab` (the memory
// plan's count; 0 on the CPU).
size_t embedding_backward_scratch_bytes(Device device, int64_t tokens, int64_t vocab);

// How a backward op writes a parameter gradient: added into it (the default), or overwritten with this
// call's contribution without reading the old values, which may be anything, NaN included (the
// first contribution of a step, as PyTorch writes a gradient that zero_grad set to None).
enum class GradWrite { accumulate, overwrite };

// ---- rmsnorm -------------------------------------------------------------------------------
// rstd[t] = 1 / sqrt(mean_c(x[t, c]^2) + eps);  y[t, c] = x[t, c] * rstd[t] * w[c]
// x, y [T, C]; w [C]; rstd [T] (saved for backward).
void rmsnorm_forward(Tensor y, Tensor rstd, Tensor x, Tensor w, double eps);
// dx += d(y)/d(x)·dy  (accumulated: dx is the residual-stream gradient);  dw += sum_t dy·x·rstd
// (dw = under GradWrite::overwrite)
void rmsnorm_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, Tensor rstd,
                      GradWrite dw_write = GradWrite::accumulate);

// ---- rope (Hugging Face rotate-half convention) ----------------------------------------------
// For head dim D and i < D/2: angle = positions[t] * inv_freq[i], c = a·cos(angle), s = a·sin(angle)
// with a the attention factor; (x[i], x[i + D/2]) <- (x[i] c - x[i + D/2] s, x[i + D/2] c + x[i] s).
// inv_freq is the table given (RoPE scaling: model/rope_scaling.h computes it as transformers does)
// or, when empty, theta^(-2i/D). In place on a [T, H, D] view (e.g. the Q or K part of the fused QKV
// output). Positions are global.
constexpr int64_t kMaxRopeHalfDim = 256;  // inv_freq entries a table may hold: head_dim <= 512
struct RopeParams {
  double theta;
  std::vector<double> inv_freq;  // D/2 entries, or empty for theta^(-2i/D)
  double attention_factor;       // scales cos and sin (yarn), so q·k logits scale by its square

  RopeParams(double theta_ = 10000.0, std::vector<double> inv_freq_ = {}, double attention_factor_ = 1.0)
      : theta(theta_), inv_freq(std::move(inv_freq_)), attention_factor(attention_factor_) {}
};
void rope_forward(Tensor x, Tensor positions, const RopeParams& p);
// The transpose: rotates the gradient by -angle and scales it by the attention factor, in place.
void rope_backward(Tensor dx, Tensor positions, const RopeParams& p);
// The same rotation from a table formed once per step: every layer rotates Q and K by the same
// positions, so the model computes c and s once (rope_table) and each layer reads them (rope_apply),
// Q and K as one [T, Hq + Hkv, D] view. table [T, D]: c in [0, D/2), s in [D/2, D); f32 on CUDA, f32
// or f64 on CPU (the model's CPU path keeps f64, so the result equals rope_forward's bit for bit).
void rope_table(Tensor table, Tensor positions, const RopeParams& p);
// x [T, H, D] rotated in place by +angle (rope_forward) or, inverse, by -angle (rope_backward).
void rope_apply(Tensor x, Tensor table, bool inverse);

// ---- swiglu --------------------------------------------------------------------------------
// gate_up [T, 2F] is the fused gate/up GEMM output: gate = columns [0, F), up = [F, 2F).
// out[t, f] = silu(gate[t, f]) * up[t, f]      out [T, F]
void swiglu_forward(Tensor out, Tensor gate_up);
// d_gate_up [T, 2F] from d_out [T, F] and the saved gate_up (d_gate_up may be gate_up itself).
// out [T, F], when given, is written as swiglu_forward writes it (bit for bit) from the same reads: a
// policy that recomputes the MLP needs the forward's output again only for the down projection's
// weight gradient, which can run after this, so the recompute reads gate_up once instead of twice.
void swiglu_backward(Tensor d_gate_up, Tensor d_out, Tensor gate_up, Tensor out = {});

// ---- linear (no bias) ------------------------------------------------------------------------
// Which cuBLASLt algorithm runs a GEMM shape on CUDA (the CPU has one GEMM):
// - heuristic: cuBLASLt's heuristic's first answer (what PyTorch's matmul runs);
// - autotune ("auto"): the heuristic's first few answers are measured on the shape's first calls and
//   the fastest runs it for the rest of the process. The trial cycles through the candidates (one
//   untimed round, then two timed rounds, CUDA events), each run the whole product into the caller's
//   output, so every result is right whichever algorithm ran. A call that may run repeatedly (its
//   output overlaps none of its inputs) runs the whole trial at once, the last run's result kept; one
//   that adds into its output in place (beta = 1 with C = D) runs once per call, so its trial spreads
//   over the shape's first calls and each adds exactly once. After the last trial run the host waits
//   for its end event once and takes each candidate's fastest run. Candidates round differently, so
//   results are not bitwise reproducible across processes under auto (within one they are, once
//   decided).
// The policy: the last set_gemm_algo_policy, else LONGTRAIN_GEMM_ALGO read at the first GEMM, else
// heuristic.
enum class GemmAlgoPolicy { heuristic, autotune };
GemmAlgoPolicy parse_gemm_algo_policy(std::string_view name, std::string_view where);
std::string_view gemm_algo_policy_name(GemmAlgoPolicy policy);
GemmAlgoPolicy gemm_algo_policy();
void set_gemm_algo_policy(GemmAlgoPolicy policy);
// What a run asks for (its config's train.gemm_algorithm) unless LONGTRAIN_GEMM_ALGO names a policy: the
// developer's override wins over every config. Returns the policy in force.
GemmAlgoPolicy set_gemm_algo_policy_unless_overridden(GemmAlgoPolicy requested);
// One decision under auto: the shape, the chosen candidate (0 = the heuristic's first) of how many, and
// the fastest timed call of the chosen one and of the heuristic's first.
struct GemmChoice {
  std::string shape;
  int chosen = 0, candidates = 0;
  double chosen_ms = 0.0, heuristic_ms = 0.0;
};
std::vector<GemmChoice> gemm_choices();
// GEMM shapes whose trial under auto has not ended (a benchmark warms up until there are none).
int gemm_trials_pending();
// GEMM calls run as trial calls so far in this process (never decreases). A trial times its calls and
// reads the times on the host, which a CUDA graph cannot hold: work whose calls added none is free of
// trials.
int64_t gemm_trial_calls();

// y = x · Wᵀ      x [T, K], w [N, K] (PyTorch/HF layout), y [T, N]
void linear_forward(Tensor y, Tensor x, Tensor w);
// y = residual + x · Wᵀ: the residual stream's add done by the GEMM (cuBLASLt's C and beta = 1 on
// CUDA: one fp32 sum rounded once, no separate pass). y may be residual itself.
void linear_residual_forward(Tensor y, Tensor x, Tensor w, Tensor residual);
// dx = dy · W (skipped when dx is empty);  dw += dyᵀ · x (dw = dyᵀ · x under GradWrite::overwrite;
// skipped when dw is empty, so the two products can run apart, with x written in between)
void linear_backward(Tensor dx, Tensor dw, Tensor dy, Tensor x, Tensor w, GradWrite dw_write = GradWrite::accumulate);

// ---- residual ------------------------------------------------------------------------------
// y += x (same shape)
void add_inplace(Tensor y, Tensor x);

// ---- fused LM head + cross-entropy -------------------------------------------------------------
// x [T, C] (final normed hidden states), w [V, C] (LM head), labels [T] i32.
// For each token with labels[t] != ignore_index: losses[t] = logsumexp(x[t]·Wᵀ) - (x[t]·Wᵀ)[labels[t]];
// ignored tokens get losses[t] = 0. losses [T] (f32 on CUDA, the float dtype on CPU).
// When dx is non-empty: dx = grad_scale · d(Σ losses)/dx (overwritten), dw += grad_scale · d(Σ losses)/dW.
// The logits exist only chunk_tokens rows at a time, never as a [T, V] tensor.
// A label outside [0, V) that is not ignore_index is an error naming the label and position.
struct CrossEntropyParams {
  int32_t ignore_index = -100;
  double grad_scale = 1.0;      // 1 / (number of valid labels in the global batch)
  int64_t chunk_tokens = 1024;  // rows of logits materialised at once
  // The caller has already checked every label (the model does, once per shard, before it calls this
  // per chunk of tokens): skips the per-call check, which on CUDA is a synchronising read.
  bool labels_checked = false;
  // overwrite: dw = this call's gradient (its first chunk overwrites, the others add).
  GradWrite dw_write = GradWrite::accumulate;
  // Optional: the factor as one element on the op's device (f32 on CUDA, f32 or f64 on the CPU), read
  // when the op runs, and grad_scale is not used. On CUDA the kernels read it, so a captured CUDA graph
  // replays with whatever value was written there before the launch (ops::fill).
  Tensor grad_scale_from;
};
void lm_head_cross_entropy(Tensor losses, Tensor dx, Tensor dw, Tensor x, Tensor w, Tensor labels,
                           const CrossEntropyParams& p);

// ---- conversion ------------------------------------------------------------------------------
// dst = src element by element, converting the float dtype (f32/f64/bf16; to bf16 rounds to nearest
// even). Same shape, both contiguous.
void convert(Tensor dst, Tensor src);
// Every element of t := value, rounded to t's float dtype as convert rounds (t contiguous). On CUDA it
// is queued like a kernel, the value its argument: no host memory is read when it runs.
void fill(Tensor t, double value);

// ---- optimizer ---------------------------------------------------------------------------------
// One AdamW step (decoupled weight decay, bias correction) over a flat range, with g = grad·grad_scale:
//   m = β1·m + (1−β1)·g;  v = β2·v + (1−β2)·g²;
//   w = w − lr·(weight_decay·w + (m · (1 / bias_correction1)) / (sqrt(v) · (1 / sqrt(bias_correction2)) + eps))
// (PyTorch's arrangement: the two bias corrections are per-step constants, so an element costs one
// division and one square root; both backends compute the constants on the host alike.)
// w is the master copy when `master` is non-empty (f32; param then receives w rounded to its dtype,
// e.g. bf16), else param itself (f32/f64). m and v have the master's (or param's) dtype; grad may be
// bf16. All tensors are 1-d with the same length.
// One call updates a whole flat buffer of parameter tensors (the trainer's every tensor at once, one
// launch on CUDA): weight decay applies to every element outside the `no_decay` ranges.
struct ElementRange {
  int64_t begin = 0, end = 0;  // [begin, end) of the call's elements
};
struct AdamWParams {
  double lr = 0.0;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double weight_decay = 0.0;
  std::vector<ElementRange> no_decay;  // sorted, disjoint, inside the call: decay 0 there
  double bias_correction1 = 1.0;  // 1 − β1^step
  double bias_correction2 = 1.0;  // 1 − β2^step
  double grad_scale = 1.0;        // gradient clipping factor
};
void adamw_update(Tensor param, Tensor master, Tensor m, Tensor v, Tensor grad, const AdamWParams& p);

// Σ x² accumulated in double (returned on the host; a CUDA call synchronises). NaN/Inf propagate.
double sum_squares(Tensor x);

// out[0] (+)= Σ x or Σ x² in double, left on x's device: no host read. A training step sums its
// losses and its gradient norm this way and reads them once, with its metrics, at the end. out is a
// one-element f64 tensor on x's device; the order of summation is fixed (the same bits every run),
// and NaN/Inf propagate.
enum class SumOf { values, squares };
void sum_into(Tensor out, Tensor x, SumOf what, bool accumulate);

// ---- CPU threads -------------------------------------------------------------------------------
// Threads of the CPU GEMMs (OpenBLAS) and, through it, of the CPU attention; 0 = every core.
void set_cpu_threads(int threads);
int cpu_threads();

}  // namespace longtrain::ops

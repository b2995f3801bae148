// Local block attention: the one computation every distributed schedule is made of. A (Q block,
// K/V block) pair gives a partial output O, normalised within the block, and its log-sum-exp LSE;
// partial results combine with lse_merge; backward takes the *final* LSE and either the final O of
// the query rows or only D = rowsum(dO ⊙ O) (callers that received the query rows from another rank).
// CPU: attention/cpu/local_attention.cpp (reference, float/double). CUDA: cuDNN fused SDPA.
//
// Shapes (token-major, strided views allowed; last dim unit-stride):
//   q, o, dq, d_o [Tq, Hq, D]   k, v, dk, dv [Tk, Hkv, D]   lse, delta [Tq, Hq]
// GQA/MQA: Hq % Hkv == 0 and query head h reads KV head h / (Hq / Hkv); K/V are never expanded.
// LSE is the natural log of the row's softmax denominator including the scale: for scores
// s_j = scale · q·k_j, lse = log Σ_j exp(s_j), and O = Σ_j exp(s_j - lse) v_j.
// On CUDA q/k/v/d_o are bf16, o bf16 (or f32), lse and delta f32, dq/dk/dv f32 accumulators or bf16
// views; on CPU all the float tensors of a call share one dtype.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "runtime/tensor.h"

namespace longtrain::attn {

enum class BlockMask {
  none,             // every query sees every key of the block
  causal_diagonal,  // a diagonal block: Tq == Tk and query i sees keys j <= i
};

// o, lse are overwritten. A block without keys (Tk = 0) gives O = 0 and LSE = -inf.
void attention_block_forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v, BlockMask mask,
                             double scale);

// delta[t, h] = Σ_d d_o[t, h, d] · o[t, h, d]: what the backward needs of the final O, for callers
// that send query rows to another rank (the Q side carries delta, not O).
void attention_delta(Tensor delta, Tensor o, Tensor d_o);

// How a backward call writes dq, dk, dv.
enum class GradMode {
  accumulate,  // dq/dk/dv += this block's gradients (a schedule summing blocks into accumulators)
  overwrite,   // dq/dk/dv := this block's gradients, every element written, so the caller need not
               // zero them (one block is the whole attention: one rank). On CUDA, bf16 dq/dk/dv are
               // written by cuDNN in place through their strides (views into the fused dQKV buffer):
               // no scratch and no accumulation pass.
};

// With P = exp(scale·q·kᵀ - lse) (final lse), dP = d_o·vᵀ, delta = rowsum(d_o ⊙ O_final),
// dS = P ⊙ (dP - delta):  dq (+)= scale · dS·k,  dk (+)= scale · dSᵀ·q,  dv (+)= Pᵀ·d_o  (by `mode`).
// Pass exactly one of `o` (the final O of the query rows; the backend forms delta itself: on CUDA
// cuDNN reads O directly) and `delta` (from attention_delta, when only it travelled with the rows);
// the other is an empty Tensor{}. Both give the same gradients (bit-identical on CPU).
// A row whose final LSE is -inf (it saw no key at all) contributes no gradient.
// On CUDA the kernel policy (below) runs cuDNN or our Hopper backward, which sums in f32 and writes
// (or adds into) each f32 or bf16 destination once, so f32 accumulators see no bf16 rounding per block.
void attention_block_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o,
                              Tensor lse, Tensor o, Tensor delta, BlockMask mask, double scale, GradMode mode);

// In place: (o_acc, lse_acc) <- merge((o_acc, lse_acc), (o_blk, lse_blk)):
//   m = max(L1, L2); L = m + log(e^(L1-m) + e^(L2-m)); O = e^(L1-L)·O1 + e^(L2-L)·O2.
// lse = -inf marks an empty partial on either side (its O is never read), so a fresh accumulator is
// (0, -inf); merging two empty partials gives (0, -inf).
void lse_merge(Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk);

// One step of a schedule: (o_acc, lse_acc) <- merge((o_acc, lse_acc), block(q, k, v)), i.e.
// attention_block_forward into (o_blk, lse_blk) followed by lse_merge, which is what the CPU does.
// On CUDA with our Hopper kernel chosen (kernel_policy() below) and an f32 o_acc it is
// one kernel that merges in its epilogue (hopper_attention.h): the block's O stays in f32 registers
// instead of being rounded to bf16 and read back, and o_blk/lse_blk are not touched. o_blk and
// lse_blk have o_acc's and lse_acc's shapes.
void attention_block_forward_merge(Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk, Tensor q, Tensor k,
                                   Tensor v, BlockMask mask, double scale);

// ---- segmented calls (document masks) ---------------------------------------------------------------

// One segment of a segmented call: query rows [q_start, q_start + q_len) of q/o/lse against key rows
// [k_start, k_start + k_len) of k/v.
struct Segment {
  int64_t q_start, q_len;
  int64_t k_start, k_len;
};

// Several independent blocks of one tensor set in one call, all with the same mask (causal_diagonal:
// q_len == k_len, the diagonal within the segment): what one block of a document-masked schedule
// becomes, one segment per shared document (document_mask.h). Query runs must not overlap (checked).
// Every row of o/lse is written: a segment's rows with its block result, every other row as an empty
// partial (O = 0, LSE = -inf), so the whole block merges with lse_merge. On CUDA it is one cuDNN call
// over ragged rows that computes only each segment's own tiles; on the CPU, one block call per segment.
void attention_segments_forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v,
                                const std::vector<Segment>& segments, BlockMask mask, double scale);

// The backward of the same segments (their query runs and their key runs must not overlap, checked).
// GradMode::overwrite writes every element of dq, dk, dv (zero outside the segments); accumulate adds
// the segments' gradients. As attention_block_backward, exactly one of o and delta is given.
void attention_segments_backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o,
                                 Tensor lse, Tensor o, Tensor delta, const std::vector<Segment>& segments,
                                 BlockMask mask, double scale, GradMode mode);

// ---- which kernel runs the block calls on CUDA (attention/cuda/kernel_choice.h) --------------------

// cudnn: cuDNN's fused SDPA for every call. hopper: our sm_90a kernels wherever they support the call
// (cuDNN elsewhere). autotune ("auto"): per call shape, both measured after its first 48 calls (cuDNN
// runs those) and the faster kept for the process (cuda/kernel_choice.h). No effect on the CPU.
enum class KernelPolicy { cudnn, hopper, autotune };

// "cudnn", "hopper" or "auto"; anything else throws naming the accepted values and `where` (the
// environment variable or config key it came from).
KernelPolicy parse_kernel_policy(std::string_view name, std::string_view where);
std::string_view kernel_policy_name(KernelPolicy policy);

// The policy in force: the last set_kernel_policy, else LONGTRAIN_ATTENTION_KERNEL (read at the first
// call), else cudnn. Set it before the first attention call whose choice should follow it (a shape
// decided under auto stays decided).
KernelPolicy kernel_policy();
void set_kernel_policy(KernelPolicy policy);
// What a run asks for (its config's attention.kernel) unless LONGTRAIN_ATTENTION_KERNEL names a policy:
// the developer's override wins over every config. Returns the policy in force.
KernelPolicy set_kernel_policy_unless_overridden(KernelPolicy requested);
// The policy LONGTRAIN_ATTENTION_KERNEL names, if it is set and not empty (a bad name throws, naming it).
std::optional<KernelPolicy> kernel_policy_from_env();

// A decision made under auto: the call shape, the kernel chosen, and each kernel's mean time over its
// timed trial calls.
struct KernelChoice {
  std::string shape;
  std::string kernel;
  double cudnn_ms = 0.0, hopper_ms = 0.0;
};
// Every decision made so far in this process, in the order they were made (empty on the CPU).
std::vector<KernelChoice> kernel_choices();
// Calls run as trial calls under auto so far in this process (never decreases; 0 on the CPU). A trial
// times its calls and reads the times on the host, which a CUDA graph cannot hold: work whose calls
// added none is free of trials.
int64_t kernel_trial_calls();

}  // namespace longtrain::attn

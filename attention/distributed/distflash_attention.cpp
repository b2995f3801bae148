// DistFlashAttn's schedule (docs/distributed-attention.md §1.3) over the contiguous layout.
//
// Causal, 0-based ranks, steps t = 0 .. ⌊P/2⌋:
//   t = 0                 every rank: its own diagonal block.
//   t >= 1, r >= t        owner step: Q_r against K/V of rank r-t.
//   t >= 1, r < t, 2t < P helper step: Q of rank r-t+P against its own K/V; the partial result goes
//                         back to rank r-t+P, which merges it.
//   otherwise             idle (even P, last step, ranks r < P/2).
// Full attention: every rank is an owner at every step t = 1 .. P-1 (K/V of rank (r-t) mod P).
// Transfers are direct point-to-point: at step t every rank posts the inputs of step t+1 (its K/V to
// the rank that owns a block against them, its Q side to the rank that helps it — distance t+1) and
// the results of step t-1 (partial O/LSE forward; dK/dV or dQ partials backward) to their owners,
// then computes step t, then waits. A final batch after the last step carries the last results.
// In every batch, the inputs come before the results, on both sides of every pair, so sends and
// receives between two ranks match in order.
#include <fmt/format.h>

#include <limits>
#include <optional>

#include "attention/distributed/schedules.h"

namespace longtrain::attn::dist {

using parallel::P2POp;
using Task = DistFlashTask;

namespace {

// The transfers that bring step `step`'s inputs (forward and backward alike): this rank receives the
// K/V of the rank it owns a block with (into kv_in's slot step % 2) or the Q side of the rank it
// helps (into q_in's), and sends its own K/V (own_kv) or Q side (own_q) to every rank that needs
// them at that step. Slots are looked up only when used: without helpers the Q-side slots are empty.
void append_step_inputs(std::vector<P2POp>& ops, int P, bool causal, int me, int step, const MessageSlots& kv_in,
                        const MessageSlots& q_in, const MessageSlots& own_kv, const MessageSlots& own_q) {
  const Task mine = distflash_task(P, causal, me, step);
  if (mine.kind == Task::owner) append_recvs(ops, kv_in[step % 2], mine.peer);
  if (mine.kind == Task::helper) append_recvs(ops, q_in[step % 2], mine.peer);
  for (int x = 0; x < P; ++x) {
    const Task theirs = distflash_task(P, causal, x, step);
    if (x == me || theirs.peer != me) continue;
    if (theirs.kind == Task::owner) append_sends(ops, own_kv[0], x);
    if (theirs.kind == Task::helper) append_sends(ops, own_q[0], x);
  }
}

}  // namespace

DistFlashAttention::DistFlashAttention(const SequenceAttentionSpec& spec)
    : DistributedAttention(Schedule::distflash, spec) {
  LT_CHECK(spec.layout == SeqLayout::contiguous,
           "attention.schedule distflash needs parallel.layout contiguous, got {}", layout_name(spec.layout));
}

std::string DistFlashAttention::describe() const {
  return fmt::format("distflash: {} steps of point-to-point transfers over {} ({} ranks, contiguous layout, {})",
                     distflash_steps(sp_.size(), causal_), sp_.name(), sp_.size(),
                     causal_ ? (sp_.size() >= 3 ? "causal, with helpers" : "causal, no helpers below 3 ranks")
                             : "full attention");
}

int distflash_steps(int P, bool causal) { return causal ? P / 2 + 1 : P; }

DistFlashTask distflash_task(int P, bool causal, int r, int t) {
  using Task = DistFlashTask;
  if (t < 0 || t >= distflash_steps(P, causal)) return {};
  if (t == 0) return {Task::own, r};
  if (!causal) return {Task::owner, (r - t + P) % P};
  if (r >= t && t <= P / 2) return {Task::owner, r - t};
  if (r < t && 2 * t < P) return {Task::helper, r - t + P};
  return {};
}

void DistFlashAttention::forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) {
  ++counters.forward_calls;
  const auto start = std::chrono::steady_clock::now();
  const int64_t T = check_call("forward", q, k, v, o, lse);
  check_call_documents(q, T);
  const int P = sp_.size(), me = sp_.rank(), S = distflash_steps(P, causal_);
  const int64_t Hq = q.size(1), D = q.size(2);
  const DType acc = lse.dtype;
  const bool remote = P > 1, helpers = causal_ && P >= 3;
  const ForwardScratch s = prepare_forward(fwd_scratch_, o, lse);

  const MessageSpec kv = kv_spec(k, k.dtype);
  const MessageSpec q_side = {{{T, Hq, D}, q.dtype}};
  const MessageSpec partial = {{{T, Hq, D}, acc}, {{T, Hq}, acc}};
  fwd_own_kv_.ensure(kv, remote ? 1 : 0, q.device);
  fwd_kv_in_.ensure(kv, remote ? 2 : 0, q.device);
  fwd_own_q_.ensure(q_side, helpers ? 1 : 0, q.device);
  fwd_q_in_.ensure(q_side, helpers ? 2 : 0, q.device);
  fwd_res_out_.ensure(partial, helpers ? 2 : 0, q.device);
  fwd_res_in_.ensure(partial, helpers ? 1 : 0, q.device);
  if (remote) {
    copy_tensor(fwd_own_kv_[0][0], k);
    copy_tensor(fwd_own_kv_[0][1], v);
  }
  if (helpers) copy_tensor(fwd_own_q_[0][0], q);

  forward_trace_.steps.assign(static_cast<size_t>(S + 1), ScheduleStep{});
  for (int t = 0; t <= S; ++t) {
    std::vector<P2POp> ops;
    if (t + 1 < S)  // inputs of step t+1
      append_step_inputs(ops, P, causal_, me, t + 1, fwd_kv_in_, fwd_q_in_, fwd_own_kv_, fwd_own_q_);
    int result_from = -1;
    if (t - 1 >= 1) {  // results of step t-1: a helper's partial (O, LSE) goes to its owner
      const Task mine = distflash_task(P, causal_, me, t - 1);
      if (mine.kind == Task::helper) append_sends(ops, fwd_res_out_[(t - 1) % 2], mine.peer);
      for (int x = 0; x < P; ++x) {
        const Task theirs = distflash_task(P, causal_, x, t - 1);
        if (x == me || theirs.kind != Task::helper || theirs.peer != me) continue;
        LT_CHECK(result_from < 0, "distflash: rank {} would receive two partial results at step {}", me, t);
        result_from = x;
        append_recvs(ops, fwd_res_in_[0], x);
      }
    }
    forward_trace_.steps[static_cast<size_t>(t)].bytes_sent += send_bytes(ops);
    std::unique_ptr<parallel::P2PWork> work = ops.empty() ? nullptr : sp_.start_p2p(ops);

    int64_t pairs = 0;
    const Task mine = t < S ? distflash_task(P, causal_, me, t) : Task{};
    std::optional<ComputeScope> scope;
    if (mine.kind != Task::idle) scope.emplace(observer_);
    if (mine.kind == Task::own || mine.kind == Task::owner) {
      const Message* in = mine.kind == Task::owner ? &fwd_kv_in_[t % 2] : nullptr;
      const Tensor kk = in ? (*in)[0] : k, vv = in ? (*in)[1] : v;
      pairs += forward_calls(block_calls(me, mine.peer, T), !documents_.empty(), s.o_acc, lse, s.o_blk, s.lse_blk, q, kk, vv, scale_);
    } else if (mine.kind == Task::helper) {
      const Message& res = fwd_res_out_[t % 2];
      fill_tensor(res[0], 0.0);
      fill_tensor(res[1], -std::numeric_limits<double>::infinity());
      const Tensor qq = fwd_q_in_[t % 2][0];
      pairs += forward_calls(block_calls(mine.peer, me, T), !documents_.empty(), res[0], res[1], s.o_blk, s.lse_blk, qq, k, v, scale_);
    }
    scope.reset();
    forward_trace_.steps[static_cast<size_t>(t)].pairs += pairs;
    if (work) work->wait();
    if (result_from >= 0) lse_merge(s.o_acc, lse, fwd_res_in_[0][0], fwd_res_in_[0][1]);
  }
  finish_forward(s, o);
  count_call(forward_trace_, start);
}

void DistFlashAttention::backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o,
                                  Tensor lse, Tensor d_o) {
  ++counters.backward_calls;
  const auto start = std::chrono::steady_clock::now();
  const int64_t T = check_call("backward", q, k, v, o, lse);
  check_call_documents(q, T);
  check_backward_tensors("distflash", dq, dk, dv, q, k, o, d_o);
  const int P = sp_.size(), me = sp_.rank(), S = distflash_steps(P, causal_);
  const int64_t Hq = q.size(1), D = q.size(2);
  const DType acc = lse.dtype;
  const bool remote = P > 1, helpers = causal_ && P >= 3;
  // Own and owner steps read the final O of the own rows; D is computed only for the helpers.
  const BackwardScratch s = prepare_backward(bwd_scratch_, dq, dk, dv, o, lse, d_o, /*send_delta=*/helpers);

  const MessageSpec kv = kv_spec(k, k.dtype), dkv = kv_spec(k, acc);
  const MessageSpec q_side = backward_q_side_spec(q, d_o, acc);  // what a helper needs
  const MessageSpec dq_spec = {{{T, Hq, D}, acc}};
  bwd_own_kv_.ensure(kv, remote ? 1 : 0, q.device);
  bwd_kv_in_.ensure(kv, remote ? 2 : 0, q.device);
  bwd_dkv_out_.ensure(dkv, remote ? 2 : 0, q.device);
  bwd_dkv_in_.ensure(dkv, remote ? 1 : 0, q.device);
  bwd_own_q_.ensure(q_side, helpers ? 1 : 0, q.device);
  bwd_q_in_.ensure(q_side, helpers ? 2 : 0, q.device);
  bwd_dq_out_.ensure(dq_spec, helpers ? 2 : 0, q.device);
  bwd_dq_in_.ensure(dq_spec, helpers ? 1 : 0, q.device);
  if (remote) {
    copy_tensor(bwd_own_kv_[0][0], k);
    copy_tensor(bwd_own_kv_[0][1], v);
  }
  if (helpers) {
    const Message& own = bwd_own_q_[0];
    copy_tensor(own[0], q);
    copy_tensor(own[1], d_o);
    copy_tensor(own[2], lse);
    copy_tensor(own[3], s.delta);
  }

  backward_trace_.steps.assign(static_cast<size_t>(S + 1), ScheduleStep{});
  for (int t = 0; t <= S; ++t) {
    std::vector<P2POp> ops;
    if (t + 1 < S)  // inputs of step t+1
      append_step_inputs(ops, P, causal_, me, t + 1, bwd_kv_in_, bwd_q_in_, bwd_own_kv_, bwd_own_q_);
    const Message* received = nullptr;  // dK/dV for this rank's K/V, or dQ for its Q
    bool received_dkv = false;
    if (t - 1 >= 1) {  // results of step t-1: an owner's dK/dV partial, a helper's dQ partial
      const Task mine = distflash_task(P, causal_, me, t - 1);
      if (mine.kind == Task::owner) append_sends(ops, bwd_dkv_out_[(t - 1) % 2], mine.peer);
      if (mine.kind == Task::helper) append_sends(ops, bwd_dq_out_[(t - 1) % 2], mine.peer);
      for (int x = 0; x < P; ++x) {
        const Task theirs = distflash_task(P, causal_, x, t - 1);
        if (x == me || theirs.peer != me || (theirs.kind != Task::owner && theirs.kind != Task::helper)) continue;
        LT_CHECK(received == nullptr, "distflash: rank {} would receive two partial gradients at step {}", me, t);
        received_dkv = theirs.kind == Task::owner;
        received = received_dkv ? &bwd_dkv_in_[0] : &bwd_dq_in_[0];
        append_recvs(ops, *received, x);
      }
    }
    backward_trace_.steps[static_cast<size_t>(t)].bytes_sent += send_bytes(ops);
    std::unique_ptr<parallel::P2PWork> work = ops.empty() ? nullptr : sp_.start_p2p(ops);

    int64_t pairs = 0;
    const Task mine = t < S ? distflash_task(P, causal_, me, t) : Task{};
    std::optional<ComputeScope> scope;
    if (mine.kind != Task::idle) scope.emplace(observer_);
    if (mine.kind == Task::own) {
      pairs += backward_calls(block_calls(me, me, T), !documents_.empty(), s.dq, s.dk, s.dv, q, k, v, d_o, lse, s.own_o(), s.own_delta(), scale_);
    } else if (mine.kind == Task::owner) {
      const Message& in = bwd_kv_in_[t % 2];
      const Message& grads = bwd_dkv_out_[t % 2];
      fill_message(grads, 0.0);
      pairs += backward_calls(block_calls(me, mine.peer, T), !documents_.empty(), s.dq, grads[0], grads[1], q, in[0], in[1], d_o, lse, s.own_o(), s.own_delta(), scale_);
    } else if (mine.kind == Task::helper) {
      const Message& in = bwd_q_in_[t % 2];
      const Message& grads = bwd_dq_out_[t % 2];
      fill_message(grads, 0.0);
      pairs += backward_calls(block_calls(mine.peer, me, T), !documents_.empty(), grads[0], s.dk, s.dv, in[0], k, v, in[1], in[2], Tensor{}, in[3], scale_);
    }
    scope.reset();
    backward_trace_.steps[static_cast<size_t>(t)].pairs += pairs;
    if (work) work->wait();
    if (received != nullptr) {
      if (received_dkv) {
        add_tensor(s.dk, (*received)[0]);
        add_tensor(s.dv, (*received)[1]);
      } else {
        add_tensor(s.dq, (*received)[0]);
      }
    }
  }
  finish_backward(s, dq, dk, dv);
  count_call(backward_trace_, start);
}

}  // namespace longtrain::attn::dist

// The distributed attention's shared parts (the base class, scratch, block calls), the ring/zigzag
// and burst schedules, and the factory. distflash is in distflash_attention.cpp.
#include "attention/distributed/schedules.h"
#include "attention/distributed/ulysses_attention.h"

#include <cmath>
#include <limits>

#include <fmt/format.h>

#include "runtime/device.h"

namespace longtrain::attn {

// ---- names, traces, base class ----------------------------------------------------------------------

std::string_view schedule_name(Schedule s) {
  switch (s) {
    case Schedule::ring: return "ring";
    case Schedule::zigzag: return "zigzag";
    case Schedule::distflash: return "distflash";
    case Schedule::burst: return "burst";
    case Schedule::ulysses: return "ulysses";
  }
  return "?";
}

Schedule parse_schedule(std::string_view name) {
  for (Schedule s : {Schedule::ring, Schedule::zigzag, Schedule::distflash, Schedule::burst, Schedule::ulysses})
    if (schedule_name(s) == name) return s;
  LT_FAIL("unknown attention schedule '{}': use ring, zigzag, distflash, burst or ulysses", name);
}

int64_t ScheduleTrace::pairs() const {
  int64_t n = 0;
  for (const ScheduleStep& s : steps) n += s.pairs;
  return n;
}

int64_t ScheduleTrace::bytes_sent() const {
  int64_t n = 0;
  for (const ScheduleStep& s : steps) n += s.bytes_sent;
  return n;
}

DistributedAttention::DistributedAttention(Schedule schedule, const SequenceAttentionSpec& spec)
    : schedule_(schedule),
      causal_(spec.causal),
      scale_(spec.scale),
      layout_(spec.layout),
      chunk_calls_(spec.chunk_calls),
      sp_(*spec.sp) {
  timing_.counters = &counters;
}

void DistributedAttention::check_call_documents(const Tensor& q, int64_t T) const {
  if (documents_.empty()) return;
  (void)q;
  check_documents(documents_, T * sp_.size(),
                  fmt::format("{} attention on sequence-parallel rank {} of {} (shards of {} tokens)",
                              schedule_name(schedule_), sp_.rank(), sp_.size(), T));
}

void DistributedAttention::count_call(const ScheduleTrace& trace, std::chrono::steady_clock::time_point start) {
  counters.bytes_sent += trace.bytes_sent();
  counters.pairs += trace.pairs();
  counters.wall_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

int64_t DistributedAttention::check_call(const char* op, const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& o, const Tensor& lse) const {
  const std::string where = fmt::format("{} attention {} on sequence-parallel rank {} of {}", schedule_name(schedule_),
                                        op, sp_.rank(), sp_.size());
  LT_CHECK(q.ndim == 3 && k.ndim == 3 && v.ndim == 3, "{}: q {}, k {}, v {} must be [tokens, heads, head_dim]", where,
           q.describe(), k.describe(), v.describe());
  const int64_t T = q.size(0);
  LT_CHECK(k.size(0) == T && v.size(0) == T,
           "{}: q has {} tokens but k {} and v {}; sequence-parallel attention is self-attention over one shard", where,
           T, k.size(0), v.size(0));
  check_same_shape(k, v, "sequence-parallel attention: k and v");
  LT_CHECK(k.size(2) == q.size(2), "{}: q {} and k {} differ in head_dim", where, q.describe(), k.describe());
  LT_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
           "{}: q has {} heads, not a multiple of the {} K/V heads (GQA/MQA need n_heads % n_kv_heads == 0)", where,
           q.size(1), k.size(1));
  LT_CHECK(q.dtype == k.dtype && q.dtype == v.dtype, "{}: q {}, k {} and v {} must share one dtype", where,
           q.describe(), k.describe(), v.describe());
  for (const Tensor* t : {&q, &k, &v, &o, &lse})
    LT_CHECK(t->device == sp_.device(), "{}: {} is not on the device of the communicator {} ({})", where,
             t->describe(), sp_.name(), sp_.device() == Device::cpu ? "cpu" : "cuda");
  const DType acc = dist::accumulator_dtype(q.dtype);
  LT_CHECK(o.ndim == 3 && o.size(0) == T && o.size(1) == q.size(1) && o.size(2) == q.size(2),
           "{}: o {} must have the shape of q {}", where, o.describe(), q.describe());
  LT_CHECK(o.dtype == q.dtype || o.dtype == acc, "{}: o {} must be {} or {}", where, o.describe(),
           dtype_name(q.dtype), dtype_name(acc));
  LT_CHECK(lse.ndim == 2 && lse.size(0) == T && lse.size(1) == q.size(1) && lse.dtype == acc,
           "{}: lse {} must be {}[{}, {}] (the accumulator dtype of {} tensors)", where, lse.describe(),
           dtype_name(acc), T, q.size(1), dtype_name(q.dtype));
  const int64_t chunks_per_rank = layout_ == SeqLayout::zigzag ? 2 : 1;
  LT_CHECK(T > 0 && T % chunks_per_rank == 0,
           "{}: the local shard has {} tokens, which the {} layout cannot split into its {} chunk(s) per rank; "
           "data.seq_len must be a multiple of {} (= {} x parallel.sp_size)",
           where, T, layout_name(layout_), chunks_per_rank, chunks_per_rank * sp_.size(), chunks_per_rank);
  return T;
}

namespace dist {

// ---- scratch and block calls ------------------------------------------------------------------------

ForwardScratch prepare_forward(MessageSlots& slots, Tensor o, Tensor lse) {
  const DType acc = lse.dtype;
  const int64_t T = o.size(0), H = o.size(1), D = o.size(2);
  const bool separate = o.dtype != acc;
  MessageSpec spec = {{{T, H, D}, o.dtype}, {{T, H}, acc}};
  if (separate) spec.push_back({{T, H, D}, acc});
  slots.ensure(spec, 1, o.device);
  ForwardScratch s{slots[0][0], slots[0][1], separate ? slots[0][2] : o};
  fill_tensor(s.o_acc, 0.0);
  fill_tensor(lse, -std::numeric_limits<double>::infinity());
  return s;
}

void finish_forward(const ForwardScratch& s, Tensor o) {
  if (s.o_acc.data != o.data) copy_tensor(o, s.o_acc);
}

BackwardScratch prepare_backward(MessageSlots& slots, Tensor dq, Tensor dk, Tensor dv, Tensor o, Tensor lse,
                                 Tensor d_o, bool send_delta) {
  const DType acc = lse.dtype;
  // The D slot exists even when unused (it is T·Hq accumulators), so the slots, and the memory plan's
  // copy of them (workspace.cpp), do not depend on the call.
  MessageSpec spec = {{{lse.size(0), lse.size(1)}, acc}};
  const Tensor* grads[3] = {&dq, &dk, &dv};
  for (const Tensor* g : grads)
    if (g->dtype != acc) spec.push_back({{g->size(0), g->size(1), g->size(2)}, acc});
  slots.ensure(spec, 1, lse.device);
  BackwardScratch s;
  s.delta = slots[0][0];
  size_t part = 1;
  Tensor* outs[3] = {&s.dq, &s.dk, &s.dv};
  for (int i = 0; i < 3; ++i) {
    *outs[i] = grads[i]->dtype != acc ? slots[0][part++] : *grads[i];
    fill_tensor(*outs[i], 0.0);
  }
  if (o.dtype == d_o.dtype) s.o = o;
  if (send_delta || s.o.ndim == 0) attention_delta(s.delta, o, d_o);
  return s;
}

void finish_backward(const BackwardScratch& s, Tensor dq, Tensor dk, Tensor dv) {
  if (s.dq.data != dq.data) copy_tensor(dq, s.dq);
  if (s.dk.data != dk.data) copy_tensor(dk, s.dk);
  if (s.dv.data != dv.data) copy_tensor(dv, s.dv);
}

void forward_call(const BlockCall& c, Tensor o_acc, Tensor lse_acc, Tensor o_blk, Tensor lse_blk, Tensor q, Tensor k,
                  Tensor v, double scale) {
  auto rows = [&](const Tensor& t) { return t.narrow(0, c.q_start, c.q_len); };
  auto keys = [&](const Tensor& t) { return t.narrow(0, c.k_start, c.k_len); };
  attention_block_forward_merge(rows(o_acc), rows(lse_acc), rows(o_blk), rows(lse_blk), rows(q), keys(k), keys(v),
                                c.mask, scale);
}

void backward_call(const BlockCall& c, Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor d_o,
                   Tensor lse, Tensor o, Tensor delta, double scale) {
  auto rows = [&](const Tensor& t) { return t.ndim == 0 ? t : t.narrow(0, c.q_start, c.q_len); };
  auto keys = [&](const Tensor& t) { return t.narrow(0, c.k_start, c.k_len); };
  attention_block_backward(rows(dq), keys(dk), keys(dv), rows(q), keys(k), keys(v), rows(d_o), rows(lse), rows(o),
                           rows(delta), c.mask, scale, GradMode::accumulate);
}

namespace {

// The query and key rows a segmented call spans, and its segments relative to them.
struct Span {
  int64_t q0, q1, k0, k1;
  std::vector<Segment> segments;
};

Span span_of(const SegmentCall& call) {
  Span s{INT64_MAX, 0, INT64_MAX, 0, {}};
  for (const Segment& g : call.segments) {
    s.q0 = std::min(s.q0, g.q_start);
    s.q1 = std::max(s.q1, g.q_start + g.q_len);
    s.k0 = std::min(s.k0, g.k_start);
    s.k1 = std::max(s.k1, g.k_start + g.k_len);
  }
  for (const Segment& g : call.segments) s.segments.push_back({g.q_start - s.q0, g.q_len, g.k_start - s.k0, g.k_len});
  return s;
}

}  // namespace

int64_t forward_calls(const std::vector<BlockCall>& calls, bool segmented, Tensor o_acc, Tensor lse_acc, Tensor o_blk,
                      Tensor lse_blk, Tensor q, Tensor k, Tensor v, double scale) {
  int64_t pairs = 0;
  if (!segmented) {
    for (const BlockCall& c : calls) {
      forward_call(c, o_acc, lse_acc, o_blk, lse_blk, q, k, v, scale);
      pairs += c.pairs();
    }
    return pairs;
  }
  for (const SegmentCall& call : segment_calls(calls)) {
    const Span s = span_of(call);
    auto rows = [&](const Tensor& t) { return t.narrow(0, s.q0, s.q1 - s.q0); };
    auto keys = [&](const Tensor& t) { return t.narrow(0, s.k0, s.k1 - s.k0); };
    attention_segments_forward(rows(o_blk), rows(lse_blk), rows(q), keys(k), keys(v), s.segments, call.mask, scale);
    lse_merge(rows(o_acc), rows(lse_acc), rows(o_blk), rows(lse_blk));
    pairs += call.pairs;
  }
  return pairs;
}

int64_t backward_calls(const std::vector<BlockCall>& calls, bool segmented, Tensor dq, Tensor dk, Tensor dv, Tensor q,
                       Tensor k, Tensor v, Tensor d_o, Tensor lse, Tensor o, Tensor delta, double scale) {
  int64_t pairs = 0;
  if (!segmented) {
    for (const BlockCall& c : calls) {
      backward_call(c, dq, dk, dv, q, k, v, d_o, lse, o, delta, scale);
      pairs += c.pairs();
    }
    return pairs;
  }
  for (const SegmentCall& call : segment_calls(calls)) {
    const Span s = span_of(call);
    auto rows = [&](const Tensor& t) { return t.ndim == 0 ? t : t.narrow(0, s.q0, s.q1 - s.q0); };
    auto keys = [&](const Tensor& t) { return t.narrow(0, s.k0, s.k1 - s.k0); };
    attention_segments_backward(rows(dq), keys(dk), keys(dv), rows(q), keys(k), keys(v), rows(d_o), rows(lse), rows(o),
                                rows(delta), s.segments, call.mask, scale, GradMode::accumulate);
    pairs += call.pairs;
  }
  return pairs;
}

void check_backward_tensors(const char* schedule, Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor o,
                            Tensor d_o) {
  auto same = [&](const Tensor& a, const Tensor& b, const char* what) {
    check_same_shape(a, b, fmt::format("{} attention backward: {}", schedule, what).c_str());
  };
  same(dq, q, "dq and q");
  same(dk, k, "dk and k");
  same(dv, k, "dv and v");
  same(d_o, q, "d_o and q");
  same(o, q, "o and q");
  LT_CHECK(d_o.dtype == q.dtype, "{} attention backward: d_o {} must have q's dtype {}", schedule, d_o.describe(),
           dtype_name(q.dtype));
}

MessageSpec kv_spec(const Tensor& k, DType dtype) {
  return {{{k.size(0), k.size(1), k.size(2)}, dtype}, {{k.size(0), k.size(1), k.size(2)}, dtype}};
}

MessageSpec backward_q_side_spec(const Tensor& q, const Tensor& d_o, DType acc) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  return {{{T, Hq, D}, q.dtype}, {{T, Hq, D}, d_o.dtype}, {{T, Hq}, acc}, {{T, Hq}, acc}};
}

namespace {

// The forward of ring, zigzag and burst: K/V blocks rotate over `topo`; at each round this rank's
// queries meet the block it holds and the partial results merge into (o, lse).
void rotating_kv_forward(RingRotation& rotation, MessageSlots& scratch, const RingTopology& topo, SeqLayout layout,
                         bool causal, ChunkCalls chunk_calls, const Documents& docs, double scale, Tensor o, Tensor lse,
                         Tensor q, Tensor k, Tensor v, ScheduleTrace& trace, ComputeObserver* observer) {
  const int64_t T = q.size(0);
  const int P = topo.size(), me = topo.sp_rank();
  const ForwardScratch s = prepare_forward(scratch, o, lse);
  RotationHooks hooks;
  hooks.compute = [&](int, int source, const Message* block, const Message*) {
    const Tensor kk = block ? (*block)[0] : k, vv = block ? (*block)[1] : v;
    const ComputeScope scope(observer);
    int64_t pairs = 0;
    pairs += forward_calls(document_block_calls(plan_block_calls(layout, P, T, me, source, causal, chunk_calls),
                                                   docs, layout, P, T, me, source, causal), !docs.empty(), s.o_acc, lse, s.o_blk, s.lse_blk, q, kk, vv, scale);
    return pairs;
  };
  auto pack = [&](const Message& m) {
    copy_tensor(m[0], k);
    copy_tensor(m[1], v);
  };
  rotation.run(topo, kv_spec(k, k.dtype), {}, q.device, pack, hooks, trace);
  finish_forward(s, o);
}

}  // namespace

// ---- ring and zigzag ----------------------------------------------------------------------------------

RingAttention::RingAttention(Schedule schedule, const SequenceAttentionSpec& spec)
    : DistributedAttention(schedule, spec) {}

std::string RingAttention::describe() const {
  return fmt::format("{}: K/V ring over {} ({} ranks, {} layout, {})", schedule_name(schedule_), sp_.name(),
                     sp_.size(), layout_name(layout_), causal_ ? "causal" : "full attention");
}

void RingAttention::forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) {
  ++counters.forward_calls;
  const auto start = std::chrono::steady_clock::now();
  check_call_documents(q, check_call("forward", q, k, v, o, lse));
  rotating_kv_forward(forward_rotation_, fwd_scratch_, RingTopology::single(sp_), layout_, causal_, chunk_calls_,
                      documents_, scale_, o, lse, q, k, v, forward_trace_, observer_);
  count_call(forward_trace_, start);
}

void RingAttention::backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                             Tensor d_o) {
  ++counters.backward_calls;
  const auto start = std::chrono::steady_clock::now();
  const int64_t T = check_call("backward", q, k, v, o, lse);
  check_call_documents(q, T);
  check_backward_tensors(schedule_name(schedule_).data(), dq, dk, dv, q, k, o, d_o);
  const int me = sp_.rank();
  // The query rows never leave this rank: every block reads the final O (or D) of the own rows.
  const BackwardScratch s = prepare_backward(bwd_scratch_, dq, dk, dv, o, lse, d_o, /*send_delta=*/false);
  RotationHooks hooks;
  hooks.compute = [&](int, int source, const Message* block, const Message* grads) {
    const Tensor kk = block ? (*block)[0] : k, vv = block ? (*block)[1] : v;
    const Tensor gk = grads ? (*grads)[0] : s.dk, gv = grads ? (*grads)[1] : s.dv;
    const ComputeScope scope(observer_);
    int64_t pairs = 0;
    pairs += backward_calls(block_calls(me, source, T), !documents_.empty(), s.dq, gk, gv, q, kk, vv, d_o, lse, s.own_o(), s.own_delta(), scale_);
    return pairs;
  };
  hooks.add_to_own = [&](const Message& m) {
    add_tensor(s.dk, m[0]);
    add_tensor(s.dv, m[1]);
  };
  auto pack = [&](const Message& m) {
    copy_tensor(m[0], k);
    copy_tensor(m[1], v);
  };
  backward_rotation_.run(RingTopology::single(sp_), kv_spec(k, k.dtype), kv_spec(k, lse.dtype), q.device, pack,
                         hooks, backward_trace_);
  finish_backward(s, dq, dk, dv);
  count_call(backward_trace_, start);
}

// ---- burst --------------------------------------------------------------------------------------------

namespace {

// The double ring when every rank of the group can use it; the single ring otherwise. All ranks must
// choose alike (they exchange blocks by the chosen route): when the rings are given (by every rank:
// the spec is the same everywhere), the choice is agreed over the group with one small all-reduce.
// A group inside one node (inter-node ring of one) or a ragged shape (rings that do not tile the
// group, parallel::has_regular_rings false) runs the single ring.
RingTopology burst_topology(const SequenceAttentionSpec& spec) {
  parallel::Communicator& sp = *spec.sp;
  if (spec.intra_node == nullptr || spec.inter_node == nullptr) return RingTopology::single(sp);
  int32_t refuse = 1;
  if (spec.inter_node->size() > 1 && spec.intra_node->size() * spec.inter_node->size() == sp.size()) {
    refuse = 0;
    try {
      (void)RingTopology::double_ring(sp, *spec.intra_node, *spec.inter_node);
    } catch (const Error&) {
      refuse = 1;
    }
  }
  // The flag lives where the communicator's tensors do: a host int for Gloo, a device one for NCCL
  // (read back through the compute stream, which the all_reduce orders itself before).
  Tensor host_flag(&refuse, DType::i32, {1}, Device::cpu);
  if (sp.device() == Device::cpu) {
    sp.all_reduce(host_flag, parallel::ReduceOp::max);
  } else {
    Arena flag_arena("burst topology flag", sp.device());
    flag_arena.add("refuse", {1}, DType::i32);
    flag_arena.allocate();
    const Tensor flag = flag_arena.get("refuse");
    copy(flag, host_flag);
    sp.all_reduce(flag, parallel::ReduceOp::max);
    copy(host_flag, flag);
  }
  if (refuse == 0) return RingTopology::double_ring(sp, *spec.intra_node, *spec.inter_node);
  return RingTopology::single(sp);
}

}  // namespace

BurstAttention::BurstAttention(const SequenceAttentionSpec& spec)
    : DistributedAttention(Schedule::burst, spec), topology_(burst_topology(spec)) {}

std::string BurstAttention::describe() const {
  if (topology_.is_double())
    return fmt::format("burst: double ring, {} nodes x {} ranks (intra-node ring {}, inter-node ring {}), {} "
                       "layout, {}",
                       topology_.I, topology_.L, topology_.intra->name(), topology_.inter->name(),
                       layout_name(layout_), causal_ ? "causal" : "full attention");
  return fmt::format("burst: single ring over {} ({} ranks, {} layout, {})", sp_.name(), sp_.size(),
                     layout_name(layout_), causal_ ? "causal" : "full attention");
}

void BurstAttention::forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) {
  ++counters.forward_calls;
  const auto start = std::chrono::steady_clock::now();
  check_call_documents(q, check_call("forward", q, k, v, o, lse));
  rotating_kv_forward(forward_rotation_, fwd_scratch_, topology_, layout_, causal_, chunk_calls_, documents_, scale_, o,
                      lse, q, k, v, forward_trace_, observer_);
  count_call(forward_trace_, start);
}

void BurstAttention::backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                              Tensor d_o) {
  ++counters.backward_calls;
  const auto start = std::chrono::steady_clock::now();
  const int64_t T = check_call("backward", q, k, v, o, lse);
  check_call_documents(q, T);
  check_backward_tensors("burst", dq, dk, dv, q, k, o, d_o);
  const int me = sp_.rank();
  const BackwardScratch s = prepare_backward(bwd_scratch_, dq, dk, dv, o, lse, d_o, /*send_delta=*/true);
  const DType acc = lse.dtype;
  const int64_t Hq = q.size(1), D = q.size(2);
  const MessageSpec q_side = backward_q_side_spec(q, d_o, acc);
  const MessageSpec dq_spec = {{{T, Hq, D}, acc}};
  RotationHooks hooks;
  hooks.compute = [&](int, int source, const Message* block, const Message* grads) {
    // A visiting Q side carries D; this rank's own rows read the final O where they can.
    const Tensor qq = block ? (*block)[0] : q, gg = block ? (*block)[1] : d_o, ll = block ? (*block)[2] : lse,
                 oo = block ? Tensor{} : s.own_o(), dd = block ? (*block)[3] : s.own_delta();
    const Tensor gq = grads ? (*grads)[0] : s.dq;
    const ComputeScope scope(observer_);
    int64_t pairs = 0;
    pairs += backward_calls(block_calls(source, me, T), !documents_.empty(), gq, s.dk, s.dv, qq, k, v, gg, ll, oo, dd, scale_);
    return pairs;
  };
  hooks.add_to_own = [&](const Message& m) { add_tensor(s.dq, m[0]); };
  auto pack = [&](const Message& m) {
    copy_tensor(m[0], q);
    copy_tensor(m[1], d_o);
    copy_tensor(m[2], lse);
    copy_tensor(m[3], s.delta);
  };
  backward_rotation_.run(topology_, q_side, dq_spec, q.device, pack, hooks, backward_trace_);
  finish_backward(s, dq, dk, dv);
  count_call(backward_trace_, start);
}

}  // namespace dist

// ---- factory ------------------------------------------------------------------------------------------

void check_sequence_attention_spec(const SequenceAttentionSpec& spec) {
  LT_CHECK(spec.scale > 0 && std::isfinite(spec.scale),
           "sequence attention: the softmax scale must be a positive number (usually 1/sqrt(head_dim)), got {}",
           spec.scale);
  if (spec.schedule == Schedule::zigzag)
    LT_CHECK(spec.layout == SeqLayout::zigzag,
             "attention.schedule zigzag needs parallel.layout zigzag (it balances causal work through that layout); "
             "use schedule ring or distflash with the contiguous layout");
  if (spec.schedule == Schedule::distflash)
    LT_CHECK(spec.layout == SeqLayout::contiguous,
             "attention.schedule distflash needs parallel.layout contiguous (it balances causal work by moving "
             "queries between ranks); use schedule zigzag or burst with the zigzag layout");
  LT_CHECK((spec.intra_node == nullptr) == (spec.inter_node == nullptr),
           "sequence attention: pass both the intra-node and the inter-node ring (burst's double ring) or neither");
  LT_CHECK((spec.ulysses_ring_intra_node == nullptr) == (spec.ulysses_ring_inter_node == nullptr),
           "sequence attention: pass both rings of the ring across the Ulysses groups (burst's double ring) or "
           "neither");
  if (spec.ulysses != nullptr && spec.ulysses->size() > 1 && spec.schedule != Schedule::ulysses) {
    const int R = spec.ulysses_ring ? spec.ulysses_ring->size() : 1;
    const int U = spec.ulysses->size();
    LT_CHECK(spec.sp == nullptr || spec.sp->size() == U * R,
             "sequence attention: the Ulysses group ({} ranks) times its ring ({} ranks) must be the sequence-parallel "
             "group ({} ranks): parallel.sp_size must be a multiple of parallel.ulysses_size",
             U, R, spec.sp ? spec.sp->size() : 0);
    LT_CHECK(spec.sp == nullptr || spec.sp->rank() == (R > 1 ? spec.ulysses_ring->rank() : 0) * U + spec.ulysses->rank(),
             "sequence attention: sequence-parallel rank {} is not member {} of Ulysses group {} (groups must be "
             "consecutive ranks)", spec.sp ? spec.sp->rank() : -1, spec.ulysses->rank(),
             R > 1 ? spec.ulysses_ring->rank() : 0);
  }
  if (spec.sp == nullptr) return;
  for (const parallel::Communicator* c : {spec.intra_node, spec.inter_node, spec.ulysses, spec.ulysses_ring,
                                          spec.ulysses_ring_intra_node, spec.ulysses_ring_inter_node})
    LT_CHECK(c == nullptr || c->device() == spec.sp->device(),
             "sequence attention: communicator {} is on another device than the sequence-parallel group {}",
             c ? c->name() : "", spec.sp->name());
}

std::unique_ptr<SequenceAttention> make_sequence_attention(const SequenceAttentionSpec& spec) {
  check_sequence_attention_spec(spec);
  if (spec.sp == nullptr || spec.sp->size() == 1)
    return std::make_unique<LocalSequenceAttention>(spec.causal, spec.scale);
  if (spec.schedule == Schedule::ulysses)
    return std::make_unique<UlyssesAttention>(*spec.sp, std::make_unique<LocalSequenceAttention>(spec.causal, spec.scale),
                                              spec.layout, 1, 0, "parallel.sp_size");
  if (spec.ulysses != nullptr && spec.ulysses->size() > 1) {
    const bool ring = spec.ulysses_ring != nullptr && spec.ulysses_ring->size() > 1;
    std::unique_ptr<SequenceAttention> inner;
    if (ring) {
      SequenceAttentionSpec across = spec;
      across.sp = spec.ulysses_ring;
      across.intra_node = spec.ulysses_ring_intra_node;
      across.inter_node = spec.ulysses_ring_inter_node;
      across.ulysses = across.ulysses_ring = across.ulysses_ring_intra_node = across.ulysses_ring_inter_node = nullptr;
      inner = make_sequence_attention(across);
    } else {
      inner = std::make_unique<LocalSequenceAttention>(spec.causal, spec.scale);
    }
    return std::make_unique<UlyssesAttention>(*spec.ulysses, std::move(inner), spec.layout,
                                              ring ? spec.ulysses_ring->size() : 1, ring ? spec.ulysses_ring->rank() : 0,
                                              "parallel.ulysses_size");
  }
  switch (spec.schedule) {
    case Schedule::ring:
    case Schedule::zigzag: return std::make_unique<dist::RingAttention>(spec.schedule, spec);
    case Schedule::distflash: return std::make_unique<dist::DistFlashAttention>(spec);
    case Schedule::burst: return std::make_unique<dist::BurstAttention>(spec);
    case Schedule::ulysses: break;  // handled above
  }
  LT_FAIL("unknown attention schedule {}", static_cast<int>(spec.schedule));
}

}  // namespace longtrain::attn

#include "attention/distributed/ulysses_attention.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

namespace longtrain::attn {

namespace {

void check_head_counts(int64_t hq, int64_t hkv, int u, const std::string& key) {
  LT_CHECK(u >= 1, "{} must be at least 1, got {}", key, u);
  LT_CHECK(hkv >= 1 && hq % hkv == 0, "model.n_heads ({}) must be a multiple of model.n_kv_heads ({})", hq, hkv);
  LT_CHECK(hq % u == 0,
           "Ulysses attention splits heads over {} = {} ranks, but model.n_heads ({}) is not a multiple of {}: use a "
           "group size that divides model.n_heads",
           key, u, hq, u);
  LT_CHECK(hkv % u == 0 || u % hkv == 0,
           "Ulysses attention over {} = {} ranks needs model.n_kv_heads ({}) to be a multiple of {} (K/V heads split) "
           "or a divisor of it (each K/V head goes to {} / n_kv_heads ranks); {} K/V heads over {} ranks would make a "
           "rank's query heads read parts of two K/V heads",
           key, u, hkv, u, key, hkv, u);
}

}  // namespace

void check_ulysses_heads(int64_t n_heads, int64_t n_kv_heads, int group_size, const std::string& group_key) {
  check_head_counts(n_heads, n_kv_heads, group_size, group_key);
}

UlyssesHeads ulysses_heads(int64_t n_heads, int64_t n_kv_heads, int group_size, int rank,
                           const std::string& group_key) {
  check_head_counts(n_heads, n_kv_heads, group_size, group_key);
  LT_CHECK(rank >= 0 && rank < group_size, "Ulysses rank {} is outside [0, {})", rank, group_size);
  UlyssesHeads h;
  h.q_count = n_heads / group_size;
  h.q_begin = rank * h.q_count;
  if (n_kv_heads >= group_size) {
    h.kv_count = n_kv_heads / group_size;
    h.kv_begin = rank * h.kv_count;
  } else {
    // Query heads [q_begin, q_begin + q_count) all read K/V head q_begin / (Hq / Hkv): q_count divides
    // the group width Hq / Hkv because group_size is a multiple of Hkv.
    h.kv_count = 1;
    h.kv_begin = h.q_begin / (n_heads / n_kv_heads);
  }
  return h;
}

std::vector<UlyssesRun> ulysses_runs(SeqLayout layout, int64_t local_len, int group_size, int ring_size,
                                     int group_index, int member) {
  const int P = group_size * ring_size;
  const int64_t S = local_len * P;
  const std::vector<LayoutRun> mine = layout_runs(layout, S, P, group_index * group_size + member);
  const std::vector<LayoutRun> gathered = layout_runs(layout, S, ring_size, group_index);
  std::vector<UlyssesRun> runs;
  for (const LayoutRun& m : mine) {
    bool placed = false;
    for (const LayoutRun& g : gathered) {
      if (m.global_start >= g.global_start && m.global_start + m.length <= g.global_start + g.length) {
        runs.push_back({m.local_start, g.local_start + (m.global_start - g.global_start), m.length});
        placed = true;
        break;
      }
    }
    LT_CHECK(placed, "Ulysses: tokens [{}, {}) of sequence-parallel rank {} are not in group {}'s shard",
             m.global_start, m.global_start + m.length, group_index * group_size + member, group_index);
  }
  return runs;
}

void ulysses_pack_heads(Tensor dst, Tensor src, int64_t head_begin) {
  dist::copy_tensor(dst, src.narrow(1, head_begin, dst.size(1)));
}

void ulysses_place_rows(Tensor gathered, Tensor from_peer, const std::vector<UlyssesRun>& runs) {
  for (const UlyssesRun& r : runs)
    dist::copy_tensor(gathered.narrow(0, r.gathered_start, r.length), from_peer.narrow(0, r.local_start, r.length));
}

void ulysses_pack_rows(Tensor to_peer, Tensor gathered, const std::vector<UlyssesRun>& runs) {
  for (const UlyssesRun& r : runs)
    dist::copy_tensor(to_peer.narrow(0, r.local_start, r.length), gathered.narrow(0, r.gathered_start, r.length));
}

void ulysses_place_heads(Tensor dst, Tensor src, int64_t head_begin, bool accumulate) {
  const Tensor d = dst.narrow(1, head_begin, src.size(1));
  if (accumulate)
    dist::add_tensor(d, src);
  else
    dist::copy_tensor(d, src);
}

UlyssesAttention::UlyssesAttention(parallel::Communicator& group, std::unique_ptr<SequenceAttention> inner,
                                   SeqLayout layout, int ring_size, int ring_rank, std::string group_key)
    : group_(group),
      inner_(std::move(inner)),
      layout_(layout),
      ring_size_(ring_size),
      ring_rank_(ring_rank),
      group_key_(std::move(group_key)) {
  LT_CHECK(inner_ != nullptr, "Ulysses attention needs the attention it runs on the gathered tokens");
  LT_CHECK(ring_size_ >= 1 && ring_rank_ >= 0 && ring_rank_ < ring_size_,
           "Ulysses attention: ring rank {} is outside [0, {})", ring_rank_, ring_size_);
}

std::string UlyssesAttention::describe() const {
  if (ring_size_ == 1) return fmt::format("ulysses over '{}' ({} ranks)", group_.name(), group_.size());
  return fmt::format("ulysses {} x ring {} (group '{}', ring rank {})", group_.size(), ring_size_, group_.name(),
                     ring_rank_);
}

namespace {

// The gathered head-layout tensors of one forward: Q, K, V, O [G, heads, D] and LSE [G, h].
dist::MessageSpec gathered_spec(int64_t G, int64_t h, int64_t g, int64_t D, DType elem, DType stat) {
  return {{{G, h, D}, elem}, {{G, g, D}, elem}, {{G, g, D}, elem}, {{G, h, D}, elem}, {{G, h}, stat}};
}

}  // namespace

size_t ulysses_kept_bytes(int group_size, int64_t tokens, int64_t n_heads, int64_t n_kv_heads, int64_t head_dim,
                          DType elem, DType stat, Device device) {
  const int U = group_size;
  const dist::MessageSpec spec = gathered_spec(U * tokens, n_heads / U, std::max<int64_t>(n_kv_heads / U, 1),
                                               head_dim, elem, stat);
  Arena table("ulysses kept", device);  // the table MessageSlots::ensure(spec, 1) allocates; never allocated
  for (size_t p = 0; p < spec.size(); ++p) table.add(fmt::format("slot0.part{}", p), spec[p].shape, spec[p].dtype);
  return table.allocation_bytes();
}

void UlyssesAttention::keep_forward(int64_t n_layers) {
  LT_CHECK(n_layers >= 0, "ulysses attention: keep_forward needs a layer count >= 0, got {}", n_layers);
  kept_.clear();
  for (int64_t l = 0; l < n_layers; ++l)
    kept_.push_back(std::make_unique<dist::MessageSlots>(fmt::format("ulysses kept forward of layer {}", l)));
  kept_filled_.assign(static_cast<size_t>(n_layers), false);
}

dist::MessageSlots& UlyssesAttention::kept_slot(const char* op) {
  LT_CHECK(layer_ >= 0 && layer_ < static_cast<int64_t>(kept_.size()),
           "ulysses attention {}: layer {} is outside the {} layers keep_forward was given", op, layer_, kept_.size());
  return *kept_[static_cast<size_t>(layer_)];
}

void UlyssesAttention::plan(const Tensor& q, const Tensor& k) {
  const int U = group_.size();
  heads_.clear();
  runs_.clear();
  for (int u = 0; u < U; ++u) {
    heads_.push_back(ulysses_heads(q.size(1), k.size(1), U, u, group_key_));
    runs_.push_back(ulysses_runs(layout_, q.size(0), U, ring_size_, ring_rank_, u));
  }
  replicated_kv_ = k.size(1) < U;
}

template <class F>
void UlyssesAttention::run_inner(F&& f) {
  inner_->set_documents(documents_);
  const AttentionCounters before = inner_->counters;
  f();
  const AttentionCounters& now = inner_->counters;
  counters.bytes_sent += now.bytes_sent - before.bytes_sent;
  counters.pairs += now.pairs - before.pairs;
  counters.compute_seconds += now.compute_seconds - before.compute_seconds;
}

int64_t UlyssesAttention::exchange(const std::vector<dist::Message>& send, const std::vector<dist::Message>& recv) {
  group_.start_all_to_all(send, recv)->wait();
  int64_t bytes = 0;
  for (int r = 0; r < group_.size(); ++r)
    if (r != group_.rank()) bytes += dist::message_bytes(send[static_cast<size_t>(r)]);
  counters.bytes_sent += bytes;
  return bytes;
}

namespace {

std::vector<dist::Message> messages(const dist::MessageSlots& slots) {
  std::vector<dist::Message> m;
  for (int i = 0; i < slots.count(); ++i) m.push_back(slots[i]);
  return m;
}

void check_call_shapes(const char* op, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& o,
                       const Tensor& lse, const parallel::Communicator& group) {
  const std::string where = fmt::format("ulysses attention {} on rank {} of group '{}'", op, group.rank(), group.name());
  LT_CHECK(q.ndim == 3 && k.ndim == 3 && v.ndim == 3 && o.ndim == 3 && lse.ndim == 2,
           "{}: q {}, k {}, v {}, o {}, lse {} must be [tokens, heads, head_dim] ([tokens, heads] for lse)", where,
           q.describe(), k.describe(), v.describe(), o.describe(), lse.describe());
  check_same_shape(k, v, "ulysses attention: k and v");
  check_same_shape(q, o, "ulysses attention: q and o");
  LT_CHECK(k.size(0) == q.size(0) && lse.size(0) == q.size(0) && lse.size(1) == q.size(1) && k.size(2) == q.size(2),
           "{}: q {}, k {} and lse {} disagree in tokens, heads or head_dim", where, q.describe(), k.describe(),
           lse.describe());
  for (const Tensor* t : {&q, &k, &v, &o, &lse})
    LT_CHECK(t->device == group.device(), "{}: {} is not on the device of the communicator '{}'", where,
             t->describe(), group.name());
}

}  // namespace

void UlyssesAttention::forward(Tensor o, Tensor lse, Tensor q, Tensor k, Tensor v) {
  const auto start = std::chrono::steady_clock::now();
  ++counters.forward_calls;
  check_call_shapes("forward", q, k, v, o, lse, group_);
  plan(q, k);
  const int U = group_.size(), me = group_.rank();
  const int64_t T = q.size(0), D = q.size(2);
  const UlyssesHeads& mine = heads_[static_cast<size_t>(me)];
  const int64_t h = mine.q_count, g = mine.kv_count, G = T * U;
  const Device dev = q.device;

  // Q, K, V: token shards -> head shards.
  fwd_out_.ensure({{{T, h, D}, q.dtype}, {{T, g, D}, k.dtype}, {{T, g, D}, v.dtype}}, U, dev);
  fwd_in_.ensure({{{T, h, D}, q.dtype}, {{T, g, D}, k.dtype}, {{T, g, D}, v.dtype}}, U, dev);
  for (int u = 0; u < U; ++u) {
    const UlyssesHeads& hd = heads_[static_cast<size_t>(u)];
    ulysses_pack_heads(fwd_out_[u][0], q, hd.q_begin);
    ulysses_pack_heads(fwd_out_[u][1], k, hd.kv_begin);
    ulysses_pack_heads(fwd_out_[u][2], v, hd.kv_begin);
  }
  int64_t bytes = exchange(messages(fwd_out_), messages(fwd_in_));
  // Kept (keep_forward): this layer's own slot, which its backward reads; else one shared slot.
  const bool keep = keeps_forward() && layer_ != kNoLayer;  // a forward-only pass keeps nothing
  dist::MessageSlots& gathered = keep ? kept_slot("forward") : fwd_gathered_;
  gathered.ensure(gathered_spec(G, h, g, D, q.dtype, lse.dtype), 1, dev);
  const dist::Message& gat = gathered[0];
  for (int u = 0; u < U; ++u)
    for (int part = 0; part < 3; ++part)
      ulysses_place_rows(gat[static_cast<size_t>(part)], fwd_in_[u][static_cast<size_t>(part)],
                         runs_[static_cast<size_t>(u)]);

  run_inner([&] { inner_->forward(gat[3], gat[4], gat[0], gat[1], gat[2]); });

  // O, LSE: head shards -> token shards.
  fwd_ret_out_.ensure({{{T, h, D}, o.dtype}, {{T, h}, lse.dtype}}, U, dev);
  fwd_ret_in_.ensure({{{T, h, D}, o.dtype}, {{T, h}, lse.dtype}}, U, dev);
  for (int u = 0; u < U; ++u) {
    ulysses_pack_rows(fwd_ret_out_[u][0], gat[3], runs_[static_cast<size_t>(u)]);
    ulysses_pack_rows(fwd_ret_out_[u][1], gat[4], runs_[static_cast<size_t>(u)]);
  }
  bytes += exchange(messages(fwd_ret_out_), messages(fwd_ret_in_));
  for (int u = 0; u < U; ++u) {
    ulysses_place_heads(o, fwd_ret_in_[u][0], heads_[static_cast<size_t>(u)].q_begin, false);
    ulysses_place_heads(lse, fwd_ret_in_[u][1], heads_[static_cast<size_t>(u)].q_begin, false);
  }
  forward_a2a_bytes_ = bytes;
  if (keep) kept_filled_[static_cast<size_t>(layer_)] = true;
  counters.wall_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void UlyssesAttention::backward(Tensor dq, Tensor dk, Tensor dv, Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse,
                                Tensor d_o) {
  const auto start = std::chrono::steady_clock::now();
  ++counters.backward_calls;
  check_call_shapes("backward", q, k, v, o, lse, group_);
  check_same_shape(dq, q, "ulysses attention backward: dq and q");
  check_same_shape(d_o, q, "ulysses attention backward: d_o and q");
  check_same_shape(dk, k, "ulysses attention backward: dk and k");
  check_same_shape(dv, v, "ulysses attention backward: dv and v");
  plan(q, k);
  const int U = group_.size(), me = group_.rank();
  const int64_t T = q.size(0), D = q.size(2);
  const UlyssesHeads& mine = heads_[static_cast<size_t>(me)];
  const int64_t h = mine.q_count, g = mine.kv_count, G = T * U;
  const Device dev = q.device;

  // To the head shards: dO alone when this layer's forward kept the gathered Q, K, V, O, LSE; else
  // Q, K, V, O, dO and LSE.
  int64_t bytes = 0;
  Tensor grads[3];  // the gathered dQ, dK, dV the inner backward writes
  if (keeps_forward()) {
    const dist::Message& kept = kept_slot("backward")[0];
    LT_CHECK(kept_filled_[static_cast<size_t>(layer_)] && kept[0].size(0) == G && kept[0].size(1) == h &&
                 kept[1].size(1) == g && kept[0].size(2) == D && kept[0].dtype == q.dtype,
             "ulysses attention backward of layer {} on rank {} of group '{}': no forward of this layer with these "
             "shapes since keep_forward (the model runs each layer's forward, then its backward)",
             layer_, me, group_.name());
    const dist::MessageSpec in_spec = {{{T, h, D}, d_o.dtype}};
    bwd_out_.ensure(in_spec, U, dev);
    bwd_in_.ensure(in_spec, U, dev);
    for (int u = 0; u < U; ++u) ulysses_pack_heads(bwd_out_[u][0], d_o, heads_[static_cast<size_t>(u)].q_begin);
    bytes = exchange(messages(bwd_out_), messages(bwd_in_));
    bwd_gathered_.ensure(
        {{{G, h, D}, d_o.dtype}, {{G, h, D}, dq.dtype}, {{G, g, D}, dk.dtype}, {{G, g, D}, dv.dtype}}, 1, dev);
    const dist::Message& gat = bwd_gathered_[0];
    for (int u = 0; u < U; ++u) ulysses_place_rows(gat[0], bwd_in_[u][0], runs_[static_cast<size_t>(u)]);
    run_inner([&] { inner_->backward(gat[1], gat[2], gat[3], kept[0], kept[1], kept[2], kept[3], kept[4], gat[0]); });
    for (size_t part = 0; part < 3; ++part) grads[part] = gat[1 + part];
  } else {
    const dist::MessageSpec in_spec = {{{T, h, D}, q.dtype},   {{T, g, D}, k.dtype},   {{T, g, D}, v.dtype},
                                       {{T, h, D}, o.dtype},   {{T, h, D}, d_o.dtype}, {{T, h}, lse.dtype}};
    bwd_out_.ensure(in_spec, U, dev);
    bwd_in_.ensure(in_spec, U, dev);
    for (int u = 0; u < U; ++u) {
      const UlyssesHeads& hd = heads_[static_cast<size_t>(u)];
      const dist::Message& m = bwd_out_[u];
      ulysses_pack_heads(m[0], q, hd.q_begin);
      ulysses_pack_heads(m[1], k, hd.kv_begin);
      ulysses_pack_heads(m[2], v, hd.kv_begin);
      ulysses_pack_heads(m[3], o, hd.q_begin);
      ulysses_pack_heads(m[4], d_o, hd.q_begin);
      ulysses_pack_heads(m[5], lse, hd.q_begin);
    }
    bytes = exchange(messages(bwd_out_), messages(bwd_in_));
    bwd_gathered_.ensure({{{G, h, D}, q.dtype},
                          {{G, g, D}, k.dtype},
                          {{G, g, D}, v.dtype},
                          {{G, h, D}, o.dtype},
                          {{G, h, D}, d_o.dtype},
                          {{G, h}, lse.dtype},
                          {{G, h, D}, dq.dtype},
                          {{G, g, D}, dk.dtype},
                          {{G, g, D}, dv.dtype}},
                         1, dev);
    const dist::Message& gat = bwd_gathered_[0];
    for (int u = 0; u < U; ++u)
      for (size_t part = 0; part < 6; ++part)
        ulysses_place_rows(gat[part], bwd_in_[u][part], runs_[static_cast<size_t>(u)]);
    run_inner([&] { inner_->backward(gat[6], gat[7], gat[8], gat[0], gat[1], gat[2], gat[3], gat[5], gat[4]); });
    for (size_t part = 0; part < 3; ++part) grads[part] = gat[6 + part];
  }

  // dQ, dK, dV: head shards -> token shards. A replicated K/V head's partials (one per rank that read
  // it) are summed at the owner.
  const dist::MessageSpec out_spec = {{{T, h, D}, dq.dtype}, {{T, g, D}, dk.dtype}, {{T, g, D}, dv.dtype}};
  bwd_ret_out_.ensure(out_spec, U, dev);
  bwd_ret_in_.ensure(out_spec, U, dev);
  for (int u = 0; u < U; ++u)
    for (size_t part = 0; part < 3; ++part)
      ulysses_pack_rows(bwd_ret_out_[u][part], grads[part], runs_[static_cast<size_t>(u)]);
  bytes += exchange(messages(bwd_ret_out_), messages(bwd_ret_in_));
  if (replicated_kv_) {
    dist::fill_tensor(dk, 0.0);
    dist::fill_tensor(dv, 0.0);
  }
  for (int u = 0; u < U; ++u) {
    const UlyssesHeads& hd = heads_[static_cast<size_t>(u)];
    ulysses_place_heads(dq, bwd_ret_in_[u][0], hd.q_begin, false);
    ulysses_place_heads(dk, bwd_ret_in_[u][1], hd.kv_begin, replicated_kv_);
    ulysses_place_heads(dv, bwd_ret_in_[u][2], hd.kv_begin, replicated_kv_);
  }
  backward_a2a_bytes_ = bytes;
  counters.wall_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace longtrain::attn

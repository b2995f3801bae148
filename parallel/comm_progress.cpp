#include "parallel/comm_progress.h"

#include <algorithm>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "parallel/store.h"
#include "runtime/error.h"

namespace longtrain::parallel {

std::string communicator_prefix(std::string_view root, const std::string& name) {
  static std::mutex mu;
  static std::map<std::string, int> generations;  // "<root><name>" -> next generation
  std::lock_guard lock(mu);
  const std::string base = std::string(root) + name;
  return fmt::format("{}/{}/", base, generations[base]++);
}

int group_rank_of(const Communicator& comm, int my_global_rank) {
  const std::vector<int>& ranks = comm.ranks();
  LT_CHECK(!ranks.empty(), "communicator '{}' has no ranks", comm.name());
  int mine = -1;
  for (size_t i = 0; i < ranks.size(); ++i) {
    for (size_t j = 0; j < i; ++j) {
      LT_CHECK(ranks[i] != ranks[j], "communicator '{}' lists global rank {} twice", comm.name(), ranks[i]);
    }
    if (ranks[i] == my_global_rank) mine = static_cast<int>(i);
  }
  LT_CHECK(mine >= 0, "global rank {} is not a member of communicator {}", my_global_rank, comm.describe_group());
  return mine;
}

void join_group(const Communicator& comm, TcpStore& store, const std::string& prefix, const std::string& announce,
                int my_global_rank) {
  std::vector<std::string> keys;
  for (int m = 0; m < comm.size(); ++m) keys.push_back(fmt::format("{}joined/{}", prefix, m));
  store.set(keys[comm.rank()], announce);
  std::vector<std::string> missing = store.wait_for(keys, comm.timeout());
  if (missing.empty()) return;
  std::vector<int> absent;
  for (int m = 0; m < comm.size(); ++m) {
    if (std::find(missing.begin(), missing.end(), keys[m]) != missing.end()) absent.push_back(m);
  }
  LT_FAIL("creating communicator {} on rank {}: {} did not join within {} ms (they never called for this group; "
          "check that every rank builds the same groups, or raise the timeout)",
          comm.describe_group(), my_global_rank, comm.describe_ranks(absent), comm.timeout().count());
}

std::vector<int64_t> balanced_split(int64_t n, int p) {
  std::vector<int64_t> begin(p + 1);
  for (int c = 0; c <= p; ++c) begin[c] = c * (n / p) + std::min<int64_t>(c, n % p);
  return begin;
}

void check_p2p_ops(const Communicator& comm, std::span<const P2POp> ops, Device device) {
  for (const P2POp& op : ops) {
    check_comm_tensor(op.kind == P2POp::Kind::send ? "send" : "recv", op.tensor, device);
    LT_CHECK(op.peer >= 0 && op.peer < comm.size() && op.peer != comm.rank(),
             "send/recv on {}: peer {} must be another rank of the group, in [0, {}) and not {} (this rank)",
             comm.describe_group(), op.peer, comm.size(), comm.rank());
  }
}

void wait_for_peer_progress() { std::this_thread::sleep_for(2 * kMonitorInterval + Millis(50)); }

namespace {

std::vector<uint64_t> parse_counts(const std::string& s) {
  std::vector<uint64_t> v;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) v.push_back(std::stoull(item));
  return v;
}

}  // namespace

Progress Progress::parse(const std::string& text) {
  Progress p;
  std::stringstream ss(text);
  std::string sends, recvs;
  ss >> p.entered >> p.completed >> p.op >> sends >> recvs;
  p.sends = parse_counts(sends);
  p.recvs = parse_counts(recvs);
  return p;
}

// ------------------------------------------------------------------------------------------------

CommProgress::CommProgress(const Communicator& comm, TcpStore& store, std::string prefix)
    : comm_(comm),
      store_(store),
      prefix_(std::move(prefix)),
      sends_(new std::atomic<uint64_t>[comm.size()]),
      recvs_(new std::atomic<uint64_t>[comm.size()]) {
  for (int i = 0; i < comm.size(); ++i) sends_[i] = recvs_[i] = 0;
}

CommProgress::~CommProgress() { unpublish(); }

void CommProgress::enter(const char* op, uint64_t s) {
  last_op_ = op;
  entered_ = s;
}

void CommProgress::mark_completed(uint64_t s) {
  uint64_t c = completed_.load();
  while (c < s && !completed_.compare_exchange_weak(c, s)) {
  }
}

std::string CommProgress::text() const {
  const int size = comm_.size();
  std::vector<uint64_t> s(size), r(size);
  for (int i = 0; i < size; ++i) s[i] = sends_[i], r[i] = recvs_[i];
  return fmt::format("{} {} {} {} {}", entered_.load(), completed_.load(), last_op_.load(), fmt::join(s, ","),
                     fmt::join(r, ","));
}

std::string CommProgress::key(int group_rank) const { return fmt::format("{}progress/{}", prefix_, group_rank); }

void CommProgress::publish() {
  store_.publish(key(comm_.rank()), [this] { return text(); });
  published_ = true;
}

void CommProgress::unpublish() {
  if (!published_) return;
  store_.unpublish(key(comm_.rank()));
  published_ = false;
}

std::optional<Progress> CommProgress::read(int group_rank, std::string* dead) {
  const int g = comm_.ranks()[group_rank];
  if (auto d = store_.try_get(fmt::format("lt/dead/{}", g))) *dead = *d;
  auto p = store_.try_get(key(group_rank));
  if (!p) return std::nullopt;
  return Progress::parse(*p);
}

std::string CommProgress::known_failure() const {
  auto f = store_.peer_failure();
  return f ? "; the store reported: " + *f : "";
}

std::string CommProgress::diagnose_collective(uint64_t s, std::string_view all_arrived) {
  std::vector<int> missing;
  std::vector<std::string> notes;
  try {
    for (int m = 0; m < comm_.size(); ++m) {
      if (m == comm_.rank()) continue;
      const int g = comm_.ranks()[m];
      std::string dead;
      std::optional<Progress> p = read(m, &dead);
      if (p && p->entered >= s) continue;  // it arrived (whatever happened to it afterwards)
      missing.push_back(m);
      if (!p) {
        notes.push_back(dead.empty() ? fmt::format("rank {} never reported progress on this communicator", g)
                                     : dead);
        continue;
      }
      // completed can pass entered in a published pair read between the two counters' updates.
      std::string note = p->entered == 0
                             ? fmt::format("rank {} has entered no collective on this communicator", g)
                             : fmt::format("rank {} is still at collective #{} ({}{})", g, p->entered, p->op,
                                           p->completed >= p->entered ? ", completed" : "");
      notes.push_back(dead.empty() ? note : note + ", and its process has ended since");
    }
  } catch (const std::exception& e) {
    return fmt::format("the other ranks' progress could not be read from the store ({}){}", e.what(),
                       known_failure());
  }
  if (missing.empty()) return std::string(all_arrived) + known_failure();
  return fmt::format("{} did not arrive: {}", comm_.describe_ranks(missing), fmt::join(notes, "; "));
}

std::optional<std::string> CommProgress::missing_transfer(P2POp::Kind kind, int peer, uint64_t k) {
  const int g = comm_.ranks()[peer];
  const int me = comm_.ranks()[comm_.rank()];
  std::string dead;
  std::optional<Progress> p = read(peer, &dead);
  if (!p) {
    return fmt::format("rank {} did not arrive: {}", g,
                       dead.empty() ? "it never reported progress on this communicator" : dead);
  }
  const std::string ended = dead.empty() ? "" : fmt::format(" (rank {}'s process has ended since)", g);
  if (kind == P2POp::Kind::recv) {
    const uint64_t posted = p->sends.at(comm_.rank());
    if (posted >= k) return std::nullopt;
    return fmt::format("rank {} did not arrive: it has posted {} send(s) to rank {}, not send #{}{}", g, posted, me, k,
                       ended);
  }
  const uint64_t posted = p->recvs.at(comm_.rank());
  if (posted >= k) return std::nullopt;
  return fmt::format("rank {} did not arrive: it has posted {} receive(s) from rank {}, not receive #{}{}", g, posted,
                     me, k, ended);
}

}  // namespace longtrain::parallel

// What the Gloo and NCCL communicators share. Mostly what names the rank(s) that did not arrive
// when an operation fails: the store keys of a communicator, the join step of its creation, the
// progress every rank publishes through the store, and the diagnosis that reads the peers'
// progress. Also the send/recv argument checks and the balanced split behind both backends'
// traffic counters (which must agree: distributed-attention volume tests run on both).
//
// Progress of one rank on one communicator, as published under "<prefix>progress/<group rank>" by
// the store's monitor thread (every kMonitorInterval, TcpStore::publish):
//   "entered completed op sends recvs"     e.g. "3 2 all_reduce 0,1 0,1"
// entered / completed: the number of the last collective this rank entered / completed (1-based);
// op: the last collective's name; sends / recvs: per group rank, how many transfers this rank posted
// to / from it. A peer's progress turns a timeout into "rank 2 did not arrive: rank 2 is still at
// collective #1 (barrier, completed)" or "rank 1 did not arrive: it has posted 1 send(s) to rank 0,
// not send #2".
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "parallel/communicator.h"

namespace longtrain::parallel {

// "<root><name>/<generation>/", e.g. "lt/comm/world/0/". Communicators of the same root and name
// get the next generation number of this process, so re-creating a group gets fresh keys.
std::string communicator_prefix(std::string_view root, const std::string& name);

// The group rank of `my_global_rank` in comm.ranks(); throws when the list is empty, names a rank
// twice or lacks this one.
int group_rank_of(const Communicator& comm, int my_global_rank);

// Creation's first step: this rank sets "<prefix>joined/<group rank>" to `announce` and waits for
// every member's key, so a member that never creates the group is named before the backend's own
// exchange (which would only time out). Bounded by comm.timeout().
void join_group(const Communicator& comm, TcpStore& store, const std::string& prefix, const std::string& announce,
                int my_global_rank);

// Chunk c of n elements split over p ranks is [begin[c], begin[c + 1]); the first n % p chunks hold
// one element more. The Gloo ring's chunks, and the volumes both backends count.
std::vector<int64_t> balanced_split(int64_t n, int p);

// start_p2p's argument checks: every tensor contiguous on `device`, every peer another rank of the
// group.
void check_p2p_ops(const Communicator& comm, std::span<const P2POp> ops, Device device);

// Sleeps until the peers' monitors have published their latest progress (two monitor intervals):
// a diagnosis reads it right after.
void wait_for_peer_progress();

// A peer's progress on one communicator, as published.
struct Progress {
  uint64_t entered = 0;
  uint64_t completed = 0;
  std::string op;
  std::vector<uint64_t> sends, recvs;  // transfers posted to / from each group rank

  static Progress parse(const std::string& text);
};

// This rank's progress on one communicator (published through the store while it lives) and the
// reading of the peers' progress. The counters are written by the communicator's calling thread
// and read by the store's monitor thread.
class CommProgress {
 public:
  CommProgress(const Communicator& comm, TcpStore& store, std::string prefix);
  ~CommProgress();
  CommProgress(const CommProgress&) = delete;
  CommProgress& operator=(const CommProgress&) = delete;

  // This rank entered collective #s, named op (a string literal: it is published as is).
  void enter(const char* op, uint64_t s);
  // Collective #s (and every one before it) completed; never moves backwards.
  void mark_completed(uint64_t s);
  // The k-th transfer to / from group rank `peer`, counted when it is posted: returns k.
  uint64_t count_send(int peer) { return ++sends_[peer]; }
  uint64_t count_recv(int peer) { return ++recvs_[peer]; }

  std::string text() const;  // "entered completed op sends recvs"
  std::string key(int group_rank) const;
  // Starts / stops publishing this rank's progress through the store (unpublish is idempotent; the
  // destructor calls it).
  void publish();
  void unpublish();

  // A peer's last published progress (none if it never published), and in *dead why its process
  // ended, when the store saw it end without finishing. Throws when the store cannot be read.
  std::optional<Progress> read(int group_rank, std::string* dead);
  // What the store told this rank about another rank's failure: "; the store reported: ..." or "".
  std::string known_failure() const;

  // Why collective #s did not complete: "rank 2 did not arrive: rank 2 is still at collective #1
  // (barrier, completed)" for every member that has not entered it, or `all_arrived` (followed by
  // known_failure()) when every member has.
  std::string diagnose_collective(uint64_t s, std::string_view all_arrived);
  // For transfer #k of `kind` (this rank's side) with group rank `peer`: "rank 1 did not arrive: it
  // has posted 1 send(s) to rank 0, not send #2" when the peer has not posted its side, none when it
  // has. Throws when the store cannot be read.
  std::optional<std::string> missing_transfer(P2POp::Kind kind, int peer, uint64_t k);

 private:
  const Communicator& comm_;
  TcpStore& store_;
  const std::string prefix_;
  std::atomic<uint64_t> entered_{0}, completed_{0};
  std::atomic<const char*> last_op_{"none"};
  std::unique_ptr<std::atomic<uint64_t>[]> sends_, recvs_;  // per group rank
  bool published_ = false;
};

}  // namespace longtrain::parallel

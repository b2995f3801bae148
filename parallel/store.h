// TcpStore: the rendezvous key-value store of a job, like torchrun's c10d TCPStore. Global rank 0
// serves it at MASTER_ADDR:MASTER_PORT; every rank (rank 0 too) is a client. It carries the Gloo
// pair addresses and NCCL unique ids of every communicator, and the progress counters that let a
// timed-out collective name the ranks that never arrived.
//
//   set/get/add/wait/check/erase, every blocking call bounded by a timeout. get() waits for the key.
//   Clients retry connecting until connect_timeout, then fail naming MASTER_ADDR:MASTER_PORT.
//
// Liveness (how a dead rank or a killed launcher stops the whole job within seconds): a client
// built with a rank registers a second, "monitor" connection with the server. When that connection
// drops before the rank said goodbye (its process exited on an error, crashed, or was killed, e.g.
// because its launcher died: the launcher gives every rank PR_SET_PDEATHSIG), the server records a
// failure event naming the rank. Every other rank's monitor thread is blocked on a watch request
// and hears of it at once; a blocked wait() on the server is aborted with the same message. When
// the server itself goes away (rank 0 died), every monitor sees its connection close. Either way
// the rank's `on_peer_failure` handler runs; the default prints the reason and exits the process
// with kExitPeerFailure, so the launcher of that node stops its other ranks and reports a failure.
// When the server's host dies without closing its connections (power, kernel panic, a network
// partition) or hangs, nothing closes: the server answers every watch within kMonitorInterval, so a
// monitor that hears nothing for liveness_timeout calls the store lost the same way, naming its
// address; every request that the server answers at once is bounded by liveness_timeout too.
// A rank may also report its own failure (report_failure) before exiting, so the others learn why.
//
// The monitor thread also publishes, every kMonitorInterval, values registered with publish()
// (communicators publish how far each rank got), without a store round trip on the hot path.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "parallel/net.h"

namespace longtrain::parallel {

using Millis = std::chrono::milliseconds;

// Exit status of a rank stopped because another rank (or the store server) failed. The launcher
// treats it as a consequence, never as the root cause, when it picks the exit code to return.
constexpr int kExitPeerFailure = 75;

// Exit status of a rank (and of the launcher) that was asked to stop by SIGTERM or SIGINT, finished
// its current step and wrote a checkpoint: the job can continue with `--resume auto`. Slurm sends
// SIGTERM before it preempts or cancels a job (`scancel --signal=TERM`, `--signal=TERM@120`).
constexpr int kExitPreempted = 76;

// How often the monitor thread wakes to publish progress; peer failures arrive immediately.
constexpr Millis kMonitorInterval{100};

// How long rank 0 keeps serving the store after it failed, unless every other rank ended sooner:
// long enough for the others to read the progress that names who did not arrive.
constexpr Millis kFailingShutdownGrace{1500};

struct StoreOptions {
  std::string host = "127.0.0.1";  // MASTER_ADDR
  int port = 29500;                // MASTER_PORT; with is_server, 0 picks a free port (see port())
  bool is_server = false;          // global rank 0 serves the store
  Millis timeout{300'000};         // default bound of get() and wait()
  Millis connect_timeout{300'000}; // how long a client keeps retrying to reach the server
  // How long the server may stay silent (no answer to the monitor's watch, or to a request it answers
  // at once) before this client calls it lost: its host died, hung or became unreachable.
  Millis liveness_timeout{30'000};
  // Liveness registration: rank >= 0 makes this client rank `rank` of a world of `world_size`
  // (the server rejects a second rank with the same number, or a different world size).
  int rank = -1;
  int world_size = 0;
  // Called once, from the monitor thread, when another rank fails or the server goes away. Empty:
  // print the reason to stderr and std::_Exit(kExitPeerFailure).
  std::function<void(const std::string& reason)> on_peer_failure;
};

class StoreServer;  // store.cpp

class TcpStore {
 public:
  explicit TcpStore(StoreOptions options);
  // A rank that ends normally says goodbye; rank 0's server then waits (up to `timeout`) for every
  // registered rank to finish before it stops. During exception unwinding (or after mark_failing)
  // no goodbye is said, so the other ranks learn that this one failed, and rank 0's server stays
  // up at most kFailingShutdownGrace for the others.
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  void set(const std::string& key, std::string_view value);
  // Waits for the key (up to the timeout) and returns its value.
  std::string get(const std::string& key);
  std::string get(const std::string& key, Millis timeout);
  std::optional<std::string> try_get(const std::string& key);  // no waiting
  // Adds delta to the integer stored at key (absent: 0) and returns the new value.
  int64_t add(const std::string& key, int64_t delta);
  // Waits until every key exists; throws on timeout naming the missing keys and the store address,
  // or at once when a rank has failed.
  void wait(const std::vector<std::string>& keys);
  void wait(const std::vector<std::string>& keys, Millis timeout);
  // Like wait() but returns the keys still missing at the timeout instead of throwing (a failure
  // event still throws).
  std::vector<std::string> wait_for(const std::vector<std::string>& keys, Millis timeout);
  bool check(const std::vector<std::string>& keys);
  bool erase(const std::string& key);

  // Tells every other rank's monitor that this rank is failing, and why (they stop at once).
  // Implies mark_failing().
  void report_failure(const std::string& reason);
  // This rank is failing on its own and will report and exit by itself: from now on a peer's
  // failure is recorded but no longer runs on_peer_failure (which would cut its own message short).
  void mark_failing() { self_failing_ = true; }
  // The first failure of another rank this process heard of, if any.
  std::optional<std::string> peer_failure() const;

  // The monitor sets `key` to value() whenever it changed, every kMonitorInterval. unpublish()
  // returns only once value() is no longer running.
  void publish(const std::string& key, std::function<std::string()> value);
  void unpublish(const std::string& key);

  const std::string& host() const { return options_.host; }
  int port() const { return port_; }
  std::string address() const;       // "host:port"
  std::string local_address() const; // this machine's IP on the route to the server
  Millis timeout() const { return options_.timeout; }
  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }

 private:
  struct Reply;
  // Sends a request and waits for its reply: the server may hold it for `server_holds` (a wait), and
  // then must answer within liveness_timeout.
  Reply request(uint8_t op, const std::string& payload, Millis server_holds = Millis(0));
  void monitor_loop();
  void handle_peer_failure(const std::string& reason);
  void publish_changed(net::Fd& conn);

  StoreOptions options_;
  int port_ = 0;
  std::unique_ptr<StoreServer> server_;
  mutable std::mutex conn_mutex_;
  net::Fd conn_;  // request/reply connection of the API calls
  std::string local_address_;

  // Liveness monitor (rank >= 0 only).
  net::Fd monitor_conn_;
  std::thread monitor_;
  std::atomic<bool> stopping_{false};
  mutable std::mutex failure_mutex_;
  std::optional<std::string> failure_;
  std::atomic<bool> failure_handled_{false};
  std::atomic<bool> self_failing_{false};

  std::mutex publish_mutex_;
  struct Published {
    std::function<std::string()> value;
    std::string last_sent;
    bool sent = false;
  };
  std::map<std::string, Published> published_;
};

// The store's fuzz target (tests/fuzz/fuzz_store.cpp): a fresh server serves one connection over
// which a client sent `request_bytes` and then closed its sending side; waits and watches time out at
// once. Returns every byte the server wrote back. Errors in the bytes end the connection, as they do
// for a real client.
std::string serve_bytes_for_fuzzing(std::string_view request_bytes);

}  // namespace longtrain::parallel

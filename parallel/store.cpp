// The rendezvous store: wire protocol, the server (one thread per connection; a blocked wait or
// watch parks its connection's thread on a condition variable), and the client with its liveness
// monitor. See store.h for the liveness design.
//
// Wire format: every message is a frame [u32 length][u8 tag][payload of length-1 bytes]. A request's
// tag is an Op, a reply's tag a Status. Payload fields: u8, i64 (little-endian), str (u32 length +
// bytes). The first request on every connection is kHello with kMagic, so a client that reached some
// other service on the port fails with a clear message instead of a protocol error.
#include "parallel/store.h"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <exception>
#include <list>
#include <unordered_map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "runtime/error.h"

namespace longtrain::parallel {

namespace {

using net::Clock;

constexpr int64_t kMagic = 0x316e7274676e6f6c;  // "longtrn1"
constexpr uint32_t kMaxFrame = 1u << 30;
// The largest world a server registers (its table has one entry per rank, allocated at the first
// registration): far above any job, far below what a corrupted world size would ask for.
constexpr int kMaxWorldSize = 1 << 20;

enum Op : uint8_t {
  kHello = 1,
  kSet,
  kGet,
  kAdd,
  kWait,
  kCheck,
  kErase,
  kRegister,
  kGoodbye,
  kWatch,
  kReportFailure,
};

enum Status : uint8_t { kOk = 0, kNotFound, kTimeout, kError, kAborted, kEvent };

struct Writer {
  std::string buf;
  Writer& u8(uint8_t v) {
    buf.push_back(static_cast<char>(v));
    return *this;
  }
  Writer& i64(int64_t v) {
    char b[8];
    std::memcpy(b, &v, 8);
    buf.append(b, 8);
    return *this;
  }
  Writer& str(std::string_view s) {
    uint32_t n = static_cast<uint32_t>(s.size());
    char b[4];
    std::memcpy(b, &n, 4);
    buf.append(b, 4);
    buf.append(s.data(), s.size());
    return *this;
  }
};

struct Reader {
  const std::string& buf;
  size_t pos = 0;
  void need(size_t n) const {
    LT_CHECK(pos + n <= buf.size(), "malformed store message ({} bytes, field at {} needs {})", buf.size(),
             pos, n);
  }
  uint8_t u8() {
    need(1);
    return static_cast<uint8_t>(buf[pos++]);
  }
  int64_t i64() {
    need(8);
    int64_t v;
    std::memcpy(&v, buf.data() + pos, 8);
    pos += 8;
    return v;
  }
  std::string str() {
    need(4);
    uint32_t n;
    std::memcpy(&n, buf.data() + pos, 4);
    pos += 4;
    need(n);
    std::string s = buf.substr(pos, n);
    pos += n;
    return s;
  }
};

void send_frame(int fd, uint8_t tag, const std::string& payload) {
  std::string frame;
  const uint32_t len = static_cast<uint32_t>(payload.size() + 1);
  frame.resize(4);
  std::memcpy(frame.data(), &len, 4);
  frame.push_back(static_cast<char>(tag));
  frame += payload;
  net::write_all(fd, frame.data(), frame.size());
}

// False on a clean EOF before the frame.
bool recv_frame(int fd, uint8_t* tag, std::string* payload, Clock::time_point deadline) {
  uint32_t len = 0;
  if (!net::read_all(fd, &len, 4, deadline)) return false;
  LT_CHECK(len >= 1 && len <= kMaxFrame, "malformed store frame of {} bytes", len);
  // The buffer grows with the bytes that arrive: a length field alone (a broken or hostile client)
  // must not make the server allocate and clear up to kMaxFrame.
  constexpr size_t kChunk = size_t{1} << 20;
  std::string body;
  for (size_t got = 0; got < len;) {
    const size_t n = std::min<size_t>(kChunk, len - got);
    body.resize(got + n);
    LT_CHECK(net::read_all(fd, body.data() + got, n, deadline), "connection closed in the middle of a frame");
    got += n;
  }
  *tag = static_cast<uint8_t>(body[0]);
  payload->assign(body, 1, std::string::npos);
  return true;
}

// A negative duration, or one too long to add to the clock (a timeout from the wire can be any
// i64), means no deadline.
Clock::time_point deadline_after(Millis d) {
  constexpr Millis kForever{int64_t{1} << 40};  // ~35 years
  return d.count() < 0 || d >= kForever ? Clock::time_point::max() : Clock::now() + d;
}

std::string seconds_text(Millis d) { return fmt::format("{:g}", static_cast<double>(d.count()) / 1000.0); }

std::string this_host() {
  char buf[256] = {};
  ::gethostname(buf, sizeof(buf) - 1);
  return buf;
}

}  // namespace

// ------------------------------------------------------------------------------------------------
// Server
// ------------------------------------------------------------------------------------------------

class StoreServer {
 public:
  explicit StoreServer(int port) : listen_(net::listen_on(port)), port_(net::local_port(listen_.get())) {
    acceptor_ = std::thread([this] { accept_loop(); });
  }
  // A server that listens nowhere: serve_connection() feeds it one connection (the fuzz target).
  // Waits and watches then last at most `max_block`, whatever timeout the request asks for.
  explicit StoreServer(Millis max_block) : port_(0), max_block_(max_block) {}
  ~StoreServer() { stop(); }

  // Serves one connection until the client closes it (or breaks the protocol).
  void serve_connection(int fd) { serve(fd); }

  int port() const { return port_; }

  // Blocks until every rank of the registered world said goodbye or died, or the deadline passed;
  // with stop_on_failure, also as soon as any rank failed.
  // `self` (the rank hosting the server) is not waited for.
  void wait_for_ranks_to_finish(Clock::time_point deadline, bool stop_on_failure, int self) {
    std::unique_lock lock(mu_);
    cv_.wait_until(lock, deadline, [&] {
      if (world_size_ == 0 || (stop_on_failure && !events_.empty())) return true;
      for (int r = 0; r < world_size_; ++r) {
        if (r != self && !ranks_[r].finished && !ranks_[r].dead) return false;
      }
      return true;
    });
  }

  void stop() {
    {
      std::lock_guard lock(mu_);
      if (stopped_) return;
      stopping_ = true;
      cv_.notify_all();
    }
    if (listen_.valid()) ::shutdown(listen_.get(), SHUT_RDWR);
    if (acceptor_.joinable()) acceptor_.join();
    std::lock_guard lock(conns_mu_);
    for (auto& c : conns_) ::shutdown(c.fd.get(), SHUT_RDWR);
    for (auto& c : conns_) c.thread.join();
    conns_.clear();
    std::lock_guard lock2(mu_);
    stopped_ = true;
  }

 private:
  struct RankInfo {
    bool registered = false;
    bool finished = false;
    bool dead = false;
    int64_t pid = 0;
    std::string host;
  };
  struct Event {
    int origin;
    std::string message;
  };
  struct Conn {
    net::Fd fd;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void accept_loop() {
    for (;;) {
      int fd = ::accept4(listen_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (fd < 0) {
        if (errno == EINTR || errno == ECONNABORTED) continue;
        return;  // shut down by stop()
      }
      {
        std::lock_guard lock(mu_);
        if (stopping_) {
          ::close(fd);
          return;
        }
      }
      std::lock_guard lock(conns_mu_);
      // Reap connections that ended, so a long job does not accumulate threads.
      for (auto it = conns_.begin(); it != conns_.end();) {
        if (it->done) {
          it->thread.join();
          it = conns_.erase(it);
        } else {
          ++it;
        }
      }
      conns_.emplace_back();
      Conn& c = conns_.back();
      c.fd.reset(fd);
      c.thread = std::thread([this, &c] {
        serve(c.fd.get());
        c.done = true;
      });
    }
  }

  void serve(int fd) {
    int registered_rank = -1;
    bool greeted = false;
    try {
      for (;;) {
        uint8_t op = 0;
        std::string payload;
        if (!recv_frame(fd, &op, &payload, Clock::time_point::max())) break;
        Reader in{payload};
        Writer out;
        uint8_t status = kOk;
        if (!greeted && op != kHello) {
          send_frame(fd, kError, Writer().str("the first request must be a longtrain store hello").buf);
          break;
        }
        switch (op) {
          case kHello: {
            if (in.i64() != kMagic) {
              send_frame(fd, kError, Writer().str("not a longtrain store client").buf);
              return finish_connection(registered_rank);
            }
            greeted = true;
            break;
          }
          case kSet: {
            std::string key = in.str();
            std::string value = in.str();
            std::lock_guard lock(mu_);
            kv_[key] = std::move(value);
            cv_.notify_all();
            break;
          }
          case kGet: {
            std::string key = in.str();
            std::lock_guard lock(mu_);
            auto it = kv_.find(key);
            if (it == kv_.end()) {
              status = kNotFound;
            } else {
              out.str(it->second);
            }
            break;
          }
          case kAdd: {
            std::string key = in.str();
            int64_t delta = in.i64();
            std::lock_guard lock(mu_);
            int64_t v = 0;
            auto it = kv_.find(key);
            // A counter is a whole decimal i64; anything else, or a sum that overflows, is refused
            // (the key keeps its value) rather than ending the connection.
            if (it != kv_.end()) {
              const std::string& text = it->second;
              const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
              if (ec != std::errc() || end != text.data() + text.size()) {
                status = kError;
                out.str(fmt::format("add to key '{}': its value is not an integer", key));
                break;
              }
            }
            const int64_t before = v;
            if (__builtin_add_overflow(before, delta, &v)) {
              status = kError;
              out.str(fmt::format("add to key '{}': {} + {} overflows a 64-bit counter", key, before, delta));
              break;
            }
            kv_[key] = std::to_string(v);
            cv_.notify_all();
            out.i64(v);
            break;
          }
          case kWait: {
            const Millis timeout{in.i64()};
            const int64_t n = in.i64();
            std::vector<std::string> keys;
            for (int64_t i = 0; i < n; ++i) keys.push_back(in.str());
            const int waiter = static_cast<int>(in.i64());
            std::unique_lock lock(mu_);
            auto all_present = [&] {
              return std::all_of(keys.begin(), keys.end(), [&](const auto& k) { return kv_.count(k) != 0; });
            };
            cv_.wait_until(lock, deadline_after(capped(timeout)),
                           [&] { return all_present() || first_event_for(waiter) || stopping_; });
            if (all_present()) break;
            if (const Event* e = first_event_for(waiter)) {
              status = kAborted;
              out.str(e->message);
            } else if (stopping_) {
              status = kAborted;
              out.str("the store server (global rank 0) is shutting down");
            } else {
              status = kTimeout;
              int64_t missing = 0;
              for (const auto& k : keys) missing += kv_.count(k) == 0;
              out.i64(missing);
              for (const auto& k : keys) {
                if (kv_.count(k) == 0) out.str(k);
              }
            }
            break;
          }
          case kCheck: {
            const int64_t n = in.i64();
            bool all = true;
            std::lock_guard lock(mu_);
            for (int64_t i = 0; i < n; ++i) all = kv_.count(in.str()) != 0 && all;
            out.u8(all ? 1 : 0);
            break;
          }
          case kErase: {
            std::string key = in.str();
            std::lock_guard lock(mu_);
            out.u8(kv_.erase(key) ? 1 : 0);
            break;
          }
          case kRegister: {
            const int rank = static_cast<int>(in.i64());
            const int world = static_cast<int>(in.i64());
            const int64_t pid = in.i64();
            std::string host = in.str();
            std::string error = register_rank(rank, world, pid, host);
            if (!error.empty()) {
              status = kError;
              out.str(error);
            } else {
              registered_rank = rank;
            }
            break;
          }
          case kGoodbye: {
            const int rank = static_cast<int>(in.i64());
            std::lock_guard lock(mu_);
            if (rank >= 0 && rank < static_cast<int>(ranks_.size())) ranks_[rank].finished = true;
            cv_.notify_all();
            break;
          }
          case kWatch: {
            const int watcher = static_cast<int>(in.i64());
            const Millis timeout{in.i64()};
            std::unique_lock lock(mu_);
            cv_.wait_until(lock, deadline_after(capped(timeout)),
                           [&] { return first_event_for(watcher) || stopping_; });
            if (const Event* e = first_event_for(watcher)) {
              status = kEvent;
              out.str(e->message);
            } else if (stopping_) {
              status = kAborted;
            }
            break;
          }
          case kReportFailure: {
            const int rank = static_cast<int>(in.i64());
            std::string reason = in.str();
            std::lock_guard lock(mu_);
            events_.push_back({rank, fmt::format("rank {}{} failed: {}", rank, where(rank), reason)});
            cv_.notify_all();
            break;
          }
          default:
            status = kError;
            out.str(fmt::format("unknown store request {}", op));
        }
        send_frame(fd, status, out.buf);
      }
    } catch (const std::exception&) {
      // A broken connection ends like an EOF; what it means for liveness is decided below.
    }
    finish_connection(registered_rank);
  }

  // A request's timeout (negative: none), bounded by max_block_ when that is set.
  Millis capped(Millis timeout) const {
    if (max_block_.count() < 0) return timeout;
    return timeout.count() < 0 ? max_block_ : std::min(timeout, max_block_);
  }

  // " (pid 123 on host-a)" for a registered rank.
  std::string where(int rank) const {
    if (rank < 0 || rank >= static_cast<int>(ranks_.size()) || !ranks_[rank].registered) return "";
    return fmt::format(" (pid {} on {})", ranks_[rank].pid, ranks_[rank].host);
  }

  const Event* first_event_for(int watcher) const {
    for (const auto& e : events_) {
      if (e.origin != watcher || watcher < 0) return &e;
    }
    return nullptr;
  }

  std::string register_rank(int rank, int world, int64_t pid, const std::string& host) {
    std::lock_guard lock(mu_);
    if (world < 1) return fmt::format("world size {} is not positive", world);
    if (world > kMaxWorldSize) return fmt::format("world size {} is above the largest supported, {}", world, kMaxWorldSize);
    if (world_size_ == 0) {
      world_size_ = world;
      ranks_.resize(world);
    }
    if (world != world_size_) {
      return fmt::format("rank {} (pid {} on {}) joined with a world size of {}, but the store on port {} serves "
                         "a world of {} ranks: is another job using the same MASTER_ADDR:MASTER_PORT, or are "
                         "WORLD_SIZE/--nnodes/--nproc-per-node inconsistent between nodes?",
                         rank, pid, host, world, port_, world_size_);
    }
    if (rank < 0 || rank >= world_size_) {
      return fmt::format("rank {} is outside [0, {}) (RANK must be below WORLD_SIZE)", rank, world_size_);
    }
    RankInfo& r = ranks_[rank];
    if (r.registered) {
      return fmt::format("rank {} joined twice: pid {} on {} and pid {} on {}; two jobs share MASTER_ADDR:"
                         "MASTER_PORT (port {}), or two processes were given the same RANK",
                         rank, r.pid, r.host, pid, host, port_);
    }
    r.registered = true;
    r.pid = pid;
    r.host = host;
    return "";
  }

  void finish_connection(int registered_rank) {
    std::lock_guard lock(mu_);
    if (registered_rank < 0) return;
    RankInfo& r = ranks_[registered_rank];
    if (r.finished || stopping_) return;
    r.dead = true;
    std::string message = fmt::format(
        "rank {}{} lost its connection to the rendezvous store without finishing: its process exited on an "
        "error, crashed or was killed (see that rank's log)",
        registered_rank, where(registered_rank));
    kv_[fmt::format("lt/dead/{}", registered_rank)] = message;
    events_.push_back({registered_rank, std::move(message)});
    cv_.notify_all();
  }

  net::Fd listen_;
  int port_;
  Millis max_block_{-1};  // no bound
  std::thread acceptor_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::unordered_map<std::string, std::string> kv_;
  int world_size_ = 0;
  std::vector<RankInfo> ranks_;
  std::vector<Event> events_;
  bool stopping_ = false;
  bool stopped_ = false;

  std::mutex conns_mu_;
  std::list<Conn> conns_;  // a list: a running thread holds a reference to its element
};

// ------------------------------------------------------------------------------------------------
// Client
// ------------------------------------------------------------------------------------------------

struct TcpStore::Reply {
  uint8_t status = kOk;
  std::string payload;
};

namespace {

// Sends the hello on a fresh connection and checks the answer.
void greet(int fd, const std::string& address, Millis within) {
  send_frame(fd, kHello, Writer().i64(kMagic).buf);
  uint8_t status = 0;
  std::string payload;
  bool ok = false;
  try {
    ok = recv_frame(fd, &status, &payload, deadline_after(within));
  } catch (const Error&) {
    ok = false;
  }
  LT_CHECK(ok && status == kOk,
           "the service at {} did not answer as a longtrain rendezvous store: another program may be using "
           "that port; pick a free MASTER_PORT (--master-port)",
           address);
}

// The monitor's request had no reply within the liveness timeout: the store's host is silent (down,
// hung or unreachable), which the monitor reports apart from a closed or broken connection (exited).
struct StoreSilent {};

// recv_frame on the monitor's connection, with a reply that did not come by `deadline` after waiting
// at least `silent_after` since `sent` thrown as StoreSilent.
bool recv_or_silent(int fd, uint8_t* status, std::string* payload, Clock::time_point deadline,
                    Clock::time_point sent, Millis silent_after) {
  try {
    return recv_frame(fd, status, payload, deadline);
  } catch (const Error&) {
    if (Clock::now() - sent >= silent_after) throw StoreSilent{};
    throw;  // closed or broken, not silent
  }
}

}  // namespace

TcpStore::TcpStore(StoreOptions options) : options_(std::move(options)) {
  LT_CHECK(options_.rank < 0 || options_.rank < options_.world_size,
           "store client for rank {} of a world of {}: RANK must be in [0, WORLD_SIZE)", options_.rank,
           options_.world_size);
  if (options_.is_server) {
    server_ = std::make_unique<StoreServer>(options_.port);
    port_ = server_->port();
  } else {
    LT_CHECK(options_.port > 0 && options_.port <= 65535, "MASTER_PORT {} is outside [1, 65535]", options_.port);
    port_ = options_.port;
  }
  const std::string hint = fmt::format(
      "the rendezvous store is served by global rank 0 (the node-rank-0 launcher's first rank); check that "
      "it is running and that MASTER_ADDR:MASTER_PORT ({}) points at it",
      address());
  try {
    conn_ = net::connect_with_retry(options_.host, port_, options_.connect_timeout, hint);
  } catch (const Error& e) {
    LT_FAIL("{}cannot reach the rendezvous store at {}: {}",
            options_.rank >= 0 ? fmt::format("rank {} ", options_.rank) : "", address(), e.what());
  }
  greet(conn_.get(), address(), std::max(options_.connect_timeout, Millis(1000)));
  local_address_ = net::local_address(conn_.get());

  if (options_.rank >= 0) {
    monitor_conn_ = net::connect_with_retry(options_.host, port_, options_.connect_timeout, hint);
    greet(monitor_conn_.get(), address(), std::max(options_.connect_timeout, Millis(1000)));
    Writer w;
    w.i64(options_.rank).i64(options_.world_size).i64(::getpid()).str(this_host());
    send_frame(monitor_conn_.get(), kRegister, w.buf);
    uint8_t status = 0;
    std::string payload;
    LT_CHECK(recv_frame(monitor_conn_.get(), &status, &payload, deadline_after(options_.timeout)),
             "the rendezvous store at {} closed the connection while rank {} registered", address(), options_.rank);
    if (status != kOk) {
      Reader r{payload};
      LT_FAIL("the rendezvous store at {} refused rank {}: {}", address(), options_.rank, r.str());
    }
    monitor_ = std::thread([this] { monitor_loop(); });
  }
}

TcpStore::~TcpStore() {
  // No goodbye while an exception unwinds or after a peer failed: the other ranks must learn that
  // this one did not finish normally.
  const bool failing = std::uncaught_exceptions() > 0 || self_failing_ || peer_failure().has_value();
  // Before the goodbye: once rank 0 has every goodbye it stops the server, and this rank's monitor
  // must take that for the end of the job, not for a failure.
  stopping_ = true;
  if (options_.rank >= 0 && !failing) {
    try {
      request(kGoodbye, Writer().i64(options_.rank).buf);
    } catch (const std::exception&) {
    }
  }
  if (monitor_conn_.valid()) ::shutdown(monitor_conn_.get(), SHUT_RDWR);
  if (monitor_.joinable()) monitor_.join();
  if (server_) {
    if (failing) {
      // The other ranks are failing too, or about to be told to stop; keep the store up a moment so
      // they can read each other's progress for their error messages.
      server_->wait_for_ranks_to_finish(Clock::now() + kFailingShutdownGrace, false, options_.rank);
    } else {
      server_->wait_for_ranks_to_finish(Clock::now() + options_.timeout, true, options_.rank);
    }
    server_->stop();
  }
}

std::string TcpStore::address() const { return fmt::format("{}:{}", options_.host, port_); }

std::string TcpStore::local_address() const { return local_address_; }

TcpStore::Reply TcpStore::request(uint8_t op, const std::string& payload, Millis server_holds) {
  std::lock_guard lock(conn_mutex_);
  Reply reply;
  try {
    send_frame(conn_.get(), op, payload);
    // The server answers a wait at its timeout, anything else at once; beyond that it is lost.
    bool got = recv_frame(conn_.get(), &reply.status, &reply.payload,
                          deadline_after(server_holds + options_.liveness_timeout));
    LT_CHECK(got, "the connection was closed");
  } catch (const Error& e) {
    LT_FAIL("lost the rendezvous store at {} (global rank 0, which serves it, exited or was killed, or its host is "
            "down or unreachable; no answer within {} s counts as lost: parallel.store_timeout_s): {}",
            address(), seconds_text(options_.liveness_timeout), e.what());
  }
  if (reply.status == kError) {
    Reader r{reply.payload};
    LT_FAIL("the rendezvous store at {} refused a request: {}", address(), r.str());
  }
  return reply;
}

void TcpStore::set(const std::string& key, std::string_view value) {
  request(kSet, Writer().str(key).str(value).buf);
}

std::string TcpStore::get(const std::string& key) { return get(key, options_.timeout); }

std::string TcpStore::get(const std::string& key, Millis timeout) {
  wait({key}, timeout);
  auto v = try_get(key);
  LT_CHECK(v.has_value(), "key '{}' was erased from the rendezvous store at {} while being read", key, address());
  return *v;
}

std::optional<std::string> TcpStore::try_get(const std::string& key) {
  Reply r = request(kGet, Writer().str(key).buf);
  if (r.status == kNotFound) return std::nullopt;
  Reader in{r.payload};
  return in.str();
}

int64_t TcpStore::add(const std::string& key, int64_t delta) {
  Reply r = request(kAdd, Writer().str(key).i64(delta).buf);
  Reader in{r.payload};
  return in.i64();
}

void TcpStore::wait(const std::vector<std::string>& keys) { wait(keys, options_.timeout); }

void TcpStore::wait(const std::vector<std::string>& keys, Millis timeout) {
  std::vector<std::string> missing = wait_for(keys, timeout);
  if (!missing.empty()) {
    LT_FAIL("rank {} timed out after {} ms waiting for {} of {} key(s) in the rendezvous store at {}; missing: "
            "{} (the ranks that set them have not arrived)",
            options_.rank, timeout.count(), missing.size(), keys.size(), address(), fmt::join(missing, ", "));
  }
}

std::vector<std::string> TcpStore::wait_for(const std::vector<std::string>& keys, Millis timeout) {
  Writer w;
  w.i64(timeout.count()).i64(static_cast<int64_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  w.i64(options_.rank);
  Reply r = request(kWait, w.buf, timeout);
  Reader in{r.payload};
  if (r.status == kOk) return {};
  if (r.status == kAborted) {
    LT_FAIL("rank {} stopped waiting for key(s) {} in the rendezvous store at {}: {}", options_.rank,
            fmt::join(keys, ", "), address(), in.str());
  }
  std::vector<std::string> missing;
  const int64_t n = in.i64();
  for (int64_t i = 0; i < n; ++i) missing.push_back(in.str());
  return missing;
}

bool TcpStore::check(const std::vector<std::string>& keys) {
  Writer w;
  w.i64(static_cast<int64_t>(keys.size()));
  for (const auto& k : keys) w.str(k);
  Reply r = request(kCheck, w.buf);
  Reader in{r.payload};
  return in.u8() != 0;
}

bool TcpStore::erase(const std::string& key) {
  Reply r = request(kErase, Writer().str(key).buf);
  Reader in{r.payload};
  return in.u8() != 0;
}

void TcpStore::report_failure(const std::string& reason) {
  self_failing_ = true;
  try {
    request(kReportFailure, Writer().i64(options_.rank).str(reason).buf, Millis(5000));
  } catch (const std::exception&) {
    // Best effort: this rank is failing anyway, and its exit will be noticed.
  }
}

std::optional<std::string> TcpStore::peer_failure() const {
  std::lock_guard lock(failure_mutex_);
  return failure_;
}

void TcpStore::publish(const std::string& key, std::function<std::string()> value) {
  std::lock_guard lock(publish_mutex_);
  published_[key] = Published{std::move(value), "", false};
}

void TcpStore::unpublish(const std::string& key) {
  std::lock_guard lock(publish_mutex_);
  published_.erase(key);
}

void TcpStore::publish_changed(net::Fd& conn) {
  std::lock_guard lock(publish_mutex_);
  for (auto& [key, p] : published_) {
    std::string v = p.value();
    if (p.sent && v == p.last_sent) continue;
    send_frame(conn.get(), kSet, Writer().str(key).str(v).buf);
    uint8_t status = 0;
    std::string payload;
    const auto sent = Clock::now();
    LT_CHECK(recv_or_silent(conn.get(), &status, &payload, deadline_after(options_.liveness_timeout), sent,
                            options_.liveness_timeout),
             "store connection closed");
    p.last_sent = std::move(v);
    p.sent = true;
  }
}

void TcpStore::monitor_loop() {
  while (!stopping_) {
    try {
      send_frame(monitor_conn_.get(), kWatch, Writer().i64(options_.rank).i64(kMonitorInterval.count()).buf);
      uint8_t status = 0;
      std::string payload;
      const auto sent = Clock::now();
      const bool got = recv_or_silent(monitor_conn_.get(), &status, &payload,
                                      deadline_after(kMonitorInterval + options_.liveness_timeout), sent,
                                      options_.liveness_timeout);
      if (stopping_) return;
      LT_CHECK(got, "connection closed");
      if (status == kEvent) {
        Reader in{payload};
        handle_peer_failure(in.str());
        return;
      }
      if (status == kAborted) {
        handle_peer_failure(fmt::format("the rendezvous store server at {} (global rank 0) shut down while rank {} "
                                        "was still running",
                                        address(), options_.rank));
        return;
      }
      publish_changed(monitor_conn_);
    } catch (const StoreSilent&) {
      // Silent on the watch or on a publish (the host stopped between the two: seen in CI).
      if (stopping_) return;
      handle_peer_failure(fmt::format(
          "the rendezvous store at {} did not answer rank {} for {} s: the host of global rank 0, which serves "
          "it, is down, hung or unreachable (the limit is parallel.store_timeout_s, or LONGTRAIN_STORE_TIMEOUT_S)",
          address(), options_.rank, seconds_text(options_.liveness_timeout)));
      return;
    } catch (const std::exception& e) {
      if (stopping_) return;
      handle_peer_failure(fmt::format("lost the connection to the rendezvous store at {}: global rank 0, which "
                                      "serves it, exited or was killed ({})",
                                      address(), e.what()));
      return;
    }
  }
}

void TcpStore::handle_peer_failure(const std::string& reason) {
  {
    std::lock_guard lock(failure_mutex_);
    if (!failure_) failure_ = reason;
  }
  if (self_failing_ || stopping_ || failure_handled_.exchange(true)) return;
  if (options_.on_peer_failure) {
    options_.on_peer_failure(reason);
    return;
  }
  std::fflush(stdout);
  // The reason names the rank that failed, or the store that was lost.
  std::fprintf(stderr, "[longtrain] rank %d stops: %s\n", options_.rank, reason.c_str());
  std::fflush(stderr);
  // Rank 0 serves the store: keep it up a moment, so the other ranks can still read who failed.
  if (server_) server_->wait_for_ranks_to_finish(Clock::now() + kFailingShutdownGrace, false, options_.rank);
  std::_Exit(kExitPeerFailure);
}

std::string serve_bytes_for_fuzzing(std::string_view request_bytes) {
  int sv[2];
  LT_CHECK(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) == 0, "socketpair failed: {}", std::strerror(errno));
  net::Fd client(sv[0]), server_end(sv[1]);
  std::string replies;
  // The client writes its bytes and half-closes while another thread reads the replies, so neither
  // side can block the other on a full socket buffer.
  std::thread writer([&] {
    size_t done = 0;
    while (done < request_bytes.size()) {
      const ssize_t w = ::send(client.get(), request_bytes.data() + done, request_bytes.size() - done, MSG_NOSIGNAL);
      if (w < 0 && errno == EINTR) continue;
      if (w <= 0) break;  // the server closed its end: it stopped reading
      done += static_cast<size_t>(w);
    }
    ::shutdown(client.get(), SHUT_WR);
  });
  std::thread reader([&] {
    char buf[4096];
    for (;;) {
      const ssize_t n = ::recv(client.get(), buf, sizeof buf, 0);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) break;
      replies.append(buf, static_cast<size_t>(n));
    }
  });
  {
    StoreServer server(Millis(0));
    server.serve_connection(server_end.get());
  }
  ::shutdown(server_end.get(), SHUT_RDWR);
  writer.join();
  reader.join();
  return replies;
}

}  // namespace longtrain::parallel

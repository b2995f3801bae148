// Small TCP helpers shared by the rendezvous store, the launcher and the multi-process tests: an
// owning file descriptor, connect-with-retry until a deadline, listen with a clear busy-port error,
// whole-buffer reads and writes with deadlines. Every failure names the address it was about.
#pragma once

#include <chrono>
#include <cstddef>
#include <string>

namespace longtrain::parallel::net {

using Clock = std::chrono::steady_clock;
using Millis = std::chrono::milliseconds;

// An owned file descriptor, closed on destruction.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() { reset(); }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  Fd(Fd&& o) noexcept : fd_(o.release()) {}
  Fd& operator=(Fd&& o) noexcept {
    if (this != &o) reset(o.release());
    return *this;
  }
  int get() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  int release() {
    int f = fd_;
    fd_ = -1;
    return f;
  }
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

std::string errno_text(int err);  // "Connection refused (errno 111)"

// Connects to host:port, retrying refused/unreachable/unresolvable attempts with backoff until
// `timeout` has passed; then throws naming host:port, the time waited and the last error, and what
// to check (`what_to_check` is appended to the message). TCP_NODELAY is set on the socket.
Fd connect_with_retry(const std::string& host, int port, Millis timeout, const std::string& what_to_check);

// A listening socket on every interface at `port` (0: the kernel picks one). A port in use throws an
// error naming the port and saying to pick another one.
Fd listen_on(int port, int backlog = 1024);

int local_port(int fd);              // the port a socket is bound to
std::string local_address(int fd);   // the numeric IP this socket's end uses ("10.0.0.3")
bool port_is_free(int port);         // nothing listens on `port` on any interface of this machine
int pick_free_port();                // a port that was free a moment ago (tests)
bool host_resolves(const std::string& host);

// Writes all of buf; throws on error (MSG_NOSIGNAL: a closed peer is an error, never SIGPIPE).
void write_all(int fd, const void* buf, size_t n);
// Reads exactly n bytes. Returns false on a clean EOF before the first byte; throws on an error, on
// EOF in the middle, or when `deadline` passes first.
bool read_all(int fd, void* buf, size_t n, Clock::time_point deadline = Clock::time_point::max());

}  // namespace longtrain::parallel::net

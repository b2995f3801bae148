#include "parallel/net.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "runtime/error.h"

namespace longtrain::parallel::net {

void Fd::reset(int fd) {
  if (fd_ >= 0) ::close(fd_);
  fd_ = fd;
}

std::string errno_text(int err) { return fmt::format("{} (errno {})", std::strerror(err), err); }

namespace {

int remaining_ms(Clock::time_point deadline) {
  if (deadline == Clock::time_point::max()) return -1;
  // Rounded up: poll() waiting a truncated count returned up to 1 ms before the deadline, so a caller
  // that then measured how long it had waited found less than its limit (a reply timed out after
  // 0.999 s of a 1 s limit was taken for a closed connection; seen in CI).
  auto left = std::chrono::ceil<Millis>(deadline - Clock::now()).count();
  return left < 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

// One non-blocking connect attempt to one resolved address, bounded by `deadline`.
// Returns the connected socket, or an invalid Fd with `err` set.
Fd try_connect(const addrinfo* ai, Clock::time_point deadline, int* err) {
  Fd fd(::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol));
  if (!fd.valid()) {
    *err = errno;
    return Fd();
  }
  if (::connect(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      *err = errno;
      return Fd();
    }
    pollfd p{fd.get(), POLLOUT, 0};
    int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n <= 0) {
      *err = n == 0 ? ETIMEDOUT : errno;
      return Fd();
    }
    int so_error = 0;
    socklen_t len = sizeof(so_error);
    ::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &so_error, &len);
    if (so_error != 0) {
      *err = so_error;
      return Fd();
    }
  }
  int flags = ::fcntl(fd.get(), F_GETFL);
  ::fcntl(fd.get(), F_SETFL, flags & ~O_NONBLOCK);
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

}  // namespace

Fd connect_with_retry(const std::string& host, int port, Millis timeout, const std::string& what_to_check) {
  const auto start = Clock::now();
  const auto deadline = start + timeout;
  std::string last_error = "no attempt was made";
  auto backoff = Millis(20);
  for (;;) {
    addrinfo hints{};
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* res = nullptr;
    const std::string service = std::to_string(port);
    int gai = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &res);
    if (gai != 0) {
      last_error = fmt::format("cannot resolve host '{}': {}", host, ::gai_strerror(gai));
    } else {
      for (addrinfo* ai = res; ai != nullptr; ai = ai->ai_next) {
        int err = 0;
        Fd fd = try_connect(ai, deadline, &err);
        if (fd.valid()) {
          ::freeaddrinfo(res);
          return fd;
        }
        last_error = errno_text(err);
      }
      ::freeaddrinfo(res);
    }
    const auto now = Clock::now();
    if (now >= deadline) break;
    // One last attempt at the deadline, so the whole timeout is used.
    std::this_thread::sleep_for(std::min<Clock::duration>(backoff, deadline - now));
    backoff = std::min(backoff * 2, Millis(500));
  }
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  LT_FAIL("could not connect to {}:{} within {:.1f} s (last error: {}); {}", host, port, waited, last_error,
          what_to_check);
}

Fd listen_on(int port, int backlog) {
  LT_CHECK(port >= 0 && port <= 65535, "port {} is outside [0, 65535]", port);
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  LT_CHECK(fd.valid(), "socket() failed: {}", errno_text(errno));
  // SO_REUSEADDR lets a restarted job reuse a port still in TIME_WAIT; on Linux it does not let two
  // listeners share a port, so a busy port is still reported below.
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  if (::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    const int err = errno;
    if (err == EADDRINUSE) {
      LT_FAIL("cannot serve on port {}: the port is already in use on this machine (another job, or a "
              "leftover process of an earlier one, is listening there); pick a free port with "
              "--master-port or MASTER_PORT",
              port);
    }
    LT_FAIL("cannot bind port {}: {}", port, errno_text(err));
  }
  LT_CHECK(::listen(fd.get(), backlog) == 0, "listen() on port {} failed: {}", port, errno_text(errno));
  return fd;
}

int local_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  LT_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0, "getsockname failed: {}",
           errno_text(errno));
  if (ss.ss_family == AF_INET6) return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
  return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
}

std::string local_address(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof(ss);
  LT_CHECK(::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) == 0, "getsockname failed: {}",
           errno_text(errno));
  char buf[INET6_ADDRSTRLEN] = {};
  if (ss.ss_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(&ss)->sin6_addr, buf, sizeof(buf));
  } else {
    ::inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(&ss)->sin_addr, buf, sizeof(buf));
  }
  return buf;
}

bool port_is_free(int port) {
  Fd fd(::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0));
  if (!fd.valid()) return false;
  int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  return ::bind(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
}

int pick_free_port() {
  Fd fd = listen_on(0);
  return local_port(fd.get());
}

bool host_resolves(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (::getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0) return false;
  ::freeaddrinfo(res);
  return true;
}

void write_all(int fd, const void* buf, size_t n) {
  const char* p = static_cast<const char*>(buf);
  while (n > 0) {
    ssize_t w = ::send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      LT_FAIL("socket write failed: {}", errno_text(errno));
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
}

bool read_all(int fd, void* buf, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(buf);
  size_t got = 0;
  while (got < n) {
    if (deadline != Clock::time_point::max()) {
      pollfd pfd{fd, POLLIN, 0};
      int r = ::poll(&pfd, 1, remaining_ms(deadline));
      if (r < 0 && errno == EINTR) continue;
      LT_CHECK(r >= 0, "socket poll failed: {}", errno_text(errno));
      if (r == 0 && Clock::now() < deadline) continue;  // woke early: wait out the rest
      LT_CHECK(r > 0, "no reply on the socket before the deadline");
    }
    ssize_t r = ::recv(fd, p + got, n - got, 0);
    if (r < 0) {
      if (errno == EINTR) continue;
      LT_FAIL("socket read failed: {}", errno_text(errno));
    }
    if (r == 0) {
      if (got == 0) return false;
      LT_FAIL("connection closed in the middle of a message ({} of {} bytes read)", got, n);
    }
    got += static_cast<size_t>(r);
  }
  return true;
}

}  // namespace longtrain::parallel::net

// The rendezvous store: key-value semantics, timeouts that name what was missing, connection errors
// that name the address, registration checks, and liveness (a rank that dies is reported to the
// others at once; one that says goodbye is not). Liveness cases use real processes (fork).
#include <gtest/gtest.h>

#include <sys/socket.h>

#include <atomic>
#include <future>
#include <thread>

#include "multiproc_util.h"
#include "parallel/net.h"
#include "parallel/store.h"

namespace longtrain::parallel {
namespace {

using namespace std::chrono_literals;
using test::Clock;

StoreOptions server_options() {
  StoreOptions o;
  o.port = 0;
  o.is_server = true;
  o.timeout = 5s;
  o.connect_timeout = 2s;
  return o;
}

StoreOptions client_options(int port) {
  StoreOptions o;
  o.port = port;
  o.timeout = 5s;
  o.connect_timeout = 2s;
  return o;
}

using ::longtrain::test::error_of;

// A read with a deadline and nothing to read gives up only once the deadline has passed, never a
// fraction of a millisecond before it: the store's monitor tells a silent server from a closed
// connection by how long it waited, and a poll() that woke up to 1 ms early turned a silent server
// into a "killed" one in CI. Deadlines at odd microseconds, as real ones fall.
TEST(Net, AReadTimesOutOnlyAfterItsDeadline) {
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  net::Fd reader(sv[0]), writer(sv[1]);
  for (int i = 0; i < 20; ++i) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::microseconds(1000 + 137 * i);
    char byte = 0;
    EXPECT_THROW(net::read_all(reader.get(), &byte, 1, deadline), Error);
    EXPECT_GE(std::chrono::steady_clock::now(), deadline) << "deadline " << 1000 + 137 * i << " us ahead";
  }
}

TEST(TcpStore, SetGetAddCheckErase) {
  TcpStore server(server_options());
  TcpStore client(client_options(server.port()));
  const std::string binary("a\0b\xff", 4);
  client.set("k", binary);
  EXPECT_EQ(server.get("k"), binary);
  EXPECT_EQ(server.try_get("absent"), std::nullopt);
  EXPECT_EQ(client.add("counter", 5), 5);
  EXPECT_EQ(server.add("counter", -2), 3);
  EXPECT_EQ(client.get("counter"), "3");
  EXPECT_TRUE(client.check({"k", "counter"}));
  EXPECT_FALSE(client.check({"k", "absent"}));
  EXPECT_TRUE(client.erase("k"));
  EXPECT_FALSE(client.erase("k"));
  EXPECT_FALSE(server.check({"k"}));
  client.set("k", "second");
  EXPECT_EQ(server.get("k"), "second");
}

TEST(TcpStore, GetWaitsForAnotherClientsSet) {
  TcpStore server(server_options());
  TcpStore client(client_options(server.port()));
  const auto start = Clock::now();
  std::thread setter([&] {
    std::this_thread::sleep_for(300ms);
    client.set("late", "value");
  });
  EXPECT_EQ(server.get("late"), "value");
  EXPECT_GE(Clock::now() - start, 250ms);
  setter.join();
}

TEST(TcpStore, WaitTimesOutNamingTheMissingKeysAndTheAddress) {
  TcpStore server(server_options());
  server.set("present", "1");
  const auto start = Clock::now();
  const std::string msg = error_of([&] { server.wait({"present", "missing/a", "missing/b"}, 300ms); });
  const auto took = Clock::now() - start;
  EXPECT_GE(took, 290ms);
  EXPECT_LT(took, 3s);
  EXPECT_NE(msg.find("timed out after 300 ms"), std::string::npos) << msg;
  EXPECT_NE(msg.find("missing: missing/a, missing/b"), std::string::npos) << msg;
  EXPECT_EQ(msg.find("missing: present"), std::string::npos) << msg;
  EXPECT_NE(msg.find(fmt::format("127.0.0.1:{}", server.port())), std::string::npos) << msg;
  EXPECT_EQ(server.wait_for({"present", "missing/a"}, 50ms), (std::vector<std::string>{"missing/a"}));
}

TEST(TcpStore, ConcurrentAddsFromManyClientsAllCount) {
  TcpStore server(server_options());
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      TcpStore c(client_options(server.port()));
      for (int i = 0; i < 50; ++i) c.add("n", 1);
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(server.get("n"), "200");
}

TEST(TcpStore, ClientRetriesUntilTheServerAppears) {
  const int port = net::pick_free_port();
  std::promise<std::string> got;
  std::thread client([&] {
    try {
      TcpStore c(client_options(port));
      got.set_value(c.get("hello"));
    } catch (const std::exception& e) {
      got.set_value(std::string("error: ") + e.what());
    }
  });
  std::this_thread::sleep_for(400ms);  // the client is retrying meanwhile
  StoreOptions o = server_options();
  o.port = port;
  TcpStore server(o);
  server.set("hello", "world");
  EXPECT_EQ(got.get_future().get(), "world");
  client.join();
}

TEST(TcpStore, UnreachableServerFailsAtTheDeadlineNamingTheAddress) {
  const int port = net::pick_free_port();
  StoreOptions o = client_options(port);
  o.connect_timeout = 400ms;
  const auto start = Clock::now();
  const std::string msg = error_of([&] { TcpStore c(o); });
  EXPECT_GE(Clock::now() - start, 390ms);
  EXPECT_LT(Clock::now() - start, 3s);
  EXPECT_NE(msg.find(fmt::format("could not connect to 127.0.0.1:{}", port)), std::string::npos) << msg;
  EXPECT_NE(msg.find("Connection refused"), std::string::npos) << msg;
  EXPECT_NE(msg.find("MASTER_ADDR:MASTER_PORT"), std::string::npos) << msg;
}

TEST(TcpStore, BusyPortIsNamed) {
  TcpStore first(server_options());
  StoreOptions o = server_options();
  o.port = first.port();
  const std::string msg = error_of([&] { TcpStore second(o); });
  EXPECT_NE(msg.find(fmt::format("port {}", first.port())), std::string::npos) << msg;
  EXPECT_NE(msg.find("already in use"), std::string::npos) << msg;
}

TEST(TcpStore, AnotherServiceOnThePortIsRecognised) {
  net::Fd listener = net::listen_on(0);
  const int port = net::local_port(listener.get());
  std::thread silent([&] {
    int fd = ::accept(listener.get(), nullptr, nullptr);
    std::this_thread::sleep_for(1100ms);  // accepts, never answers (the client gives up after 1 s)
    if (fd >= 0) ::close(fd);
  });
  StoreOptions o = client_options(port);
  o.connect_timeout = 300ms;
  const std::string msg = error_of([&] { TcpStore c(o); });
  EXPECT_NE(msg.find("did not answer as a longtrain rendezvous store"), std::string::npos) << msg;
  silent.join();
}

// What the store fuzz target found: an add that overflowed a signed 64-bit counter (undefined
// behaviour in the server), and a registration whose world size made the server allocate a rank
// table of 26 GB. Both are now refused to the client, naming the key or the size; the server goes on.
TEST(TcpStore, AnOverflowingAddOrAHugeWorldIsRefusedAndTheServerGoesOn) {
  TcpStore server(server_options());
  TcpStore client(client_options(server.port()));
  EXPECT_EQ(client.add("c", INT64_MAX - 1), INT64_MAX - 1);
  std::string msg = error_of([&] { client.add("c", 2); });
  EXPECT_NE(msg.find("add to key 'c': 9223372036854775806 + 2 overflows a 64-bit counter"), std::string::npos) << msg;
  EXPECT_EQ(client.get("c"), std::to_string(INT64_MAX - 1));
  client.set("text", "abc");
  msg = error_of([&] { client.add("text", 1); });
  EXPECT_NE(msg.find("add to key 'text': its value is not an integer"), std::string::npos) << msg;
  StoreOptions huge = client_options(server.port());
  huge.rank = 0;
  huge.world_size = 1 << 29;
  msg = error_of([&] { TcpStore rank(huge); });
  EXPECT_NE(msg.find("world size 536870912 is above the largest supported"), std::string::npos) << msg;
  EXPECT_EQ(client.add("c", -5), INT64_MAX - 6);  // the same connection still works
}

TEST(TcpStore, RegistrationRejectsADuplicateRankOrAnotherWorldSize) {
  StoreOptions so = server_options();
  so.rank = 0;
  so.world_size = 3;
  TcpStore server(so);
  StoreOptions a = client_options(server.port());
  a.rank = 1;
  a.world_size = 3;
  TcpStore first(a);
  std::string msg = error_of([&] { TcpStore again(a); });
  EXPECT_NE(msg.find("rank 1 joined twice"), std::string::npos) << msg;
  StoreOptions b = client_options(server.port());
  b.rank = 2;
  b.world_size = 4;
  msg = error_of([&] { TcpStore other(b); });
  EXPECT_NE(msg.find("world size of 4"), std::string::npos) << msg;
  EXPECT_NE(msg.find("serves a world of 3 ranks"), std::string::npos) << msg;
  // Rank 2 never joined, so rank 0's server would wait for it at shutdown: say this rank is failing,
  // which skips that wait.
  server.mark_failing();
}

// Rank 1 is a separate process that registers and then dies: rank 0 hears of it at once, through
// its monitor and through a wait() that was blocked on a key rank 1 would have set.
TEST(TcpStoreLiveness, ARankThatDiesIsReportedToTheOthers) {
  // Fork before this process starts any thread; the child retries until the server is up.
  const int port = net::pick_free_port();
  std::fflush(nullptr);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    StoreOptions co = client_options(port);
    co.rank = 1;
    co.world_size = 2;
    co.on_peer_failure = [](const std::string&) {};
    auto* leaked = new TcpStore(co);  // never destroyed: the process dies without a goodbye
    leaked->set("rank1/started", "1");
    std::this_thread::sleep_for(200ms);
    ::_exit(3);
  }
  std::promise<std::string> heard;
  StoreOptions so = server_options();
  so.port = port;
  so.rank = 0;
  so.world_size = 2;
  so.on_peer_failure = [&](const std::string& why) { heard.set_value(why); };
  TcpStore server(so);
  server.wait({"rank1/started"});
  const auto start = Clock::now();
  const std::string msg = error_of([&] { server.wait({"rank1/never"}, 20s); });
  EXPECT_LT(Clock::now() - start, 3s) << "the wait must be aborted, not run to its timeout";
  EXPECT_NE(msg.find("rank 1 (pid " + std::to_string(child)), std::string::npos) << msg;
  EXPECT_NE(msg.find("lost its connection to the rendezvous store without finishing"), std::string::npos) << msg;
  auto f = heard.get_future();
  ASSERT_EQ(f.wait_for(3s), std::future_status::ready);
  EXPECT_NE(f.get().find("rank 1 (pid"), std::string::npos);
  EXPECT_TRUE(server.try_get("lt/dead/1").has_value());
  int status = 0;
  ::waitpid(child, &status, 0);
}

// A rank that finishes normally says goodbye: nobody is told it failed, and rank 0's server, which
// waits for every rank to finish before it stops, does not wait for it.
TEST(TcpStoreLiveness, ARankThatFinishesIsNotAFailure) {
  const int port = net::pick_free_port();
  std::atomic<bool> heard{false};
  auto start = Clock::now();
  {
    std::fflush(nullptr);
    pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      {
        StoreOptions co = client_options(port);
        co.rank = 1;
        co.world_size = 2;
        TcpStore c(co);
        c.set("rank1/done", "1");
      }
      ::_exit(0);
    }
    StoreOptions so = server_options();
    so.port = port;
    so.rank = 0;
    so.world_size = 2;
    so.timeout = 20s;
    so.on_peer_failure = [&](const std::string&) { heard = true; };
    TcpStore server(so);
    server.wait({"rank1/done"});
    int status = 0;
    ::waitpid(child, &status, 0);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    std::this_thread::sleep_for(300ms);
    start = Clock::now();
  }
  EXPECT_LT(Clock::now() - start, 2s) << "rank 0's store must stop once every rank finished";
  EXPECT_FALSE(heard.load());
}

// Rank 0 serves the store; when it dies, rank 1's monitor notices the connection closing.
TEST(TcpStoreLiveness, TheServerGoingAwayIsReported) {
  const int port = net::pick_free_port();
  std::fflush(nullptr);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    StoreOptions so = server_options();
    so.port = port;
    so.rank = 0;
    so.world_size = 2;
    so.on_peer_failure = [](const std::string&) {};
    auto* leaked = new TcpStore(so);
    leaked->set("rank0/up", "1");
    std::this_thread::sleep_for(500ms);
    ::_exit(1);
  }
  std::promise<std::string> heard;
  StoreOptions co = client_options(port);
  co.rank = 1;
  co.world_size = 2;
  co.on_peer_failure = [&](const std::string& why) { heard.set_value(why); };
  TcpStore client(co);
  client.wait({"rank0/up"});
  auto f = heard.get_future();
  ASSERT_EQ(f.wait_for(5s), std::future_status::ready);
  const std::string why = f.get();
  EXPECT_NE(why.find(fmt::format("lost the connection to the rendezvous store at 127.0.0.1:{}", port)),
            std::string::npos)
      << why;
  EXPECT_TRUE(client.peer_failure().has_value());
  int status = 0;
  ::waitpid(child, &status, 0);
}

// A server host that goes silent between the monitor's watch and its publish of a changed value is
// reported as silent (hung or unreachable), as on the watch, not as exited: here the published value's
// own callback stops the server process just before the monitor sends it (a CI run hit this order
// with a real SIGSTOP).
TEST(TcpStoreLiveness, AServerSilentOnAPublishIsReportedAsSilent) {
  const int port = net::pick_free_port();
  std::fflush(nullptr);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    StoreOptions so = server_options();
    so.port = port;
    so.rank = 0;
    so.world_size = 2;
    so.on_peer_failure = [](const std::string&) {};
    auto* leaked = new TcpStore(so);
    leaked->set("rank0/up", "1");
    std::this_thread::sleep_for(30s);  // stopped before then, and killed
    ::_exit(1);
  }
  std::promise<std::string> heard;
  StoreOptions co = client_options(port);
  co.rank = 1;
  co.world_size = 2;
  co.liveness_timeout = 1s;
  co.on_peer_failure = [&](const std::string& why) { heard.set_value(why); };
  TcpStore client(co);
  client.wait({"rank0/up"});
  std::atomic<bool> stopped{false};
  client.publish("rank1/progress", [&] {
    if (!stopped.exchange(true)) ::kill(child, SIGSTOP);
    return std::string("1");
  });
  auto f = heard.get_future();
  const bool ready = f.wait_for(10s) == std::future_status::ready;
  ::kill(child, SIGKILL);
  int status = 0;
  ::waitpid(child, &status, 0);
  ASSERT_TRUE(ready) << "no failure reported 10 s after the server stopped";
  EXPECT_TRUE(stopped.load());
  const std::string why = f.get();
  EXPECT_NE(why.find(fmt::format("the rendezvous store at 127.0.0.1:{} did not answer rank 1 for 1 s", port)),
            std::string::npos)
      << why;
}

}  // namespace
}  // namespace longtrain::parallel

// The control plane's wire layer: framing, connections and conversions, including what a
// misbehaving peer can throw at it.
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <future>
#include <random>
#include <thread>

#include "core/idle_spin.h"
#include "core/rpc/connection.h"
#include "core/rpc/frame.h"
#include "core/rpc/io_loop.h"
#include "core/rpc/wire.h"
#include "test_util.h"

namespace tessera::testing {
namespace {

using rpc::FrameDecoder;

std::vector<uint8_t> HeartbeatFrame(int64_t tasks_done) {
  capnp::MallocMessageBuilder message;
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.setRequestId(static_cast<uint64_t>(tasks_done));
  envelope.initBody().initHeartbeat().setTasksDone(tasks_done);
  return rpc::EncodeFrame(message);
}

TEST(FrameTest, DecodesFramesFedInArbitraryPieces) {
  std::vector<uint8_t> stream;
  for (int i = 0; i < 20; ++i) {
    std::vector<uint8_t> frame = HeartbeatFrame(i);
    stream.insert(stream.end(), frame.begin(), frame.end());
  }
  FrameDecoder decoder;
  for (uint8_t byte : stream) ASSERT_OK(decoder.Feed({&byte, 1}));
  for (int i = 0; i < 20; ++i) {
    ASSERT_TRUE(decoder.HasMessage());
    auto message = decoder.PopMessage();
    auto envelope = message->reader().getRoot<proto::Envelope>();
    ASSERT_EQ(envelope.getBody().which(), proto::Envelope::Body::HEARTBEAT);
    EXPECT_EQ(envelope.getBody().getHeartbeat().getTasksDone(), i);
  }
  EXPECT_FALSE(decoder.HasMessage());
}

TEST(FrameTest, RejectsBadMagicAndOversizedFrames) {
  FrameDecoder decoder;
  const uint8_t garbage[] = {'G', 'E', 'T', ' ', '/', ' ', 'H', 'T', 'T', 'P'};
  Status bad = decoder.Feed(garbage);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.message().find("magic"), std::string::npos);
  EXPECT_FALSE(decoder.Feed(garbage).ok()) << "a failed decoder stays failed";

  FrameDecoder small(1024);
  std::vector<uint8_t> header(8);
  const uint32_t magic = rpc::kFrameMagic, length = 4096;
  std::memcpy(header.data(), &magic, 4);
  std::memcpy(header.data() + 4, &length, 4);
  Status oversized = small.Feed(header);
  ASSERT_FALSE(oversized.ok());
  EXPECT_NE(oversized.message().find("4096"), std::string::npos);
}

// A PutObjects frame carrying `bytes` of inline data (a frame of about that size).
std::vector<uint8_t> LargeFrame(size_t bytes) {
  capnp::MallocMessageBuilder message;
  auto put = message.initRoot<proto::Envelope>().initBody().initPutObjects();
  put.initInline(1).init(0, static_cast<unsigned>(bytes));
  return rpc::EncodeFrame(message);
}

TEST(FrameTest, AFrameOverTheLimitIsJudgedOnceTheMessagesBeforeItWereTaken) {
  std::vector<uint8_t> stream = HeartbeatFrame(1);
  const std::vector<uint8_t> large = LargeFrame(8192);
  stream.insert(stream.end(), large.begin(), large.end());
  // Handling the first message raises the limit (a Hello accepted): the large frame passes.
  FrameDecoder raised(1024);
  ASSERT_OK(raised.Feed(stream));
  ASSERT_TRUE(raised.HasMessage());
  raised.PopMessage();
  EXPECT_FALSE(raised.HasMessage()) << "held back until the messages before it were handled";
  raised.set_max_frame_bytes(rpc::kDefaultMaxFrameBytes);
  ASSERT_OK(raised.Feed({}));
  ASSERT_TRUE(raised.HasMessage());
  EXPECT_GE(raised.PopMessage()->bytes(), 8192u);
  // It does not: the large frame is refused.
  FrameDecoder kept(1024);
  ASSERT_OK(kept.Feed(stream));
  kept.PopMessage();
  Status refused = kept.Feed({});
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.message().find("limit 1024"), std::string::npos) << refused.ToString();
}

TEST(FrameTest, RandomPayloadsNeverCrashTheReader) {
  std::mt19937_64 rng(7);
  int rejected = 0;
  for (int trial = 0; trial < 2000; ++trial) {
    const uint32_t words = 1 + static_cast<uint32_t>(rng() % 32);
    std::vector<uint8_t> frame(8 + words * 8);
    const uint32_t magic = rpc::kFrameMagic, length = words * 8;
    std::memcpy(frame.data(), &magic, 4);
    std::memcpy(frame.data() + 4, &length, 4);
    for (size_t i = 8; i < frame.size(); ++i) frame[i] = static_cast<uint8_t>(rng());
    FrameDecoder decoder;
    Status fed = decoder.Feed(frame);
    // Either the frame is rejected, or reading it fails cleanly, or it reads as something.
    Status read = rpc::CatchMalformed([&]() -> Status {
      if (!fed.ok()) return fed;
      auto envelope = decoder.PopMessage()->reader().getRoot<proto::Envelope>();
      if (envelope.getBody().which() == proto::Envelope::Body::SUBMIT_TASKS) {
        for (auto task : envelope.getBody().getSubmitTasks().getTasks()) {
          TESSERA_RETURN_IF_ERROR(rpc::FromWire(task).status());
        }
      }
      return Status::Ok();
    });
    rejected += !read.ok();
  }
  EXPECT_GT(rejected, 0);
}

TEST(FrameTest, AnHonestLargeBatchReadSeveralTimesStaysWithinTheTraversalLimit) {
  // A worker reads each dispatched task more than once; 5000 tasks in one frame must not trip
  // the limit that guards against amplification (it once cost a worker its connection).
  capnp::MallocMessageBuilder message;
  auto tasks = message.initRoot<proto::Envelope>().initBody().initDispatchTasks().initTasks(5000);
  for (unsigned i = 0; i < tasks.size(); ++i) {
    TaskSpec spec;
    spec.id = TaskId(i + 1);
    spec.name = "noop#" + std::to_string(i);
    spec.op = "noop";
    spec.outputs = {ObjectId(i + 1)};
    ObjectSpec out{
        ObjectId(i + 1), "o", {Shape{}, DType::kF32, Device::Cpu()}, ObjectRole::kOutput, spec.id};
    rpc::ToWire(spec, {out}, tasks[i].initTask());
  }
  FrameDecoder decoder;
  ASSERT_OK(decoder.Feed(rpc::EncodeFrame(message)));
  auto received = decoder.PopMessage();
  Status read = rpc::CatchMalformed([&]() -> Status {
    auto batch = received->reader().getRoot<proto::Envelope>().getBody().getDispatchTasks();
    for (int pass = 0; pass < 3; ++pass) {
      for (auto task : batch.getTasks()) {
        TESSERA_RETURN_IF_ERROR(rpc::FromWire(task.getTask()).status());
      }
    }
    return Status::Ok();
  });
  EXPECT_OK(read);
}

TEST(WireTest, TaskRoundTripKeepsEverything) {
  TaskSpec task;
  task.id = TaskId(42);
  task.name = "h.3/forward";
  task.layer = "h.3";
  task.op = "transformer_block_forward";
  task.attrs = Attrs{{"channels", int64_t{768}},
                     {"eps", 1e-5},
                     {"mode", std::string("train")},
                     {"ranges", std::vector<int64_t>{0, 5, 9, 12}}};
  task.inputs = {ObjectId(7), ObjectId(8)};
  task.outputs = {ObjectId(9)};
  task.pinned_worker = WorkerId(3);
  task.priority = -2;
  task.memory_estimate_bytes = 1 << 20;
  task.donations = {{1, 0}};
  task.after = {TaskId(3), TaskId(5)};
  task.device_kind = DeviceKind::kCuda;  // a GPU worker runs it with its CUDA kernel
  ObjectSpec output{ObjectId(9),
                    "h.3.y",
                    {Shape{4, 64, 768}, DType::kBF16, Device::Cuda(1)},
                    ObjectRole::kActivation,
                    TaskId(42)};
  capnp::MallocMessageBuilder message;
  auto wire = message.initRoot<proto::Task>();
  rpc::ToWire(task, {output}, wire);
  ASSERT_OK_AND_ASSIGN(rpc::WireTask back, rpc::FromWire(wire.asReader()));
  EXPECT_EQ(back.spec.name, task.name);
  EXPECT_EQ(back.spec.layer, task.layer);
  EXPECT_EQ(back.spec.op, task.op);
  EXPECT_EQ(back.spec.attrs, task.attrs);
  EXPECT_EQ(back.spec.inputs, task.inputs);
  EXPECT_EQ(back.spec.outputs, task.outputs);
  EXPECT_EQ(back.spec.pinned_worker, task.pinned_worker);
  EXPECT_EQ(back.spec.priority, task.priority);
  EXPECT_EQ(back.spec.memory_estimate_bytes, task.memory_estimate_bytes);
  EXPECT_EQ(back.spec.donations, task.donations);
  EXPECT_EQ(back.spec.after, task.after);
  EXPECT_EQ(back.spec.device_kind, DeviceKind::kCuda);
  ASSERT_EQ(back.outputs.size(), 1u);
  EXPECT_EQ(back.outputs[0].meta, output.meta);
  EXPECT_EQ(back.outputs[0].name, output.name);
}

TEST(WireTest, ForgedValuesAreRejected) {
  capnp::MallocMessageBuilder message;
  auto meta = message.initRoot<proto::TensorMeta>();
  meta.setDtype(200);
  EXPECT_FALSE(rpc::FromWire(meta.asReader()).ok());
  meta.setDtype(0);
  meta.initShape(1).set(0, -5);
  EXPECT_FALSE(rpc::FromWire(meta.asReader()).ok());
  auto task = message.initRoot<proto::Task>();
  task.setName("t");
  task.setDeviceKind(9);
  EXPECT_NE(rpc::FromWire(task.asReader()).status().message().find("unknown device kind 9"),
            std::string::npos);
  EXPECT_EQ(rpc::Address::Parse("localhost:6379")->port, 6379);
  EXPECT_EQ(rpc::Address::Parse("unix:/tmp/x.sock")->path, "/tmp/x.sock");
  EXPECT_FALSE(rpc::Address::Parse("localhost").ok());
  EXPECT_FALSE(rpc::Address::Parse("host:99999").ok());
}

// Two connected endpoints on one io thread.
class ConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int fds[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0);
    rpc::GenericSocket a(io_), b(io_);
    a.assign(rpc::asio::generic::stream_protocol(AF_UNIX, 0), fds[0]);
    b.assign(rpc::asio::generic::stream_protocol(AF_UNIX, 0), fds[1]);
    a_ = rpc::Connection::Create(std::move(a), "a");
    b_ = rpc::Connection::Create(std::move(b), "b");
    work_.emplace(io_.get_executor());
    thread_ = std::thread([this] { io_.run(); });
  }
  void TearDown() override {
    a_->Close(Cancelled("test over"));
    b_->Close(Cancelled("test over"));
    work_.reset();
    thread_.join();
  }

  rpc::asio::io_context io_;
  std::optional<rpc::asio::executor_work_guard<rpc::asio::io_context::executor_type>> work_;
  std::thread thread_;
  std::shared_ptr<rpc::Connection> a_, b_;
};

TEST_F(ConnectionTest, DeliversManyMessagesInOrderFromSeveralThreads) {
  constexpr int kPerThread = 2000;
  std::promise<std::vector<int64_t>> received;
  std::vector<int64_t> seen;
  b_->Start(
      [&](rpc::Connection&, rpc::ReceivedMessage& message) {
        seen.push_back(
            message.reader().getRoot<proto::Envelope>().getBody().getHeartbeat().getTasksDone());
        if (seen.size() == size_t{2} * kPerThread) received.set_value(seen);
        return Status::Ok();
      },
      [](rpc::Connection&, const Status&) {});
  a_->Start([](rpc::Connection&, rpc::ReceivedMessage&) { return Status::Ok(); },
            [](rpc::Connection&, const Status&) {});
  auto sender = [&](int64_t base) {
    for (int i = 0; i < kPerThread; ++i) a_->SendFrame(HeartbeatFrame(base + i));
  };
  std::thread t1(sender, 0), t2(sender, 1'000'000);
  t1.join();
  t2.join();
  auto future = received.get_future();
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  std::vector<int64_t> all = future.get();
  // Each sender's messages arrive in its order.
  int64_t last_low = -1, last_high = 999'999;
  for (int64_t value : all) {
    if (value < 1'000'000) {
      EXPECT_GT(value, last_low);
      last_low = value;
    } else {
      EXPECT_GT(value, last_high);
      last_high = value;
    }
  }
}

// A frame of `bytes` bytes of payload, every byte (tag + i) % 251, tagged in the request id.
std::vector<uint8_t> PayloadFrame(int64_t tag, size_t bytes) {
  capnp::MallocMessageBuilder message;
  auto envelope = message.initRoot<proto::Envelope>();
  envelope.setRequestId(static_cast<uint64_t>(tag));
  auto data = envelope.initBody().initPutObjects().initInline(1).init(0, bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<kj::byte>((tag + i) % 251);
  return rpc::EncodeFrame(message);
}

// Senders off the io thread write on their own thread when nothing else is on its way out; a
// frame larger than the socket's buffer is written in part there and finished by the io thread
// while more frames queue behind it. Every frame arrives whole, each sender's in order.
TEST_F(ConnectionTest, LargeFramesFromSeveralThreadsArriveWholeAndInOrder) {
  constexpr int kPerThread = 60;
  std::promise<void> all_received;
  std::vector<int64_t> seen;
  int corrupt = 0;
  b_->Start(
      [&](rpc::Connection&, rpc::ReceivedMessage& message) {
        auto envelope = message.reader().getRoot<proto::Envelope>();
        const auto tag = static_cast<int64_t>(envelope.getRequestId());
        auto data = envelope.getBody().getPutObjects().getInline()[0];
        for (size_t i = 0; i < data.size(); ++i) {
          if (data[i] != static_cast<kj::byte>((tag + i) % 251)) {
            ++corrupt;
            break;
          }
        }
        seen.push_back(tag);
        if (seen.size() == size_t{2} * kPerThread) all_received.set_value();
        return Status::Ok();
      },
      [](rpc::Connection&, const Status&) {});
  a_->Start([](rpc::Connection&, rpc::ReceivedMessage&) { return Status::Ok(); },
            [](rpc::Connection&, const Status&) {});
  auto sender = [&](int64_t base) {
    for (int i = 0; i < kPerThread; ++i) {
      // Mostly small, every fifth 1 MiB (a unix socket buffers a few hundred KiB).
      a_->SendFrame(PayloadFrame(base + i, i % 5 == 0 ? size_t{1} << 20 : 100 + i));
    }
  };
  std::thread t1(sender, 0), t2(sender, 1'000'000);
  t1.join();
  t2.join();
  ASSERT_EQ(all_received.get_future().wait_for(std::chrono::seconds(20)),
            std::future_status::ready);
  EXPECT_EQ(corrupt, 0);
  int64_t last_low = -1, last_high = 999'999;
  for (int64_t tag : seen) {
    int64_t& last = tag < 1'000'000 ? last_low : last_high;
    EXPECT_EQ(tag, last + 1);
    last = tag;
  }
}

// A connection closed while other threads send into it: they stop writing (nothing written to
// a closed or reused descriptor; the sanitizer builds check the races), and the peer gets whole
// frames up to the close.
TEST_F(ConnectionTest, SendersRacingACloseStopCleanly) {
  std::atomic<int> received{0};
  std::promise<Status> closed;
  b_->Start(
      [&](rpc::Connection&, rpc::ReceivedMessage&) {
        ++received;
        return Status::Ok();
      },
      [&](rpc::Connection&, const Status& reason) { closed.set_value(reason); });
  a_->Start([](rpc::Connection&, rpc::ReceivedMessage&) { return Status::Ok(); },
            [](rpc::Connection&, const Status&) {});
  std::atomic<bool> stop{false};
  std::vector<std::thread> senders;
  senders.reserve(3);
  for (int t = 0; t < 3; ++t) {
    senders.emplace_back([&, t] {
      for (int64_t i = 0; !stop.load(); ++i) a_->SendFrame(PayloadFrame(t, 1000 + 997 * (i % 300)));
    });
  }
  while (received.load() < 100) std::this_thread::yield();
  a_->Close(Cancelled("closed while sending"));
  auto future = closed.get_future();
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  stop = true;
  for (std::thread& sender : senders) sender.join();
  EXPECT_GE(received.load(), 100);
  // The peer saw an orderly end of stream, not garbage.
  EXPECT_EQ(future.get().message().find("bad frame"), std::string::npos) << future.get().ToString();
}

TEST_F(ConnectionTest, GarbageClosesOnlyTheOffendingConnection) {
  std::promise<Status> closed;
  b_->Start([](rpc::Connection&, rpc::ReceivedMessage&) { return Status::Ok(); },
            [&](rpc::Connection&, const Status& reason) { closed.set_value(reason); });
  a_->Start([](rpc::Connection&, rpc::ReceivedMessage&) { return Status::Ok(); },
            [](rpc::Connection&, const Status&) {});
  a_->SendFrame(std::vector<uint8_t>(64, 0xab));
  auto future = closed.get_future();
  ASSERT_EQ(future.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  Status reason = future.get();
  EXPECT_NE(reason.message().find("bad frame magic"), std::string::npos) << reason.ToString();
}

TEST_F(ConnectionTest, AHandlerErrorClosesWithThatReason) {
  std::promise<Status> closed;
  b_->Start([](rpc::Connection&,
               rpc::ReceivedMessage&) { return InvalidArgument("heartbeat before hello"); },
            [&](rpc::Connection&, const Status& reason) { closed.set_value(reason); });
  a_->Start([](rpc::Connection&, rpc::ReceivedMessage&) { return Status::Ok(); },
            [](rpc::Connection&, const Status&) {});
  a_->SendFrame(HeartbeatFrame(1));
  auto future = closed.get_future();
  ASSERT_EQ(future.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_NE(future.get().message().find("heartbeat before hello"), std::string::npos);
}

// A server-side connection created with a small frame limit (not authenticated yet): a large
// frame closes it and nothing else; after Admit the same frame is delivered.
TEST(ConnectionLimitTest, APreauthFrameOverTheLimitClosesOnlyThatConnection) {
  rpc::asio::io_context io;
  auto work = rpc::asio::make_work_guard(io);
  struct Pair {
    std::shared_ptr<rpc::Connection> client, server;
  };
  auto make_pair = [&](const std::string& name) {
    int fds[2];
    TESSERA_CHECK(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0, "socketpair");
    rpc::GenericSocket a(io), b(io);
    a.assign(rpc::asio::generic::stream_protocol(AF_UNIX, 0), fds[0]);
    b.assign(rpc::asio::generic::stream_protocol(AF_UNIX, 0), fds[1]);
    return Pair{rpc::Connection::Create(std::move(a), name + "-client"),
                rpc::Connection::Create(std::move(b), name, /*max_frame_bytes=*/4096)};
  };
  Pair stranger = make_pair("stranger"), bystander = make_pair("bystander"),
       admitted = make_pair("admitted");
  std::promise<Status> stranger_closed;
  std::promise<size_t> admitted_got_large;
  std::atomic<int> bystander_messages{0};
  std::atomic<bool> bystander_closed{false};
  auto quiet = [](rpc::Connection&, rpc::ReceivedMessage&) { return Status::Ok(); };
  auto ignore_close = [](rpc::Connection&, const Status&) {};
  stranger.server->Start(
      quiet, [&](rpc::Connection&, const Status& reason) { stranger_closed.set_value(reason); });
  bystander.server->Start(
      [&](rpc::Connection&, rpc::ReceivedMessage&) {
        ++bystander_messages;
        return Status::Ok();
      },
      [&](rpc::Connection&, const Status&) { bystander_closed = true; });
  admitted.server->Start(
      [&](rpc::Connection& self, rpc::ReceivedMessage& message) {
        if (message.bytes() > 4096) {
          admitted_got_large.set_value(message.bytes());
        } else {
          self.Admit();  // its first message proved it (as a scheduler accepts a Hello)
        }
        return Status::Ok();
      },
      ignore_close);
  for (Pair* pair : {&stranger, &bystander, &admitted}) pair->client->Start(quiet, ignore_close);
  std::thread thread([&] { io.run(); });

  stranger.client->SendFrame(LargeFrame(size_t{64} * 1024));
  admitted.client->SendFrame(HeartbeatFrame(1));
  admitted.client->SendFrame(LargeFrame(size_t{64} * 1024));  // behind the first, maybe in one read
  auto closed = stranger_closed.get_future();
  ASSERT_EQ(closed.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  const Status reason = closed.get();
  EXPECT_NE(reason.message().find("bad frame length"), std::string::npos) << reason.ToString();
  auto large = admitted_got_large.get_future();
  ASSERT_EQ(large.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_GE(large.get(), size_t{64} * 1024);
  // The bystander, pending like the stranger, still works.
  bystander.client->SendFrame(HeartbeatFrame(2));
  EXPECT_TRUE(Eventually([&] { return bystander_messages.load() == 1; }));
  EXPECT_FALSE(bystander_closed.load());

  for (Pair* pair : {&stranger, &bystander, &admitted}) {
    pair->client->Close(Cancelled("test over"));
    pair->server->Close(Cancelled("test over"));
  }
  work.reset();
  thread.join();
}

// Out of descriptors, accept fails at once for as long as that lasts: the listener must shed and
// pause, not retry in a hot loop (a scheduler at its limit once spun at 97% CPU and stopped
// answering). Client sockets are made before the limit is lowered and connected after (a connect
// takes no descriptor), so only the listener's side runs out.
TEST(ListenerTest, OutOfDescriptorsItShedsAndPausesInsteadOfSpinning) {
  rpc::asio::io_context io;
  auto work = rpc::asio::make_work_guard(io);
  std::atomic<int> accepted{0};
  std::vector<rpc::GenericSocket> kept;  // io thread only
  auto listener = rpc::Listener::Listen(io, rpc::Address::Tcp("127.0.0.1", 0),
                                        [&](rpc::GenericSocket socket, const std::string&) {
                                          kept.push_back(std::move(socket));
                                          ++accepted;
                                        });
  ASSERT_OK(listener.status());
  std::thread thread([&] { io.run(); });
  sockaddr_in server{};
  server.sin_family = AF_INET;
  server.sin_port = htons((*listener)->address().port);
  server.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  constexpr int kClients = 8;
  std::vector<int> clients;
  clients.reserve(kClients);
  for (int i = 0; i < kClients; ++i) clients.push_back(::socket(AF_INET, SOCK_STREAM, 0));

  rlimit saved{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &saved), 0);
  const int lowest_free = ::dup(0);
  ::close(lowest_free);
  rlimit none_left = saved;
  none_left.rlim_cur = static_cast<rlim_t>(lowest_free);  // every descriptor below it is in use
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &none_left), 0);
  for (int fd : clients) {
    ASSERT_EQ(::connect(fd, reinterpret_cast<const sockaddr*>(&server), sizeof(server)), 0);
  }
  rusage before{}, after{};
  ::getrusage(RUSAGE_SELF, &before);
  const auto start = std::chrono::steady_clock::now();
  std::this_thread::sleep_for(std::chrono::seconds(1));
  ::getrusage(RUSAGE_SELF, &after);
  const double wall =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &saved), 0);
  auto seconds = [](const timeval& t) { return static_cast<double>(t.tv_sec) + t.tv_usec * 1e-6; };
  const double cpu = seconds(after.ru_utime) - seconds(before.ru_utime) + seconds(after.ru_stime) -
                     seconds(before.ru_stime);
  auto shed = [&] {
    int closed = 0;
    for (int fd : clients) {
      char byte;
      closed += ::recv(fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT) == 0;
    }
    return closed;
  };
  const int shed_while_out = shed();
  std::printf("out of descriptors for %.2f s: %.3f s of CPU, %d connection(s) shed\n", wall, cpu,
              shed_while_out);
  EXPECT_LT(cpu, 0.5 * wall) << "the listener spins";
  EXPECT_GE(shed_while_out, 1);
  // With descriptors again, the others are accepted.
  EXPECT_TRUE(Eventually([&] { return accepted.load() + shed() == kClients; }));
  for (int fd : clients) ::close(fd);
  rpc::asio::post(io, [&] {
    (*listener)->Close();
    kept.clear();
  });
  work.reset();
  thread.join();
}

TEST(IdleSpinTest, ReturnsAsSoonAsReadyAndGivesUpAfterTheSpin) {
  int calls = 0;
  EXPECT_TRUE(SpinUntil(std::chrono::seconds(10), [&calls] { return ++calls == 3; }));
  EXPECT_EQ(calls, 3);
  calls = 0;
  EXPECT_FALSE(SpinUntil(std::chrono::microseconds(0), [&calls] { return ++calls > 1; }));
  EXPECT_EQ(calls, 1);  // no spin: asked once
  calls = 0;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_FALSE(SpinUntil(std::chrono::milliseconds(20), [&calls] { return ++calls < 0; }));
  EXPECT_GE(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(20));
  EXPECT_GT(calls, 1);
}

// The spin follows the gaps: halved after each gap longer than the bound (down to none), full
// again after a gap a full spin would have caught.
TEST(IdleSpinTest, TheSpinnerBacksOffAfterLongGapsAndComesBackAfterShortOnes) {
  using std::chrono::microseconds;
  IdleSpinner spinner(microseconds(1000));
  const auto never = [] { return false; };
  EXPECT_EQ(spinner.allowance(), microseconds(1000));
  for (const int expected : {500, 250, 125, 62, 31, 15, 7, 3, 1, 0, 0}) {
    EXPECT_FALSE(spinner.Spin(never));
    std::this_thread::sleep_for(std::chrono::milliseconds(3));  // a long gap
    spinner.Woke();
    EXPECT_EQ(spinner.allowance(), microseconds(expected));
  }
  EXPECT_FALSE(spinner.Spin(never));  // no spin at all now
  spinner.Woke();                     // at once: a short gap
  EXPECT_EQ(spinner.allowance(), microseconds(1000));
  int calls = 0;
  EXPECT_TRUE(spinner.Spin([&calls] { return ++calls == 2; }));
  EXPECT_EQ(spinner.allowance(), microseconds(1000));
}

// The io loop runs handlers posted from other threads whether it spins or sleeps in the reactor
// at the time, and returns like io_context::run: when stopped, or out of work.
TEST(IoLoopTest, RunsPostedHandlersAndReturnsWhenStoppedOrOutOfWork) {
  for (const auto spin : {std::chrono::microseconds(0), std::chrono::microseconds(50),
                          std::chrono::microseconds(100'000)}) {
    SCOPED_TRACE(spin.count());
    rpc::asio::io_context io;
    auto work = rpc::asio::make_work_guard(io);
    std::atomic<int> ran{0};
    std::thread loop([&] { rpc::RunIoLoop(io, spin); });
    for (int i = 0; i < 200; ++i) {
      rpc::asio::post(io, [&ran] { ++ran; });
      // Now and then after a pause longer than the short spin, so it is asleep in the reactor.
      if (i % 50 == 0) std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    std::promise<void> done;
    rpc::asio::post(io, [&done] { done.set_value(); });
    ASSERT_EQ(done.get_future().wait_for(std::chrono::seconds(10)), std::future_status::ready);
    EXPECT_EQ(ran.load(), 200);
    io.stop();
    loop.join();  // returned: stopped
    EXPECT_TRUE(io.stopped());

    rpc::asio::io_context idle;
    rpc::asio::post(idle, [&ran] { ++ran; });
    rpc::RunIoLoop(idle, spin);  // returns: out of work
    EXPECT_EQ(ran.load(), 201);
  }
}

TEST(ListenerTest, ConnectsOverTcpAndUnixAndReportsUnreachableAddresses) {
  rpc::asio::io_context io;
  auto work = rpc::asio::make_work_guard(io);
  std::thread thread([&] { io.run(); });
  std::vector<std::shared_ptr<rpc::Connection>> accepted;
  std::promise<int64_t> got;
  auto on_accept = [&](rpc::GenericSocket socket, std::string peer) {
    auto connection = rpc::Connection::Create(std::move(socket), std::move(peer));
    connection->Start(
        [&](rpc::Connection&, rpc::ReceivedMessage& m) {
          got.set_value(m.reader().getRoot<proto::Envelope>().getRequestId());
          return Status::Ok();
        },
        [](rpc::Connection&, const Status&) {});
    accepted.push_back(connection);
  };
  const std::string path = TempPath("tessera_listener_test.sock");
  for (const rpc::Address& address :
       {rpc::Address::Tcp("127.0.0.1", 0), rpc::Address::Unix(path)}) {
    got = std::promise<int64_t>();
    auto listener = rpc::Listener::Listen(io, address, on_accept);
    ASSERT_TRUE(listener.ok()) << listener.status().ToString();
    ASSERT_OK_AND_ASSIGN(rpc::GenericSocket socket,
                         rpc::ConnectSocket(io, (*listener)->address(), 2000));
    auto client = rpc::Connection::Create(std::move(socket), "client");
    client->Start([](rpc::Connection&, rpc::ReceivedMessage&) { return Status::Ok(); },
                  [](rpc::Connection&, const Status&) {});
    client->SendFrame(HeartbeatFrame(77));
    auto future = got.get_future();
    ASSERT_EQ(future.wait_for(std::chrono::seconds(5)), std::future_status::ready);
    EXPECT_EQ(future.get(), 77);
    client->Close(Cancelled("done"));
    (*listener)->Close();
  }
  Result<rpc::GenericSocket> refused =
      rpc::ConnectSocket(io, rpc::Address::Tcp("127.0.0.1", 1), 1000);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(refused.status().message().find("127.0.0.1:1"), std::string::npos);
  for (auto& c : accepted) c->Close(Cancelled("done"));
  work.reset();
  thread.join();
}

}  // namespace
}  // namespace tessera::testing

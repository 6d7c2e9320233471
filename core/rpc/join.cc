#include "core/rpc/join.h"

#include <unistd.h>

#include <atomic>
#include <future>

#include "core/rpc/wire.h"

namespace tessera::rpc {

Result<Joined> Join(asio::io_context& io, const Address& address, const HelloFields& hello,
                    int timeout_ms, Connection::MessageHandler on_message,
                    std::function<void(const Status&)> on_close,
                    std::function<void(const Joined&)> on_welcome) {
  TESSERA_ASSIGN_OR_RETURN(GenericSocket socket, ConnectSocket(io, address, timeout_ms));
  Joined joined;
  joined.connection = Connection::Create(std::move(socket), address.ToString());
  auto welcomed = std::make_shared<std::promise<Status>>();
  auto answered = std::make_shared<std::atomic<bool>>(false);
  auto welcome = std::make_shared<Joined>();
  joined.connection->Start(
      [welcomed, answered, welcome, on_message = std::move(on_message),
       on_welcome = std::move(on_welcome)](Connection& connection,
                                           ReceivedMessage& message) -> Status {
        if (answered->load()) return on_message(connection, message);
        answered->store(true);
        auto body = message.reader().getRoot<proto::Envelope>().getBody();
        if (body.which() == proto::Envelope::Body::WELCOME) {
          welcome->id = body.getWelcome().getId();
          welcome->heartbeat_interval_ms = body.getWelcome().getHeartbeatIntervalMs();
          welcome->connection = connection.shared_from_this();
          if (on_welcome) on_welcome(*welcome);  // before any later message is handled
          welcomed->set_value(Status::Ok());
          return Status::Ok();
        }
        Status refused = body.which() == proto::Envelope::Body::REFUSED
                             ? FromWire(body.getRefused())
                             : Internal("the scheduler answered Hello with message kind {}",
                                        static_cast<int>(body.which()));
        welcomed->set_value(refused.WithContext("the scheduler refused to let this process join"));
        return refused;
      },
      [welcomed, answered, on_close = std::move(on_close)](Connection&, const Status& reason) {
        if (!answered->exchange(true)) welcomed->set_value(reason.WithContext("joining"));
        on_close(reason);
      });

  rpc::ScopedMessageBuilder message;
  auto body = message.initRoot<proto::Envelope>().initBody().initHello();
  body.setProtocolVersion(kProtocolVersion);
  body.setRole(hello.role);
  body.setToken(hello.token);
  char hostname[256] = {};
  ::gethostname(hostname, sizeof(hostname) - 1);
  body.setHostname(hostname);
  body.setPid(::getpid());
  body.setDataAddress(hello.data_address);
  body.setCpuThreads(hello.cpu_threads);
  body.setGpu(hello.gpu);
  body.setCpus(hello.cpus);
  body.setHostCapacity(hello.host_capacity);
  joined.connection->Send(message);

  std::future<Status> future = welcomed->get_future();
  if (future.wait_for(std::chrono::milliseconds(timeout_ms)) != std::future_status::ready) {
    joined.connection->Close(TimedOut("no answer to Hello"));
    return Unavailable("the scheduler at {} did not answer within {} ms", address.ToString(),
                       timeout_ms);
  }
  TESSERA_RETURN_IF_ERROR(future.get());
  joined.id = welcome->id;
  joined.heartbeat_interval_ms = welcome->heartbeat_interval_ms;
  return joined;
}

}  // namespace tessera::rpc

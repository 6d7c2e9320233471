// Outbox: where the scheduler's outgoing messages go (the network in the service, a recorder in
// tests).
#pragma once

#include <capnp/message.h>

#include "core/ids.h"
#include "core/status.h"

namespace tessera {

class Outbox {
 public:
  virtual ~Outbox() = default;
  virtual void Send(WorkerId to, capnp::MessageBuilder& message) = 0;
  // Drops a participant's connection (after a refusal, or when declared dead).
  virtual void Disconnect(WorkerId who, const Status& reason) = 0;
};

}  // namespace tessera

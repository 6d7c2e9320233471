#include "launcher/process_main.h"

#include <signal.h>

#include <cstdio>
#include <string>
#include <thread>

#include "core/logging.h"

namespace tessera {

Result<Settings> LoadProcessSettings() {
  TESSERA_ASSIGN_OR_RETURN(Settings settings, Settings::FromProcessEnvironment());
  TESSERA_RETURN_IF_ERROR(SetLogLevel(settings.log_level).WithContext("TESSERA_LOG_LEVEL"));
  return settings;
}

int FailWith(std::string_view program, const Status& status) {
  std::fprintf(stderr, "%.*s: error: %s\n", static_cast<int>(program.size()), program.data(),
               status.ToString().c_str());
  return 1;
}

void HandleTerminationSignals(std::function<void()> on_signal) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::thread([signals, on_signal = std::move(on_signal)] {
    int signal = 0;
    sigwait(&signals, &signal);
    on_signal();
  }).detach();
}

}  // namespace tessera

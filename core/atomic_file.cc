#include "core/atomic_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iterator>

namespace tessera {

Status WriteFileAtomically(const std::string& path, std::string_view contents, int mode) {
  const std::string temp = path + ".tmp." + std::to_string(::getpid());
  const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) {
    return Unavailable("cannot create '{}': {}", temp, std::strerror(errno));
  }
  ::fchmod(fd, static_cast<mode_t>(mode));  // exact bits, whatever the umask
  size_t written = 0;
  while (written < contents.size()) {
    const ssize_t n = ::write(fd, contents.data() + written, contents.size() - written);
    if (n < 0) {
      if (errno == EINTR) continue;
      const int error = errno;
      ::close(fd);
      ::unlink(temp.c_str());
      return DataLoss("writing '{}' failed: {}", temp, std::strerror(error));
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    return DataLoss("flushing '{}' failed: {}", temp, std::strerror(error));
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(temp.c_str());
    return Unavailable("renaming '{}' to '{}' failed: {}", temp, path, std::strerror(error));
  }
  // Persist the rename itself.
  const std::string directory = std::filesystem::path(path).parent_path().string();
  const int dir_fd = ::open(directory.empty() ? "." : directory.c_str(), O_RDONLY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
  return Status::Ok();
}

Result<std::string> ReadWholeFile(const std::string& path, std::string_view what) {
  std::ifstream file(path, std::ios::binary);
  if (!file) return NotFound("cannot open {} '{}': {}", what, path, std::strerror(errno));
  std::string bytes((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  if (file.bad()) return DataLoss("error reading {} '{}'", what, path);
  return bytes;
}

Result<std::string> ReadFileTrimmed(const std::string& path) {
  std::ifstream file(path);
  if (!file) return NotFound("cannot read '{}': {}", path, std::strerror(errno));
  std::string text((std::istreambuf_iterator<char>(file)), std::istreambuf_iterator<char>());
  while (!text.empty() && std::isspace(static_cast<unsigned char>(text.back()))) text.pop_back();
  return text;
}

}  // namespace tessera

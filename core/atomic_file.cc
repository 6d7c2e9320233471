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

#include "core/allocator.h"

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
  // Only a regular file has an end to read to: a directory throws from the stream, a device such
  // as /dev/zero or a pipe never ends (or not before memory does).
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) {
    return NotFound("cannot open {} '{}': {}", what, path, std::strerror(errno));
  }
  if (!S_ISREG(info.st_mode)) {
    return InvalidArgument("{} '{}' is {}, not a regular file", what, path,
                           S_ISDIR(info.st_mode) ? "a directory" : "a device, pipe or socket");
  }
  if (const int64_t memory = PhysicalHostMemoryBytes(); memory > 0 && info.st_size > memory) {
    return ResourceExhausted("{} '{}' is {:.1f} GiB, more than this machine's {:.1f} GiB of memory",
                             what, path, static_cast<double>(info.st_size) / (1 << 30),
                             static_cast<double>(memory) / (1 << 30));
  }
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

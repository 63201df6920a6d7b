#pragma once
// Socket helpers of the executor's tests.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>

namespace moeplan::test {

// Whether a TCP connection from `source` (a loopback address: all of 127/8 is this host) to
// 127.0.0.1:`port` completes its handshake within `ms`.
inline bool connects_from(const char* source, int port, int ms = 1500) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  sockaddr_in from{};
  from.sin_family = AF_INET;
  ::inet_pton(AF_INET, source, &from.sin_addr);
  sockaddr_in to{};
  to.sin_family = AF_INET;
  to.sin_port = htons(static_cast<uint16_t>(port));
  to.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bool connected = false;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&from), sizeof from) == 0) {
    const int r = ::connect(fd, reinterpret_cast<sockaddr*>(&to), sizeof to);
    pollfd p{fd, POLLOUT, 0};
    int error = 0;
    socklen_t n = sizeof error;
    connected = r == 0 || (errno == EINPROGRESS && ::poll(&p, 1, ms) == 1 &&
                           ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &error, &n) == 0 && error == 0);
  }
  ::close(fd);
  return connected;
}

}  // namespace moeplan::test

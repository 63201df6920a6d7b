// CRC-32 against the standard's check value, against a byte-at-a-time reference at every
// length and alignment around the eight-byte steps, continued over pieces, and over a file.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <random>
#include <vector>

#include <unistd.h>

#include "moeplan/core/checksum.h"
#include "moeplan/core/errors.h"

namespace moeplan {
namespace {

// The textbook bitwise CRC-32 (reflected polynomial 0xEDB88320), one bit at a time.
uint32_t bitwise_crc32(const unsigned char* p, size_t n) {
  uint32_t c = 0xFFFFFFFFu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
  }
  return ~c;
}

std::vector<unsigned char> random_bytes(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<unsigned char> b(n);
  for (auto& x : b) x = static_cast<unsigned char>(rng());
  return b;
}

TEST(Checksum, CheckValueAndZlibValues) {
  const std::string text = "123456789";
  EXPECT_EQ(crc32(text.data(), text.size()), 0xCBF43926u);  // the CRC-32 check value
  EXPECT_EQ(crc32(nullptr, 0), 0u);
  // zlib.crc32 of the bytes (7i + 3) mod 256, i < 1000, and of its bytes 3 to 994.
  std::vector<unsigned char> b(1000);
  for (size_t i = 0; i < b.size(); ++i) b[i] = static_cast<unsigned char>((i * 7 + 3) % 256);
  EXPECT_EQ(crc32(b.data(), b.size()), 0x17bc2a46u);
  EXPECT_EQ(crc32(b.data() + 3, b.size() - 8), 0x90e5a44au);
}

TEST(Checksum, EveryLengthAndAlignmentMatchesTheBitwiseCrc) {
  const std::vector<unsigned char> b = random_bytes(4096, 7);
  for (size_t offset = 0; offset < 9; ++offset)
    for (size_t n = 0; n + offset <= 80; ++n)
      ASSERT_EQ(crc32(b.data() + offset, n), bitwise_crc32(b.data() + offset, n)) << offset << " " << n;
  EXPECT_EQ(crc32(b.data() + 1, 4093), bitwise_crc32(b.data() + 1, 4093));
}

TEST(Checksum, ContinuesOverPieces) {
  const std::vector<unsigned char> b = random_bytes(10007, 11);
  const uint32_t whole = crc32(b.data(), b.size());
  for (size_t cut : {size_t{0}, size_t{1}, size_t{7}, size_t{8}, size_t{4099}, b.size()})
    EXPECT_EQ(crc32(b.data() + cut, b.size() - cut, crc32(b.data(), cut)), whole) << cut;
}

TEST(Checksum, FileOfSeveralBuffers) {
  const std::vector<unsigned char> b = random_bytes((3 << 20) + 5, 13);  // three 1 MiB reads and a tail
  const auto path = std::filesystem::temp_directory_path() / ("moeplan-checksum-" + std::to_string(::getpid()));
  {
    std::ofstream out(path, std::ios::binary);
    out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
  }
  EXPECT_EQ(crc32_file(path.string()), bitwise_crc32(b.data(), b.size()));
  std::filesystem::remove(path);
  try {
    crc32_file(path.string());
    FAIL() << "a missing file is read";
  } catch (const InputError& e) {
    EXPECT_NE(std::string(e.what()).find(path.string()), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace moeplan

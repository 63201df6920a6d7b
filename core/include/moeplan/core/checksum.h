#pragma once
// CRC-32 (the zlib/PNG polynomial), to tell a damaged file from a good one.

#include <cstddef>
#include <cstdint>
#include <string>

namespace moeplan {

// Continues a running CRC: crc32(b, crc32(a)) == crc32(a + b). Start with 0.
uint32_t crc32(const void* data, size_t bytes, uint32_t crc = 0);

// CRC-32 of a whole file; throws InputError naming the file if it cannot be read.
uint32_t crc32_file(const std::string& path);

}  // namespace moeplan

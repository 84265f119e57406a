// checksum64: the 64-bit checksum of static cache sections and headers.
//
// Four independent multiply-rotate lanes consume 32 bytes per round so the loop runs at
// memory speed; the tail is folded in 8 bytes, then 1 byte, at a time. It detects
// corruption, not tampering: it is not a cryptographic hash.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ngc {

// The checksum of `n` bytes at `data`. `data` may be unaligned. Deterministic across
// platforms (words are read little-endian).
uint64_t checksum64(const void* data, size_t n, uint64_t seed = 0);

}  // namespace ngc

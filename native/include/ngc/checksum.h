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

// The same checksum over bytes given in pieces: update() any number of times, then
// digest(). Equal to checksum64() of the concatenation.
class Checksum64 {
 public:
  explicit Checksum64(uint64_t seed = 0);
  void update(const void* data, size_t n);
  uint64_t digest() const;

 private:
  uint64_t lanes_[4];          // the four lane states after every whole 32-byte block
  unsigned char pending_[32];  // bytes of the current, incomplete block
  size_t n_pending_ = 0;       // < 32
  uint64_t length_ = 0;        // bytes seen in all
};

}  // namespace ngc

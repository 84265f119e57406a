#include "ngc/checksum.h"

#include <cstring>

namespace ngc {
namespace {

constexpr uint64_t kMulA = 0x9E3779B185EBCA87ULL;  // odd constants with well-mixed bits
constexpr uint64_t kMulB = 0xC2B2AE3D27D4EB4FULL;
constexpr uint64_t kMulC = 0x165667B19E3779F9ULL;

inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

inline uint64_t load64(const unsigned char* p) {
  uint64_t v;
  std::memcpy(&v, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
  v = __builtin_bswap64(v);
#endif
  return v;
}

inline uint64_t lane_step(uint64_t lane, uint64_t word) {
  return rotl(lane ^ (word * kMulB), 29) * kMulA;
}

inline uint64_t finalize(uint64_t h) {
  h ^= h >> 31;
  h *= kMulC;
  h ^= h >> 27;
  h *= kMulB;
  h ^= h >> 33;
  return h;
}

}  // namespace

uint64_t checksum64(const void* data, size_t n, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  const unsigned char* end = p + n;
  uint64_t a = seed + kMulA, b = seed ^ kMulB, c = seed - kMulC, d = ~seed;
  while (end - p >= 32) {
    a = lane_step(a, load64(p));
    b = lane_step(b, load64(p + 8));
    c = lane_step(c, load64(p + 16));
    d = lane_step(d, load64(p + 24));
    p += 32;
  }
  uint64_t h = rotl(a, 1) + rotl(b, 7) + rotl(c, 12) + rotl(d, 18) + static_cast<uint64_t>(n) * kMulC;
  while (end - p >= 8) {
    h = lane_step(h, load64(p));
    p += 8;
  }
  while (p < end) {
    h = rotl(h ^ (*p++ * kMulC), 11) * kMulA;
  }
  return finalize(h);
}

}  // namespace ngc

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

inline uint64_t lane_step(uint64_t lane, uint64_t word) { return rotl(lane ^ (word * kMulB), 29) * kMulA; }

inline void block(uint64_t* lanes, const unsigned char* p) {
  lanes[0] = lane_step(lanes[0], load64(p));
  lanes[1] = lane_step(lanes[1], load64(p + 8));
  lanes[2] = lane_step(lanes[2], load64(p + 16));
  lanes[3] = lane_step(lanes[3], load64(p + 24));
}

uint64_t finish(const uint64_t* lanes, const unsigned char* tail, size_t n_tail, uint64_t length) {
  uint64_t h = rotl(lanes[0], 1) + rotl(lanes[1], 7) + rotl(lanes[2], 12) + rotl(lanes[3], 18) + length * kMulC;
  const unsigned char* p = tail;
  const unsigned char* end = tail + n_tail;
  while (end - p >= 8) {
    h = lane_step(h, load64(p));
    p += 8;
  }
  while (p < end) h = rotl(h ^ (*p++ * kMulC), 11) * kMulA;
  h ^= h >> 31;
  h *= kMulC;
  h ^= h >> 27;
  h *= kMulB;
  h ^= h >> 33;
  return h;
}

}  // namespace

Checksum64::Checksum64(uint64_t seed) : lanes_{seed + kMulA, seed ^ kMulB, seed - kMulC, ~seed} {}

void Checksum64::update(const void* data, size_t n) {
  const auto* p = static_cast<const unsigned char*>(data);
  length_ += n;
  if (n_pending_ > 0) {
    const size_t take = n < 32 - n_pending_ ? n : 32 - n_pending_;
    std::memcpy(pending_ + n_pending_, p, take);
    n_pending_ += take;
    p += take;
    n -= take;
    if (n_pending_ < 32) return;
    block(lanes_, pending_);
    n_pending_ = 0;
  }
  while (n >= 32) {
    block(lanes_, p);
    p += 32;
    n -= 32;
  }
  std::memcpy(pending_, p, n);
  n_pending_ = n;
}

uint64_t Checksum64::digest() const { return finish(lanes_, pending_, n_pending_, length_); }

uint64_t checksum64(const void* data, size_t n, uint64_t seed) {
  Checksum64 c(seed);
  c.update(data, n);
  return c.digest();
}

}  // namespace ngc

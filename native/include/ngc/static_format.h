// The static cache file format, version 1, byte by byte.
//
// A static cache is an immutable file of n-gram -> follower counts (llama.cpp's "static"
// table), memory-mapped read-only and shared by every process of a node. Every integer is
// little-endian; a reader on a big-endian machine sees the endianness marker reversed and
// refuses the file. Every section starts at an offset that is a multiple of 8, so a mapped
// file is usable in place.
//
//   offset size  field
//   ------ ----  -----------------------------------------------------------------------
//        0    8  magic            "NGCSTAT\0"
//        8    4  format_version   1
//       12    4  endian_marker    0x01020304 (bytes 04 03 02 01 on disk)
//       16    4  header_size      128: the section table starts here
//       20    4  ngram_size       k, tokens per key, 1..4 (2 by default, as llama.cpp)
//       24    4  vocab_size       V; every token id in the file is < V; 1 <= V <= 2^24
//       28    4  n_sections       6 in version 1
//       32   32  fingerprint      the tokenizer fingerprint (opaque 32 bytes)
//       64    8  generation       the generation number of this file in its namespace
//       72    8  n_keys           K, distinct k-grams; K < 2^32
//       80    8  n_followers      F, distinct (k-gram, follower) pairs; F < 2^32
//       88    8  n_tokens         tokens observed when counting (informational)
//       96    8  n_overflow       O, follower counts too large for their packed field
//      104    4  token_bits       b = bits of a packed follower's token = bit width of V-1
//                                 (at least 1); the count field has c = 32 - b >= 8 bits
//      108    4  flags            0 (reserved)
//      112    8  file_size        the size of the whole file in bytes
//      120    8  header_checksum  checksum64 of bytes [0, 120) followed by the section
//                                 table
//      128 32*S  section table, S = n_sections entries of
//                  +0 u32 id  +4 u32 reserved (0)  +8 u64 offset  +16 u64 length
//                  +24 u64 checksum (checksum64 of the section's bytes)
//
// Sections (ids 1..6, in this order, each at an 8-aligned offset, inside the file, not
// overlapping; the gap before a section is zero padding of fewer than 8 bytes):
//
//   1 ROWS       u32[V + 1]: keys are sorted lexicographically; the keys whose first
//                token is t are key indexes [ROWS[t], ROWS[t+1]). ROWS[V] == K.
//   2 KEYS       u32[K * (k - 1)]: the remaining k-1 tokens of each key (empty for k=1).
//   3 STARTS     u32[K + 1]: the followers of key i are FOLLOWERS[STARTS[i], STARTS[i+1]).
//                Non-decreasing; STARTS[0] == 0, STARTS[K] == F; at least one follower
//                per key.
//   4 TOTALS     u32[K]: the sum of the key's follower counts (saturated at 2^32-1).
//   5 FOLLOWERS  u32[F]: packed (token << c) | count_field. The first follower of each key
//                is its best one (the highest count; the lowest token on ties); the rest
//                follow sorted by token. count_field == 2^c - 1 means the count is in
//                OVERFLOW; otherwise it is the count (>= 1).
//   6 OVERFLOW   {u32 follower_index, u32 count}[O], sorted by follower_index.
//
// Opening validates the header, the header checksum, the section table and that every
// section's length equals what the counts imply: O(1) in the file size. Section checksums
// are checked by verify() (O(size)), when a file is built, downloaded or asked for.
// A lookup bounds-checks every index it reads from the file, so damaged section bytes
// give "not found" or an error, never an out-of-bounds read.
#pragma once

#include <cstdint>

#include "ngc/limits.h"

namespace ngc::format {

constexpr char kMagic[8] = {'N', 'G', 'C', 'S', 'T', 'A', 'T', '\0'};
constexpr uint32_t kVersion = 1;
constexpr uint32_t kEndianMarker = 0x01020304;
constexpr uint32_t kHeaderSize = 128;
constexpr uint32_t kSectionEntrySize = 32;
constexpr uint32_t kNumSections = 6;
constexpr uint32_t kMaxVocab = ::ngc::kMaxVocab;
constexpr uint32_t kFingerprintSize = ::ngc::kFingerprintSize;

enum SectionId : uint32_t {
  kRows = 1,
  kKeys = 2,
  kStarts = 3,
  kTotals = 4,
  kFollowers = 5,
  kOverflow = 6,
};

inline const char* section_name(uint32_t id) {
  switch (id) {
    case kRows: return "ROWS";
    case kKeys: return "KEYS";
    case kStarts: return "STARTS";
    case kTotals: return "TOTALS";
    case kFollowers: return "FOLLOWERS";
    case kOverflow: return "OVERFLOW";
    default: return "UNKNOWN";
  }
}

// Header field offsets (see the table above).
namespace off {
constexpr uint32_t kMagic = 0, kVersion = 8, kEndian = 12, kHeaderSize = 16, kNgramSize = 20,
                   kVocabSize = 24, kNumSections = 28, kFingerprint = 32, kGeneration = 64,
                   kNumKeys = 72, kNumFollowers = 80, kNumTokens = 88, kNumOverflow = 96,
                   kTokenBits = 104, kFlags = 108, kFileSize = 112, kHeaderChecksum = 120;
}  // namespace off

// The bit width of vocab_size - 1, at least 1: the token field of a packed follower.
inline uint32_t token_bits_for(uint32_t vocab_size) {
  uint32_t bits = 1;
  while (bits < 32 && (uint64_t{1} << bits) < vocab_size) ++bits;
  return bits;
}

}  // namespace ngc::format

// The static cache file format, versions 1 and 2, byte by byte.
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
//        8    4  format_version   1, or 2 when the file has a corpus index (sections 7-9)
//       12    4  endian_marker    0x01020304 (bytes 04 03 02 01 on disk)
//       16    4  header_size      128: the section table starts here
//       20    4  ngram_size       k, tokens per key, 1..4 (2 by default, as llama.cpp)
//       24    4  vocab_size       V; every token id in the file is < V; 1 <= V <= 2^24
//       28    4  n_sections       6 in version 1, 9 in version 2
//       32   32  fingerprint      the tokenizer fingerprint (opaque 32 bytes)
//       64    8  generation       the generation number of this file in its namespace
//       72    8  n_keys           K, distinct k-grams; K < 2^32
//       80    8  n_followers      F, distinct (k-gram, follower) pairs; F < 2^32
//       88    8  n_tokens         tokens observed when counting (informational)
//       96    8  n_overflow       O, follower counts too large for their packed field
//      104    4  token_bits       b = bits of a packed follower's token = bit width of V-1
//                                 (at least 1); the count field has c = 32 - b >= 8 bits
//      108    4  flags            version 1: 0 (reserved). Version 2: bits 0-7 are the
//                                 corpus index's depth D (see SUFFIXES), 0 when sections
//                                 7-9 are empty; bits 8-31 are 0
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
// Version 2 adds the corpus index, for longest-match drafting (match.h). Either all three
// sections are empty (no index; D == 0) or none is (1 <= D <= 64):
//
//   7 TEXT       u32[T]: the indexed corpus tokens, its streams one after another with
//                kSeparator (0xFFFFFFFF) between two streams. T < 2^32 - 1; every other
//                value is < V. T is TEXT's length / 4.
//   8 SUFFIXES   u32[N]: every position p of TEXT that holds a token (not a separator),
//                N of them, sorted by the tokens read backwards from p: TEXT[p],
//                TEXT[p-1], ..., compared over the first D of them, a separator or the
//                start of TEXT counting as a value above every token and ending the
//                string (two strings that both end there are equal). Entries equal over
//                those D tokens may come in any order (the builder orders them by the
//                tokens further back, then by p). So the positions where a given string
//                of at most D tokens ends are one contiguous run. N is SUFFIXES' length / 4.
//   9 BUCKETS    u32[V + 1]: the positions p with TEXT[p] == t are SUFFIXES[BUCKETS[t],
//                BUCKETS[t+1]). BUCKETS[0] == 0, non-decreasing, BUCKETS[V] == N.
//
// Sizes: TEXT + SUFFIXES are 8 bytes per indexed token (2x the corpus's token bytes).
// A version-2 file without an index is never written (the writer writes version 1), so
// every reader of version 1 reads every file that has no index.
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
constexpr uint32_t kVersion = 2;         // the newest version read and written
constexpr uint32_t kVersionNoIndex = 1;  // written when the file has no corpus index
constexpr uint32_t kEndianMarker = 0x01020304;
constexpr uint32_t kHeaderSize = 128;
constexpr uint32_t kSectionEntrySize = 32;
constexpr uint32_t kNumSectionsV1 = 6;
constexpr uint32_t kNumSections = 9;          // the most sections of any version (version 2)
constexpr uint32_t kSeparator = 0xFFFFFFFFu;  // TEXT: between two streams
constexpr uint32_t kMaxIndexDepth = 64;
constexpr uint32_t kMaxVocab = ::ngc::kMaxVocab;
constexpr uint32_t kFingerprintSize = ::ngc::kFingerprintSize;

enum SectionId : uint32_t {
  kRows = 1,
  kKeys = 2,
  kStarts = 3,
  kTotals = 4,
  kFollowers = 5,
  kOverflow = 6,
  kText = 7,
  kSuffixes = 8,
  kBuckets = 9,
};

inline const char* section_name(uint32_t id) {
  switch (id) {
    case kRows:
      return "ROWS";
    case kKeys:
      return "KEYS";
    case kStarts:
      return "STARTS";
    case kTotals:
      return "TOTALS";
    case kFollowers:
      return "FOLLOWERS";
    case kOverflow:
      return "OVERFLOW";
    case kText:
      return "TEXT";
    case kSuffixes:
      return "SUFFIXES";
    case kBuckets:
      return "BUCKETS";
    default:
      return "UNKNOWN";
  }
}

// Header field offsets (see the table above).
namespace off {
constexpr uint32_t kMagic = 0, kVersion = 8, kEndian = 12, kHeaderSize = 16, kNgramSize = 20, kVocabSize = 24,
                   kNumSections = 28, kFingerprint = 32, kGeneration = 64, kNumKeys = 72, kNumFollowers = 80,
                   kNumTokens = 88, kNumOverflow = 96, kTokenBits = 104, kFlags = 108, kFileSize = 112,
                   kHeaderChecksum = 120;
}  // namespace off

// The bit width of vocab_size - 1, at least 1: the token field of a packed follower.
inline uint32_t token_bits_for(uint32_t vocab_size) {
  uint32_t bits = 1;
  while (bits < 32 && (uint64_t{1} << bits) < vocab_size) ++bits;
  return bits;
}

}  // namespace ngc::format

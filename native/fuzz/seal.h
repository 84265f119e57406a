// seal(): recomputes the checksums of a static cache file held in memory.
//
// A hostile file can carry valid checksums (checksum64 detects corruption, not
// tampering), so the static target seals every mutated input to reach the structural
// checks behind the checksums; seal_static does the same to a file on disk, turning a
// crash input into a file that reproduces outside the fuzzer.
#pragma once

#include <cstdint>
#include <cstring>
#include <vector>

#include "ngc/checksum.h"
#include "ngc/static_format.h"

namespace ngc::fuzz {

// Rewrites the checksum of every section that lies inside the file, then the header
// checksum. The table's length is the header's n_sections (at most the 9 of version 2).
// Returns false (and changes nothing) when `f` is shorter than that table.
inline bool seal(std::vector<uint8_t>& f) {
  auto le64 = [](const uint8_t* p) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    return v;
  };
  if (f.size() < format::kHeaderSize) return false;
  uint32_t n;
  std::memcpy(&n, f.data() + format::off::kNumSections, 4);
  n = n < format::kNumSections ? n : format::kNumSections;
  const size_t table_end = format::kHeaderSize + size_t{n} * format::kSectionEntrySize;
  if (f.size() < table_end) return false;
  for (uint32_t i = 0; i < n; ++i) {
    uint8_t* e = f.data() + format::kHeaderSize + i * format::kSectionEntrySize;
    const uint64_t off = le64(e + 8), len = le64(e + 16);
    if (off <= f.size() && len <= f.size() - off) {
      const uint64_t sum = checksum64(f.data() + off, len);
      std::memcpy(e + 24, &sum, 8);
    }
  }
  uint8_t scratch[format::kHeaderSize + format::kNumSections * format::kSectionEntrySize];
  std::memcpy(scratch, f.data(), table_end);
  std::memset(scratch + format::off::kHeaderChecksum, 0, 8);
  const uint64_t sum = checksum64(scratch, table_end);
  std::memcpy(f.data() + format::off::kHeaderChecksum, &sum, 8);
  return true;
}

}  // namespace ngc::fuzz

#include "ngc/static_cache.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <string>
#include <vector>

#include "ngc/checksum.h"

namespace ngc {
namespace {

template <typename T>
T read_le(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

std::string str(uint64_t v) { return std::to_string(v); }

// The length in bytes that section `id` must have, given the header counts.
uint64_t expected_length(uint32_t id, const StaticInfo& h) {
  switch (id) {
    case format::kRows:
      return (uint64_t{h.vocab_size} + 1) * 4;
    case format::kKeys:
      return h.n_keys * (h.ngram_size - 1) * 4;
    case format::kStarts:
      return (h.n_keys + 1) * 4;
    case format::kTotals:
      return h.n_keys * 4;
    case format::kFollowers:
      return h.n_followers * 4;
    case format::kOverflow:
      return h.n_overflow * 8;
    case format::kText:
      return h.n_text * 4;
    case format::kSuffixes:
      return h.n_suffixes * 4;
    case format::kBuckets:
      return h.index_depth == 0 ? 0 : (uint64_t{h.vocab_size} + 1) * 4;
    default:
      return 0;
  }
}

#ifdef NGC_HEAP_FILES
// Reads the `size` bytes of `fd` into a new block of exactly that size.
Status read_whole(int fd, const std::string& path, size_t size, std::unique_ptr<uint8_t[]>* out) {
  std::unique_ptr<uint8_t[]> block(new uint8_t[size]);
  for (size_t done = 0; done < size;) {
    const ssize_t n = ::pread(fd, block.get() + done, size - done, static_cast<off_t>(done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return Status::IoError("cannot read " + path + ": " + std::strerror(errno));
    if (n == 0) return Status::IoError("cannot read " + path + ": it shrank while being read");
    done += static_cast<size_t>(n);
  }
  *out = std::move(block);
  return Status::Ok();
}
#endif

}  // namespace

Status StaticCache::open(const std::string& path, std::unique_ptr<StaticCache>* out) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return Status::IoError("cannot open " + path + ": " + std::strerror(errno));
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    return Status::IoError("cannot stat " + path + ": " + std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return Status::IoError(path + " is not a regular file");
  }
  const size_t size = static_cast<size_t>(st.st_size);
  if (size < format::kHeaderSize) {
    ::close(fd);
    return Status::FormatError(path + ": file is " + str(size) + " bytes, smaller than the " +
                               str(format::kHeaderSize) + "-byte header; not a static cache");
  }
  std::unique_ptr<StaticCache> cache(new StaticCache());
#ifdef NGC_HEAP_FILES
  // The sanitizer builds: a heap block of exactly the file's size, so AddressSanitizer
  // reports any read past the file's last byte (it does not see into a mapping).
  Status read = read_whole(fd, path, size, &cache->heap_);
  ::close(fd);
  if (!read.ok()) return read;
  cache->base_ = cache->heap_.get();
#else
  void* map = ::mmap(nullptr, size, PROT_READ, MAP_SHARED, fd, 0);
  const int map_err = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (map == MAP_FAILED) return Status::IoError("cannot map " + path + ": " + std::strerror(map_err));
  cache->base_ = static_cast<const uint8_t*>(map);
#endif
  cache->size_ = size;
  Status s = cache->validate_header();
  if (!s.ok()) return Status(s.code(), path + ": " + s.message());
  *out = std::move(cache);
  return Status::Ok();
}

StaticCache::~StaticCache() {
  if (base_ != nullptr && heap_ == nullptr) ::munmap(const_cast<uint8_t*>(base_), size_);
}

Status StaticCache::validate_header() {
  const uint8_t* h = base_;
  if (std::memcmp(h + format::off::kMagic, format::kMagic, 8) != 0) {
    return Status::FormatError("bad magic: not an ngramcache static cache file");
  }
  const uint32_t endian = read_le<uint32_t>(h + format::off::kEndian);
  if (endian != format::kEndianMarker) {
    return Status::FormatError("endianness marker is 0x" + [&] {
      char buf[16];
      std::snprintf(buf, sizeof buf, "%08x", endian);
      return std::string(buf);
    }() + ", expected 0x01020304: file written on a machine of the other byte order, or corrupt");
  }
  info_.format_version = read_le<uint32_t>(h + format::off::kVersion);
  if (info_.format_version < 1 || info_.format_version > format::kVersion) {
    return Status::FormatError("unsupported format version " + str(info_.format_version) +
                               " (this build reads versions 1 to " + str(format::kVersion) + ")");
  }
  const uint32_t header_size = read_le<uint32_t>(h + format::off::kHeaderSize);
  const uint32_t n_sections = read_le<uint32_t>(h + format::off::kNumSections);
  if (header_size != format::kHeaderSize) {
    return Status::FormatError("header size is " + str(header_size) + ", expected " + str(format::kHeaderSize));
  }
  const uint32_t want_sections = info_.format_version == 1 ? format::kNumSectionsV1 : format::kNumSections;
  if (n_sections != want_sections) {
    return Status::FormatError("section count is " + str(n_sections) + ", format version " + str(info_.format_version) +
                               " has " + str(want_sections));
  }
  info_.n_sections = n_sections;
  const uint64_t table_end = uint64_t{format::kHeaderSize} + uint64_t{n_sections} * format::kSectionEntrySize;
  if (table_end > size_) {
    return Status::FormatError("truncated: the section table ends at byte " + str(table_end) + " but the file has " +
                               str(size_) + " bytes");
  }
  // The header checksum covers bytes [0, 120) and the section table.
  uint8_t
      scratch[format::kHeaderSize + format::kNumSections * format::kSectionEntrySize];  // room for the largest table
  std::memcpy(scratch, h, table_end);
  std::memset(scratch + format::off::kHeaderChecksum, 0, 8);
  const uint64_t stored = read_le<uint64_t>(h + format::off::kHeaderChecksum);
  if (checksum64(scratch, table_end) != stored) {
    return Status::FormatError("header checksum mismatch: the header or section table is corrupt");
  }

  info_.ngram_size = read_le<uint32_t>(h + format::off::kNgramSize);
  info_.vocab_size = read_le<uint32_t>(h + format::off::kVocabSize);
  std::memcpy(info_.fingerprint, h + format::off::kFingerprint, format::kFingerprintSize);
  info_.generation = read_le<uint64_t>(h + format::off::kGeneration);
  info_.n_keys = read_le<uint64_t>(h + format::off::kNumKeys);
  info_.n_followers = read_le<uint64_t>(h + format::off::kNumFollowers);
  info_.n_tokens = read_le<uint64_t>(h + format::off::kNumTokens);
  info_.n_overflow = read_le<uint64_t>(h + format::off::kNumOverflow);
  info_.token_bits = read_le<uint32_t>(h + format::off::kTokenBits);
  info_.file_size = read_le<uint64_t>(h + format::off::kFileSize);
  const uint32_t flags = read_le<uint32_t>(h + format::off::kFlags);
  if (info_.format_version == 1 ? flags != 0 : (flags >> 8) != 0 || (flags & 0xFF) > format::kMaxIndexDepth) {
    return Status::FormatError("flags 0x" +
                               [&] {
                                 char buf[16];
                                 std::snprintf(buf, sizeof buf, "%08x", flags);
                                 return std::string(buf);
                               }() +
                               " are not valid for format version " + str(info_.format_version));
  }
  info_.index_depth = flags & 0xFF;

  if (info_.ngram_size < 1 || info_.ngram_size > kNgramMax) {
    return Status::FormatError("n-gram size " + str(info_.ngram_size) + " is outside 1..4");
  }
  if (info_.vocab_size < 1 || info_.vocab_size > format::kMaxVocab) {
    return Status::FormatError("vocabulary size " + str(info_.vocab_size) + " is outside 1..2^24");
  }
  if (info_.token_bits != format::token_bits_for(info_.vocab_size)) {
    return Status::FormatError("token_bits is " + str(info_.token_bits) + ", vocabulary size " + str(info_.vocab_size) +
                               " implies " + str(format::token_bits_for(info_.vocab_size)));
  }
  if (info_.n_keys >= UINT32_MAX || info_.n_followers >= UINT32_MAX || info_.n_overflow > info_.n_followers ||
      info_.n_keys > info_.n_followers) {
    return Status::FormatError("counts out of range: " + str(info_.n_keys) + " keys, " + str(info_.n_followers) +
                               " followers, " + str(info_.n_overflow) + " overflow counts");
  }
  if (info_.file_size != size_) {
    // Name the section the file ends in, so a truncated download is easy to recognise.
    std::string where;
    for (uint32_t i = 0; i < n_sections; ++i) {
      const uint8_t* e = h + format::kHeaderSize + i * format::kSectionEntrySize;
      const uint64_t o = read_le<uint64_t>(e + 8), l = read_le<uint64_t>(e + 16);
      if (size_ < o + l) {
        where = ", inside or before section " + std::string(format::section_name(read_le<uint32_t>(e))) + " (bytes " +
                str(o) + ".." + str(o + l) + ")";
        break;
      }
    }
    return Status::FormatError("truncated or padded: the header says " + str(info_.file_size) +
                               " bytes, the file has " + str(size_) + where);
  }

  uint64_t prev_end = table_end;
  for (uint32_t i = 0; i < n_sections; ++i) {
    const uint8_t* e = h + format::kHeaderSize + i * format::kSectionEntrySize;
    SectionInfo& s = info_.sections[i];
    s.id = read_le<uint32_t>(e);
    s.offset = read_le<uint64_t>(e + 8);
    s.length = read_le<uint64_t>(e + 16);
    s.checksum = read_le<uint64_t>(e + 24);
    const std::string name = format::section_name(i + 1);
    if (s.id != i + 1) {
      return Status::FormatError("section " + str(i) + " has id " + str(s.id) + ", expected " + str(i + 1) + " (" +
                                 name + ")");
    }
    if (s.offset % 8 != 0) {
      return Status::FormatError("section " + name + " is misaligned: offset " + str(s.offset) +
                                 " is not a multiple of 8");
    }
    if (s.offset < prev_end) {
      return Status::FormatError("section " + name + " at offset " + str(s.offset) +
                                 " overlaps what precedes it (ends at " + str(prev_end) + ")");
    }
    if (s.offset > size_ || s.length > size_ - s.offset) {
      return Status::FormatError("section " + name + " (offset " + str(s.offset) + ", length " + str(s.length) +
                                 ") extends past the end of the file (" + str(size_) + " bytes)");
    }
    if (s.id == format::kText || s.id == format::kSuffixes) {
      // Their counts are their lengths (the header has no field for them).
      if (s.length % 4 != 0 || s.length / 4 >= format::kSeparator) {
        return Status::FormatError("section " + name + " is " + str(s.length) +
                                   " bytes: not a whole number of entries below 2^32 - 1");
      }
      (s.id == format::kText ? info_.n_text : info_.n_suffixes) = s.length / 4;
      if (s.id == format::kSuffixes && info_.n_suffixes > info_.n_text) {
        return Status::FormatError("SUFFIXES has " + str(info_.n_suffixes) + " entries, more than TEXT's " +
                                   str(info_.n_text));
      }
      if ((info_.index_depth == 0) != (s.length == 0)) {
        return Status::FormatError("section " + name + " is " + str(s.length) + " bytes but the index depth is " +
                                   str(info_.index_depth) + " (both or neither must be zero)");
      }
    }
    const uint64_t want = expected_length(s.id, info_);
    if (s.length != want) {
      return Status::FormatError("section " + name + " is " + str(s.length) + " bytes, the header counts imply " +
                                 str(want));
    }
    prev_end = s.offset + s.length;
  }

  count_bits_ = 32 - info_.token_bits;
  count_escape_ = (count_bits_ >= 32) ? UINT32_MAX : ((1u << count_bits_) - 1);
  auto ptr = [&](int idx) { return reinterpret_cast<const uint32_t*>(base_ + info_.sections[idx].offset); };
  rows_ = ptr(0);
  keys_ = ptr(1);
  starts_ = ptr(2);
  totals_ = ptr(3);
  followers_ = ptr(4);
  overflow_ = ptr(5);
  if (info_.index_depth > 0) {
    corpus_.text = ptr(6);
    corpus_.n_text = info_.n_text;
    corpus_.suffixes = ptr(7);
    corpus_.n_suffixes = info_.n_suffixes;
    corpus_.buckets = ptr(8);
    corpus_.vocab = info_.vocab_size;
    corpus_.depth = info_.index_depth;
  }
  return Status::Ok();
}

FindResult StaticCache::find(const Token* key, StaticPart* out) const {
  const uint32_t t0 = static_cast<uint32_t>(key[0]);
  if (t0 >= info_.vocab_size) return FindResult::kNotFound;
  uint32_t lo = rows_[t0];
  uint32_t hi = rows_[t0 + 1];
  if (lo > hi || hi > info_.n_keys) return FindResult::kCorrupt;
  const uint32_t w = info_.ngram_size - 1;  // tokens per KEYS record
  uint32_t idx;
  if (w == 0) {
    if (lo == hi) return FindResult::kNotFound;
    idx = lo;
  } else {
    // Branch-light lower bound over the row's records, compared lexicographically.
    const uint32_t* rec = keys_;
    auto less = [&](uint32_t i) {
      const uint32_t* r = rec + static_cast<uint64_t>(i) * w;
      for (uint32_t j = 0; j < w; ++j) {
        const uint32_t a = r[j], b = static_cast<uint32_t>(key[1 + j]);
        if (a != b) return a < b;
      }
      return false;
    };
    uint32_t n = hi - lo;
    if (n == 0) return FindResult::kNotFound;
    uint32_t base = lo;
    while (n > 1) {
      const uint32_t half = n / 2;
      // Both candidates of the next step, fetched while this comparison waits on memory:
      // long rows (most look-ups land in rows of hundreds of keys) then cost about half
      // the sequential misses.
      __builtin_prefetch(rec + static_cast<uint64_t>(base + half / 2) * w);
      __builtin_prefetch(rec + static_cast<uint64_t>(base + half + half / 2) * w);
      base = less(base + half) ? base + half : base;
      n -= half;
    }
    base += less(base) ? 1 : 0;
    if (base >= hi) return FindResult::kNotFound;
    const uint32_t* r = rec + static_cast<uint64_t>(base) * w;
    for (uint32_t j = 0; j < w; ++j) {
      if (r[j] != static_cast<uint32_t>(key[1 + j])) return FindResult::kNotFound;
    }
    idx = base;
  }
  const uint32_t b = starts_[idx], e = starts_[idx + 1];
  if (b >= e || e > info_.n_followers) return FindResult::kCorrupt;
  out->followers = followers_ + b;
  out->size = e - b;
  out->total = totals_[idx];
  out->first = b;
  return FindResult::kFound;
}

uint32_t StaticCache::count_at(const StaticPart& part, uint32_t j) const {
  const uint32_t field = part.followers[j] & count_escape_;
  if (field != count_escape_) return field;
  // Rare: a count too large for its field lives in OVERFLOW, sorted by follower index.
  const uint32_t target = part.first + j;
  uint64_t lo = 0, hi = info_.n_overflow;
  while (lo < hi) {
    const uint64_t mid = (lo + hi) / 2;
    if (overflow_[2 * mid] < target)
      lo = mid + 1;
    else
      hi = mid;
  }
  if (lo < info_.n_overflow && overflow_[2 * lo] == target) return overflow_[2 * lo + 1];
  return field;  // damaged file: the escape value is still a valid, bounded count
}

uint32_t StaticCache::count_of(const StaticPart& part, Token token) const {
  const uint32_t t = static_cast<uint32_t>(token);
  if (t >= info_.vocab_size) return 0;
  if (token_at(part, 0) == token) return count_at(part, 0);
  // Followers [1, size) are sorted by token: branch-light lower bound on the packed words.
  const uint32_t* f = part.followers + 1;
  uint32_t n = part.size - 1;
  if (n == 0) return 0;
  const uint32_t probe = t << count_bits_;
  const uint32_t* base = f;
  while (n > 1) {
    const uint32_t half = n / 2;
    base = (base[half] < probe) ? base + half : base;
    n -= half;
  }
  base += (*base < probe) ? 1 : 0;
  if (base < f + (part.size - 1) && (*base >> count_bits_) == t) {
    return count_at(part, static_cast<uint32_t>(base - part.followers));
  }
  return 0;
}

Status StaticCache::key_at(uint64_t i, NGram* key, StaticPart* part) const {
  if (i >= info_.n_keys) return Status::InvalidArgument("key index " + str(i) + " out of range");
  // The first token is the row that holds key i: binary search in ROWS.
  uint64_t lo = 0, hi = info_.vocab_size;  // find the last t with rows_[t] <= i
  while (hi - lo > 1) {
    const uint64_t mid = (lo + hi) / 2;
    if (rows_[mid] <= i)
      lo = mid;
    else
      hi = mid;
  }
  NGram g;
  g.tokens[0] = static_cast<Token>(lo);
  for (uint32_t j = 0; j + 1 < info_.ngram_size; ++j)
    g.tokens[1 + j] = static_cast<Token>(keys_[i * (info_.ngram_size - 1) + j]);
  const uint32_t b = starts_[i], e = starts_[i + 1];
  if (b >= e || e > info_.n_followers) return Status::FormatError("STARTS of key " + str(i) + " is out of range");
  *key = g;
  *part = StaticPart{followers_ + b, e - b, totals_[i], b};
  return Status::Ok();
}

Status StaticCache::verify() const {
  for (uint32_t i = 0; i < info_.n_sections; ++i) {
    const SectionInfo& s = info_.sections[i];
    if (checksum64(base_ + s.offset, s.length) != s.checksum) {
      return Status::FormatError(std::string("checksum mismatch in section ") + format::section_name(s.id) +
                                 ": the file is corrupt");
    }
  }
  // Structure: rows monotone, keys sorted within rows, followers well formed.
  const uint32_t V = info_.vocab_size, w = info_.ngram_size - 1;
  if (rows_[0] != 0 || rows_[V] != info_.n_keys) return Status::FormatError("ROWS does not span all keys");
  // Monotone everywhere first: with ROWS[V] == K that bounds every row by K before any key
  // is read (a row past K followed by a lower one would read KEYS out of bounds).
  for (uint32_t t = 0; t < V; ++t) {
    if (rows_[t] > rows_[t + 1]) return Status::FormatError("ROWS is not monotone at token " + str(t));
  }
  for (uint32_t t = 0; t < V; ++t) {
    for (uint32_t i = rows_[t]; i < rows_[t + 1]; ++i) {
      for (uint32_t j = 0; j < w; ++j) {
        if (keys_[uint64_t{i} * w + j] >= V)
          return Status::FormatError("key " + str(i) + " has a token outside the vocabulary");
      }
      if (i > rows_[t] && !std::lexicographical_compare(keys_ + uint64_t{i - 1} * w, keys_ + uint64_t{i} * w,
                                                        keys_ + uint64_t{i} * w, keys_ + uint64_t{i + 1} * w)) {
        return Status::FormatError("keys of row " + str(t) + " are not strictly sorted");
      }
    }
  }
  if (starts_[0] != 0 || starts_[info_.n_keys] != info_.n_followers)
    return Status::FormatError("STARTS does not span all followers");
  uint64_t prev_overflow = 0;
  for (uint64_t k = 0; k < info_.n_overflow; ++k) {
    const uint32_t idx = overflow_[2 * k];
    if (idx >= info_.n_followers || (k > 0 && idx <= prev_overflow))
      return Status::FormatError("OVERFLOW is not sorted or out of range");
    if ((followers_[idx] & count_escape_) != count_escape_)
      return Status::FormatError("OVERFLOW names a follower without the escape count");
    prev_overflow = idx;
  }
  for (uint64_t i = 0; i < info_.n_keys; ++i) {
    const uint32_t b = starts_[i], e = starts_[i + 1];
    if (b >= e || e > info_.n_followers)
      return Status::FormatError("key " + str(i) + " has no followers or they are out of range");
    StaticPart part{followers_ + b, e - b, totals_[i], b};
    uint64_t total = 0;
    uint32_t best = 0;
    for (uint32_t j = 0; j < part.size; ++j) {
      const uint32_t tok = part.followers[j] >> count_bits_;
      const uint32_t c = count_at(part, j);
      if (tok >= V) return Status::FormatError("follower of key " + str(i) + " is outside the vocabulary");
      if (c == 0) return Status::FormatError("follower of key " + str(i) + " has count 0");
      if (j >= 2 && (part.followers[j - 1] >> count_bits_) >= tok) {
        return Status::FormatError("followers of key " + str(i) + " are not sorted by token");
      }
      if (j >= 1) {
        const uint32_t t_best = part.followers[0] >> count_bits_;
        if (tok == t_best) return Status::FormatError("key " + str(i) + " lists its best follower twice");
        if (c > count_at(part, 0) || (c == count_at(part, 0) && tok < t_best)) {
          return Status::FormatError("the first follower of key " + str(i) + " is not its best");
        }
      }
      total += c;
      best = std::max(best, c);
    }
    if (std::min<uint64_t>(total, UINT32_MAX) != part.total)
      return Status::FormatError("TOTALS of key " + str(i) + " is wrong");
  }
  return verify_corpus();
}

Status StaticCache::verify_corpus() const {
  const CorpusIndex& c = corpus_;
  if (c.empty()) return Status::Ok();
  const uint32_t V = info_.vocab_size;
  uint64_t n_tokens = 0;
  for (uint64_t p = 0; p < c.n_text; ++p) {
    if (c.text[p] == format::kSeparator) continue;
    if (c.text[p] >= V) return Status::FormatError("TEXT[" + str(p) + "] is outside the vocabulary");
    ++n_tokens;
  }
  if (n_tokens != c.n_suffixes) return Status::FormatError("SUFFIXES does not have one entry per TEXT token");
  if (c.buckets[0] != 0 || c.buckets[V] != c.n_suffixes) return Status::FormatError("BUCKETS does not span SUFFIXES");
  for (uint32_t t = 0; t < V; ++t) {
    if (c.buckets[t] > c.buckets[t + 1]) return Status::FormatError("BUCKETS is not monotone at token " + str(t));
  }
  // Each position once (a bitmap), in its bucket, and not before the one before it over the
  // first D tokens (entries equal over those may come in any order).
  std::vector<uint64_t> seen((c.n_text + 63) / 64, 0);
  uint32_t t = 0;
  for (uint64_t i = 0; i < c.n_suffixes; ++i) {
    const uint32_t p = c.suffixes[i];
    if (p >= c.n_text || c.text[p] == format::kSeparator)
      return Status::FormatError("SUFFIXES[" + str(i) + "] is not a token position");
    if (seen[p / 64] >> (p % 64) & 1) return Status::FormatError("SUFFIXES lists position " + str(p) + " twice");
    seen[p / 64] |= uint64_t{1} << (p % 64);
    while (i >= c.buckets[t + 1]) ++t;  // terminates: buckets[V] == n_suffixes > i
    if (c.text[p] != t) return Status::FormatError("SUFFIXES[" + str(i) + "] is outside its bucket");
    if (i == c.buckets[t]) continue;
    const uint32_t q = c.suffixes[i - 1];
    int order = 0;  // of q against p over the first D tokens read backwards
    for (uint32_t j = 0; j < c.depth && order == 0; ++j) {
      const uint32_t a = c.at(int64_t{q} - j), b = c.at(int64_t{p} - j);
      if (a != b) order = a < b ? -1 : 1;
      if (a == format::kSeparator && b == format::kSeparator) break;  // equal: both ended
    }
    if (order > 0) return Status::FormatError("SUFFIXES is not sorted at entry " + str(i));
  }
  return Status::Ok();
}

}  // namespace ngc

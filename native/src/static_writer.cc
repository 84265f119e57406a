#include "ngc/static_writer.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "ngc/checksum.h"
#include "ngc/file_util.h"

namespace ngc {
namespace {

std::string str(uint64_t v) { return std::to_string(v); }

template <typename T>
void put_le(uint8_t* p, T v) {
  std::memcpy(p, &v, sizeof(T));
}

}  // namespace

Status StaticWriter::Spill::open(const std::string& folder) {
  dir = folder;
  NGC_RETURN_IF_ERROR(open_scratch_file(dir, &fd));
  buf.reserve(kFlushBytes + 8);
  return Status::Ok();
}

Status StaticWriter::Spill::flush() {
  if (buf.empty()) return Status::Ok();
  sum.update(buf.data(), buf.size());
  bytes += buf.size();
  Status s = write_all(fd, buf.data(), buf.size(), "a scratch file in " + dir);
  buf.clear();
  return s;
}

StaticWriter::Spill::~Spill() {
  if (fd >= 0) ::close(fd);
}

Status StaticWriter::create(const std::string& path, const StaticHeader& header, std::unique_ptr<StaticWriter>* out) {
  if (header.ngram_size < 1 || header.ngram_size > kNgramMax) {
    return Status::InvalidArgument("ngram_size must be in 1..4, got " + str(header.ngram_size));
  }
  if (header.vocab_size < 1 || header.vocab_size > format::kMaxVocab) {
    return Status::InvalidArgument("vocab_size must be in 1..2^24, got " + str(header.vocab_size));
  }
  std::unique_ptr<StaticWriter> w(new StaticWriter());
  w->path_ = path;
  w->header_ = header;
  w->count_bits_ = 32 - format::token_bits_for(header.vocab_size);
  w->escape_ = (1u << w->count_bits_) - 1;
  w->rows_.assign(uint64_t{header.vocab_size} + 1, 0);
  for (Spill& s : w->spills_) NGC_RETURN_IF_ERROR(s.open(dir_of(path)));
  NGC_RETURN_IF_ERROR(w->spills_[1].append_u32(0));  // STARTS[0]
  *out = std::move(w);
  return Status::Ok();
}

StaticWriter::~StaticWriter() = default;

Status StaticWriter::add(const Token* key, const Follower* followers, size_t n) {
  const uint32_t k = header_.ngram_size, V = header_.vocab_size;
  NGram g = NGram::from(key, static_cast<int>(k));
  for (uint32_t i = 0; i < k; ++i) {
    if (key[i] < 0 || static_cast<uint32_t>(key[i]) >= V) {
      return Status::InvalidArgument("key token " + str(static_cast<uint32_t>(key[i])) +
                                     " is outside the vocabulary (size " + str(V) + ")");
    }
  }
  if (has_prev_ && !std::lexicographical_compare(prev_.tokens, prev_.tokens + k, g.tokens, g.tokens + k)) {
    return Status::InvalidArgument("keys must be added in strictly increasing order");
  }
  if (n == 0) return Status::InvalidArgument("a key needs at least one follower");
  if (n_followers_ + n >= UINT32_MAX || n_keys_ + 1 >= UINT32_MAX) {
    return Status::OutOfRange("more than 2^32-1 keys or followers do not fit format version 1");
  }
  size_t best = 0;
  uint64_t total = 0;
  for (size_t j = 0; j < n; ++j) {
    const Follower& f = followers[j];
    if (f.token < 0 || static_cast<uint32_t>(f.token) >= V) {
      return Status::InvalidArgument("follower token " + str(static_cast<uint32_t>(f.token)) +
                                     " is outside the vocabulary (size " + str(V) + ")");
    }
    if (f.count == 0) return Status::InvalidArgument("follower counts must be > 0");
    if (j > 0 && followers[j - 1].token >= f.token)
      return Status::InvalidArgument("followers must be sorted by token and unique");
    if (f.count > followers[best].count) best = j;  // strict: the lowest token wins ties
    total += f.count;
  }
  Spill& keys = spills_[0];
  Spill& starts = spills_[1];
  Spill& totals = spills_[2];
  Spill& fol = spills_[3];
  Spill& overflow = spills_[4];
  auto push = [&](const Follower& f) -> Status {
    const uint32_t field = f.count >= escape_ ? escape_ : f.count;
    if (field == escape_) {
      NGC_RETURN_IF_ERROR(overflow.append_u32(static_cast<uint32_t>(n_followers_)));
      NGC_RETURN_IF_ERROR(overflow.append_u32(f.count));
      ++n_overflow_;
    }
    ++n_followers_;
    return fol.append_u32((static_cast<uint32_t>(f.token) << count_bits_) | field);
  };
  NGC_RETURN_IF_ERROR(push(followers[best]));
  for (size_t j = 0; j < n; ++j) {
    if (j != best) NGC_RETURN_IF_ERROR(push(followers[j]));
  }
  rows_[static_cast<uint32_t>(key[0])] += 1;
  for (uint32_t i = 1; i < k; ++i) NGC_RETURN_IF_ERROR(keys.append_u32(static_cast<uint32_t>(key[i])));
  NGC_RETURN_IF_ERROR(totals.append_u32(static_cast<uint32_t>(std::min<uint64_t>(total, UINT32_MAX))));
  NGC_RETURN_IF_ERROR(starts.append_u32(static_cast<uint32_t>(n_followers_)));
  ++n_keys_;
  prev_ = g;
  has_prev_ = true;
  return Status::Ok();
}

Status StaticWriter::finish() {
  // ROWS holds counts per first token; turn them into start offsets.
  uint32_t acc = 0;
  for (uint32_t& r : rows_) {
    const uint32_t c = r;
    r = acc;
    acc += c;
  }
  for (Spill& s : spills_) NGC_RETURN_IF_ERROR(s.flush());
  const bool indexed = depth_ > 0;
  if (indexed) {
    if (depth_ > format::kMaxIndexDepth || text_.size() >= format::kSeparator || suffixes_.empty() ||
        suffixes_.size() > text_.size() || buckets_.size() != uint64_t{header_.vocab_size} + 1 ||
        buckets_.back() != suffixes_.size()) {
      return Status::InvalidArgument("the corpus index is malformed (depth " + str(depth_) + ", " + str(text_.size()) +
                                     " text entries, " + str(suffixes_.size()) + " suffixes)");
    }
  }
  const uint32_t n_sections = indexed ? format::kNumSections : format::kNumSectionsV1;
  const std::vector<uint32_t>* in_memory[format::kNumSections] = {&rows_,  nullptr, nullptr,    nullptr,  nullptr,
                                                                  nullptr, &text_,  &suffixes_, &buckets_};
  uint64_t lengths[format::kNumSections] = {};
  uint64_t sums[format::kNumSections] = {};
  for (uint32_t i = 0; i < n_sections; ++i) {
    if (in_memory[i]) {
      lengths[i] = in_memory[i]->size() * 4ull;
      sums[i] = checksum64(in_memory[i]->data(), lengths[i]);
    } else {
      lengths[i] = spills_[i - 1].bytes;
      sums[i] = spills_[i - 1].sum.digest();
    }
  }

  const uint64_t table_end = uint64_t{format::kHeaderSize} + n_sections * format::kSectionEntrySize;
  uint8_t head[format::kHeaderSize + format::kNumSections * format::kSectionEntrySize] = {};
  uint64_t offsets[format::kNumSections];
  uint64_t pos = table_end;
  for (uint32_t i = 0; i < n_sections; ++i) {
    pos = (pos + 7) & ~uint64_t{7};
    offsets[i] = pos;
    pos += lengths[i];
  }
  const uint64_t file_size = pos;

  std::memcpy(head + format::off::kMagic, format::kMagic, 8);
  put_le<uint32_t>(head + format::off::kVersion, indexed ? format::kVersion : format::kVersionNoIndex);
  put_le<uint32_t>(head + format::off::kEndian, format::kEndianMarker);
  put_le<uint32_t>(head + format::off::kHeaderSize, format::kHeaderSize);
  put_le<uint32_t>(head + format::off::kNgramSize, header_.ngram_size);
  put_le<uint32_t>(head + format::off::kVocabSize, header_.vocab_size);
  put_le<uint32_t>(head + format::off::kNumSections, n_sections);
  std::memcpy(head + format::off::kFingerprint, header_.fingerprint, format::kFingerprintSize);
  put_le<uint64_t>(head + format::off::kGeneration, header_.generation);
  put_le<uint64_t>(head + format::off::kNumKeys, n_keys_);
  put_le<uint64_t>(head + format::off::kNumFollowers, n_followers_);
  put_le<uint64_t>(head + format::off::kNumTokens, header_.n_tokens);
  put_le<uint64_t>(head + format::off::kNumOverflow, n_overflow_);
  put_le<uint32_t>(head + format::off::kTokenBits, 32 - count_bits_);
  put_le<uint32_t>(head + format::off::kFlags, depth_);  // version 1: 0
  put_le<uint64_t>(head + format::off::kFileSize, file_size);
  for (uint32_t i = 0; i < n_sections; ++i) {
    uint8_t* e = head + format::kHeaderSize + i * format::kSectionEntrySize;
    put_le<uint32_t>(e, i + 1);
    put_le<uint64_t>(e + 8, offsets[i]);
    put_le<uint64_t>(e + 16, lengths[i]);
    put_le<uint64_t>(e + 24, sums[i]);
  }
  put_le<uint64_t>(head + format::off::kHeaderChecksum, checksum64(head, table_end));

  std::unique_ptr<AtomicFile> out;
  NGC_RETURN_IF_ERROR(AtomicFile::create(path_, &out));
  NGC_RETURN_IF_ERROR(out->write(head, table_end));
  uint64_t written = table_end;
  static const uint8_t zeros[8] = {};
  std::vector<uint8_t> chunk(4 << 20);
  for (uint32_t i = 0; i < n_sections; ++i) {
    if (offsets[i] > written) NGC_RETURN_IF_ERROR(out->write(zeros, offsets[i] - written));
    if (in_memory[i]) {
      if (lengths[i] > 0) NGC_RETURN_IF_ERROR(out->write(in_memory[i]->data(), lengths[i]));
    } else {
      const int in = spills_[i - 1].fd;
      uint64_t left = lengths[i];
      if (::lseek(in, 0, SEEK_SET) != 0)
        return Status::IoError(std::string("cannot rewind a scratch file: ") + std::strerror(errno));
      while (left > 0) {
        const ssize_t r = ::read(in, chunk.data(), std::min<uint64_t>(chunk.size(), left));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) {
          return Status::IoError(std::string("cannot read back a scratch file: ") +
                                 (r < 0 ? std::strerror(errno) : "short read"));
        }
        NGC_RETURN_IF_ERROR(out->write(chunk.data(), static_cast<size_t>(r)));
        left -= static_cast<uint64_t>(r);
      }
    }
    written = offsets[i] + lengths[i];
  }
  return out->commit();  // fsync, rename onto path_, fsync the directory
}

}  // namespace ngc

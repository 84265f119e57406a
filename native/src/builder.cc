#include "ngc/builder.h"

#include <functional>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <queue>
#include <thread>
#include <vector>

#include "ngc/file_util.h"
#include "ngc/match.h"

namespace ngc {
namespace {

std::string str(uint64_t v) { return std::to_string(v); }

constexpr size_t kIoBuffer = 1 << 20;  // bytes buffered per run file, reading or writing

// A run on disk: (Word pair, uint64_t count) records sorted by pair, in an unlinked file.
template <typename Word>
struct Record {
  Word pair;
  uint64_t count;
};

class ScratchFile {
 public:
  ~ScratchFile() {
    if (fd_ >= 0) ::close(fd_);
  }
  Status open(const std::string& dir) {
    dir_ = dir;
    return open_scratch_file(dir, &fd_);
  }
  Status write(const void* data, size_t n) {
    NGC_RETURN_IF_ERROR(write_all(fd_, data, n, "a sorted run to scratch space in " + dir_));
    bytes_ += n;
    return Status::Ok();
  }
  // Reads up to n bytes from `offset`; returns bytes read (0 at the end) or -1.
  ssize_t read_at(void* data, size_t n, uint64_t offset) const {
    for (;;) {
      const ssize_t r = ::pread(fd_, data, n, static_cast<off_t>(offset));
      if (r < 0 && errno == EINTR) continue;
      return r;
    }
  }
  uint64_t bytes() const { return bytes_; }

 private:
  int fd_ = -1;  // owned; the file is unlinked at once, so it has no name
  uint64_t bytes_ = 0;
  std::string dir_;  // its folder, for error messages
};

// Appends records to a scratch file through a buffer, summing equal consecutive pairs.
template <typename Word>
class RunWriter {
 public:
  explicit RunWriter(ScratchFile* file) : file_(file) { buf_.reserve(kIoBuffer / sizeof(Record<Word>)); }
  Status add(Word pair, uint64_t count) {
    if (has_ && pair == cur_.pair) {
      cur_.count += count;
      return Status::Ok();
    }
    if (has_) {
      buf_.push_back(cur_);
      if (buf_.size() == buf_.capacity()) NGC_RETURN_IF_ERROR(flush());
    }
    cur_ = {pair, count};
    has_ = true;
    return Status::Ok();
  }
  Status close() {
    if (has_) buf_.push_back(cur_);
    has_ = false;
    return flush();
  }

 private:
  Status flush() {
    Status s = file_->write(buf_.data(), buf_.size() * sizeof(Record<Word>));
    buf_.clear();
    return s;
  }
  ScratchFile* file_;
  std::vector<Record<Word>> buf_;
  Record<Word> cur_{};
  bool has_ = false;
};

// A sorted source of (pair, count) for the merge.
template <typename Word>
class Source {
 public:
  virtual ~Source() = default;
  // Loads the next record into head(); returns false at the end (or on error(), checked after).
  virtual bool next() = 0;
  const Record<Word>& head() const { return head_; }
  virtual Status error() const { return Status::Ok(); }

 protected:
  Record<Word> head_{};
};

// A sorted slice of the in-memory buffer: every element counts once.
template <typename Word>
class SliceSource : public Source<Word> {
 public:
  SliceSource(const Word* begin, const Word* end) : p_(begin), end_(end) {}
  bool next() override {
    if (p_ == end_) return false;
    const Word w = *p_;
    const Word* q = p_;
    while (q != end_ && *q == w) ++q;
    this->head_ = {w, static_cast<uint64_t>(q - p_)};
    p_ = q;
    return true;
  }

 private:
  const Word* p_;
  const Word* end_;
};

// Weighted records held in memory, sorted.
template <typename Word>
class RecordSource : public Source<Word> {
 public:
  explicit RecordSource(const std::vector<Record<Word>>& v) : v_(v) {}
  bool next() override {
    if (i_ == v_.size()) return false;
    this->head_ = v_[i_++];
    return true;
  }

 private:
  const std::vector<Record<Word>>& v_;
  size_t i_ = 0;
};

template <typename Word>
class FileSource : public Source<Word> {
 public:
  explicit FileSource(const ScratchFile* f) : f_(f), buf_(kIoBuffer / sizeof(Record<Word>)) {}
  bool next() override {
    if (i_ == n_) {
      const ssize_t r = f_->read_at(buf_.data(), buf_.size() * sizeof(Record<Word>), offset_);
      if (r < 0) {
        error_ = Status::IoError(std::string("cannot read a run back: ") + std::strerror(errno));
        return false;
      }
      if (r % sizeof(Record<Word>) != 0) {
        error_ = Status::IoError("a run file was cut short");
        return false;
      }
      offset_ += static_cast<uint64_t>(r);
      n_ = static_cast<size_t>(r) / sizeof(Record<Word>);
      i_ = 0;
      if (n_ == 0) return false;
    }
    this->head_ = buf_[i_++];
    return true;
  }
  Status error() const override { return error_; }

 private:
  const ScratchFile* f_;
  std::vector<Record<Word>> buf_;
  size_t i_ = 0, n_ = 0;
  uint64_t offset_ = 0;
  Status error_;
};

// Merges sorted sources, calling emit(pair, summed count) once per distinct pair in order.
template <typename Word, typename Emit>
Status merge_sources(std::vector<std::unique_ptr<Source<Word>>>& sources, Emit&& emit) {
  auto cmp = [&](size_t a, size_t b) { return sources[a]->head().pair > sources[b]->head().pair; };
  std::priority_queue<size_t, std::vector<size_t>, decltype(cmp)> heap(cmp);
  for (size_t i = 0; i < sources.size(); ++i) {
    if (sources[i]->next()) heap.push(i);
    NGC_RETURN_IF_ERROR(sources[i]->error());
  }
  bool has = false;
  Record<Word> cur{};
  while (!heap.empty()) {
    const size_t i = heap.top();
    heap.pop();
    const Record<Word>& r = sources[i]->head();
    if (has && r.pair == cur.pair) {
      cur.count += r.count;
    } else {
      if (has) NGC_RETURN_IF_ERROR(emit(cur.pair, cur.count));
      cur = r;
      has = true;
    }
    if (sources[i]->next()) heap.push(i);
    NGC_RETURN_IF_ERROR(sources[i]->error());
  }
  if (has) NGC_RETURN_IF_ERROR(emit(cur.pair, cur.count));
  return Status::Ok();
}

template <typename Word>
class BuilderImpl : public Builder {
 public:
  BuilderImpl(const BuilderOptions& o, const std::string& path, uint32_t bits, size_t capacity,
              size_t weighted_capacity)
      : opt_(o), path_(path), bits_(bits), k_(o.header.ngram_size) {
    scratch_ = o.scratch_dir.empty() ? dir_of(path) : o.scratch_dir;
    threads_ = o.threads > 0 ? o.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
    buf_.reserve(capacity);
    weighted_capacity_ = weighted_capacity;
    pair_mask_ = (k_ + 1) * bits_ >= sizeof(Word) * 8 ? ~Word{0} : ((Word{1} << ((k_ + 1) * bits_)) - 1);
  }

  const BuilderOptions& options() const override { return opt_; }

  void begin_stream() override {
    in_stream_ = 0;
    window_ = 0;
    ++stats_.n_streams;
    if (!text_.empty() && text_.back() != format::kSeparator) text_.push_back(format::kSeparator);
  }

  void set_index_capacity(uint64_t tokens) {
    index_capacity_ = tokens;
    text_.reserve(std::min<uint64_t>(tokens, uint64_t{1} << 24));
  }

  Status add_index_tokens(const Token* data, size_t n) override {
    const uint32_t V = opt_.header.vocab_size;
    for (size_t i = 0; i < n; ++i) {
      if (static_cast<uint32_t>(data[i]) >= V) {  // also catches negatives
        return Status::InvalidArgument("token " + std::to_string(data[i]) + " at index text position " + str(i) +
                                       " is outside the vocabulary [0, " + str(V) + ")");
      }
    }
    if (!opt_.corpus_index || n == 0) return Status::Ok();
    if (!text_.empty() && text_.back() != format::kSeparator) text_.push_back(format::kSeparator);
    const uint64_t room = index_capacity_ > text_.size() ? index_capacity_ - text_.size() : 0;
    const size_t take = static_cast<size_t>(std::min<uint64_t>(room, n));
    for (size_t i = 0; i < take; ++i) text_.push_back(static_cast<uint32_t>(data[i]));
    stats_.n_indexed += take;
    stats_.n_not_indexed += n - take;
    return Status::Ok();
  }

  Status add_tokens(const Token* data, size_t n) override {
    const uint32_t V = opt_.header.vocab_size;
    for (size_t i = 0; i < n; ++i) {
      if (static_cast<uint32_t>(data[i]) >= V) {  // also catches negatives
        return Status::InvalidArgument("token " + std::to_string(data[i]) + " at stream position " +
                                       str(in_stream_ + i) + " is outside the vocabulary [0, " + str(V) + ")");
      }
    }
    stats_.n_tokens += n;
    if (opt_.corpus_index) {
      // The index keeps whole tokens up to its share; separators count against it too.
      const uint64_t room = index_capacity_ > text_.size() ? index_capacity_ - text_.size() : 0;
      const size_t take = static_cast<size_t>(std::min<uint64_t>(room, n));
      for (size_t i = 0; i < take; ++i) text_.push_back(static_cast<uint32_t>(data[i]));
      stats_.n_indexed += take;
      stats_.n_not_indexed += n - take;
    }
    const uint64_t before = in_stream_;
    for (size_t i = 0; i < n; ++i) {
      window_ = ((window_ << bits_) | static_cast<Word>(static_cast<uint32_t>(data[i]))) & pair_mask_;
      if (++in_stream_ > k_) {
        buf_.push_back(window_);
        if (buf_.size() == buf_.capacity()) NGC_RETURN_IF_ERROR(spill());
      }
    }
    stats_.n_pairs += (in_stream_ > k_ ? in_stream_ - k_ : 0) - (before > k_ ? before - k_ : 0);
    return Status::Ok();
  }

  Status add_count(const Token* key, Token follower, uint64_t count) override {
    const uint32_t V = opt_.header.vocab_size;
    Word w = 0;
    for (uint32_t i = 0; i <= k_; ++i) {
      const Token t = i < k_ ? key[i] : follower;
      if (static_cast<uint32_t>(t) >= V) {
        return Status::InvalidArgument("token " + std::to_string(t) + " is outside the vocabulary [0, " + str(V) + ")");
      }
      w = (w << bits_) | static_cast<Word>(static_cast<uint32_t>(t));
    }
    if (count == 0) return Status::InvalidArgument("counts must be > 0");
    if (weighted_.capacity() < weighted_capacity_) weighted_.reserve(weighted_capacity_);
    weighted_.push_back({w, count});
    stats_.n_pairs += count;
    if (weighted_.size() >= weighted_capacity_) NGC_RETURN_IF_ERROR(spill());
    return Status::Ok();
  }

  Status finish() override {
    CorpusArrays index;
    if (opt_.corpus_index) {
      while (!text_.empty() && text_.back() == format::kSeparator) text_.pop_back();
      if (stats_.n_indexed > 0) build_corpus_index(text_, opt_.header.vocab_size, opt_.index_depth, &index);
      NGC_RETURN_IF_ERROR(poll());
    }
    sort_buffer();
    sort_weighted();
    // Too many runs for one merge: merge them in groups into longer runs first.
    const size_t fan_in = static_cast<size_t>(opt_.max_fan_in);
    while (runs_.size() > fan_in) {
      std::vector<std::unique_ptr<Source<Word>>> group;
      for (size_t i = 0; i < fan_in; ++i) group.push_back(std::make_unique<FileSource<Word>>(runs_[i].get()));
      auto merged = std::make_unique<ScratchFile>();
      NGC_RETURN_IF_ERROR(merged->open(scratch_));
      RunWriter<Word> w(merged.get());
      NGC_RETURN_IF_ERROR(merge_sources<Word>(group, [&](Word p, uint64_t c) {
        NGC_RETURN_IF_ERROR(poll());
        return w.add(p, c);
      }));
      NGC_RETURN_IF_ERROR(w.close());
      group.clear();
      runs_.erase(runs_.begin(), runs_.begin() + fan_in);
      ++merge_passes_;
      runs_.push_back(std::move(merged));
    }
    std::vector<std::unique_ptr<Source<Word>>> sources;
    for (const auto& r : runs_) sources.push_back(std::make_unique<FileSource<Word>>(r.get()));
    add_memory_sources(&sources);

    StaticHeader h = opt_.header;
    h.n_tokens = tokens_unknown_ ? 0 : stats_.n_tokens;
    std::unique_ptr<StaticWriter> writer;
    NGC_RETURN_IF_ERROR(StaticWriter::create(path_, h, &writer));
    const Word token_mask = (Word{1} << bits_) - 1;
    std::vector<Follower> followers;
    Token key[kNgramMax];
    bool has_key = false;
    Word cur_key = 0;
    auto flush_key = [&]() -> Status {
      for (uint32_t t = 0; t < k_; ++t) key[t] = static_cast<Token>((cur_key >> (bits_ * (k_ - 1 - t))) & token_mask);
      Status s = writer->add(key, followers.data(), followers.size());
      followers.clear();
      return s;
    };
    NGC_RETURN_IF_ERROR(merge_sources<Word>(sources, [&](Word pair, uint64_t count) -> Status {
      NGC_RETURN_IF_ERROR(poll());
      const Word kbits = pair >> bits_;
      if (has_key && kbits != cur_key) NGC_RETURN_IF_ERROR(flush_key());
      cur_key = kbits;
      has_key = true;
      followers.push_back(
          {static_cast<Token>(pair & token_mask), static_cast<uint32_t>(std::min<uint64_t>(count, UINT32_MAX))});
      return Status::Ok();
    }));
    if (has_key) NGC_RETURN_IF_ERROR(flush_key());
    stats_.n_keys = writer->n_keys();
    stats_.n_merge_passes = merge_passes_;
    if (!index.suffixes.empty()) {
      writer->set_corpus_index(std::move(text_), std::move(index.suffixes), std::move(index.buckets), opt_.index_depth);
    }
    return writer->finish();
  }

  const BuildStats& stats() const override { return stats_; }
  void add_observed_tokens(uint64_t n) override { stats_.n_tokens += n; }
  void mark_tokens_unknown() override { tokens_unknown_ = true; }
  void set_interrupt_check(std::function<bool()> fn) override { interrupted_ = std::move(fn); }

 private:
  // Sorts buf_ in `threads_` parts; part boundaries go to parts_.
  void sort_buffer() {
    parts_.clear();
    const size_t n = buf_.size();
    const size_t p = std::max<size_t>(1, std::min<size_t>(threads_, n / 65536 + 1));
    for (size_t i = 0; i <= p; ++i) parts_.push_back(n * i / p);
    std::vector<std::thread> workers;
    for (size_t i = 1; i < p; ++i) {
      workers.emplace_back([this, i] { std::sort(buf_.begin() + parts_[i], buf_.begin() + parts_[i + 1]); });
    }
    std::sort(buf_.begin() + parts_[0], buf_.begin() + parts_[1]);
    for (auto& w : workers) w.join();
  }

  void sort_weighted() {
    std::sort(weighted_.begin(), weighted_.end(),
              [](const Record<Word>& a, const Record<Word>& b) { return a.pair < b.pair; });
  }

  void add_memory_sources(std::vector<std::unique_ptr<Source<Word>>>* sources) {
    for (size_t i = 0; i + 1 < parts_.size(); ++i) {
      if (parts_[i] < parts_[i + 1])
        sources->push_back(std::make_unique<SliceSource<Word>>(buf_.data() + parts_[i], buf_.data() + parts_[i + 1]));
    }
    if (!weighted_.empty()) sources->push_back(std::make_unique<RecordSource<Word>>(weighted_));
  }

  // Writes everything in memory as one sorted run on disk and empties the buffers.
  Status spill() {
    sort_buffer();
    sort_weighted();
    std::vector<std::unique_ptr<Source<Word>>> sources;
    add_memory_sources(&sources);
    auto run = std::make_unique<ScratchFile>();
    NGC_RETURN_IF_ERROR(run->open(scratch_));
    RunWriter<Word> w(run.get());
    NGC_RETURN_IF_ERROR(merge_sources<Word>(sources, [&](Word p, uint64_t c) { return w.add(p, c); }));
    NGC_RETURN_IF_ERROR(w.close());
    stats_.bytes_spilled += run->bytes();
    ++stats_.n_runs;
    runs_.push_back(std::move(run));
    buf_.clear();
    weighted_.clear();
    parts_.clear();
    return Status::Ok();
  }

  BuilderOptions opt_;
  std::string path_;
  std::string scratch_;
  uint32_t bits_;  // bits per token field
  uint32_t k_;     // tokens per key
  int threads_ = 1;
  Word pair_mask_ = 0;      // the low (k+1) x bits_ bits
  Word window_ = 0;         // the last k+1 tokens of the current stream, packed
  uint64_t in_stream_ = 0;  // tokens of the current stream so far
  std::vector<Word> buf_;   // unsorted pairs of count 1 (sorted in parts_ before a spill)
  std::vector<size_t> parts_;
  std::vector<Record<Word>> weighted_;
  size_t weighted_capacity_ = 0;
  std::vector<std::unique_ptr<ScratchFile>> runs_;
  uint64_t merge_passes_ = 0;  // intermediate merges of max_fan_in runs
  BuildStats stats_;
  bool tokens_unknown_ = false;        // the header records n_tokens 0 ("unknown")
  std::function<bool()> interrupted_;  // polled by finish(); may be empty
  std::vector<uint32_t> text_;         // the corpus index's TEXT (when opt_.corpus_index)
  uint64_t index_capacity_ = 0;        // most TEXT entries
  uint64_t polled_ = 0;                // pairs merged since the last poll

  Status poll() {
    if (++polled_ < (1u << 16)) return Status::Ok();
    polled_ = 0;
    if (interrupted_ && interrupted_()) return Status::Cancelled("interrupted; " + path_ + " was not written");
    return Status::Ok();
  }
};

}  // namespace

Status build_static(const std::vector<TokenStream>& streams, const StaticHeader& header, const std::string& path,
                    bool corpus_index, uint64_t memory_budget, BuildStats* stats) {
  BuilderOptions o;
  o.header = header;
  o.corpus_index = corpus_index;
  o.memory_budget = memory_budget;
  std::unique_ptr<Builder> b;
  NGC_RETURN_IF_ERROR(Builder::create(o, path, &b));
  for (const TokenStream& s : streams) {
    b->begin_stream();
    NGC_RETURN_IF_ERROR(b->add_tokens(s.data, s.size));
  }
  NGC_RETURN_IF_ERROR(b->finish());
  if (stats != nullptr) *stats = b->stats();
  return Status::Ok();
}

Status Builder::create(const BuilderOptions& o, const std::string& path, std::unique_ptr<Builder>* out) {
  const StaticHeader& h = o.header;
  if (h.ngram_size < 1 || h.ngram_size > kNgramMax)
    return Status::InvalidArgument("ngram_size must be in 1..4, got " + str(h.ngram_size));
  if (h.vocab_size < 1 || h.vocab_size > format::kMaxVocab) {
    return Status::InvalidArgument("vocab_size must be in 1..2^24, got " + str(h.vocab_size));
  }
  if (o.max_fan_in < 2 || o.max_fan_in > 1024) return Status::InvalidArgument("max_fan_in must be in 2..1024");
  if (o.corpus_index && (o.index_depth < 1 || o.index_depth > format::kMaxIndexDepth)) {
    return Status::InvalidArgument("index_depth must be in 1.." + str(format::kMaxIndexDepth) + ", got " +
                                   str(o.index_depth));
  }
  if (o.memory_budget < kMinBudget) {
    return Status::InvalidArgument("memory budget " + str(o.memory_budget) + " bytes is below the minimum of 16 MiB");
  }
  const uint32_t bits = format::token_bits_for(h.vocab_size);
  // Fixed costs besides the pair buffer: the writer's ROWS (4 bytes per vocabulary entry)
  // and I/O buffers, and the merge's read buffers (max_fan_in + a few).
  const uint64_t fixed = uint64_t{h.vocab_size} * 4 + (uint64_t(o.max_fan_in) + 16) * kIoBuffer;
  uint64_t usable = o.memory_budget > fixed + (8ull << 20) ? o.memory_budget - fixed : (8ull << 20);
  // The corpus index takes half: its text, ranks, sort entries and result, 32 bytes a token.
  const uint64_t index_tokens = o.corpus_index ? std::min<uint64_t>(usable / 2 / 32, format::kSeparator - 1) : 0;
  if (o.corpus_index) usable -= usable / 2;
  // Three quarters for pairs of count 1, a quarter for weighted records (imports, merges).
  if ((h.ngram_size + 1) * bits <= 64) {
    *out = std::make_unique<BuilderImpl<uint64_t>>(o, path, bits, usable * 3 / 4 / sizeof(uint64_t),
                                                   usable / 4 / sizeof(Record<uint64_t>));
    static_cast<BuilderImpl<uint64_t>*>(out->get())->set_index_capacity(index_tokens);
  } else {
    using U128 = unsigned __int128;
    *out = std::make_unique<BuilderImpl<U128>>(o, path, bits, usable * 3 / 4 / sizeof(U128),
                                               usable / 4 / sizeof(Record<U128>));
    static_cast<BuilderImpl<U128>*>(out->get())->set_index_capacity(index_tokens);
  }
  return Status::Ok();
}

}  // namespace ngc

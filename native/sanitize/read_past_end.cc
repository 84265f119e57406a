// Reads the last byte of an opened static file, then the byte just past it: the proof that
// the AddressSanitizer build sees out-of-bounds reads of a static file's bytes. Built with
// NGC_HEAP_FILES the file is a heap block of exactly its size and ASan stops the program at
// the second read (heap-buffer-overflow); a mapped file (the release core) is not checked,
// the read lands in the mapping's last page, and the program prints the byte and exits 0.
//
//   read_past_end STATIC.ngc
//
// Prints "open_mode=<mmap|heap> size=<bytes>" before the reads. Exit 1 when the file does
// not open or has no key (the reads start from a key's followers, the core's own pointer).
#include <cstdint>
#include <cstdio>
#include <memory>

#include "ngc/ngram.h"
#include "ngc/static_cache.h"
#include "ngc/static_format.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s STATIC.ngc\n", argv[0]);
    return 2;
  }
  std::unique_ptr<ngc::StaticCache> cache;
  ngc::Status s = ngc::StaticCache::open(argv[1], &cache);
  if (!s.ok()) {
    std::fprintf(stderr, "%s\n", s.message().c_str());
    return 1;
  }
  const ngc::StaticInfo& info = cache->info();
  ngc::NGram key;
  ngc::StaticPart part;
  if (info.n_keys == 0 || !cache->key_at(0, &key, &part).ok()) {
    std::fprintf(stderr, "%s has no key to start from\n", argv[1]);
    return 1;
  }
  // The file's first byte, from a pointer the core handed out: FOLLOWERS[part.first] sits
  // 4 x part.first bytes into the FOLLOWERS section.
  const auto* followers = reinterpret_cast<const volatile uint8_t*>(part.followers - part.first);
  const volatile uint8_t* base = followers - info.sections[ngc::format::kFollowers - 1].offset;
  std::printf("open_mode=%s size=%llu\n", cache->open_mode(), static_cast<unsigned long long>(info.file_size));
  std::fflush(stdout);
  const unsigned last = base[info.file_size - 1];
  std::printf("last byte: %u\n", last);
  std::fflush(stdout);
  const unsigned past = base[info.file_size];  // out of bounds, on purpose
  std::printf("byte past the end: %u (not caught)\n", past);
  return 0;
}

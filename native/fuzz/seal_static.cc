// seal_static FILE...: rewrites the checksums of static cache files in place (seal.h), so
// an input saved by fuzz_static_cache reproduces with StaticCache::open + verify() alone
// (for example `ngramcache inspect --verify FILE`).

#include <cstdio>
#include <fstream>
#include <iterator>
#include <vector>

#include "seal.h"

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s FILE...\n", argv[0]);
    return 2;
  }
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    std::vector<uint8_t> f((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!in.eof() && in.fail()) {
      std::fprintf(stderr, "seal_static: cannot read %s\n", argv[i]);
      return 1;
    }
    if (!ngc::fuzz::seal(f)) {
      std::fprintf(stderr, "seal_static: %s is shorter than a section table; left as is\n", argv[i]);
      continue;
    }
    std::ofstream out(argv[i], std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(f.data()), static_cast<std::streamsize>(f.size()));
    if (!out) {
      std::fprintf(stderr, "seal_static: cannot write %s\n", argv[i]);
      return 1;
    }
  }
  return 0;
}

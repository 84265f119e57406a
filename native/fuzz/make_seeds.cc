// Writes the seed corpora of the fuzz targets with the core's own writers:
//   make_seeds STATIC_DIR LLAMA_DIR
// STATIC_DIR gets small valid static cache files (every n-gram size, small and tiny
// vocabularies, empty caches, counts in OVERFLOW, saturated totals); LLAMA_DIR gets the
// same caches as llama.cpp files (write_llama_file) plus an empty one. Deterministic.

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ngc/builder.h"
#include "ngc/llama_format.h"
#include "ngc/static_cache.h"
#include "ngc/static_writer.h"

namespace {

int fail(const std::string& what, const ngc::Status& s) {
  std::fprintf(stderr, "make_seeds: %s: %s\n", what.c_str(), s.message().c_str());
  return 1;
}

// A random count: mostly small, sometimes at or beyond the packed field (OVERFLOW).
uint32_t random_count(std::mt19937& rng, uint32_t escape) {
  switch (rng() % 10) {
    case 0:
      return escape;
    case 1:
      return UINT32_MAX;
    case 2:
      return escape - 1;
    default:
      return 1 + rng() % 20;
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s STATIC_DIR LLAMA_DIR\n", argv[0]);
    return 2;
  }
  const std::string static_dir = argv[1], llama_dir = argv[2];
  std::filesystem::create_directories(static_dir);
  std::filesystem::create_directories(llama_dir);
  std::mt19937 rng(20240607);
  int n_files = 0;
  for (uint32_t k = 1; k <= 4; ++k) {
    for (uint32_t V : {1u, 2u, 5u, 13u, 64u}) {
      for (uint32_t want_keys : {0u, 1u, 4u, 24u}) {
        ngc::StaticHeader h;
        h.ngram_size = k;
        h.vocab_size = V;
        for (uint32_t i = 0; i < ngc::format::kFingerprintSize; ++i) h.fingerprint[i] = static_cast<uint8_t>(i * 7 + k);
        h.generation = want_keys;
        h.n_tokens = 1000 + want_keys;
        const std::string name = "k" + std::to_string(k) + "_v" + std::to_string(V) + "_n" + std::to_string(want_keys);
        const std::string path = static_dir + "/" + name + ".ngc";
        // Sorted, distinct keys (a std::map keeps them in lexicographic order).
        std::map<std::vector<ngc::Token>, std::vector<ngc::Follower>> keys;
        for (uint32_t attempt = 0; attempt < want_keys * 4 && keys.size() < want_keys; ++attempt) {
          std::vector<ngc::Token> key(k);
          for (auto& t : key) t = static_cast<ngc::Token>(rng() % V);
          if (keys.count(key)) continue;
          std::map<ngc::Token, uint32_t> followers;
          const uint32_t n = 1 + rng() % std::min<uint32_t>(V, 5);
          const uint32_t escape = (1u << (32 - ngc::format::token_bits_for(V))) - 1;
          for (uint32_t j = 0; j < n; ++j) followers[static_cast<ngc::Token>(rng() % V)] = random_count(rng, escape);
          for (const auto& [t, c] : followers) keys[key].push_back({t, c});
        }
        std::unique_ptr<ngc::StaticWriter> w;
        ngc::Status s = ngc::StaticWriter::create(path, h, &w);
        if (!s.ok()) return fail(path, s);
        for (const auto& [key, fol] : keys) {
          s = w->add(key.data(), fol.data(), fol.size());
          if (!s.ok()) return fail(path, s);
        }
        s = w->finish();
        if (!s.ok()) return fail(path, s);
        std::unique_ptr<ngc::StaticCache> cache;
        s = ngc::StaticCache::open(path, &cache);
        if (s.ok()) s = cache->verify();
        if (!s.ok()) return fail(path, s);
        s = ngc::write_llama_file(*cache, llama_dir + "/" + name + ".bin");
        if (!s.ok()) return fail(llama_dir, s);
        n_files += 2;
      }
    }
  }
  // Version-2 files: small corpora with their index (depths 1-32, one to three streams).
  for (uint32_t V : {2u, 5u, 40u}) {
    for (uint32_t depth : {1u, 3u, 32u}) {
      std::vector<std::vector<ngc::Token>> streams(1 + rng() % 3);
      for (auto& st : streams) {
        st.resize(1 + rng() % 60);
        for (auto& t : st) t = static_cast<ngc::Token>(rng() % V);
      }
      ngc::BuilderOptions o;
      o.header.ngram_size = 2;
      o.header.vocab_size = V;
      o.corpus_index = true;
      o.index_depth = depth;
      o.threads = 1;
      const std::string path = static_dir + "/index_v" + std::to_string(V) + "_d" + std::to_string(depth) + ".ngc";
      std::unique_ptr<ngc::Builder> b;
      ngc::Status s = ngc::Builder::create(o, path, &b);
      for (const auto& st : streams) {
        if (!s.ok()) break;
        b->begin_stream();
        s = b->add_tokens(st.data(), st.size());
      }
      if (s.ok()) s = b->finish();
      std::unique_ptr<ngc::StaticCache> cache;
      if (s.ok()) s = ngc::StaticCache::open(path, &cache);
      if (s.ok()) s = cache->verify();
      if (!s.ok()) return fail(path, s);
      ++n_files;
    }
  }
  std::ofstream(llama_dir + "/empty.bin");
  std::printf("make_seeds: %d files in %s and %s\n", n_files + 1, static_dir.c_str(), llama_dir.c_str());
  return 0;
}

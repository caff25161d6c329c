#pragma once
// Open-addressing hash maps for the two big tokenizer tables (150k-entry vocabularies and merge
// lists), built once at load time and read on every token: a single probe array, no per-entry
// allocation, so loading a large tokenizer.json stays well under the 200 ms budget.

#include <xxhash.h>

#include <cstdint>
#include <string_view>
#include <vector>

namespace moeline::tokenizer::tok {

class FlatStringMap {
 public:
  void reserve(std::size_t n) {
    std::size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    slots_.assign(cap, Slot{});
  }
  // Inserts or overwrites.
  void put(std::string_view key, std::int32_t value) {
    if ((size_ + 1) * 2 > slots_.size()) grow();
    Slot& s = find_slot(key, hash(key));
    if (s.value < 0) ++size_;
    s = Slot{key.data(), static_cast<std::uint32_t>(key.size()), value};
  }
  std::int32_t get(std::string_view key) const {
    if (slots_.empty()) return -1;
    return const_cast<FlatStringMap*>(this)->find_slot(key, hash(key)).value;
  }
  std::size_t size() const { return size_; }

 private:
  struct Slot {
    const char* data = nullptr;
    std::uint32_t size = 0;
    std::int32_t value = -1;
  };
  static std::uint64_t hash(std::string_view key) { return XXH3_64bits(key.data(), key.size()); }
  Slot& find_slot(std::string_view key, std::uint64_t h) {
    const std::size_t mask = slots_.size() - 1;
    for (std::size_t i = h & mask;; i = (i + 1) & mask) {
      Slot& s = slots_[i];
      if (s.value < 0 || std::string_view(s.data, s.size) == key) return s;
    }
  }
  void grow() {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(old.empty() ? 16 : old.size() * 2, Slot{});
    for (const Slot& s : old) {
      if (s.value >= 0) {
        std::string_view k(s.data, s.size);
        find_slot(k, hash(k)) = s;
      }
    }
  }
  std::vector<Slot> slots_;
  std::size_t size_ = 0;
};

class FlatU64Map {
 public:
  static constexpr std::uint64_t kEmpty = ~0ull;
  void reserve(std::size_t n) {
    std::size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    values_.assign(cap, 0);
  }
  void put(std::uint64_t key, std::uint64_t value) {
    if ((size_ + 1) * 2 > keys_.size()) grow();
    const std::size_t i = find_slot(key);
    if (keys_[i] == kEmpty) ++size_;
    keys_[i] = key;
    values_[i] = value;
  }
  // Returns false when absent.
  bool get(std::uint64_t key, std::uint64_t& value) const {
    if (keys_.empty()) return false;
    const std::size_t i = find_slot(key);
    if (keys_[i] == kEmpty) return false;
    value = values_[i];
    return true;
  }

 private:
  static std::uint64_t mix(std::uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    return x;
  }
  std::size_t find_slot(std::uint64_t key) const {
    const std::size_t mask = keys_.size() - 1;
    for (std::size_t i = mix(key) & mask;; i = (i + 1) & mask) {
      if (keys_[i] == kEmpty || keys_[i] == key) return i;
    }
  }
  void grow() {
    std::vector<std::uint64_t> old_keys = std::move(keys_), old_values = std::move(values_);
    const std::size_t cap = old_keys.empty() ? 16 : old_keys.size() * 2;
    keys_.assign(cap, kEmpty);
    values_.assign(cap, 0);
    for (std::size_t i = 0; i < old_keys.size(); ++i) {
      if (old_keys[i] != kEmpty) {
        const std::size_t j = find_slot(old_keys[i]);
        keys_[j] = old_keys[i];
        values_[j] = old_values[i];
      }
    }
  }
  std::vector<std::uint64_t> keys_;
  std::vector<std::uint64_t> values_;
  std::size_t size_ = 0;
};

}  // namespace moeline::tokenizer::tok

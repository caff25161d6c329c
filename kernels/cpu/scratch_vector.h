#pragma once
// Vectors for the activation copies the fast kernels make once per matmul and write in full before
// reading: storage that starts on a cache line, and growth that leaves the new elements as they
// are instead of zeroing them.
// - Rows that are whole multiples of 64 bytes then keep every 64-byte load inside one line: a load
//   across two lines costs two, and the prefill tiles load every activation chunk once per weight
//   tile (on a Zen 5 core, BF16 tiles ran 15-20% faster on line-aligned activations than on the
//   16-byte-aligned storage std::vector gets from malloc).
// - The copies are reused across matmuls of varying shapes, so a plain vector's resize zeroed the
//   part that grew on nearly every call (memset was 3% of a BF16 prefill).
// Only for elements every reader finds written: `resize` leaves trivially constructible elements
// uninitialized.

#include <cstddef>
#include <new>
#include <utility>
#include <vector>

namespace moeline::kernels {

constexpr size_t kCacheLineBytes = 64;

template <class T>
struct ScratchAllocator {
  using value_type = T;
  ScratchAllocator() = default;
  template <class U>
  ScratchAllocator(const ScratchAllocator<U>&) {}
  T* allocate(size_t n) {
    return static_cast<T*>(::operator new (n * sizeof(T), std::align_val_t{kCacheLineBytes}));
  }
  void deallocate(T* p, size_t) { ::operator delete (p, std::align_val_t{kCacheLineBytes}); }
  // Default-initialization: what resize() uses to grow, a no-op for scalars.
  template <class U>
  void construct(U* p) {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
  template <class U>
  bool operator==(const ScratchAllocator<U>&) const {
    return true;
  }
};

template <class T>
using ScratchVector = std::vector<T, ScratchAllocator<T>>;

}  // namespace moeline::kernels

// Non-temporal stores on x86-64 (SSE2, part of the base instruction set); elsewhere plain copies. See stream.h.

#include "stream.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define GEARSAM_STREAM_STORES 1
#endif

namespace gearsam::cpu {
namespace {

// The size of the last-level cache as Linux's sysfs gives it (the highest level under cpu0), else 32 MiB. Not
// sysconf's: glibc derives that from CPUID, which virtual machines may misreport (320 MiB for a 32 MiB L3 seen).
int64_t last_level_cache_bytes() {
  int64_t bytes = 0;
#if defined(__linux__)
  int best_level = 0;
  for (int index = 0; index < 8; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    std::ifstream level_file(dir + "level"), size_file(dir + "size");
    int level = 0;
    std::string size;  // e.g. "32768K"
    if (!(level_file >> level) || !(size_file >> size) || level <= best_level) continue;
    const int64_t value = std::atoll(size.c_str());
    const char unit = size.back();
    bytes = value << (unit == 'K' ? 10 : unit == 'M' ? 20 : unit == 'G' ? 30 : 0);
    best_level = level;
  }
#endif
  return bytes > 0 ? bytes : int64_t(32) << 20;
}

}  // namespace

int64_t stream_threshold_bytes() {
#if defined(GEARSAM_STREAM_STORES)
  static const int64_t threshold = last_level_cache_bytes();
  return threshold;
#else
  return -1;
#endif
}

bool stream_stores(int64_t bytes) {
  const int64_t threshold = stream_threshold_bytes();
  return threshold >= 0 && bytes > threshold;
}

void stream_copy(void* dst, const void* src, int64_t bytes) {
#if defined(GEARSAM_STREAM_STORES)
  constexpr int64_t kVector = 16;
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  const int64_t head = std::min<int64_t>(bytes, (kVector - reinterpret_cast<uintptr_t>(d) % kVector) % kVector);
  std::memcpy(d, s, head);  // up to dst's first 16-byte boundary
  const int64_t vectors = (bytes - head) / kVector;
  auto* dv = reinterpret_cast<__m128i*>(d + head);
  const auto* sv = reinterpret_cast<const __m128i*>(s + head);
  for (int64_t i = 0; i < vectors; ++i) _mm_stream_si128(dv + i, _mm_loadu_si128(sv + i));
  const int64_t done = head + vectors * kVector;
  std::memcpy(d + done, s + done, bytes - done);
#else
  std::memcpy(dst, src, bytes);
#endif
}

void store_fence() {
#if defined(GEARSAM_STREAM_STORES)
  _mm_sfence();
#endif
}

}  // namespace gearsam::cpu

// Non-temporal stores on x86-64 (SSE2, part of the base instruction set); elsewhere plain copies. See stream.h.

#include "stream.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define GEARSAM_STREAM_STORES 1
#endif

namespace gearsam::cpu {
namespace {

// One line of a sysfs file, or "" where it cannot be read (C stdio: a file holding one number needs no stream).
std::string read_line(const std::string& path) {
  std::FILE* file = std::fopen(path.c_str(), "r");
  if (file == nullptr) return "";
  char buffer[64] = {};
  const bool read = std::fgets(buffer, sizeof buffer, file) != nullptr;
  std::fclose(file);
  return read ? std::string(buffer) : "";
}

// The size of one core's private cache: the level-2 cache as Linux's sysfs gives it for cpu0, else 1 MiB. Not
// sysconf's: glibc derives that from CPUID, which virtual machines may misreport.
int64_t private_cache_bytes() {
  int64_t bytes = 0;
#if defined(__linux__)
  for (int index = 0; index < 8 && bytes == 0; ++index) {
    const std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(index) + "/";
    if (std::atoi(read_line(dir + "level").c_str()) != 2 || read_line(dir + "type").rfind("Instruction", 0) == 0)
      continue;
    char* unit = nullptr;
    const std::string size = read_line(dir + "size");  // e.g. "2048K\n"
    const int64_t value = std::strtoll(size.c_str(), &unit, 10);
    if (value > 0) bytes = value << (*unit == 'K' ? 10 : *unit == 'M' ? 20 : *unit == 'G' ? 30 : 0);
  }
#endif
  return bytes > 0 ? bytes : int64_t(1) << 20;
}

// GEARSAM_STREAM_THRESHOLD_BYTES where it is set (a machine whose sysfs misdescribes its caches; measuring the
// choice: benchmarks/bench_stream_threshold.py), else private_cache_bytes().
int64_t threshold_from_environment() {
  const char* text = std::getenv("GEARSAM_STREAM_THRESHOLD_BYTES");
  if (text == nullptr) return private_cache_bytes();
  char* end = nullptr;
  const long long value = std::strtoll(text, &end, 10);
  TORCH_CHECK(*text != '\0' && *end == '\0' && value >= 0,
              "GEARSAM_STREAM_THRESHOLD_BYTES must be a whole number of bytes, 0 or more, not '", text, "'");
  return value;
}

}  // namespace

int64_t stream_threshold_bytes() {
#if defined(GEARSAM_STREAM_STORES)
  static const int64_t threshold = threshold_from_environment();
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

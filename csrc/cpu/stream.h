// Stores that bypass the caches, for outputs a pass writes without reading them.
//
// A plain store to a line that is not in the cache first reads that line from memory (write-allocate), so a pass that
// writes a buffer without reading it moves the buffer's bytes twice: the perturbation's backup, the restore's and the
// base step's parameter. Non-temporal stores write whole lines straight to memory. They pay off only where the buffer
// would be out of the cache by its next read anyway, so they are used for buffers larger than the last-level cache.
#pragma once

#include <cstdint>

namespace gearsam::cpu {

// Outputs larger than this many bytes are written with non-temporal stores: the last-level cache's size (32 MiB
// where the system does not say), or -1 where the CPU has no such stores.
int64_t stream_threshold_bytes();

// Whether a pass writing an output of this many bytes uses non-temporal stores.
bool stream_stores(int64_t bytes);

// dst = src, bytes of them, with non-temporal stores where the CPU has them (x86-64; elsewhere memcpy). Not ordered
// with later stores until store_fence().
void stream_copy(void* dst, const void* src, int64_t bytes);

// Orders the non-temporal stores made so far before any later store: every parallel task that streams ends with it,
// so the buffers are complete when the parallel region returns.
void store_fence();

}  // namespace gearsam::cpu

// Two flat buffers that trade their memory instead of copying it.
//
// A pass that moves w + eps into the parameter in place and w into the backup writes two buffers and reads two. Past
// the stream threshold (stream.h) the perturbation instead writes w + eps into the backup buffer and then exchanges
// the two buffers' memory: every parameter, a view of the parameter buffer's storage, sees w + eps at once, and the
// backup holds w, untouched. It moves 12 bytes per float32 element, not 16. The base step that follows exchanges them
// back and updates w in place (backup then holds w + eps), so a parameter lives at the same address between steps.
//
// Only where both tensors are the whole of their own CPU storages, of one size: an exchange swaps what the two
// storages hold, so every view of either follows it.
#pragma once

#include <ATen/core/Tensor.h>

namespace gearsam::cpu {

// Whether a and b may exchange their memory: distinct CPU storages, each all of its tensor's contiguous elements,
// of equal size, larger than the stream threshold (within it, writing in place moves no bytes twice).
bool exchangeable(const at::Tensor& a, const at::Tensor& b);

// Swaps the memory of a's and b's storages (exchangeable(a, b) must hold): O(1), no element is copied.
void exchange_memory(const at::Tensor& a, const at::Tensor& b);

// exchange_memory(a, b) where exchangeable(a, b); whether it did.
bool try_exchange_memory(const at::Tensor& a, const at::Tensor& b);

}  // namespace gearsam::cpu

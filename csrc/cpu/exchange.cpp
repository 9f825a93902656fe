// See exchange.h.

#include "exchange.h"

#include "stream.h"

namespace gearsam::cpu {
namespace {

bool whole_storage(const at::Tensor& t) {
  return t.has_storage() && t.is_cpu() && t.is_contiguous() && t.storage_offset() == 0 &&
         t.storage().nbytes() == t.nbytes();
}

}  // namespace

bool exchangeable(const at::Tensor& a, const at::Tensor& b) {
  return whole_storage(a) && whole_storage(b) && a.scalar_type() == b.scalar_type() && a.numel() == b.numel() &&
         !a.storage().is_alias_of(b.storage()) && stream_stores(a.nbytes());
}

void exchange_memory(const at::Tensor& a, const at::Tensor& b) {
  a.storage().unsafeGetStorageImpl()->swap_data_ptr(*b.storage().unsafeGetStorageImpl());
}

bool try_exchange_memory(const at::Tensor& a, const at::Tensor& b) {
  if (!exchangeable(a, b)) return false;
  exchange_memory(a, b);
  return true;
}

}  // namespace gearsam::cpu

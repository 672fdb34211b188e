// The non-inline part of the backend seam (backend.h): memory and the value checks.
#include "backend/backend.h"

#include <cstring>

namespace switchyard::backend {

void copy_bytes(const Context& ctx, void* dst, const Device& dst_device, const void* src,
                const Device& src_device, size_t bytes) {
  if (bytes == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, bytes);
    return;
  }
  cuda::copy(dst, dst_device, src, src_device, bytes, ctx.stream, ctx.op ? ctx.op : "copy");
}

void fill_zero(const Context& ctx, void* p, size_t bytes) {
  if (bytes == 0) return;
  if (ctx.device.is_cpu()) {
    std::memset(p, 0, bytes);
    return;
  }
  cuda::fill_zero(p, bytes, ctx.device, ctx.stream, ctx.op ? ctx.op : "fill_zero");
}

int64_t first_non_finite(const Context& ctx, const void* p, DType dtype, int64_t n) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "first_non_finite", ctx.device);
  return cpu::first_non_finite(p, dtype, n);
}

int64_t first_id_out_of_range(const Context& ctx, const int32_t* ids, int64_t n, int64_t lo,
                              int64_t hi) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "first_id_out_of_range", ctx.device);
  return cpu::first_id_out_of_range(ids, n, lo, hi);
}

ReplayRowSummary classify_replay_rows(const Context& ctx, const int32_t* replay_idx,
                                      const bool* padding_mask, int64_t T, int64_t K, int64_t E,
                                      uint8_t* row_kind, bool merge_repeated, bool mark_invalid) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "classify_replay_rows", ctx.device);
  return cpu::classify_replay_rows(replay_idx, padding_mask, T, K, E, row_kind, merge_repeated,
                                   mark_invalid);
}

}  // namespace switchyard::backend

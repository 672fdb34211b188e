// The backend seam: the one kernel-selection point per op. Front-ends (src/core, src/ep) validate,
// shape and allocate, then call backend::<op>(ctx, ...) with the same raw-pointer arguments the
// kernels take; the selection by ctx.device lives here and nowhere else. The CPU backend forwards
// to cpu:: (whose runtime ISA choice, scalar/AVX2, stays in src/cpu/isa.h); the CUDA backend
// (src/cuda/cuda_backend.h) has no kernels yet, so a CUDA device gets BackendError "[op] has no
// CUDA kernel yet" (or "not built with CUDA"). A CUDA kernel later replaces one no_kernel() call
// here, without touching a front-end.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cpu/finite_kernels.h"
#include "cpu/gate_kernels.h"
#include "cpu/permute_kernels.h"
#include "cpu/router_kernels.h"
#include "cpu/routing_kernels.h"
#include "cpu/value_checks.h"
#include "cuda/cuda_backend.h"
#include "switchyard/tensor.h"

namespace switchyard::backend {

/// Where an op's kernels run: the device, an opaque execution stream (a cudaStream_t in a CUDA
/// build; null = the device's default stream; the CPU backend has none and ignores it), and the
/// front-end op it serves (for messages: "[route] route_forward has no CUDA kernel yet ...").
struct Context {
  Device device = kCpu;
  void* stream = nullptr;
  const char* op = nullptr;
};

/// The context of front-end `op` whose tensors live where `t` does (front-ends check that every
/// tensor argument shares that device, detail::check_device).
inline Context context_of(const Tensor& t, const char* op = nullptr) {
  return Context{t.device(), nullptr, op};
}

// Kernel-interface types shared by every backend (defined with the CPU kernels).
using cpu::by_row_dtype;
using cpu::kLossChunk;
using cpu::kRowInvalid;
using cpu::kRowMerged;
using cpu::kRowNative;
using cpu::kRowPadded;
using cpu::kRowReplayed;
using cpu::kScoreSigmoid;
using cpu::kScoreSoftmax;
using cpu::kScoreSqrtSoftplus;
using cpu::ReplayRowProblem;
using cpu::ReplayRowSummary;
using cpu::RouteKernelParams;

// ---- memory ----

/// Copies `bytes` bytes from src (on src_device) to dst (on dst_device), finished on return
/// (ctx.stream orders it; ctx.device is either end).
void copy_bytes(const Context& ctx, void* dst, const Device& dst_device, const void* src,
                const Device& src_device, size_t bytes);
/// Zeroes `bytes` bytes at p on ctx.device.
void fill_zero(const Context& ctx, void* p, size_t bytes);

// ---- value checks (validation before any work) ----

/// See cpu::first_non_finite (cpu/finite_kernels.h): flat index of the first NaN/Inf, or n.
int64_t first_non_finite(const Context& ctx, const void* p, DType dtype, int64_t n);
/// See cpu::first_id_out_of_range: flat index of the first id outside [lo, hi), or n.
int64_t first_id_out_of_range(const Context& ctx, const int32_t* ids, int64_t n, int64_t lo,
                              int64_t hi);
/// See cpu::classify_replay_rows.
ReplayRowSummary classify_replay_rows(const Context& ctx, const int32_t* replay_idx,
                                      const bool* padding_mask, int64_t T, int64_t K, int64_t E,
                                      uint8_t* row_kind, bool merge_repeated = false,
                                      bool mark_invalid = false);

// ---- gate (cpu/gate_kernels.h) ----

inline void gate_forward(const Context& ctx, const void* x, DType x_dtype, const void* weight,
                         DType w_dtype, const void* bias, DType bias_dtype, void* logits,
                         DType acc_dtype, int64_t num_tokens, int64_t hidden, int64_t num_experts) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "gate_forward", ctx.device);
  cpu::gate_forward(x, x_dtype, weight, w_dtype, bias, bias_dtype, logits, acc_dtype, num_tokens,
                    hidden, num_experts);
}

// Returns whether every value of weight and grad_weight is finite (cpu/gate_kernels.h).
inline bool gate_backward(const Context& ctx, const void* grad_logits, const void* x, DType x_dtype,
                          const void* weight, DType w_dtype, void* grad_x, void* grad_weight,
                          void* grad_bias, DType acc_dtype, int64_t num_tokens, int64_t hidden,
                          int64_t num_experts) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "gate_backward", ctx.device);
  return cpu::gate_backward(grad_logits, x, x_dtype, weight, w_dtype, grad_x, grad_weight,
                            grad_bias, acc_dtype, num_tokens, hidden, num_experts);
}

// ---- router (cpu/router_kernels.h) ----

template <class S>
void route_forward(const Context& ctx, const S* logits, const S* bias, const uint8_t* row_kind,
                   const int32_t* replay_idx, const RouteKernelParams& p, int32_t* selected_idx,
                   S* weights, double* aux_prob_sum, int64_t* aux_counts, double* z_sum) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "route_forward", ctx.device);
  cpu::route_forward<S>(logits, bias, row_kind, replay_idx, p, selected_idx, weights, aux_prob_sum,
                        aux_counts, z_sum);
}

/// Capacity drops on the router's [T, K] table (cpu/routing_kernels.h: the one implementation,
/// shared with the routing plan; the capacity formula and argument checks stay in src/core).
template <class S>
int64_t apply_capacity(const Context& ctx, const int32_t* selected_idx, const S* weights, int64_t T,
                       int64_t K, int64_t E, int64_t capacity, TokenDropPolicy policy,
                       int32_t* topk_idx, S* out_weights, int64_t* counts) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "apply_capacity", ctx.device);
  return cpu::apply_capacity<S>(selected_idx, weights, T, K, E, capacity, policy, topk_idx,
                                out_weights, counts);
}

/// dst[i] = S(src[i]) (cpu::cast_values): the expert bias in the router's compute dtype.
template <class S>
void cast_values(const Context& ctx, const void* src, DType src_dtype, int64_t n, S* dst) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "cast_values", ctx.device);
  cpu::cast_values<S>(src, src_dtype, n, dst);
}

/// Sinkhorn routing's ids and row kinds (cpu::sinkhorn_rows).
template <class S>
void sinkhorn_rows(const Context& ctx, const S* logits, const int32_t* replay_idx,
                   const uint8_t* row_kind, int64_t T, int64_t E, int64_t K, double tol,
                   int32_t* ids, uint8_t* kernel_kind) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "sinkhorn_rows", ctx.device);
  cpu::sinkhorn_rows<S>(logits, replay_idx, row_kind, T, E, K, tol, ids, kernel_kind);
}

/// Quantile balancing's ids, row kinds and local beta (cpu::quantile_balancing_rows).
inline void quantile_balancing_rows(const Context& ctx, const float* z, const float* beta,
                                    const int32_t* replay_idx, const uint8_t* row_kind, int64_t T,
                                    int64_t E, int64_t K, int32_t* ids, uint8_t* kernel_kind,
                                    float* beta_local) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "quantile_balancing_rows", ctx.device);
  cpu::quantile_balancing_rows(z, beta, replay_idx, row_kind, T, E, K, ids, kernel_kind,
                               beta_local);
}

template <class S>
void route_backward(const Context& ctx, const S* logits, const int32_t* selected_idx,
                    const int32_t* topk_idx, const uint8_t* row_kind, const S* grad_w,
                    const RouteKernelParams& p, const double* aux_grad, double z_coeff,
                    S* grad_logits) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "route_backward", ctx.device);
  cpu::route_backward<S>(logits, selected_idx, topk_idx, row_kind, grad_w, p, aux_grad, z_coeff,
                         grad_logits);
}

// ---- row movement: permute / unpermute / combine (cpu/permute_kernels.h) ----

inline void gather_rows(const Context& ctx, const void* src, const int64_t* index, int64_t num_rows,
                        int64_t row_bytes, void* dst) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "gather_rows", ctx.device);
  cpu::gather_rows(src, index, num_rows, row_bytes, dst);
}

template <class X>
void combine_rows(const Context& ctx, const X* y, const float* weight, const int64_t* offsets,
                  const int64_t* rows, int64_t T, int64_t H, X* out) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "combine_rows", ctx.device);
  cpu::combine_rows<X>(y, weight, offsets, rows, T, H, out);
}

template <class X>
void gather_scale_rows(const Context& ctx, const X* g, const float* weight, const int64_t* index,
                       int64_t num_rows, int64_t H, X* out) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "gather_scale_rows", ctx.device);
  cpu::gather_scale_rows<X>(g, weight, index, num_rows, H, out);
}

template <class X>
void row_dots(const Context& ctx, const X* a, const X* b, const int64_t* index, int64_t num_rows,
              int64_t H, float* out) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "row_dots", ctx.device);
  cpu::row_dots<X>(a, b, index, num_rows, H, out);
}

/// The routing plan of a validated id table (cpu::build_routing_plan; sizes are data-dependent, so
/// the backend allocates the plan's tensors on ctx.device).
inline RoutingPlan build_routing_plan(const Context& ctx, const int32_t* idx, const float* w,
                                      int64_t T, int64_t K, int64_t E, int64_t capacity,
                                      TokenDropPolicy policy, int64_t align, bool pad_to_capacity) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "build_routing_plan", ctx.device);
  return cpu::build_routing_plan(idx, w, T, K, E, capacity, policy, align, pad_to_capacity);
}

/// The per-row values of a routing plan scattered to its [T, K] slots (cpu::rows_to_slots).
inline void rows_to_slots(const Context& ctx, const float* row_values, const int64_t* slot_row,
                          int64_t num_slots, float* out) {
  if (!ctx.device.is_cpu()) cuda::no_kernel(ctx.op, "rows_to_slots", ctx.device);
  cpu::rows_to_slots(row_values, slot_row, num_slots, out);
}

}  // namespace switchyard::backend

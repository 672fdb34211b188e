// CPU kernels of the router: per-token scores, top-k / replay, weights, loss partial sums and
// backward (capacity is src/core/capacity.cpp, shared with the routing plan). Raw pointers, trusted input (the front-end in src/core/router.cpp validates).
#pragma once

#include <cstdint>

#include "cpu/isa.h"

namespace switchyard::cpu {

/// Row kinds (RouteResult::row_kind).
inline constexpr uint8_t kRowNative = 0;
inline constexpr uint8_t kRowReplayed = 1;
inline constexpr uint8_t kRowPadded = 2;

/// Score functions, same order as switchyard::ScoreFunction.
inline constexpr int kScoreSoftmax = 0;
inline constexpr int kScoreSigmoid = 1;
inline constexpr int kScoreSqrtSoftplus = 2;

/// Tokens per chunk of the deterministic loss reductions: partial sums are formed per fixed chunk
/// and added in chunk order, so the result does not depend on the thread count.
inline constexpr int64_t kLossChunk = 128;

struct RouteKernelParams {
  int64_t num_tokens = 0;   // T
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // K
  int score_function = kScoreSoftmax;
  bool pre_softmax = false;
  int64_t num_groups = 0;  // 0 = no group limit
  int64_t group_topk = 0;
  double scaling = 1.0;
  bool need_aux = false;   // compute aux-loss scores/counts
  int64_t aux_groups = 1;  // G: token t belongs to group t % G (seq_aux_loss), else G = 1
  bool need_z = false;     // compute sum of logsumexp^2
};

// route_forward: over all tokens. Writes selected_idx [T,K] (ids before capacity; -1 on padded
//   rows) and weights [T,K] (0 on padded rows). When need_aux: aux_prob_sum [G,E] (sum over valid
//   tokens of the aux scores) and aux_counts [G,E] (aux top-k counts). When need_z: *z_sum = sum of
//   lse^2. bias and replay_idx may be null; replay_idx is read only on rows of kind kRowReplayed.
// route_backward: over all tokens into grad_logits [T,E]. grad_w may be null. aux_grad [G,E]
//   (null = none) is dLoss/dP already multiplied by the loss-grad scale; z_coeff likewise.
// sinkhorn_select: Sinkhorn routing selection (Megatron-Core moe_utils.sinkhorn, in double): over
//   the rows with use_row[t] != 0, cost = exp(z) (shifted by max z only above 700, where double
//   would overflow), alternate d0 = 1/(n (cost d1 + 1e-8)) and d1 = 1/(E (d0 cost + 1e-8)) until
//   mean|d1_old - d1| <= tol, then each used row's top-k of d1 * cost * d0 (ties: lower id) into
//   ids [T,K]. Deterministic: fixed summation order, one thread.
#define SY_ROUTER_KERNELS                                                                       \
  template <class S>                                                                            \
  void route_forward(const S* logits, const S* bias, const uint8_t* row_kind,                   \
                     const int32_t* replay_idx, const RouteKernelParams& p,                     \
                     int32_t* selected_idx, S* weights, double* aux_prob_sum,                   \
                     int64_t* aux_counts, double* z_sum);                                       \
  template <class S>                                                                            \
  void route_backward(const S* logits, const int32_t* selected_idx, const int32_t* topk_idx,    \
                      const uint8_t* row_kind, const S* grad_w, const RouteKernelParams& p,     \
                      const double* aux_grad, double z_coeff, S* grad_logits);             \
  template <class S>                                                                            \
  void sinkhorn_select(const S* logits, const uint8_t* use_row, int64_t T, int64_t E, int64_t K, \
                       double tol, int32_t* ids);
SY_CPU_DECLARE_VARIANTS(SY_ROUTER_KERNELS)
#undef SY_ROUTER_KERNELS

#ifndef SY_ISA_NS
template <class S>
inline void route_forward(const S* logits, const S* bias, const uint8_t* row_kind,
                          const int32_t* replay_idx, const RouteKernelParams& p,
                          int32_t* selected_idx, S* weights, double* aux_prob_sum,
                          int64_t* aux_counts, double* z_sum) {
  SY_CPU_SELECT(route_forward<S>)(logits, bias, row_kind, replay_idx, p, selected_idx, weights,
                                  aux_prob_sum, aux_counts, z_sum);
}
template <class S>
inline void route_backward(const S* logits, const int32_t* selected_idx, const int32_t* topk_idx,
                           const uint8_t* row_kind, const S* grad_w, const RouteKernelParams& p,
                           const double* aux_grad, double z_coeff, S* grad_logits) {
  SY_CPU_SELECT(route_backward<S>)(logits, selected_idx, topk_idx, row_kind, grad_w, p, aux_grad,
                                   z_coeff, grad_logits);
}
template <class S>
inline void sinkhorn_select(const S* logits, const uint8_t* use_row, int64_t T, int64_t E,
                            int64_t K, double tol, int32_t* ids) {
  SY_CPU_SELECT(sinkhorn_select<S>)(logits, use_row, T, E, K, tol, ids);
}
#endif

}  // namespace switchyard::cpu

// Internal pieces of the router shared by its files (src/core/router_*.cpp). Not installed.
//   router_config.cpp     enum names, validate_router_config, load-balancing coefficients
//   router_select.cpp     kernel parameters and the scores / selection / capacity forward
//   router_rows.cpp       row kinds: padded, native, replayed (replay rows checked here)
//   router_balancing.cpp  sinkhorn and quantile-balancing selection, expert-bias update
//   router_losses.cpp     cross-rank sums, the error / settings agreement, the loss values and
//                         gradient coefficients, the write into the caller's GlobalAuxLossState
//   router_noise.cpp      counter-based random numbers: forced logits, input jitter
//   router.cpp            the topk_route / topk_route_backward front-end
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "ep/agreement.h"
#include "switchyard/router.h"

namespace switchyard::detail {

inline constexpr const char* kRouteOp = "route";

/// RouteResult::saved: what the backward reads. Tensors share storage with the forward's (the
/// logits with the caller's, unless bf16 or forced); never modified after the forward.
struct RouteSaved {
  Tensor logits;           ///< [T, E] the logits routed (fp32 copy of bf16 ones, forced ones)
  Tensor selected_idx;     ///< [T, K] int32 ids before capacity drops (-1 on padded rows)
  Tensor topk_idx;         ///< [T, K] int32 ids after capacity (the result's topk_idx)
  Tensor row_kind;         ///< [T] uint8: backend::kRowNative / kRowReplayed / kRowPadded
  Tensor aux_grad;         ///< [G, E] fp64 dLoss/dP per (sequence group, expert); undefined if none
  int64_t aux_groups = 1;  ///< G: 1, or num_sequences for seq_aux_loss
  double z_grad_coeff = 0.0;         ///< 2 * z_loss_coeff / num_valid_tokens (scaled)
  RouterConfig config;               ///< the forward's configuration
  DType logits_dtype = DType::fp32;  ///< dtype of the logits given (bf16 ones are kept in fp32)
};

/// "layer 5, " (or "" for an unknown layer), the prefix of per-layer messages.
std::string layer_prefix(int64_t layer);

// ---- router_config.cpp ----
/// Coefficient of each load-balancing loss (Megatron's get_aux_loss_coeff): from the lists when
/// given, else from aux_loss_type / aux_loss_coeff.
struct LbCoeffs {
  double aux = 0.0, seq = 0.0, global = 0.0;
  bool any() const { return aux > 0.0 || seq > 0.0 || global > 0.0; }
};
LbCoeffs lb_coeffs(const RouterConfig& c);

// ---- router_select.cpp ----
backend::RouteKernelParams kernel_params(const RouterConfig& c, int64_t T);

/// The kernels' forward and capacity: fills saved.selected_idx (allocated), r.topk_idx,
/// r.topk_weights, r.num_tokens_per_expert and r.num_dropped, the aux partial sums [G, E] and the
/// z sum. replay_idx / row_kind as the kernels read them (balancing rows are "replayed").
template <class S>
void run_forward(const Tensor& logits, const Tensor& bias, const Tensor& replay_idx,
                 const Tensor& row_kind, const backend::RouteKernelParams& p, int64_t capacity,
                 TokenDropPolicy drop_policy, bool round_weights_to_bf16, RouteResult& r,
                 RouteSaved& saved, std::vector<double>& aux_psum, std::vector<int64_t>& aux_cnt,
                 double& z_sum);

// ---- router_rows.cpp ----
/// Row kinds into kind[T] (backend::kRowNative / kRowReplayed / kRowPadded) and the row counts of
/// r; a bad replay row throws (or routes natively with InvalidReplayRows::native, counted).
void classify_rows(const Tensor& replay_idx, const Tensor& padding_mask, int64_t T, int64_t K,
                   int64_t E, const RouteOptions& options, uint8_t* kind, RouteResult& r);

// ---- router_balancing.cpp ----
/// Sinkhorn (training): ids [T, K] for every native row from the Sinkhorn-normalised batch of the
/// unpadded rows; replayed rows keep the given ids. kernel_kind: native rows become "replayed".
Tensor sinkhorn_rows(const Tensor& logits, const Tensor& replay_idx, const uint8_t* kind, int64_t T,
                     int64_t E, int64_t K, uint8_t* kernel_kind);
/// Quantile balancing: ids [T, K] for every native row (top-k of z - qb_beta, ties the larger
/// logit then the lower id), replayed rows keep theirs; with `training`, the batch quantile into
/// r.qb_beta_local. kernel_kind: native rows become "replayed".
Tensor quantile_balancing_rows(const Tensor& logits, const Tensor& qb_beta,
                               const Tensor& replay_idx, const uint8_t* kind, int64_t T, int64_t E,
                               int64_t K, bool training, uint8_t* kernel_kind, RouteResult& r);

// ---- router_losses.cpp ----
/// Element-wise sum over the ranks of c, in rank order (deterministic whatever MPI would do).
template <class T>
void sum_over_ranks(dist::Communicator& c, T* v, int64_t n);
/// What the ranks of the loss communicators must agree on before the first reduction: the sizes
/// and loss types finish_losses' collectives and values depend on (`groups`: G of seq_aux_loss;
/// `training`: whether finish_losses runs at all).
std::vector<dist::detail::Setting> route_settings(const RouterConfig& config, int64_t groups,
                                                  bool training, const RouteComms& comms);
/// Collective over comms.loss, then comms.global_aux_loss (dist::detail::agreed_error): every rank
/// throws the same std::invalid_argument when any rank failed (`local_error`, "" = none) or a
/// setting differs between ranks; returns normally on every rank otherwise.
void agree_route(const RouteComms& comms, const std::string& local_error,
                 std::vector<dist::detail::Setting> settings);

/// What the forward kernels summed, for the losses.
struct LossSums {
  int64_t num_tokens = 0;        ///< T
  int64_t groups = 1;            ///< G (sequence groups of seq_aux_loss)
  std::vector<double> aux_psum;  ///< [G, E] sums of the aux scores over valid tokens
  std::vector<int64_t> aux_cnt;  ///< [G, E] aux top-k counts
  double z_sum = 0.0;            ///< sum of logsumexp^2
};
/// Megatron-Core's loss values and gradient coefficients from this rank's sums (summed over the
/// communicators first): r.aux_loss, r.aux_loss_parts, r.z_loss, saved.aux_grad,
/// saved.aux_groups, saved.z_grad_coeff. With global_aux_loss, `state` (validated) gets this batch
/// when `update` is accumulate; the loss always sees the state plus this batch.
void finish_losses(const RouterConfig& config, LossSums& sums, dist::Communicator* loss_comm,
                   dist::Communicator* global_comm, GlobalAuxLossState* state,
                   GlobalAuxLossUpdate update, RouteResult& r, RouteSaved& saved);

// ---- router_noise.cpp ----
/// A uniform in (0, 1) for counter i of a seed: splitmix64 of (seed, i), top 24 bits.
double unit_uniform(uint64_t seed, uint64_t i);
/// N(0, 1) for counter i (Box-Muller on two independent uniforms of the same seed).
double unit_normal(uint64_t seed, uint64_t i);
/// force_load_balancing / force_biased: the logits routed instead of the given ones.
Tensor forced_logits(const Tensor& logits, const RouterConfig& c, const RouteOptions& o);

}  // namespace switchyard::detail

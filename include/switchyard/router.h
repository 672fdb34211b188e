// Routing after the gate: scores, top-k (or replayed ids), capacity, auxiliary losses, and the
// exact backward of all of it into the gate logits. The gate GEMM itself lives in gate.h.
//
// Semantics follow Megatron-Core's TopKRouter (option names included); see DESIGN.md "Semantics".
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "switchyard/capacity.h"
#include "switchyard/dist.h"
#include "switchyard/routing_plan.h"
#include "switchyard/tensor.h"

namespace switchyard {

/// Score function applied to the gate logits (Megatron-Core `moe_router_score_function`).
enum class ScoreFunction : uint8_t { softmax, sigmoid, sqrtsoftplus };

/// Load-balancing type (Megatron-Core `moe_router_load_balancing_type`): a loss, or `sinkhorn`
/// routing (selection on the Sinkhorn-normalised batch while training; weights sigmoid(z) for
/// K = 1, softmax over all E for K > 1, as Megatron's; no loss; needs score_function softmax, no
/// groups, no bias, scaling 1).
///
/// `quantile_balancing` (Megatron's dual coordinate-descent QB): native rows select the top-k of
/// z - qb_beta (RouteInputs::qb_beta), weights from the score function at those ids as for
/// replayed rows; while training the result carries this batch's per-expert quantile
/// (RouteResult::qb_beta_local) from which the caller updates qb_beta once per global batch. No
/// loss, no groups, no padding mask, top_k < num_experts.
enum class AuxLossType : uint8_t {
  none,
  aux_loss,
  seq_aux_loss,
  global_aux_loss,
  sinkhorn,
  quantile_balancing
};

/// What a replay row that is neither K distinct ids in [0, E) nor all -1 becomes (it mixes -1 and
/// ids, repeats an id, or names an id outside [0, E)); one vocabulary for C++ and Python
/// ("error" / "native" / "merge"), the rule itself is classify_replay_rows (replay.h).
enum class ReplayRowPolicy : uint8_t {
  error,   ///< std::invalid_argument naming layer, token and row (default)
  native,  ///< the row is routed natively and counted (num_invalid_replay_rows)
  /// A row whose only fault is a repeated id is replayed with that id's slots merged (one
  /// (token, expert) pair, the slots' weights summed); other invalid rows are errors. topk_route
  /// keeps the repeated slots in topk_idx, each with its weight (a combine over the slots adds
  /// them up); Megatron's [T, E] probs hold the sum.
  merge,
};

/// Router configuration; names are Megatron-Core's (`moe_router_*`, `moe_*`). The router dtype
/// (`router_dtype`) is the dtype of the logits passed to topk_route: fp32 or fp64.
struct RouterConfig {
  int64_t num_experts = 0;  ///< E >= 1
  int64_t top_k = 1;        ///< K in [1, E]
  ScoreFunction score_function = ScoreFunction::softmax;
  /// softmax only: softmax over all E, then top-k, no renormalisation (else softmax over the K).
  bool pre_softmax = false;
  /// Group-limited top-k (DeepSeek-V3): 0 = off. E % num_groups == 0, group_topk in
  /// [1, min(num_groups, K)], K <= group_topk * E / num_groups.
  int64_t num_groups = 0;
  int64_t group_topk = 0;
  /// Multiplies the routing weights (Megatron `moe_router_topk_scaling_factor`); 1 = none.
  double topk_scaling_factor = 1.0;
  /// Expert capacity C = expert_capacity(T, K, E, capacity_factor) = min(ceil(T*K/E *
  /// capacity_factor), T) (capacity.h); nullopt = no capacity (no drops).
  std::optional<double> capacity_factor{};
  TokenDropPolicy token_drop_policy = TokenDropPolicy::probs;
  /// Megatron moe_pad_expert_input_to_capacity: every expert's input is padded to C rows
  /// (RouteResult::expert_capacity; the routing plan built with routing_plan_options() pads with
  /// zero rows of weight 0); needs capacity_factor.
  bool pad_to_capacity = false;
  /// Megatron moe_router_padding_for_quantization (moe_router_padding_for_fp8 is its older alias):
  /// every expert's row count is padded up to a multiple of padding_align_size (FP8/FP4 grouped
  /// GEMM tiles) by the routing plan built with routing_plan_options(). Ids, weights and counts of
  /// the route are unchanged.
  bool padding_for_quantization = false;
  /// The multiple of padding_for_quantization (Megatron's get_align_size_for_quantization: 16 for
  /// FP8, 32 for MXFP8, 128 for FP4, 256 with Transformer Engine's op fuser); >= 1.
  int64_t padding_align_size = 16;
  AuxLossType aux_loss_type = AuxLossType::none;
  double aux_loss_coeff = 0.0;  ///< coefficient of the aux_loss_type loss (>= 0)
  /// Several load-balancing losses at once (Megatron's moe_router_load_balancing_type given as a
  /// list, moe_aux_loss_coeff a list of the same length): each of aux_loss, seq_aux_loss and
  /// global_aux_loss at most once, each with its coefficient; aux_loss_type must then be none.
  /// Empty = the single aux_loss_type / aux_loss_coeff.
  std::vector<AuxLossType> aux_loss_types{};
  std::vector<double> aux_loss_coeffs{};
  double z_loss_coeff = 0.0;  ///< z-loss coefficient (>= 0); 0 = off
  /// Megatron calculate_per_token_loss: the aux- and z-loss gradients are those of the loss times
  /// the number of valid (unpadded) tokens (the reported values stay the losses themselves).
  bool calculate_per_token_loss = false;
  /// Megatron MTP layers: with is_mtp_layer and mtp_use_repeated_layer, the one MTP layer runs
  /// mtp_num_layers times, so its load-balancing losses (value and gradient) are divided by
  /// mtp_num_layers. The z-loss gradient is not; its value (RouteResult::z_loss) is, as Megatron
  /// logs it.
  bool is_mtp_layer = false;
  bool mtp_use_repeated_layer = false;
  int64_t mtp_num_layers = 0;
  /// Benchmarking (Megatron moe_router_force_load_balancing): route on N(0, 1) logits drawn from
  /// RouteOptions::force_seed instead of the given ones; the gradient passes straight through to
  /// the given logits (Megatron's RandomSTE). Replayed rows keep their ids.
  bool force_load_balancing = false;
  /// Benchmarking (Megatron moe_router_force_biased): random N(0, 1) logits plus a per-expert
  /// bias N(0, |force_biased|) drawn from RouteOptions::force_bias_seed (Megatron shares it across
  /// ranks, and reuses it per layer when force_biased < 0: pass the same seed). 0 = off.
  double force_biased = 0.0;
};

/// Whether a topk_route call with global_aux_loss adds its batch to the GlobalAuxLossState.
/// Megatron-Core accumulates only on training forwards with grad enabled: a no_grad or
/// checkpoint-recompute forward must pass `read_only` (an eval forward, RouteOptions::training
/// false, computes no loss and never touches the state). Either way the loss is computed from the
/// state plus this batch (mean over steps + 1), so a read-only call returns the value an
/// accumulating call on the same state would.
enum class GlobalAuxLossUpdate : uint8_t { accumulate, read_only };

/// Running state of `global_aux_loss` (Megatron's `global_tokens_per_expert` and `ga_steps`): the
/// per-expert counts of every accumulating batch since the last `reset()`. One object per MoE
/// layer, owned by the caller; a topk_route call with global_aux_loss and
/// RouteOptions::global_aux_loss_update == accumulate adds its batch's counts. A recompute that
/// must reproduce its forward exactly routes with a snapshot of the state taken before that
/// forward (copy `steps`, `clone()` the tensor), or read-only on an unchanged state.
struct GlobalAuxLossState {
  /// [E] fp64: sum of the counts over the accumulated steps (undefined = nothing accumulated).
  Tensor num_tokens_per_expert{};
  /// Number of accumulated batches.
  int64_t steps = 0;
  /// Start a new accumulation window (Megatron `reset_global_aux_loss_tracker`).
  void reset() {
    num_tokens_per_expert = Tensor();
    steps = 0;
  }
};

/// Optional tensors of topk_route. Undefined tensors are "not given".
struct RouteInputs {
  /// [E] fp32 (or fp64): aux-loss-free balancing bias, added to the selection scores only.
  Tensor expert_bias{};
  /// [T] bool: true = padded token; its row is all -1 and it is left out of counts and losses.
  Tensor padding_mask{};
  /// [T, K] int32: ids to use instead of the live top-k (router replay). A row of all -1 is
  /// routed natively. See ReplayRowPolicy for bad rows.
  Tensor replay_idx{};
  /// [E] fp32: quantile_balancing's per-expert bias (subtracted for selection only); undefined =
  /// zeros.
  Tensor qb_beta{};
  /// Required when aux_loss_type == global_aux_loss; updated by the call (not by backward) when
  /// RouteOptions::global_aux_loss_update is accumulate.
  GlobalAuxLossState* global_aux_loss_state = nullptr;
};

/// Options of topk_route.
struct RouteOptions {
  ReplayRowPolicy invalid_replay_rows = ReplayRowPolicy::error;
  /// MoE layer number, used only in error messages (-1 = unknown, left out of messages).
  int64_t layer = -1;
  /// seq_aux_loss only: tokens are laid out [seq_length, num_sequences] flattened (Megatron's
  /// [s, b] order: token t belongs to sequence t % num_sequences); T % seq_length == 0.
  int64_t seq_length = 0;
  /// Megatron-Core's module training flag. false is its eval path: no aux, seq, global or z loss
  /// (values 0, no loss gradient, no reduction over the loss communicators, the
  /// GlobalAuxLossState untouched). sinkhorn: training selects on the Sinkhorn-normalised scores
  /// (Megatron's training path), else on the logits (its eval path). Sinkhorn normalises over the
  /// batch, so it is not batch invariant. quantile_balancing: training also computes
  /// RouteResult::qb_beta_local (needs num_tokens * top_k divisible by num_experts).
  bool training = true;
  /// Seeds of force_load_balancing / force_biased (counter-based: a value depends only on its
  /// seed and position, so the draws are thread-count invariant).
  uint64_t force_seed = 0;
  uint64_t force_bias_seed = 0;
  /// global_aux_loss only: add this batch to the state (training forward with grad) or not.
  GlobalAuxLossUpdate global_aux_loss_update = GlobalAuxLossUpdate::accumulate;
};

namespace detail {
/// What topk_route_backward needs from the forward (logits, ids before capacity, row kinds, loss
/// gradient coefficients, the config). Defined in src/core; opaque here.
struct RouteSaved;
}  // namespace detail

/// Result of topk_route, also the handle its backward needs (`saved`). Integer outputs (ids, counts) are not
/// differentiable. Every field is deterministic and independent of the thread count; each token's
/// ids and weights depend only on that token's logits (batch invariant), except through capacity.
struct RouteResult {
  /// [T, K] int32: chosen expert per slot, -1 = none (padded token, dropped slot). Native rows are
  /// ordered by descending selection score (ties: lower id); replayed rows keep the given order.
  Tensor topk_idx{};
  /// [T, K] dtype of the logits (bf16, fp32 or fp64): routing weight per slot, 0 where topk_idx
  /// is -1.
  Tensor topk_weights{};
  /// [E] int64: number of (token, expert) pairs kept per expert (after capacity, no padding).
  Tensor num_tokens_per_expert{};
  /// Capacity C per expert, or -1 without capacity_factor. With pad_to_capacity the routing plan
  /// (routing_plan_options) pads every expert's input to C rows (zero rows, weight 0).
  int64_t expert_capacity = -1;
  bool pad_to_capacity = false;
  /// Each expert's rows are padded to a multiple of this by the routing plan: padding_align_size
  /// with padding_for_quantization, else 1 (none).
  int64_t expert_alignment = 1;
  int64_t num_dropped = 0;  ///< (token, expert) pairs dropped by capacity
  /// quantile_balancing while training: [E] fp32, Megatron's qb_dual_update quantile: per
  /// expert the (T*K/E + 1)-th largest of z - alpha over tokens, alpha the (K+1)-th largest of
  /// z - qb_beta per token. Undefined otherwise. Not differentiable.
  Tensor qb_beta_local{};

  /// Loss values, coefficients included (0 when off and in eval), as Megatron logs them per
  /// layer (times the coefficient; an MTP layer run mtp_num_layers times logs its share).
  /// aux_loss is the sum of the load-balancing losses, aux_loss_parts each of them (Megatron logs
  /// them apart).
  double aux_loss = 0.0;
  struct AuxLossParts {
    double aux_loss = 0.0, seq_aux_loss = 0.0, global_aux_loss = 0.0;
  } aux_loss_parts;
  double z_loss = 0.0;

  /// Row counts: replayed + native + padded == T. Invalid replay rows routed natively (with
  /// ReplayRowPolicy::native) count as native and also in num_invalid_replay_rows.
  int64_t num_replayed_rows = 0;
  int64_t num_native_rows = 0;
  int64_t num_padded_rows = 0;
  int64_t num_invalid_replay_rows = 0;

  /// State saved for topk_route_backward (opaque; shared by copies of the result, never
  /// modified after the forward). Null for a default-constructed result.
  std::shared_ptr<const detail::RouteSaved> saved;
};

/// Routes T tokens to K of E experts from gate logits.
/// logits: [T, E] fp32 or fp64 (the router dtype), or bf16 (Megatron-Core's default
/// moe_router_dtype=None: scores, weights and losses computed in fp32 from the bf16 logits, the
/// weights rounded to bf16 before capacity, returned in bf16); NaN/Inf is an error naming token
/// and expert.
/// Throws std::invalid_argument before any work for a bad config, shape, dtype or replay row.
/// Deterministic; not collective (per-rank capacity and losses over the local tokens).
RouteResult topk_route(const Tensor& logits, const RouteInputs& inputs, const RouterConfig& config,
                       const RouteOptions& options = {});

/// Communicators of the cross-rank loss statistics (Megatron-Core's process groups). Null = local.
struct RouteComms {
  /// Megatron's tp_cp group: aux_loss / seq_aux_loss per-expert counts and token totals are
  /// summed over it, the z-loss is averaged over it (coefficient / size), and
  /// calculate_per_token_loss scales by local valid tokens * its size.
  dist::Communicator* loss = nullptr;
  /// Megatron's tp_dp_cp group: global_aux_loss per-expert counts and token total (the state
  /// accumulates the summed counts, the same on every rank).
  dist::Communicator* global_aux_loss = nullptr;
};

/// topk_route with cross-rank loss statistics. Collective over the given communicators (every
/// rank must call it with the same config): sums are taken over allgathered values in rank order,
/// so they are deterministic. Before any reduction the ranks agree: a bad argument on any rank
/// makes every rank throw the same std::invalid_argument ("[route] on rank r: <its message>"),
/// and so does a setting the reductions depend on that differs between ranks ("[route] loss_comm
/// ranks disagree: num_experts=8 on rank 0, 16 on rank 1": num_experts, top_k, the aux / seq /
/// global aux losses, the seq_aux_loss sequence count, which communicators were given), before
/// any state is updated. Ids and weights stay per token; only the losses and their gradients see
/// the other ranks.
RouteResult topk_route(const Tensor& logits, const RouteInputs& inputs, const RouterConfig& config,
                       const RouteOptions& options, const RouteComms& comms);

/// Options of topk_route_backward.
struct RouteBackwardOptions {
  /// Multiplies the aux- and z-loss gradients (Megatron's MoEAuxLossAutoScaler main-loss scale).
  double loss_grad_scale = 1.0;
};

/// Gradients of topk_route.
struct RouteGrads {
  Tensor grad_logits{};  ///< [T, E] dtype of the logits (bf16 ones: computed in fp32, rounded)
};

/// Backward of topk_route: grad_logits = d/dlogits of <grad_topk_weights, topk_weights> plus
/// loss_grad_scale * d(aux_loss + z_loss)/dlogits. grad_topk_weights: [T, K] fp32/fp64, or
/// undefined (losses only); entries at dropped/padded slots are ignored. Padded rows get 0.
/// Replayed rows differentiate through the weights at the replayed ids. Deterministic.
/// The forward's configuration is the one saved in the result.
RouteGrads topk_route_backward(const Tensor& grad_topk_weights, const RouteResult& result,
                               const RouteBackwardOptions& options = {});

/// The routing-plan options that carry a route's capacity and padding to build_routing_plan (and
/// the dispatcher): expert_capacity C (the route already dropped, so the plan drops nothing more),
/// pad_to_capacity and expert_alignment from the result. build_routing_plan(r.topk_idx,
/// weights, E, routing_plan_options(r)) then lays out every expert's block padded as Megatron's
/// dispatcher would (zero rows with token -1 and weight 0 instead of Megatron's weight-0 real
/// tokens; see notes/router-parity.md).
RoutingPlanOptions routing_plan_options(const RouteResult& result);

/// Aux-loss-free bias update (DeepSeek-V3): returns b + rate * sign(mean(c) - c).
/// expert_bias: [E] fp32; num_tokens_per_expert: [E] int64 or fp32/fp64 counts (summed over the
/// step, e.g. RouteResult::num_tokens_per_expert); result [E] fp32. Deterministic.
Tensor update_expert_bias(const Tensor& expert_bias, const Tensor& num_tokens_per_expert,
                          double rate);

/// The same with the counts summed over `comm` first (Megatron sums them over tp_dp_cp before
/// the update), so every rank gets the same bias. Collective; a bad argument on any rank throws
/// on every rank.
Tensor update_expert_bias(const Tensor& expert_bias, const Tensor& num_tokens_per_expert,
                          double rate, dist::Communicator& comm);

/// The logits topk_route routes instead of the given ones under force_load_balancing /
/// force_biased (benchmarking): N(0, 1) per element from options.force_seed plus, with
/// force_biased, a per-expert N(0, |force_biased|) bias from options.force_bias_seed; [T, E] in
/// the dtype of `logits` (fp32 for bf16). Only the shape and dtype of `logits` are read.
Tensor forced_router_logits(const Tensor& logits, const RouterConfig& config,
                            const RouteOptions& options);

/// Quantile balancing's once-per-global-batch update (Megatron-Core finalize_model_grads
/// _update_router_qb_beta, moe_router_quantile_balancing_ema = ema): avg = qb_beta_accum /
/// max(count, 1) (this rank's mean of the accumulated RouteResult::qb_beta_local), new =
/// ema * qb_beta + (1 - ema) * avg, re-centred to mean 0. qb_beta, qb_beta_accum: [E] fp32;
/// count >= 0 (accumulated micro-batches); ema in [0, 1]. Computed in double, rounded once;
/// returns [E] fp32.
Tensor update_qb_beta(const Tensor& qb_beta, const Tensor& qb_beta_accum, int64_t count,
                      double ema);

/// The same with avg averaged over `comm` (Megatron averages it over its dp_cp group): every
/// rank's avg is allgathered and summed in rank order (deterministic), then divided by the size,
/// so every rank gets the same qb_beta. Collective; a bad argument on any rank (or a different
/// number of experts) throws on every rank.
Tensor update_qb_beta(const Tensor& qb_beta, const Tensor& qb_beta_accum, int64_t count,
                      double ema, dist::Communicator& comm);

/// The comm-taking router calls whose agreement fail_router_collective joins.
enum class RouterCollective : uint8_t { topk_route, update_expert_bias, update_qb_beta };

/// For a caller (a binding, a framework adapter) whose own checks failed on this rank before it
/// could call one of the collective router calls: joins that call's agreement in its place (over
/// comms.loss and comms.global_aux_loss for topk_route, comms.loss for the updates), so every
/// rank throws the same std::invalid_argument ("[route] on rank r: <message>") instead of the
/// others waiting for this rank. Always throws (this rank's message when no communicator).
[[noreturn]] void fail_router_collective(RouterCollective op, const std::string& message,
                                         const RouteComms& comms);

/// Input jitter (Megatron-Core `moe_input_jitter_eps`, Switch Transformer): returns x * u with
/// u ~ Uniform(1 - eps, 1 + eps) drawn per element from a counter-based generator keyed by
/// (seed, flat index), computed in fp32 (fp64 for fp64 x) and rounded once to x's dtype.
/// x: [T, H] bf16, fp32 or fp64; eps in [0, 1). Deterministic and thread-count invariant; not
/// batch invariant (a token's noise depends on its row). Replay is unaffected: replayed ids are
/// used as given, only the weights see the jittered logits.
Tensor input_jitter(const Tensor& x, double eps, uint64_t seed);

/// Backward of input_jitter: grad_x = grad * u (same eps and seed), in grad's dtype.
Tensor input_jitter_backward(const Tensor& grad, double eps, uint64_t seed);

/// Parse/print enum names ("softmax", "seq_aux_loss", ...); parse throws std::invalid_argument.
/// (token_drop_policy_name / parse_token_drop_policy are in capacity.h.)
const char* score_function_name(ScoreFunction f);
ScoreFunction parse_score_function(const std::string& name);
const char* aux_loss_type_name(AuxLossType t);
AuxLossType parse_aux_loss_type(const std::string& name);

/// Checks a config alone (the checks topk_route runs first); throws std::invalid_argument.
void validate_router_config(const RouterConfig& config);

}  // namespace switchyard

// The MoE models whose shapes the tests and the benchmarks use, in one place. Every number is the
// model's published configuration (Hugging Face config.json of the checkpoint named below), in
// switchyard's vocabulary (DESIGN.md; DeepEP's and Megatron-Core's names):
//
//   field                 Qwen/Qwen3-30B-A3B     deepseek-ai/DeepSeek-V3        Mixtral-8x7B-v0.1
//   hidden                hidden_size 2048       hidden_size 7168               hidden_size 4096
//   moe_ffn_hidden        moe_intermediate 768   moe_intermediate 2048          intermediate 14336
//   num_experts           num_experts 128        n_routed_experts 256           num_local_experts 8
//   top_k                 num_experts_per_tok 8  num_experts_per_tok 8          num_experts_per_tok
//   2 score_function        softmax                scoring_func sigmoid           softmax
//   num_groups/group_topk -                      n_group 8 / topk_group 4       -
//   expert_bias           -                      yes (topk_method noaux_tc:      -
//                                                e_score_correction_bias)
//   topk_scaling_factor   1                      routed_scaling_factor 2.5      1
//   shared experts        -                      n_shared_experts 1 (FFN 2048)  -
//   layers (MoE)          48 (48)                61 (58: first_k_dense 3)       32 (32)
//   load balancing        router_aux_loss_coef   aux_loss_alpha 0.001, seq_aux router_aux_loss_coef
//                         0.001 (aux_loss)       (seq_aux_loss; bias balancing) 0.02 (aux_loss)
//
// Weights are renormalised over the chosen K in all three (Qwen3 norm_topk_prob true, DeepSeek-V3
// norm_topk_prob true, Mixtral's softmax over the top-k logits), i.e. Megatron-Core's
// pre_softmax=false for softmax; sigmoid weights are always renormalised for K > 1.
//
// The token count is not a property of the model: each test or benchmark picks its own (and says
// when it scales one down to fit the machine).
#pragma once

#include <cstdint>

#include "switchyard/router.h"

namespace switchyard::testing {

/// One MoE layer's shapes and router semantics.
struct MoeModel {
  const char* name;        ///< snake_case label used in benchmark rows ("qwen3_30b_a3b")
  int64_t hidden;          ///< H
  int64_t moe_ffn_hidden;  ///< F: one routed expert's intermediate size
  int64_t num_experts;     ///< E: routed experts
  int64_t top_k;           ///< K
  // The rest defaults to the plain top-k softmax router (Qwen3's and Mixtral's): a model lists
  // only what differs.
  ScoreFunction score_function = ScoreFunction::softmax;
  int64_t num_groups = 0;  ///< 0 = no group-limited routing
  int64_t group_topk = 0;
  bool expert_bias = false;  ///< aux-loss-free balancing bias on the selection scores
  double topk_scaling_factor = 1.0;
  int64_t num_shared_experts = 0;
  int64_t shared_expert_ffn_hidden = 0;  ///< intermediate size of all shared experts together
  int64_t num_layers = 0;                ///< transformer layers
  int64_t num_moe_layers = 0;            ///< of which MoE
  AuxLossType aux_loss_type = AuxLossType::aux_loss;
  double aux_loss_coeff = 0.0;

  /// The router configuration of this model (losses as published; no capacity: all three are
  /// trained dropless in Megatron-Core's recipes).
  RouterConfig router_config() const {
    RouterConfig c;
    c.num_experts = num_experts;
    c.top_k = top_k;
    c.score_function = score_function;
    c.num_groups = num_groups;
    c.group_topk = group_topk;
    c.topk_scaling_factor = topk_scaling_factor;
    c.aux_loss_type = aux_loss_type;
    c.aux_loss_coeff = aux_loss_coeff;
    return c;
  }
};

/// Qwen/Qwen3-30B-A3B.
inline constexpr MoeModel kQwen3_30B_A3B{
    .name = "qwen3_30b_a3b",
    .hidden = 2048,
    .moe_ffn_hidden = 768,
    .num_experts = 128,
    .top_k = 8,
    .num_layers = 48,
    .num_moe_layers = 48,
    .aux_loss_coeff = 1e-3,
};

/// deepseek-ai/DeepSeek-V3 (and -R1: same MoE layers).
inline constexpr MoeModel kDeepSeekV3{
    .name = "deepseek_v3",
    .hidden = 7168,
    .moe_ffn_hidden = 2048,
    .num_experts = 256,
    .top_k = 8,
    .score_function = ScoreFunction::sigmoid,
    .num_groups = 8,
    .group_topk = 4,
    .expert_bias = true,
    .topk_scaling_factor = 2.5,
    .num_shared_experts = 1,
    .shared_expert_ffn_hidden = 2048,
    .num_layers = 61,
    .num_moe_layers = 58,
    .aux_loss_type = AuxLossType::seq_aux_loss,
    .aux_loss_coeff = 1e-3,
};

/// mistralai/Mixtral-8x7B-v0.1.
inline constexpr MoeModel kMixtral8x7B{
    .name = "mixtral_8x7b",
    .hidden = 4096,
    .moe_ffn_hidden = 14336,
    .num_experts = 8,
    .top_k = 2,
    .num_layers = 32,
    .num_moe_layers = 32,
    .aux_loss_coeff = 2e-2,
};

}  // namespace switchyard::testing

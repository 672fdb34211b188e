// Expert capacity and token dropping: the one definition shared by the router (topk_route) and the
// routing plan (build_routing_plan, the dispatcher's plan). Semantics are Megatron-Core's
// get_capacity / apply_router_token_dropping (see DESIGN.md "Semantics" and notes/routing.md).
#pragma once

#include <cstdint>
#include <string>

namespace switchyard {

/// Which (token, expert) pairs an expert over capacity keeps (Megatron-Core
/// `moe_token_drop_policy`): `probs` keeps the highest routing weights (ties: lower token index),
/// `position` keeps the first tokens (lowest token index).
enum class TokenDropPolicy : uint8_t { probs, position };

/// "probs" / "position"; parse throws std::invalid_argument naming `op`.
const char* token_drop_policy_name(TokenDropPolicy p);
TokenDropPolicy parse_token_drop_policy(const std::string& name);

/// Per-expert capacity of a call routing `num_tokens` tokens to `top_k` of `num_experts` experts:
/// C = min(ceil(num_tokens * top_k / num_experts * capacity_factor), num_tokens).
/// The ceil is Megatron-Core's get_capacity(num_tokens * topk, num_experts, capacity_factor),
/// computed the same way in double. The clamp to num_tokens is what Megatron's
/// apply_router_token_dropping does with a larger C: no expert can receive more than one pair per
/// token, so nothing is dropped, and with pad_to_capacity its routing map then holds all
/// num_tokens tokens per expert (the padded row count is min(C, num_tokens)). The clamp also
/// keeps a huge factor from overflowing. capacity_factor must be finite and > 0 (checked by the
/// callers, which name their own argument).
int64_t expert_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                        double capacity_factor);

}  // namespace switchyard

// Expert capacity (Megatron-Core get_capacity) and token dropping (apply_router_token_dropping),
// shared by the router and the routing plan: the formula and the policy names (front-end side);
// the drops are a kernel behind the seam (src/cpu/routing_kernels.cpp).
#include "switchyard/capacity.h"

#include <cmath>

#include "check.h"

namespace switchyard {

const char* token_drop_policy_name(TokenDropPolicy p) {
  return p == TokenDropPolicy::probs ? "probs" : "position";
}

TokenDropPolicy parse_token_drop_policy(const std::string& name) {
  if (name == "probs") return TokenDropPolicy::probs;
  if (name == "position") return TokenDropPolicy::position;
  detail::fail_arg("route", "token_drop_policy must be probs or position, got \"", name, "\"");
}

int64_t expert_capacity(int64_t num_tokens, int64_t top_k, int64_t num_experts,
                        double capacity_factor) {
  // Megatron: math.ceil((num_tokens * topk / num_experts) * capacity_factor), in double.
  const double c = std::ceil(static_cast<double>(num_tokens * top_k) /
                             static_cast<double>(num_experts) * capacity_factor);
  return c >= static_cast<double>(num_tokens) ? num_tokens : static_cast<int64_t>(c);
}

}  // namespace switchyard

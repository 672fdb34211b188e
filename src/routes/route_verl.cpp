// Route tables -> verl's batch layout (int16 [batch, seq, num_hidden_layers, K] + attention mask).
#include "switchyard/route_verl.h"

#include <algorithm>
#include <cstring>

#include "check.h"

namespace switchyard {

using detail::fail_arg;

namespace {

constexpr const char* kOp = "to_verl";

// Checks the tables and the layer map; returns K.
int64_t check_inputs(const std::vector<RouteTable>& tables, const std::vector<int64_t>& moe_layers,
                     int64_t num_hidden_layers) {
  if (tables.empty()) fail_arg(kOp, "tables must hold at least one table");
  if (num_hidden_layers < 1)
    fail_arg(kOp, "num_hidden_layers must be >= 1, got ", num_hidden_layers);
  for (size_t m = 0; m < moe_layers.size(); ++m) {
    if (moe_layers[m] < 0 || moe_layers[m] >= num_hidden_layers ||
        (m > 0 && moe_layers[m] <= moe_layers[m - 1])) {
      fail_arg(kOp, "moe_layers must be strictly increasing hidden-layer indices in [0, "
               "num_hidden_layers=", num_hidden_layers, "), got ", moe_layers[m], " at position ",
               m);
    }
  }
  const int64_t M = static_cast<int64_t>(moe_layers.size());
  const int64_t K = tables[0].top_k();
  for (size_t i = 0; i < tables.size(); ++i) {
    const RouteTable& t = tables[i];
    check_route_table(t, kOp, detail::cat("tables[", i, "]").c_str());
    if (t.num_moe_layers() != M) {
      fail_arg(kOp, "tables[", i, "] has ", t.num_moe_layers(), " MoE layers, moe_layers names ",
               M);
    }
    if (t.top_k() != K) fail_arg(kOp, "tables[", i, "] has top_k=", t.top_k(), ", tables[0] ", K);
    if (t.num_experts > 32768) {
      fail_arg(kOp, "tables[", i, "]: verl stores ids as int16, num_experts must be <= 32768, got ",
               t.num_experts);
    }
  }
  return K;
}

// Writes table `i` at the given positions of batch row b.
void place(const RouteTable& t, size_t i, const std::vector<int64_t>& moe_layers, int64_t b,
           const std::vector<int64_t>& positions, int64_t S, int64_t H, int32_t* out) {
  const int64_t M = t.num_moe_layers(), K = t.top_k();
  const int32_t* in = t.topk_idx.data<int32_t>();
  for (int64_t r = 0; r < t.num_tokens(); ++r) {
    for (int64_t m = 0; m < M; ++m) {
      const int32_t* row = in + (r * M + m) * K;
      int64_t none = 0;
      for (int64_t k = 0; k < K; ++k) none += row[k] < 0;
      if (none == K) continue;  // no route: verl's 0 row
      if (none > 0) {
        fail_arg(kOp, "tables[", i, "]: row at token ", r, ", MoE layer ", m,
                 " mixes -1 with expert ids; verl's layout has no place for it");
      }
      int32_t* dst = out + ((b * S + positions[size_t(r)]) * H + moe_layers[size_t(m)]) * K;
      std::memcpy(dst, row, size_t(K) * sizeof(int32_t));
    }
  }
}

// The batch of B = tables.size() rows of S positions: table b's rows go to positions_of(b)
// (ascending, one per table row), which are also the mask's ones.
template <class PositionsOf>
VerlBatch fill_batch(const std::vector<RouteTable>& tables, const std::vector<int64_t>& moe_layers,
                     int64_t H, int64_t K, int64_t S, PositionsOf positions_of) {
  const int64_t B = static_cast<int64_t>(tables.size());
  int64_t bytes = 4;  // routed_experts [B, S, H, K] int32 must be allocatable: at most 2^62 bytes
  for (int64_t d : {B, S, H, K}) {
    if (__builtin_mul_overflow(bytes, d, &bytes) || bytes > (int64_t{1} << 62)) {
      fail_arg(kOp, "seq_len=", S, " makes routed_experts [", B, ", ", S, ", ", H, ", ", K,
               "] larger than 2^62 bytes");
    }
  }
  VerlBatch v;
  v.routed_experts = Tensor::zeros({B, S, H, K}, DType::int32);
  v.attention_mask = Tensor::zeros({B, S}, DType::int64);
  int32_t* out = v.routed_experts.data<int32_t>();
  int64_t* mask = v.attention_mask.data<int64_t>();
  std::vector<int64_t> pos;
  for (int64_t b = 0; b < B; ++b) {
    positions_of(b, pos);
    for (int64_t p : pos) mask[b * S + p] = 1;
    place(tables[size_t(b)], size_t(b), moe_layers, b, pos, S, H, out);
  }
  return v;
}

}  // namespace

VerlBatch to_verl(const std::vector<RouteTable>& tables, const std::vector<int64_t>& moe_layers,
                  const VerlOptions& options) {
  const int64_t H = options.num_hidden_layers;
  const int64_t K = check_inputs(tables, moe_layers, H);
  int64_t longest = 0;
  for (const RouteTable& t : tables) longest = std::max(longest, t.num_tokens());
  if (options.seq_len < 0) fail_arg(kOp, "seq_len must be >= 0 (0 = longest), got ", options.seq_len);
  const int64_t S = options.seq_len > 0 ? options.seq_len : longest;
  if (S < longest) {
    fail_arg(kOp, "seq_len=", S, " is shorter than the longest table (", longest, " tokens)");
  }
  return fill_batch(tables, moe_layers, H, K, S, [&](int64_t b, std::vector<int64_t>& pos) {
    const int64_t T = tables[size_t(b)].num_tokens();
    const int64_t first = options.padding_side == PaddingSide::left ? S - T : 0;
    pos.resize(size_t(T));
    for (int64_t r = 0; r < T; ++r) pos[size_t(r)] = first + r;
  });
}

VerlBatch to_verl(const std::vector<RouteTable>& tables, const std::vector<int64_t>& moe_layers,
                  int64_t num_hidden_layers, const Tensor& attention_mask) {
  const int64_t H = num_hidden_layers;
  const int64_t K = check_inputs(tables, moe_layers, H);
  detail::check_defined(attention_mask, kOp, "attention_mask");
  detail::check_dtype(attention_mask, kOp, "attention_mask",
                      {DType::boolean, DType::uint8, DType::int32, DType::int64});
  detail::check_dim(attention_mask, kOp, "attention_mask", 2);
  const int64_t B = static_cast<int64_t>(tables.size());
  detail::check_shape(attention_mask, kOp, "attention_mask", {B, -1});
  const int64_t S = attention_mask.size(1);
  // Check every row before writing any (a bad mask row is reported before any work).
  std::vector<std::vector<int64_t>> positions(static_cast<size_t>(B));
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t s = 0; s < S; ++s) {
      if (attention_mask.item_as_double(b * S + s) != 0.0) positions[size_t(b)].push_back(s);
    }
    const int64_t T = tables[size_t(b)].num_tokens();
    if (static_cast<int64_t>(positions[size_t(b)].size()) != T) {
      fail_arg(kOp, "attention_mask row ", b, " has ", positions[size_t(b)].size(),
               " real tokens, tables[", b, "] has ", T, " rows");
    }
  }
  return fill_batch(tables, moe_layers, H, K, S, [&](int64_t b, std::vector<int64_t>& pos) {
    pos = positions[size_t(b)];
  });
}

}  // namespace switchyard

// Route tables -> verl's batch layout (int16 [batch, seq, num_hidden_layers, K] + attention mask).
#include "switchyard/route_verl.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "check.h"
#include "route_rows.h"

namespace switchyard {

using detail::fail_arg;

namespace {

constexpr const char* kOp = "to_verl";

// Tables at least as large as this go to the engine's threads (below it a fork costs more).
constexpr int64_t kParallelBytes = int64_t{1} << 20;

// Checks the tables' shapes and the layer map; returns K. Ids are checked while placing them.
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
    const std::string name = detail::cat("tables[", i, "]");
    detail::check_defined(t.topk_idx, kOp, name.c_str());
    detail::check_dtype(t.topk_idx, kOp, name.c_str(), {DType::int32});
    detail::check_dim(t.topk_idx, kOp, name.c_str(), 3);
    if (t.num_experts < 1) fail_arg(kOp, name, ".num_experts must be >= 1, got ", t.num_experts);
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

// Writes batch row b ([S, H, K] int16 at `out`): table rows at `positions` (ascending), zeros
// elsewhere; every byte of the row is written once. Returns "" or what is wrong with the table
// (a bad id, a row mixing -1 with ids), found while copying.
std::string place(const RouteTable& t, size_t i, const std::vector<int64_t>& col_of,
                  const std::vector<int64_t>& positions, int64_t S, int64_t H, int16_t* out) {
  const int64_t M = t.num_moe_layers(), K = t.top_k(), E = t.num_experts;
  const int32_t* in = t.topk_idx.data<int32_t>();
  int64_t s = 0;
  for (size_t r = 0; r <= positions.size(); ++r) {
    const int64_t next = r < positions.size() ? positions[r] : S;
    std::memset(out + s * H * K, 0, size_t((next - s) * H * K) * sizeof(int16_t));  // padding
    if (r == positions.size()) break;
    int16_t* dst_tok = out + next * H * K;
    for (int64_t h = 0; h < H; ++h) {
      int16_t* dst = dst_tok + h * K;
      const int64_t m = col_of[size_t(h)];
      if (m < 0) {  // dense layer
        std::memset(dst, 0, size_t(K) * sizeof(int16_t));
        continue;
      }
      const int32_t* row = in + (int64_t(r) * M + m) * K;
      int32_t lo = row[0], hi = row[0];
      for (int64_t k = 1; k < K; ++k) {
        lo = std::min(lo, row[k]);
        hi = std::max(hi, row[k]);
      }
      if (lo >= 0 && hi < E) {
        for (int64_t k = 0; k < K; ++k) dst[k] = static_cast<int16_t>(row[k]);
        continue;
      }
      if (lo < -1 || hi >= E) {
        try {  // names the first bad id exactly as check_route_table does
          check_route_table(t, kOp, detail::cat("tables[", i, "]").c_str());
        } catch (const std::invalid_argument& e) {
          return e.what();
        }
      }
      if (hi >= 0) {
        return detail::cat("[", kOp, "] tables[", i, "]: row at token ", r, ", MoE layer ", m,
                           " mixes -1 with expert ids; verl's layout has no place for it");
      }
      std::memset(dst, 0, size_t(K) * sizeof(int16_t));  // no route: verl's 0 row
    }
    s = next + 1;
  }
  return {};
}

// The batch of B = tables.size() rows of S positions: table b's rows go to positions_of(b)
// (ascending, one per table row), which are also the mask's ones. Rows are filled on the engine's
// threads; the error of the first failing row (batch order) is thrown.
template <class PositionsOf>
VerlBatch fill_batch(const std::vector<RouteTable>& tables, const std::vector<int64_t>& moe_layers,
                     int64_t H, int64_t K, int64_t S, PositionsOf positions_of) {
  const int64_t B = static_cast<int64_t>(tables.size());
  int64_t bytes = 2;  // routed_experts [B, S, H, K] int16 must be allocatable: at most 2^62 bytes
  for (int64_t d : {B, S, H, K}) {
    if (__builtin_mul_overflow(bytes, d, &bytes) || bytes > (int64_t{1} << 62)) {
      fail_arg(kOp, "seq_len=", S, " makes routed_experts [", B, ", ", S, ", ", H, ", ", K,
               "] larger than 2^62 bytes");
    }
  }
  std::vector<int64_t> col_of(size_t(H), -1);
  for (size_t m = 0; m < moe_layers.size(); ++m) col_of[size_t(moe_layers[m])] = int64_t(m);
  VerlBatch v;
  v.routed_experts = Tensor::empty({B, S, H, K}, DType::int16);
  v.attention_mask = Tensor::zeros({B, S}, DType::int64);
  int16_t* out = v.routed_experts.data<int16_t>();
  int64_t* mask = v.attention_mask.data<int64_t>();
  std::vector<std::string> errors(static_cast<size_t>(B));
#pragma omp parallel if (B > 1 && bytes >= kParallelBytes)
  {
    std::vector<int64_t> pos;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < B; ++b) {
      positions_of(b, pos);
      for (int64_t p : pos) mask[b * S + p] = 1;
      errors[size_t(b)] =
          place(tables[size_t(b)], size_t(b), col_of, pos, S, H, out + b * S * H * K);
    }
  }
  for (const std::string& e : errors) {
    if (!e.empty()) throw std::invalid_argument(e);
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
  // Check every mask row before writing any (a bad mask row is reported before any table error).
  std::vector<int64_t> pos;
  for (int64_t b = 0; b < B; ++b) {
    detail::mask_positions(attention_mask, b, pos);
    const int64_t T = tables[size_t(b)].num_tokens();
    if (static_cast<int64_t>(pos.size()) != T) {
      fail_arg(kOp, "attention_mask row ", b, " has ", pos.size(), " real tokens, tables[", b,
               "] has ", T, " rows");
    }
  }
  return fill_batch(tables, moe_layers, H, K, S, [&](int64_t b, std::vector<int64_t>& p) {
    detail::mask_positions(attention_mask, b, p);
  });
}

ImportResult from_verl(const Tensor& routed_experts, const Tensor& attention_mask,
                       const ImportOptions& options) {
  const char* op = "from_verl";
  const Tensor& re = routed_experts;
  detail::check_defined(re, op, "routed_experts");
  detail::check_dtype(re, op, "routed_experts",
                      {DType::int16, DType::uint16, DType::uint8, DType::int32, DType::int64});
  detail::check_dim(re, op, "routed_experts", 4);
  detail::check_defined(attention_mask, op, "attention_mask");
  detail::check_dtype(attention_mask, op, "attention_mask",
                      {DType::boolean, DType::uint8, DType::int32, DType::int64});
  detail::check_shape(attention_mask, op, "attention_mask", {re.size(0), re.size(1)});
  if (options.num_experts < 1) fail_arg(op, "num_experts must be >= 1, got ", options.num_experts);
  detail::check_invalid_rows_policy(op, options.invalid_rows);
  if (options.prompt_start != 0) {
    fail_arg(op, "prompt_start must be 0 (verl's tensor has a row for every token), got ",
             options.prompt_start);
  }
  check_import_options(options);  // the rest of the options (layer map, policies)
  const int64_t B = re.size(0), S = re.size(1), H = re.size(2), K = re.size(3);
  if (options.num_input_layers > 0 && H != options.num_input_layers) {
    fail_arg(op, "routed_experts has ", H,
             " layers per token, expected num_input_layers=", options.num_input_layers);
  }
  if (options.top_k > 0 && K != options.top_k) {
    fail_arg(op, "routed_experts has top_k=", K, ", expected ", options.top_k);
  }
  if (K < 1 || H < 1 || H > 65536 || K > 65536 || H * K > (int64_t{1} << 20)) {
    fail_arg(op, "routed_experts [", B, ", ", S, ", ", H, ", ", K,
             "] is not a route batch (layers and top_k must be >= 1, their product <= 2^20)");
  }
  detail::RowPlan plan;
  try {
    plan = detail::make_row_plan(options, H, K);
  } catch (const std::invalid_argument& e) {
    fail_arg(op, "routed_experts (", H, " layers): ", e.what());
  }
  const int64_t M = static_cast<int64_t>(plan.moe.size());
  const int64_t row_elems = H * K;
  std::vector<RouteTable> tables(static_cast<size_t>(B));
  std::vector<detail::RowFindings> finds(static_cast<size_t>(B));
  std::vector<int64_t> bad_position(static_cast<size_t>(B), -1);
  std::vector<std::string> failures(static_cast<size_t>(B));
  std::vector<std::exception_ptr> thrown(static_cast<size_t>(B));  // e.g. bad_alloc
  detail::visit_id_dtype(re.dtype(), [&](auto* tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    const T* base = static_cast<const T*>(re.raw());
#pragma omp parallel if (B > 1 && static_cast <int64_t>(re.nbytes()) >= kParallelBytes)
    {
      std::vector<int64_t> pos;
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < B; ++b) {
        try {
          detail::mask_positions(attention_mask, b, pos);
          const int64_t n = static_cast<int64_t>(pos.size());
          RouteTable& t = tables[size_t(b)];
          t.num_experts = options.num_experts;
          t.topk_idx = Tensor::empty({n, M, K}, DType::int32);
          const T* row_b = base + b * S * row_elems;
          detail::RowFindings& f = finds[size_t(b)];
          if (!detail::import_rows<T>([&](int64_t r) { return row_b + pos[size_t(r)] * row_elems; },
                                      n, plan, t.topk_idx.data<int32_t>(), f)) {
            failures[size_t(b)] = f.error;
            bad_position[size_t(b)] = pos[size_t(f.error_token)];
          }
        } catch (...) {
          thrown[size_t(b)] = std::current_exception();
        }
      }
    }
  });
  for (int64_t b = 0; b < B; ++b) {
    if (thrown[size_t(b)]) std::rethrow_exception(thrown[size_t(b)]);
    if (!failures[size_t(b)].empty()) {
      fail_arg(op, "routed_experts[", b, "] (sequence ", b, ", position ", bad_position[size_t(b)],
               "): ", failures[size_t(b)]);
    }
  }
  ImportResult r;
  ImportReport& rep = r.report;
  rep.num_sequences = B;
  rep.num_input_layers = H;
  rep.num_hidden_layers = plan.hidden;
  rep.top_k = K;
  rep.moe_layers = plan.moe;
  int64_t dense_nonzero = 0, first_dense_layer = -1, first_dense_seq = -1;
  for (int64_t b = 0; b < B; ++b) {
    const detail::RowFindings& f = finds[size_t(b)];
    rep.num_tokens += tables[size_t(b)].num_tokens();
    rep.num_zero_rows += f.num_zero_rows;
    rep.num_invalid_rows += f.num_invalid_rows;
    for (const auto& z : f.first_zero_rows) {
      if (rep.first_zero_rows.size() < detail::kMaxReportedZeroRows)
        rep.first_zero_rows.push_back({b, z[0], z[1]});
    }
    if (f.dense_nonzero > 0 && dense_nonzero == 0) {
      first_dense_layer = f.first_dense_layer;
      first_dense_seq = b;
    }
    dense_nonzero += f.dense_nonzero;
    r.sources.push_back(detail::cat("routed_experts[", b, "]"));
  }
  if (dense_nonzero > 0) {
    rep.warnings.push_back(detail::cat("routed_experts: ", dense_nonzero,
                                       " rows on layers the map calls dense hold nonzero ids "
                                       "(first on hidden layer ",
                                       first_dense_layer, ", sequence ", first_dense_seq,
                                       "): is the layer map right?"));
  }
  r.sequences = std::move(tables);
  return r;
}

}  // namespace switchyard

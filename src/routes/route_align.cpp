// Alignment of route tables to the trainer's layout: padding removal, THD packing, context- and
// sequence-parallel splits, pipeline layer slices, micro-batches, and their inverses. Everything
// here moves whole rows of K ids; nothing is computed on ids.
#include "switchyard/route_align.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <numeric>
#include <type_traits>

#include "check.h"
#include "route_codec.h"
#include "route_rows.h"

namespace switchyard {

using detail::fail_arg;

namespace {

// Largest padding multiple (and tp/cp/fp8 size) pack_thd accepts: 2*tp*cp of any real layout is far
// below it (tp 1024, cp 512); beyond it sizes overflow or a pack needs gigabytes of -1 rows.
constexpr int64_t kMaxPackMultiple = int64_t{1} << 20;

// Bytes of one token's routes.
size_t token_bytes(const RouteTable& t) {
  return static_cast<size_t>(t.num_moe_layers() * t.top_k()) * sizeof(int32_t);
}

void check_same_layout(const std::vector<RouteTable>& tables, const char* op, const char* name) {
  for (size_t i = 0; i < tables.size(); ++i) {
    detail::check_defined(tables[i].topk_idx, op, name);
    detail::check_dtype(tables[i].topk_idx, op, name, {DType::int32});
    detail::check_dim(tables[i].topk_idx, op, name, 3);
    if (tables[i].num_moe_layers() != tables[0].num_moe_layers() ||
        tables[i].top_k() != tables[0].top_k() || tables[i].num_experts != tables[0].num_experts) {
      fail_arg(op, name, "[", i, "] must match ", name,
               "[0] (num_moe_layers=", tables[0].num_moe_layers(), ", top_k=", tables[0].top_k(),
               ", num_experts=", tables[0].num_experts,
               "), got num_moe_layers=", tables[i].num_moe_layers(), ", top_k=", tables[i].top_k(),
               ", num_experts=", tables[i].num_experts);
    }
  }
}

void check_table(const RouteTable& t, const char* op, const char* name) {
  detail::check_defined(t.topk_idx, op, name);
  detail::check_dtype(t.topk_idx, op, name, {DType::int32});
  detail::check_dim(t.topk_idx, op, name, 3);
}

void check_cu(const std::vector<int64_t>& cu, const char* op, int64_t total) {
  if (cu.empty() || cu.front() != 0) fail_arg(op, "cu_seqlens_padded must start with 0");
  for (size_t i = 1; i < cu.size(); ++i) {
    if (cu[i] < cu[i - 1])
      fail_arg(op, "cu_seqlens_padded must be non-decreasing, got ", cu[i - 1], " then ", cu[i],
               " at ", i);
  }
  if (total >= 0 && cu.back() != total) {
    fail_arg(op, "cu_seqlens_padded must end at the table's ", total, " tokens, got ", cu.back());
  }
}

int64_t gcd64(int64_t a, int64_t b) { return b == 0 ? a : gcd64(b, a % b); }

// Inputs at least this large go to the engine's threads (below it a fork costs more).
constexpr int64_t kParallelBytes = int64_t{1} << 20;

// Tokens [begin, begin + n) of a table, copied on the engine's threads with every id checked on
// the way (check_route_table names the first bad one).
RouteTable checked_copy(const RouteTable& t, int64_t begin, int64_t n, const char* op) {
  RouteTable out;
  out.num_experts = t.num_experts;
  out.topk_idx = Tensor::empty({n, t.num_moe_layers(), t.top_k()}, DType::int32);
  const int64_t row = t.num_moe_layers() * t.top_k();
  const int64_t total = n * row;
  const int32_t* src = t.topk_idx.data<int32_t>() + begin * row;
  int32_t* dst = out.topk_idx.data<int32_t>();
  constexpr int64_t kChunk = int64_t{1} << 16;  // ids per task
  const int64_t chunks = (total + kChunk - 1) / kChunk;
  bool ok = true;
#pragma omp parallel for schedule(static) reduction(&& : ok) if (total * 4 >= kParallelBytes)
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t lo = c * kChunk, len = std::min(kChunk, total - lo);
    ok = detail::copy_ids_checked(dst + lo, src + lo, len, t.num_experts) && ok;
  }
  if (!ok) check_route_table(t, op, "table");
  return out;
}

}  // namespace

std::vector<RouteTable> drop_padding(const Tensor& topk_idx, const Tensor& attention_mask,
                                     int64_t num_experts) {
  const char* op = "drop_padding";
  detail::check_defined(topk_idx, op, "topk_idx");
  detail::check_dtype(topk_idx, op, "topk_idx",
                      {DType::int32, DType::int16, DType::uint16, DType::uint8, DType::int64});
  detail::check_dim(topk_idx, op, "topk_idx", 4);
  detail::check_defined(attention_mask, op, "attention_mask");
  detail::check_dtype(attention_mask, op, "attention_mask",
                      {DType::boolean, DType::uint8, DType::int32, DType::int64});
  detail::check_shape(attention_mask, op, "attention_mask", {topk_idx.size(0), topk_idx.size(1)});
  if (num_experts < 1) fail_arg(op, "num_experts must be >= 1, got ", num_experts);
  const int64_t B = topk_idx.size(0), S = topk_idx.size(1), L = topk_idx.size(2),
                K = topk_idx.size(3);
  const int64_t row = L * K;
  std::vector<RouteTable> out(static_cast<size_t>(B));
  std::vector<char> bad(static_cast<size_t>(B), 0);
  std::vector<std::exception_ptr> thrown(static_cast<size_t>(B));
  detail::visit_id_dtype(topk_idx.dtype(), [&](auto* tag) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(tag)>>;
    const T* src = static_cast<const T*>(topk_idx.raw());
#pragma omp parallel if (B > 1 && static_cast <int64_t>(topk_idx.nbytes()) >= kParallelBytes)
    {
      std::vector<int64_t> pos;
#pragma omp for schedule(dynamic, 1)
      for (int64_t b = 0; b < B; ++b) {
        detail::mask_positions(attention_mask, b, pos);
        const int64_t n = static_cast<int64_t>(pos.size());
        RouteTable& t = out[size_t(b)];
        t.num_experts = num_experts;
        try {
          t.topk_idx = Tensor::empty({n, L, K}, DType::int32);
        } catch (...) {  // no exception may leave an OpenMP region: raised below
          thrown[size_t(b)] = std::current_exception();
          continue;
        }
        int32_t* dst = t.topk_idx.data<int32_t>();
        bool ok = true;
        for (int64_t j = 0; j < n; ++j) {
          ok &= detail::widen_ids_checked(dst + j * row, src + (b * S + pos[size_t(j)]) * row, row,
                                          num_experts);
        }
        bad[size_t(b)] = !ok;
      }
    }
    // The slow path, in batch order: the first bad id, named by its place in topk_idx.
    for (int64_t b = 0; b < B; ++b) {
      if (thrown[size_t(b)]) std::rethrow_exception(thrown[size_t(b)]);
      if (!bad[size_t(b)]) continue;
      for (int64_t s = 0; s < S; ++s) {
        for (int64_t i = 0; i < row; ++i) {
          const int64_t v = static_cast<int64_t>(src[(b * S + s) * row + i]);
          if ((v < -1 || v >= num_experts) && attention_mask.item_as_double(b * S + s) != 0.0) {
            fail_arg(op, "topk_idx: ids must be -1 or in [0, num_experts=", num_experts, "), got ",
                     v, " at batch ", b, ", position ", s, ", layer ", i / K, ", slot ", i % K);
          }
        }
      }
    }
  });
  return out;
}

int64_t pack_alignment(const PackOptions& o) {
  const char* op = "pack_thd";
  if (o.tp_size < 1) fail_arg(op, "tp_size must be >= 1, got ", o.tp_size);
  if (o.cp_size < 1) fail_arg(op, "cp_size must be >= 1, got ", o.cp_size);
  if (o.fp8_align < 0) fail_arg(op, "fp8_align must be >= 0, got ", o.fp8_align);
  // Bounded before multiplying (no int64 overflow) and after (a multiple this large pads every
  // sequence to millions of rows: an argument error, not a pack).
  if (o.tp_size > kMaxPackMultiple || o.cp_size > kMaxPackMultiple || o.fp8_align > kMaxPackMultiple) {
    fail_arg(op, "tp_size, cp_size and fp8_align must be <= ", kMaxPackMultiple, ", got tp_size=",
             o.tp_size, ", cp_size=", o.cp_size, ", fp8_align=", o.fp8_align);
  }
  int64_t m = o.cp_size > 1 ? 2 * o.tp_size * o.cp_size : o.tp_size;
  if (o.fp8_align > 0) m = m / gcd64(m, o.fp8_align) * o.fp8_align;
  if (m > kMaxPackMultiple) {
    fail_arg(op, "padding multiple ", m, " (tp_size=", o.tp_size, ", cp_size=", o.cp_size,
             ", fp8_align=", o.fp8_align, ") must be <= ", kMaxPackMultiple);
  }
  return m;
}

PackedRoutes pack_thd(const std::vector<RouteTable>& sequences, const PackOptions& options) {
  const char* op = "pack_thd";
  const int64_t m = pack_alignment(options);
  if (sequences.empty()) fail_arg(op, "sequences must not be empty");
  check_same_layout(sequences, op, "sequences");
  PackedRoutes p;
  p.cu_seqlens.push_back(0);
  p.cu_seqlens_padded.push_back(0);
  for (const auto& s : sequences) {
    const int64_t n = s.num_tokens();
    p.cu_seqlens.push_back(p.cu_seqlens.back() + n);
    p.cu_seqlens_padded.push_back(p.cu_seqlens_padded.back() + (n + m - 1) / m * m);
  }
  // Every byte is written once: the rows copied (their ids checked on the way), the alignment
  // padding -1. Sequences go to the engine's threads.
  const RouteTable& s0 = sequences[0];
  p.table.num_experts = s0.num_experts;
  p.table.topk_idx =
      Tensor::empty({p.cu_seqlens_padded.back(), s0.num_moe_layers(), s0.top_k()}, DType::int32);
  int32_t* dst = p.table.topk_idx.data<int32_t>();
  const int64_t row = s0.num_moe_layers() * s0.top_k();
  const int64_t n = static_cast<int64_t>(sequences.size());
  std::vector<char> bad(sequences.size(), 0);
#pragma omp parallel for schedule( \
    dynamic, 1) if (n > 1 && p.table.topk_idx.nbytes() >= size_t(kParallelBytes))
  for (int64_t i = 0; i < n; ++i) {
    const RouteTable& t = sequences[size_t(i)];
    int32_t* d = dst + p.cu_seqlens_padded[size_t(i)] * row;
    bad[size_t(i)] = !detail::copy_ids_checked(d, t.topk_idx.data<int32_t>(), t.num_tokens() * row,
                                               t.num_experts);
    std::fill(d + t.num_tokens() * row, dst + p.cu_seqlens_padded[size_t(i) + 1] * row, -1);
  }
  for (size_t i = 0; i < sequences.size(); ++i) {
    if (bad[i]) check_route_table(sequences[i], op, detail::cat("sequences[", i, "]").c_str());
  }
  return p;
}

std::vector<RouteTable> unpack_thd(const PackedRoutes& packed) {
  const char* op = "unpack_thd";
  check_table(packed.table, op, "packed.table");
  check_cu(packed.cu_seqlens_padded, op, packed.table.num_tokens());
  if (packed.cu_seqlens.size() != packed.cu_seqlens_padded.size() ||
      packed.cu_seqlens.front() != 0) {
    fail_arg(op, "cu_seqlens must start with 0 and have ", packed.cu_seqlens_padded.size(),
             " entries like cu_seqlens_padded, got ", packed.cu_seqlens.size());
  }
  const size_t n = packed.cu_seqlens.size() - 1;
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = packed.cu_seqlens[i + 1] - packed.cu_seqlens[i];
    const int64_t padded = packed.cu_seqlens_padded[i + 1] - packed.cu_seqlens_padded[i];
    if (len < 0 || len > padded) {
      fail_arg(op, "sequence ", i, " has ", len, " tokens but only ", padded, " padded slots");
    }
  }
  const size_t tb = token_bytes(packed.table);
  const auto* src = static_cast<const char*>(packed.table.topk_idx.raw());
  std::vector<RouteTable> out;
  for (size_t i = 0; i < n; ++i) {
    const int64_t len = packed.cu_seqlens[i + 1] - packed.cu_seqlens[i];
    RouteTable t;
    t.num_experts = packed.table.num_experts;
    t.topk_idx =
        Tensor::empty({len, packed.table.num_moe_layers(), packed.table.top_k()}, DType::int32);
    std::memcpy(t.topk_idx.raw(), src + size_t(packed.cu_seqlens_padded[i]) * tb, size_t(len) * tb);
    out.push_back(std::move(t));
  }
  return out;
}

RouteTable cp_zigzag_split(const RouteTable& packed, const std::vector<int64_t>& cu_seqlens_padded,
                           int64_t cp_size, int64_t cp_rank) {
  const char* op = "cp_zigzag_split";
  check_table(packed, op, "packed");
  if (cp_size < 1 || cp_size > kMaxPackMultiple)
    fail_arg(op, "cp_size must be in [1, ", kMaxPackMultiple, "], got ", cp_size);
  if (cp_rank < 0 || cp_rank >= cp_size)
    fail_arg(op, "cp_rank must be in [0, ", cp_size, "), got ", cp_rank);
  check_cu(cu_seqlens_padded, op, packed.num_tokens());
  if (cp_size == 1) return checked_copy(packed, 0, packed.num_tokens(), op);  // no split
  for (size_t i = 0; i + 1 < cu_seqlens_padded.size(); ++i) {
    const int64_t len = cu_seqlens_padded[i + 1] - cu_seqlens_padded[i];
    if (len % (2 * cp_size) != 0) {
      fail_arg(op, "sequence ", i, " has padded length ", len,
               ", not a multiple of 2*cp_size=", 2 * cp_size);
    }
  }
  RouteTable out;
  out.num_experts = packed.num_experts;
  out.topk_idx = Tensor::empty(
      {packed.num_tokens() / cp_size, packed.num_moe_layers(), packed.top_k()}, DType::int32);
  const int64_t row = packed.num_moe_layers() * packed.top_k();
  const int32_t* src = packed.topk_idx.data<int32_t>();
  int32_t* dst = out.topk_idx.data<int32_t>();
  const int64_t n = static_cast<int64_t>(cu_seqlens_padded.size()) - 1;
  bool ok = true;
  // Sequence i's two chunks land at cu_seqlens_padded[i] / cp_size of the piece.
#pragma omp parallel for schedule(dynamic, 16) reduction(&& : ok) \
    if (n > 1 && packed.topk_idx.nbytes() >= size_t(kParallelBytes))
  for (int64_t i = 0; i < n; ++i) {
    const int64_t start = cu_seqlens_padded[size_t(i)];
    const int64_t chunk = (cu_seqlens_padded[size_t(i) + 1] - start) / (2 * cp_size);
    int32_t* d = dst + start / cp_size * row;
    for (int64_t c : {cp_rank, 2 * cp_size - 1 - cp_rank}) {
      ok = detail::copy_ids_checked(d, src + (start + c * chunk) * row, chunk * row,
                                    packed.num_experts) &&
           ok;
      d += chunk * row;
    }
  }
  if (!ok) check_route_table(packed, op, "packed");
  return out;
}

RouteTable cp_zigzag_gather(const std::vector<RouteTable>& pieces,
                            const std::vector<int64_t>& cu_seqlens_padded) {
  const char* op = "cp_zigzag_gather";
  if (pieces.empty()) fail_arg(op, "pieces must not be empty");
  check_same_layout(pieces, op, "pieces");
  const int64_t cp = static_cast<int64_t>(pieces.size());
  check_cu(cu_seqlens_padded, op, -1);
  const int64_t total = cu_seqlens_padded.back();
  for (int64_t r = 0; r < cp; ++r) {
    if (pieces[size_t(r)].num_tokens() * cp != total) {
      fail_arg(op, "pieces[", r, "] must hold ", total, "/", cp, " tokens, got ",
               pieces[size_t(r)].num_tokens());
    }
  }
  if (cp == 1) return RouteTable{pieces[0].topk_idx.clone(), pieces[0].num_experts};
  for (size_t i = 0; i + 1 < cu_seqlens_padded.size(); ++i) {
    const int64_t len = cu_seqlens_padded[i + 1] - cu_seqlens_padded[i];
    if (len % (2 * cp) != 0)
      fail_arg(op, "sequence ", i, " has padded length ", len,
               ", not a multiple of 2*cp_size=", 2 * cp);
  }
  const RouteTable& p0 = pieces[0];
  RouteTable out;
  out.num_experts = p0.num_experts;
  out.topk_idx = Tensor::empty({total, p0.num_moe_layers(), p0.top_k()}, DType::int32);
  const size_t tb = token_bytes(p0);
  auto* dst = static_cast<char*>(out.topk_idx.raw());
  std::vector<int64_t> cursor(size_t(cp), 0);  // tokens consumed from each piece
  for (size_t i = 0; i + 1 < cu_seqlens_padded.size(); ++i) {
    const int64_t start = cu_seqlens_padded[i];
    const int64_t chunk = (cu_seqlens_padded[i + 1] - start) / (2 * cp);
    for (int64_t r = 0; r < cp; ++r) {
      const auto* src = static_cast<const char*>(pieces[size_t(r)].topk_idx.raw());
      for (int64_t c : {r, 2 * cp - 1 - r}) {
        std::memcpy(dst + size_t(start + c * chunk) * tb, src + size_t(cursor[size_t(r)]) * tb,
                    size_t(chunk) * tb);
        cursor[size_t(r)] += chunk;
      }
    }
  }
  return out;
}

RouteTable sp_split(const RouteTable& table, int64_t tp_size, int64_t tp_rank) {
  const char* op = "sp_split";
  check_table(table, op, "table");
  if (tp_size < 1) fail_arg(op, "tp_size must be >= 1, got ", tp_size);
  if (tp_rank < 0 || tp_rank >= tp_size)
    fail_arg(op, "tp_rank must be in [0, ", tp_size, "), got ", tp_rank);
  if (table.num_tokens() % tp_size != 0) {
    fail_arg(op, "num_tokens must be a multiple of tp_size=", tp_size, ", got ",
             table.num_tokens());
  }
  const int64_t n = table.num_tokens() / tp_size;
  return checked_copy(table, tp_rank * n, n, op);
}

RouteTable concat_tokens(const std::vector<RouteTable>& pieces) {
  const char* op = "concat_tokens";
  if (pieces.empty()) fail_arg(op, "pieces must not be empty");
  check_same_layout(pieces, op, "pieces");
  int64_t n = 0;
  for (const auto& p : pieces) n += p.num_tokens();
  RouteTable out;
  out.num_experts = pieces[0].num_experts;
  out.topk_idx = Tensor::empty({n, pieces[0].num_moe_layers(), pieces[0].top_k()}, DType::int32);
  auto* dst = static_cast<char*>(out.topk_idx.raw());
  for (const auto& p : pieces) {
    std::memcpy(dst, p.topk_idx.raw(), p.topk_idx.nbytes());
    dst += p.topk_idx.nbytes();
  }
  return out;
}

RouteTable sp_gather(const std::vector<RouteTable>& pieces) {
  if (pieces.empty()) fail_arg("sp_gather", "pieces must not be empty");
  for (size_t i = 0; i < pieces.size(); ++i) {
    if (pieces[i].num_tokens() != pieces[0].num_tokens()) {
      fail_arg("sp_gather", "pieces must hold equal token counts, got ", pieces[0].num_tokens(),
               " and ", pieces[i].num_tokens(), " at ", i);
    }
  }
  return concat_tokens(pieces);
}

std::pair<int64_t, int64_t> pp_moe_layer_range(const std::vector<int64_t>& moe_layers,
                                               int64_t num_hidden_layers,
                                               const PipelineOptions& o) {
  const char* op = "pp_moe_layer_range";
  if (o.pp_size < 1) fail_arg(op, "pp_size must be >= 1, got ", o.pp_size);
  if (o.vpp_size < 1) fail_arg(op, "vpp_size must be >= 1, got ", o.vpp_size);
  if (o.pp_rank < 0 || o.pp_rank >= o.pp_size)
    fail_arg(op, "pp_rank must be in [0, ", o.pp_size, "), got ", o.pp_rank);
  if (o.vpp_rank < 0 || o.vpp_rank >= o.vpp_size)
    fail_arg(op, "vpp_rank must be in [0, ", o.vpp_size, "), got ", o.vpp_rank);
  if (num_hidden_layers < 1 || num_hidden_layers > detail::kMaxLayers)
    fail_arg(op, "num_hidden_layers must be in [1, ", detail::kMaxLayers, "], got ", num_hidden_layers);
  // More pipeline chunks than layers cannot be a layout (and would overflow pp_size*vpp_size).
  if (o.pp_size > num_hidden_layers || o.vpp_size > num_hidden_layers)
    fail_arg(op, "pp_size and vpp_size must be <= num_hidden_layers=", num_hidden_layers,
             ", got pp_size=", o.pp_size, ", vpp_size=", o.vpp_size);
  for (size_t i = 0; i < moe_layers.size(); ++i) {
    if (moe_layers[i] < 0 || moe_layers[i] >= num_hidden_layers ||
        (i > 0 && moe_layers[i] <= moe_layers[i - 1])) {
      fail_arg(op, "moe_layers must be ascending hidden-layer indices in [0, ", num_hidden_layers,
               "), got ", moe_layers[i], " at ", i);
    }
  }
  // Checked before `uneven` below: a negative size alone used to pass as "even split".
  if (o.first_stage_layers < 0 || o.last_stage_layers < 0) {
    fail_arg(op, "first_stage_layers and last_stage_layers must be >= 0 (0 = even split), got ",
             o.first_stage_layers, " and ", o.last_stage_layers);
  }
  // Hidden layers [lo, hi) of this chunk.
  int64_t lo = 0, hi = 0;
  const bool uneven = o.first_stage_layers > 0 || o.last_stage_layers > 0;
  if (uneven) {
    if (o.vpp_size != 1)
      fail_arg(op, "first/last_stage_layers need vpp_size == 1, got vpp_size=", o.vpp_size);
    std::vector<int64_t> per(size_t(o.pp_size), 0);
    int64_t rest = num_hidden_layers;
    int64_t middle_stages = o.pp_size;
    if (o.first_stage_layers > 0) {
      per[0] = o.first_stage_layers;
      rest -= per[0];
      --middle_stages;
    }
    if (o.last_stage_layers > 0 && o.pp_size > 1) {
      per.back() = o.last_stage_layers;
      rest -= per.back();
      --middle_stages;
    }
    if (rest < 0 || (middle_stages == 0 && rest != 0) ||
        (middle_stages > 0 && rest % middle_stages != 0)) {
      fail_arg(op, "num_hidden_layers=", num_hidden_layers,
               " does not split over pp_size=", o.pp_size,
               " with first_stage_layers=", o.first_stage_layers,
               " and last_stage_layers=", o.last_stage_layers);
    }
    for (int64_t s = 0; s < o.pp_size; ++s) {
      const bool fixed = (s == 0 && o.first_stage_layers > 0) ||
                         (s == o.pp_size - 1 && o.last_stage_layers > 0 && o.pp_size > 1);
      if (!fixed) per[size_t(s)] = rest / middle_stages;
    }
    for (int64_t s = 0; s < o.pp_rank; ++s) lo += per[size_t(s)];
    hi = lo + per[size_t(o.pp_rank)];
  } else {
    const int64_t chunks = o.pp_size * o.vpp_size;
    if (num_hidden_layers % chunks != 0) {
      fail_arg(op, "num_hidden_layers=", num_hidden_layers,
               " must be divisible by pp_size*vpp_size=", chunks);
    }
    const int64_t per = num_hidden_layers / chunks;
    const int64_t chunk = o.vpp_rank * o.pp_size + o.pp_rank;
    lo = chunk * per;
    hi = lo + per;
  }
  const int64_t begin =
      std::lower_bound(moe_layers.begin(), moe_layers.end(), lo) - moe_layers.begin();
  const int64_t end =
      std::lower_bound(moe_layers.begin(), moe_layers.end(), hi) - moe_layers.begin();
  return {begin, end};
}

RouteTable slice_layers(const RouteTable& table, int64_t begin, int64_t end) {
  const char* op = "slice_layers";
  check_table(table, op, "table");
  const int64_t L = table.num_moe_layers(), K = table.top_k(), T = table.num_tokens();
  if (begin < 0 || end < begin || end > L)
    fail_arg(op, "range [", begin, ", ", end, ") must lie in [0, ", L, "]");
  RouteTable out;
  out.num_experts = table.num_experts;
  out.topk_idx = Tensor::empty({T, end - begin, K}, DType::int32);
  const int32_t* src = table.topk_idx.data<int32_t>();
  int32_t* dst = out.topk_idx.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(dst + t * (end - begin) * K, src + (t * L + begin) * K,
                size_t((end - begin) * K) * sizeof(int32_t));
  }
  return out;
}

RouteTable concat_layers(const std::vector<RouteTable>& pieces) {
  const char* op = "concat_layers";
  if (pieces.empty()) fail_arg(op, "pieces must not be empty");
  int64_t L = 0;
  for (size_t i = 0; i < pieces.size(); ++i) {
    check_table(pieces[i], op, "pieces");
    if (pieces[i].num_tokens() != pieces[0].num_tokens() ||
        pieces[i].top_k() != pieces[0].top_k() || pieces[i].num_experts != pieces[0].num_experts) {
      fail_arg(op, "pieces[", i, "] must match pieces[0] in num_tokens, top_k and num_experts");
    }
    L += pieces[i].num_moe_layers();
  }
  const int64_t T = pieces[0].num_tokens(), K = pieces[0].top_k();
  RouteTable out;
  out.num_experts = pieces[0].num_experts;
  out.topk_idx = Tensor::empty({T, L, K}, DType::int32);
  int32_t* dst = out.topk_idx.data<int32_t>();
  for (int64_t t = 0; t < T; ++t) {
    for (const auto& p : pieces) {
      const int64_t n = p.num_moe_layers() * K;
      std::memcpy(dst, p.topk_idx.data<int32_t>() + t * n, size_t(n) * sizeof(int32_t));
      dst += n;
    }
  }
  return out;
}

std::vector<std::vector<RouteTable>> split_micro_batches(const std::vector<RouteTable>& sequences,
                                                         int64_t micro_batch_size) {
  if (micro_batch_size < 1)
    fail_arg("split_micro_batches", "micro_batch_size must be >= 1, got ", micro_batch_size);
  std::vector<std::vector<RouteTable>> out;
  for (size_t i = 0; i < sequences.size(); i += size_t(micro_batch_size)) {
    const size_t end = std::min(sequences.size(), i + size_t(micro_batch_size));
    out.emplace_back(sequences.begin() + long(i), sequences.begin() + long(end));
  }
  return out;
}

}  // namespace switchyard

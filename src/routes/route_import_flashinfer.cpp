// FlashInfer: the fused MoE kernels' per-MoE-layer routing_replay_out buffers of one batch.
#include <algorithm>
#include <cstdint>
#include <cstring>

#include "route_import_core.h"
#include "switchyard/error.h"

namespace switchyard {

using detail::cat;
using detail::fail_arg;
using namespace detail;  // the importers' shared room (route_import_core.h)

namespace {
constexpr const char* kOp = kImportOp;
}  // namespace

namespace {

// The shared part of both FlashInfer overloads: `layers[l]` points at `num_rows * top_k` elements.
ImportResult import_replay_buffers(const std::vector<const char*>& layers, Elem elem,
                                   int64_t num_rows, int64_t top_k,
                                   const std::vector<int64_t>& cu_seqlens,
                                   const ImportOptions& options) {
  check_import_options(options);
  const int64_t L = static_cast<int64_t>(layers.size());
  if (L < 1) fail_arg(kOp, "flashinfer: layers must hold one routing_replay_out per MoE layer");
  if (options.num_input_layers > 0 && L != options.num_input_layers) {
    fail_arg(kOp, "flashinfer: expected ", options.num_input_layers, " layer buffers, got ", L);
  }
  if (options.top_k > 0 && top_k != options.top_k)
    fail_arg(kOp, "flashinfer: expected top_k=", options.top_k, ", got ", top_k);
  if (num_rows < 0 || top_k < 1 || top_k > 65536) {
    fail_arg(kOp, "flashinfer: buffers must be [N >= 0, 1 <= top_k <= 65536], got [", num_rows,
             ", ", top_k, "]");
  }
  for (int64_t l = 0; l < L; ++l)
    if (layers[size_t(l)] == nullptr && num_rows > 0)
      fail_arg(kOp, "flashinfer: layers[", l, "] is null");
  if (cu_seqlens.empty() || cu_seqlens[0] != 0) {
    fail_arg(kOp, "flashinfer: cu_seqlens must start at 0, got ",
             cu_seqlens.empty() ? std::string("[]") : std::to_string(cu_seqlens[0]));
  }
  for (size_t s = 1; s < cu_seqlens.size(); ++s) {
    if (cu_seqlens[s] < cu_seqlens[s - 1]) {
      fail_arg(kOp, "flashinfer: cu_seqlens must be non-decreasing, got cu_seqlens[", s,
               "]=", cu_seqlens[s], " < cu_seqlens[", s - 1, "]=", cu_seqlens[s - 1]);
    }
  }
  if (cu_seqlens.back() > num_rows) {
    fail_arg(kOp, "flashinfer: cu_seqlens ends at ", cu_seqlens.back(), " but the buffers hold ",
             num_rows, " rows");
  }
  const size_t es = elem_size(elem);
  ImportResult all;
  ArrayLayout lay;
  lay.moe_only = true;
  lay.last_token_row = false;  // every token of the batch went through the router
  std::string seq_rows;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t b = cu_seqlens[s], n = cu_seqlens[s + 1] - b;
    // [n, L, K] from L buffers of [N, K]: the layout import_array reads.
    seq_rows.resize(size_t(n * L * top_k) * es);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t l = 0; l < L; ++l)
        std::memcpy(seq_rows.data() + size_t((r * L + l) * top_k) * es,
                    layers[size_t(l)] + size_t((b + r) * top_k) * es, size_t(top_k) * es);
    // Into `all` directly: "(sequence s)" in its messages is the sequence's index in the batch.
    import_array(seq_rows.data(), elem, n, L, top_k,
                 cat("flashinfer (batch rows ", b, "..", b + n, ")"), options, all, lay);
  }
  return all;
}

}  // namespace

ImportResult import_flashinfer_replay(const std::vector<Tensor>& layers,
                                      const std::vector<int64_t>& cu_seqlens,
                                      const ImportOptions& options) {
  std::vector<const char*> ptrs;
  Elem elem = Elem::i4;
  int64_t rows = 0, top_k = 0;
  for (size_t l = 0; l < layers.size(); ++l) {
    const Tensor& t = layers[l];
    const std::string name = cat("flashinfer: layers[", l, "]");
    if (t.dim() != 2)
      fail_arg(kOp, name, ": expected a 2-D [N, top_k] buffer, got ", t.dim(), " dimensions");
    const Elem e = tensor_elem(t, name);
    if (l == 0) {
      elem = e;
      rows = t.size(0);
      top_k = t.size(1);
    } else if (e != elem || t.size(0) != rows || t.size(1) != top_k) {
      fail_arg(kOp, name, ": [", t.size(0), ", ", t.size(1), "] ", dtype_name(t.dtype()),
               " differs from layers[0]: [", rows, ", ", top_k, "] ",
               dtype_name(layers[0].dtype()));
    }
    ptrs.push_back(static_cast<const char*>(t.raw()));
  }
  return import_replay_buffers(ptrs, elem, rows, top_k, cu_seqlens, options);
}

ImportResult import_flashinfer_replay(const std::vector<const int16_t*>& layers, int64_t num_rows,
                                      int64_t top_k, const std::vector<int64_t>& cu_seqlens,
                                      const ImportOptions& options) {
  std::vector<const char*> ptrs;
  for (const int16_t* p : layers) ptrs.push_back(reinterpret_cast<const char*>(p));
  return import_replay_buffers(ptrs, Elem::i2, num_rows, top_k, cu_seqlens, options);
}

ImportResult import_flashinfer_npy_bytes(std::string_view bytes, const std::string& source,
                                         const std::vector<int64_t>& cu_seqlens,
                                         const ImportOptions& options) {
  check_import_options(options);
  const Npy3 a = parse_npy3(bytes, source);
  const int64_t L = a.shape[0], N = a.shape[1], K = a.shape[2];
  if (L < 1 || L > 65536)
    fail_arg(kOp, source, ": expected [num_moe_layers, N, top_k] with 1..65536 layers, got ", L);
  std::vector<const char*> layers;
  for (int64_t l = 0; l < L; ++l) layers.push_back(a.data + size_t(l * N * K) * elem_size(a.elem));
  try {
    return import_replay_buffers(layers, a.elem, N, K,
                                 cu_seqlens.empty() ? std::vector<int64_t>{0, N} : cu_seqlens,
                                 options);
  } catch (const std::invalid_argument& e) {
    fail_arg(kOp, source, ": ", strip_import_prefix(e));
  }
}

ImportResult import_flashinfer(const std::vector<std::string>& paths,
                               const std::vector<std::vector<int64_t>>& cu_seqlens,
                               const ImportOptions& options) {
  check_import_options(options);
  if (!cu_seqlens.empty() && cu_seqlens.size() != paths.size()) {
    fail_arg(kOp, "flashinfer: cu_seqlens must hold one list per file (", paths.size(),
             " files), got ", cu_seqlens.size());
  }
  ImportResult all;
  for (size_t i = 0; i < paths.size(); ++i) {
    const std::vector<int64_t> none;
    merge_import(all,
                 import_flashinfer_npy_bytes(read_import_file(paths[i]), paths[i],
                                             cu_seqlens.empty() ? none : cu_seqlens[i], options),
                 paths[i]);
  }
  return all;
}

}  // namespace switchyard

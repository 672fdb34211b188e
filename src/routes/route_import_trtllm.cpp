// TensorRT-LLM: [seq_len-1, num_moe_layers, K] arrays whose layer axis holds only MoE layers.
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

ImportResult import_trtllm_arrays(const std::vector<Tensor>& arrays, const ImportOptions& options) {
  check_import_options(options);
  ImportResult r;
  ArrayLayout lay;
  lay.moe_only = true;
  for (size_t i = 0; i < arrays.size(); ++i) {
    const Tensor& a = arrays[i];
    const std::string source = cat("trtllm[", i, "]");
    if (a.dim() != 3) {
      fail_arg(kOp, source, ": expected a 3-D array [seq_len-1, num_moe_layers, top_k], got ",
               a.dim(), " dimensions");
    }
    const Elem elem = tensor_elem(a, source);
    import_array(static_cast<const char*>(a.raw()), elem, a.size(0), a.size(1), a.size(2), source,
                 options, r, lay);
    prepend_none_rows(r, options.prompt_start, source, "prompt_start");
  }
  return r;
}

ImportResult import_trtllm_npy_bytes(std::string_view bytes, const std::string& source,
                                     const ImportOptions& options) {
  check_import_options(options);
  const Npy3 a = parse_npy3(bytes, source);
  ImportResult r;
  ArrayLayout lay;
  lay.moe_only = true;
  import_array(a.data, a.elem, a.shape[0], a.shape[1], a.shape[2], source, options, r, lay);
  prepend_none_rows(r, options.prompt_start, source, "prompt_start");
  return r;
}

ImportResult import_trtllm(const std::vector<std::string>& paths, const ImportOptions& options) {
  check_import_options(options);
  ImportResult all;
  for (const auto& p : paths)
    merge_import(all, import_trtllm_npy_bytes(read_import_file(p), p, options), p);
  return all;
}

}  // namespace switchyard

// Bindings of the route toolkit (include/switchyard/routes*.h, route_file.h): tables cross as
// int32 torch tensors [tokens, moe_layers, K] (-1 = no route) with a num_experts beside them.
#include "switchyard/routes.h"

#include <pybind11/stl.h>

#include <string>
#include <string_view>
#include <vector>

#include "bindings.h"
#include "bridge.h"
#include "switchyard/route_align.h"
#include "switchyard/route_file.h"
#include "switchyard/route_import.h"
#include "switchyard/route_stats.h"
#include "switchyard/route_verl.h"

namespace switchyard::py_bind {

namespace {

/// A torch id tensor as a RouteTable plus the Python object its ids point into.
///
/// Ownership rule of these bindings: a RouteTable built from a borrowed tensor is only valid while
/// the py_bridge::Arg it came from is alive (a non-contiguous tensor is borrowed through a
/// contiguous copy that only the Arg holds). So the Arg travels with the table, and a caller keeps
/// the TableArg (never just `.table`) until the engine call that reads it has returned.
struct TableArg {
  RouteTable table;
  py_bridge::Arg keep;
};

/// Who checks a table's ids: here (default), or the engine function it goes to, which checks them
/// while copying them (pack_thd, cp_zigzag_split, sp_split, to_verl): one pass over the ids
/// instead of two.
enum class IdCheck : uint8_t { here, in_engine };

/// int32 borrowed, int64 converted after a range check; validated as a route table.
TableArg to_table(py::handle obj, int64_t num_experts, const char* op, const char* name,
                  IdCheck ids = IdCheck::here) {
  TableArg out;
  out.keep = py_bridge::borrow(obj, op, name, {DType::int32, DType::int64});
  const Tensor& a = out.keep.t;
  RouteTable& t = out.table;
  t.num_experts = num_experts;
  if (a.dtype() == DType::int64) {
    const int64_t* p = a.data<int64_t>();
    for (int64_t i = 0; i < a.numel(); ++i) {
      if (p[i] < -1 || p[i] > INT32_MAX) {
        throw py::value_error(std::string("[") + op + "] " + name + " holds " +
                              std::to_string(p[i]) + " at flat index " + std::to_string(i) +
                              ", expected -1 or an expert id");
      }
    }
    t.topk_idx = a.to(DType::int32);
  } else {
    t.topk_idx = a;
  }
  if (ids == IdCheck::here) check_route_table(t, op, name);
  return out;
}

/// Several tables and the objects they point into (same rule as TableArg).
struct TablesArg {
  std::vector<RouteTable> tables;
  std::vector<py_bridge::Arg> keep;
};

TablesArg to_tables(const py::sequence& seq, int64_t num_experts, const char* op,
                    IdCheck ids = IdCheck::here) {
  TablesArg out;
  out.tables.reserve(seq.size());
  out.keep.reserve(seq.size());
  for (size_t i = 0; i < seq.size(); ++i) {
    const std::string name = "tables[" + std::to_string(i) + "]";
    TableArg a = to_table(seq[i], num_experts, op, name.c_str(), ids);
    out.tables.push_back(std::move(a.table));
    out.keep.push_back(std::move(a.keep));
  }
  return out;
}

py::list from_tables(const std::vector<RouteTable>& tables) {
  py::list out;
  for (const RouteTable& t : tables) out.append(py_bridge::to_torch(t.topk_idx));
  return out;
}

ZeroRowPolicy zero_policy(const std::string& s) {
  if (s == "keep") return ZeroRowPolicy::keep;
  if (s == "to_none") return ZeroRowPolicy::to_none;
  if (s == "error") return ZeroRowPolicy::error;
  throw py::value_error("[routes.import] zero_rows must be 'keep', 'to_none' or 'error', got '" +
                        s + "'");
}

// The replay core's vocabulary (switchyard.replay.POLICIES); the engine refuses merge with its
// reason. "to_none" (the old word for native) is mapped in switchyard/routes.py.
ReplayRowPolicy invalid_policy(const std::string& s) {
  if (s == "error") return ReplayRowPolicy::error;
  if (s == "native") return ReplayRowPolicy::native;
  if (s == "merge") return ReplayRowPolicy::merge;
  throw py::value_error("[routes.import] invalid_rows must be 'error' or 'native', got '" + s +
                        "'");
}

const char* zero_policy_name(ZeroRowPolicy p) {
  switch (p) {
    case ZeroRowPolicy::keep:
      return "keep";
    case ZeroRowPolicy::to_none:
      return "to_none";
    case ZeroRowPolicy::error:
      break;
  }
  return "error";
}

const char* invalid_policy_name(ReplayRowPolicy p) {
  switch (p) {
    case ReplayRowPolicy::error:
      return "error";
    case ReplayRowPolicy::native:
      return "native";
    case ReplayRowPolicy::merge:
      break;
  }
  return "merge";
}

DType routed_dtype(const std::string& s) {
  if (s == "int32") return DType::int32;
  if (s == "uint8") return DType::uint8;
  if (s == "uint16") return DType::uint16;
  throw py::value_error(
      "[routes.import] routed_experts_dtype must be 'int32', 'uint8' or 'uint16', got '" + s +
      "'");
}

/// The import options as a Python dict (the constructor's keywords): round trips.
py::dict options_dict(const RouteImportOptions& o) {
  py::dict d;
  d["num_experts"] = o.num_experts;
  d["first_k_dense"] = o.layer_map.first_k_dense;
  d["moe_layer_freq"] = o.layer_map.moe_layer_freq;
  d["num_mtp_layers"] = o.layer_map.num_mtp_layers;
  d["num_input_layers"] = o.num_input_layers;
  d["top_k"] = o.top_k;
  d["zero_rows"] = zero_policy_name(o.zero_rows);
  d["invalid_rows"] = invalid_policy_name(o.invalid_rows);
  d["prompt_start"] = o.prompt_start;
  d["routed_experts_dtype"] = dtype_name(o.routed_experts_dtype);
  return d;
}

/// The one binding of the importers' options (include/switchyard/route_import.h): every import
/// function and VllmRouteStream take it; switchyard/routes.py builds it in one place.
void bind_import_options(py::module_& m) {
  using O = RouteImportOptions;
  py::class_<O>(m, "RouteImportOptions")
      .def(py::init([](int64_t num_experts, int64_t first_k_dense,
                       const std::vector<int64_t>& moe_layer_freq, int64_t num_mtp_layers,
                       int64_t num_input_layers, int64_t top_k, const std::string& zero_rows,
                       const std::string& invalid_rows, int64_t prompt_start,
                       const std::string& routed_experts_dtype) {
             O o;
             o.num_experts = num_experts;
             o.layer_map.first_k_dense = first_k_dense;
             o.layer_map.moe_layer_freq = moe_layer_freq;
             o.layer_map.num_mtp_layers = num_mtp_layers;
             o.num_input_layers = num_input_layers;
             o.top_k = top_k;
             o.zero_rows = zero_policy(zero_rows);
             o.invalid_rows = invalid_policy(invalid_rows);
             o.prompt_start = prompt_start;
             o.routed_experts_dtype = routed_dtype(routed_experts_dtype);
             return o;
           }),
           py::arg("num_experts") = 0, py::arg("first_k_dense") = 0,
           py::arg("moe_layer_freq") = std::vector<int64_t>{}, py::arg("num_mtp_layers") = 0,
           py::arg("num_input_layers") = 0, py::arg("top_k") = 0, py::arg("zero_rows") = "keep",
           py::arg("invalid_rows") = "error", py::arg("prompt_start") = 0,
           py::arg("routed_experts_dtype") = "int32")
      .def_readwrite("num_experts", &O::num_experts)
      .def_property(
          "first_k_dense", [](const O& o) { return o.layer_map.first_k_dense; },
          [](O& o, int64_t v) { o.layer_map.first_k_dense = v; })
      .def_property(
          "moe_layer_freq", [](const O& o) { return o.layer_map.moe_layer_freq; },
          [](O& o, const std::vector<int64_t>& v) { o.layer_map.moe_layer_freq = v; })
      .def_property(
          "num_mtp_layers", [](const O& o) { return o.layer_map.num_mtp_layers; },
          [](O& o, int64_t v) { o.layer_map.num_mtp_layers = v; })
      .def_readwrite("num_input_layers", &O::num_input_layers)
      .def_readwrite("top_k", &O::top_k)
      .def_property(
          "zero_rows", [](const O& o) { return zero_policy_name(o.zero_rows); },
          [](O& o, const std::string& v) { o.zero_rows = zero_policy(v); })
      .def_property(
          "invalid_rows", [](const O& o) { return invalid_policy_name(o.invalid_rows); },
          [](O& o, const std::string& v) { o.invalid_rows = invalid_policy(v); })
      .def_readwrite("prompt_start", &O::prompt_start)
      .def_property(
          "routed_experts_dtype", [](const O& o) { return dtype_name(o.routed_experts_dtype); },
          [](O& o, const std::string& v) { o.routed_experts_dtype = routed_dtype(v); })
      .def("as_dict", &options_dict)
      .def("__eq__",
           [](const O& a, const O& b) {
             return options_dict(a).equal(options_dict(b));
           })
      .def("__repr__", [](const O& o) {
        std::string r = "RouteImportOptions(";
        bool first = true;
        for (auto item : options_dict(o)) {
          r += (first ? "" : ", ") + py::str(item.first).cast<std::string>() + "=" +
               py::repr(item.second).cast<std::string>();
          first = false;
        }
        return r + ")";
      });
  m.def("check_import_options", &check_import_options, py::arg("options"));
}

py::tuple import_result(const ImportResult& r) {
  py::dict rep;
  rep["num_sequences"] = r.report.num_sequences;
  rep["num_tokens"] = r.report.num_tokens;
  rep["num_input_layers"] = r.report.num_input_layers;
  rep["top_k"] = r.report.top_k;
  rep["moe_layers"] = r.report.moe_layers;
  rep["num_zero_rows"] = r.report.num_zero_rows;
  rep["num_invalid_rows"] = r.report.num_invalid_rows;
  rep["first_zero_rows"] = r.report.first_zero_rows;
  rep["warnings"] = r.report.warnings;
  rep["sources"] = r.sources;
  return py::make_tuple(from_tables(r.sequences), rep);
}

py::dict file_info(const RouteFileInfo& i) {
  py::dict d;
  d["num_experts"] = i.num_experts;
  d["top_k"] = i.top_k;
  d["num_moe_layers"] = i.num_moe_layers;
  d["moe_layers"] = i.moe_layers;
  d["id_width"] = i.id_width;
  d["version"] = i.version;
  return d;
}

py::dict drift_dict(const RouteDrift& d) {
  py::dict o;
  o["num_tokens"] = d.num_tokens;
  o["num_rows"] = d.num_rows;
  o["num_decisions"] = d.num_decisions;
  o["num_differing_decisions"] = d.num_differing_decisions;
  o["num_differing_rows"] = d.num_differing_rows;
  o["num_differing_tokens"] = d.num_differing_tokens;
  o["num_skipped_rows"] = d.num_skipped_rows;
  o["decision_mismatch"] = d.decision_mismatch();
  o["token_mismatch"] = d.token_mismatch();
  o["mean_differing_layers"] = d.mean_differing_layers();
  std::vector<double> per_layer;
  for (size_t l = 0; l < d.layer_decisions.size(); ++l) {
    per_layer.push_back(d.layer_mismatch(static_cast<int64_t>(l)));
  }
  o["layer_mismatch"] = per_layer;
  return o;
}

}  // namespace

void bind_routes(py::module_& m) {
  // ---- file ----
  py::class_<RouteFileWriter>(m, "RouteFileWriter")
      .def(py::init([](const std::string& path, int64_t num_experts, int64_t top_k,
                       int64_t num_moe_layers, const std::vector<int64_t>& moe_layers,
                       int compression_level) {
             RouteFileInfo info;
             info.num_experts = num_experts;
             info.top_k = top_k;
             info.num_moe_layers = num_moe_layers;
             info.moe_layers = moe_layers;
             RouteFileWriterOptions o;
             o.compression_level = compression_level;
             return std::make_unique<RouteFileWriter>(path, info, o);
           }),
           py::arg("path"), py::arg("num_experts"), py::arg("top_k"), py::arg("num_moe_layers"),
           py::arg("moe_layers"), py::arg("compression_level"))
      .def("append",
           [](RouteFileWriter& w, py::handle table, int64_t num_experts) {
             const TableArg t = to_table(table, num_experts, "routes.write", "table");
             py::gil_scoped_release nogil;
             w.append(t.table);
           })
      // Without the GIL: close() fsyncs, and each call waits for an append of another thread.
      .def("close", &RouteFileWriter::close, py::call_guard<py::gil_scoped_release>())
      .def("abort", &RouteFileWriter::abort, py::call_guard<py::gil_scoped_release>())
      .def("discard", &RouteFileWriter::discard, py::call_guard<py::gil_scoped_release>())
      .def_static("partial_path", &RouteFileWriter::partial_path)
      .def_property_readonly("num_sequences", &RouteFileWriter::num_sequences)
      .def_property_readonly("bytes_written", &RouteFileWriter::bytes_written);

  py::class_<RouteFileReader>(m, "RouteFileReader")
      .def(py::init([](const std::string& path, int64_t max_decoded_bytes) {
             return RouteFileReader::open(path, RouteDecodeOptions{max_decoded_bytes});
           }),
           py::arg("path"), py::arg("max_decoded_bytes") = 0)
      .def_static(
          "from_bytes",
          [](const py::bytes& b, int64_t max_decoded_bytes) {
            return RouteFileReader::from_bytes(std::string(b),
                                               RouteDecodeOptions{max_decoded_bytes});
          },
          py::arg("data"), py::arg("max_decoded_bytes") = 0)
      .def_property_readonly("info", [](const RouteFileReader& r) { return file_info(r.info()); })
      .def("__len__", &RouteFileReader::num_sequences)
      .def_property_readonly("complete", &RouteFileReader::complete)
      .def_property_readonly("status", &RouteFileReader::status)
      .def_property_readonly("file_size", &RouteFileReader::file_size)
      .def("read", [](const RouteFileReader& r, int64_t i) {
        RouteTable t;
        {
          py::gil_scoped_release nogil;
          t = r.read(i);
        }
        return py_bridge::to_torch(t.topk_idx);
      });

  // ---- wire format: a complete route file in memory ----
  m.def("routes_encode", [](const py::sequence& tables, int64_t num_experts, int64_t top_k,
                            int64_t num_moe_layers, const std::vector<int64_t>& moe_layers,
                            int64_t num_hidden_layers, int compression_level) {
    RouteFileInfo info;
    info.num_experts = num_experts;
    info.top_k = top_k;
    info.num_moe_layers = num_moe_layers;
    info.moe_layers = moe_layers;
    info.num_hidden_layers = num_hidden_layers;
    RouteFileWriterOptions o;
    o.compression_level = compression_level;
    const TablesArg in = to_tables(tables, num_experts, "routes.encode", IdCheck::in_engine);
    Tensor out;
    {
      py::gil_scoped_release nogil;
      out = encode_route_file(in.tables, info, o);
    }
    return py_bridge::to_torch(out);
  });
  m.def("routes_decode", [](py::handle data, int64_t max_decoded_bytes) {
    // A uint8 tensor is read in place; anything else must expose a contiguous byte buffer.
    py_bridge::Arg arg;
    py::buffer_info buf;
    std::string_view bytes;
    if (py::isinstance(data, py_bridge::torch_module().attr("Tensor"))) {
      arg = py_bridge::borrow(data, "routes.decode", "data", {DType::uint8});
      if (arg.t.dim() != 1) {
        throw py::value_error("[routes.decode] data must be a 1-D uint8 tensor, got " +
                              std::to_string(arg.t.dim()) + " dimensions");
      }
      bytes = std::string_view(static_cast<const char*>(arg.t.raw()), arg.t.nbytes());
    } else {
      if (!PyObject_CheckBuffer(data.ptr())) {
        throw py::value_error(
            "[routes.decode] data must be a uint8 tensor or bytes-like, got " +
            py::str(py::type::handle_of(data).attr("__name__")).cast<std::string>());
      }
      buf = py::reinterpret_borrow<py::buffer>(data).request();
      if (buf.ndim > 1 && buf.strides.back() != buf.itemsize) {
        throw py::value_error("[routes.decode] data must be a contiguous byte buffer");
      }
      bytes = std::string_view(static_cast<const char*>(buf.ptr),
                               static_cast<size_t>(buf.size * buf.itemsize));
    }
    RouteFileInfo info;
    std::vector<RouteTable> tables;
    {
      py::gil_scoped_release nogil;
      tables = decode_route_file(bytes, &info, RouteDecodeOptions{max_decoded_bytes});
    }
    py::dict meta = file_info(info);
    meta["num_hidden_layers"] = info.num_hidden_layers;
    std::vector<int64_t> lengths;
    lengths.reserve(tables.size());
    for (const RouteTable& t : tables) lengths.push_back(t.num_tokens());
    meta["num_tokens"] = lengths;
    return py::make_tuple(from_tables(tables), meta);
  }, py::arg("data"), py::arg("max_decoded_bytes") = 0);

  m.def("routes_verify", [](const std::string& path, int64_t max_decoded_bytes) {
    RouteFileCheck c = verify_route_file(path, RouteDecodeOptions{max_decoded_bytes});
    py::dict d;
    d["ok"] = c.ok;
    d["num_sequences"] = c.num_sequences;
    d["num_readable"] = c.num_readable;
    d["num_tokens"] = c.num_tokens;
    d["problems"] = c.problems;
    return d;
  }, py::arg("path"), py::arg("max_decoded_bytes") = 0);

  // ---- import: every importer takes one RouteImportOptions ----
  bind_import_options(m);
  m.def("routes_import_vllm", [](const std::vector<std::string>& paths, const ImportOptions& o) {
    return import_result(import_vllm_files(paths, o));
  });
  m.def("routes_import_vllm_arrays", [](const py::sequence& arrays, const ImportOptions& o) {
    std::vector<py_bridge::Arg> args;
    std::vector<Tensor> ts;
    args.reserve(arrays.size());
    for (size_t i = 0; i < arrays.size(); ++i) {
      const std::string name = "arrays[" + std::to_string(i) + "]";
      args.push_back(py_bridge::borrow(
          arrays[i], "import", name.c_str(),
          {DType::int32, DType::int64, DType::uint8, DType::int16, DType::uint16}));
      ts.push_back(args.back().t);
    }
    ImportResult r;
    {
      py::gil_scoped_release nogil;
      r = import_vllm_arrays(ts, o);
    }
    return import_result(r);
  });
  m.def("routes_from_verl",
        [](py::handle routed_experts, py::handle attention_mask, const ImportOptions& o) {
          py_bridge::Arg re = py_bridge::borrow(
              routed_experts, "from_verl", "routed_experts",
              {DType::int16, DType::uint16, DType::uint8, DType::int32, DType::int64});
          py_bridge::Arg am = py_bridge::borrow(attention_mask, "from_verl", "attention_mask");
          ImportResult r;
          {
            py::gil_scoped_release nogil;
            r = from_verl(re.t, am.t, o);
          }
          return import_result(r);
        });
  m.def("routes_import_sglang", [](const std::vector<std::string>& paths, const ImportOptions& o) {
    return import_result(import_sglang(paths, o));
  });
  // Text arrives as a view of the Python str (or bytes): its UTF-8 is the str's own buffer for
  // ASCII text, so a response of hundreds of MB is not copied before the parse.
  m.def("routes_import_sglang_text", [](std::string_view text, const ImportOptions& o) {
    return import_result(import_sglang_text(text, "<text>", o));
  });
  // ---- route data from the newest engines (vLLM >= 0.22 HTTP) and verl's batch layout ----
  m.def("routes_import_vllm_http_text", [](std::string_view text, const ImportOptions& o) {
    return import_result(import_vllm_http_text(text, "<text>", o));
  });
  m.def("routes_import_vllm_npy_base64", [](std::string_view text, const ImportOptions& o) {
    return import_result(import_vllm_npy_base64(text, "routed_experts", o));
  });
  // ---- engine layouts beyond vLLM / SGLang (issue 25) ----
  m.def("routes_import_trtllm", [](const std::vector<std::string>& paths, const ImportOptions& o) {
    return import_result(import_trtllm(paths, o));
  });
  m.def("routes_import_trtllm_arrays", [](const py::sequence& arrays, const ImportOptions& o) {
    std::vector<py_bridge::Arg> args;
    std::vector<Tensor> ts;
    args.reserve(arrays.size());
    for (size_t i = 0; i < arrays.size(); ++i) {
      const std::string name = "trtllm[" + std::to_string(i) + "]";
      args.push_back(py_bridge::borrow(arrays[i], "import", name.c_str(),
                                       {DType::int32, DType::int64, DType::uint8}));
      ts.push_back(args.back().t);
    }
    return import_result(import_trtllm_arrays(ts, o));
  });
  m.def("routes_import_flashinfer_replay", [](const py::sequence& layers,
                                              const std::vector<int64_t>& cu_seqlens,
                                              const ImportOptions& o) {
    std::vector<py_bridge::Arg> args;
    std::vector<Tensor> ts;
    args.reserve(layers.size());
    for (size_t i = 0; i < layers.size(); ++i) {
      const std::string name = "layers[" + std::to_string(i) + "]";
      args.push_back(py_bridge::borrow(layers[i], "import", name.c_str(),
                                       {DType::int32, DType::int64, DType::uint8}));
      ts.push_back(args.back().t);
    }
    return import_result(import_flashinfer_replay(ts, cu_seqlens, o));
  });
  m.def("routes_import_vllm_stream_text", [](std::string_view text, const ImportOptions& o) {
    return import_result(import_vllm_stream_text(text, "<text>", o));
  });
  py::class_<VllmRouteStream>(m, "VllmRouteStream")
      .def(py::init([](const ImportOptions& o) { return VllmRouteStream(o); }), py::arg("options"))
      .def("add",
           [](VllmRouteStream& s, const std::string& id, py::handle routes, int64_t start,
              int64_t new_tokens, int64_t prompt_tokens) {
             py_bridge::Arg a = py_bridge::borrow(routes, "import", "routes",
                                                  {DType::int32, DType::int64, DType::uint8});
             s.add(id, a.t, start, new_tokens, prompt_tokens);
           })
      .def("add_npy",
           [](VllmRouteStream& s, const std::string& id, const py::bytes& npy, int64_t start,
              int64_t new_tokens, int64_t prompt_tokens) {
             s.add_npy(id, std::string(npy), start, new_tokens, prompt_tokens);
           })
      .def("add_tokens", &VllmRouteStream::add_tokens)
      .def("set_prompt_start", &VllmRouteStream::set_prompt_start)
      .def("add_sse", [](VllmRouteStream& s, const std::string& event) { return s.add_sse(event); })
      .def("finish",
           [](VllmRouteStream& s, const std::string& id) { return import_result(s.finish(id)); })
      .def("pending", &VllmRouteStream::pending);
  m.def("routes_to_verl",
        [](const py::sequence& tables, int64_t num_experts, const std::vector<int64_t>& moe_layers,
           int64_t num_hidden_layers, py::object attention_mask, const std::string& padding_side,
           int64_t seq_len) {
          const TablesArg in = to_tables(tables, num_experts, "to_verl", IdCheck::in_engine);
          const std::vector<RouteTable>& ts = in.tables;
          VerlBatch v;
          if (!attention_mask.is_none()) {
            py_bridge::Arg am = py_bridge::borrow(attention_mask, "to_verl", "attention_mask");
            py::gil_scoped_release nogil;
            v = to_verl(ts, moe_layers, num_hidden_layers, am.t);
          } else {
            if (padding_side != "left" && padding_side != "right") {
              throw py::value_error("[to_verl] padding_side must be 'left' or 'right', got '" +
                                    padding_side + "'");
            }
            VerlOptions o;
            o.num_hidden_layers = num_hidden_layers;
            o.padding_side = padding_side == "left" ? PaddingSide::left : PaddingSide::right;
            o.seq_len = seq_len;
            py::gil_scoped_release nogil;
            v = to_verl(ts, moe_layers, o);
          }
          return py::make_tuple(py_bridge::to_torch(v.routed_experts),
                                py_bridge::to_torch(v.attention_mask));
        });
  m.def("routes_moe_layer_indices", [](int64_t first_k_dense, const std::vector<int64_t>& freq,
                                       int64_t num_mtp_layers, int64_t num_input_layers) {
    LayerMap lm;
    lm.first_k_dense = first_k_dense;
    lm.moe_layer_freq = freq;
    lm.num_mtp_layers = num_mtp_layers;
    return moe_layer_indices(lm, num_input_layers);
  });
  m.def("routes_parse_moe_layer_freq", &parse_moe_layer_freq);

  // ---- align ----
  m.def("routes_drop_padding", [](py::handle topk_idx, py::handle mask, int64_t num_experts) {
    py_bridge::Arg ai =
        py_bridge::borrow(topk_idx, "drop_padding", "topk_idx",
                          {DType::int32, DType::int16, DType::uint16, DType::uint8, DType::int64});
    py_bridge::Arg am = py_bridge::borrow(mask, "drop_padding", "attention_mask");
    std::vector<RouteTable> out;
    {
      py::gil_scoped_release nogil;
      out = drop_padding(ai.t, am.t, num_experts);
    }
    return from_tables(out);
  });
  m.def("routes_pack_thd", [](const py::sequence& tables, int64_t num_experts, int64_t tp_size,
                              int64_t cp_size, int64_t fp8_align) {
    PackOptions o;
    o.tp_size = tp_size;
    o.cp_size = cp_size;
    o.fp8_align = fp8_align;
    const TablesArg in = to_tables(tables, num_experts, "pack_thd", IdCheck::in_engine);
    PackedRoutes p;
    {
      py::gil_scoped_release nogil;
      p = pack_thd(in.tables, o);
    }
    return py::make_tuple(py_bridge::to_torch(p.table.topk_idx), p.cu_seqlens, p.cu_seqlens_padded);
  });
  m.def("routes_unpack_thd",
        [](py::handle packed, const std::vector<int64_t>& cu_seqlens,
           const std::vector<int64_t>& cu_seqlens_padded, int64_t num_experts) {
          const TableArg in = to_table(packed, num_experts, "unpack_thd", "packed");
          PackedRoutes p;
          p.table = in.table;
          p.cu_seqlens = cu_seqlens;
          p.cu_seqlens_padded = cu_seqlens_padded;
          return from_tables(unpack_thd(p));
        });
  m.def("routes_cp_zigzag_split", [](py::handle packed, const std::vector<int64_t>& cu_padded,
                                     int64_t cp_size, int64_t cp_rank, int64_t num_experts) {
    const TableArg in =
        to_table(packed, num_experts, "cp_zigzag_split", "packed", IdCheck::in_engine);
    RouteTable out;
    {
      py::gil_scoped_release nogil;
      out = cp_zigzag_split(in.table, cu_padded, cp_size, cp_rank);
    }
    return py_bridge::to_torch(out.topk_idx);
  });
  m.def("routes_cp_zigzag_gather", [](const py::sequence& pieces,
                                      const std::vector<int64_t>& cu_padded, int64_t num_experts) {
    const TablesArg in = to_tables(pieces, num_experts, "cp_zigzag_gather");
    return py_bridge::to_torch(cp_zigzag_gather(in.tables, cu_padded).topk_idx);
  });
  m.def("routes_sp_split",
        [](py::handle table, int64_t tp_size, int64_t tp_rank, int64_t num_experts) {
          const TableArg in = to_table(table, num_experts, "sp_split", "table", IdCheck::in_engine);
          RouteTable out;
          {
            py::gil_scoped_release nogil;
            out = sp_split(in.table, tp_size, tp_rank);
          }
          return py_bridge::to_torch(out.topk_idx);
        });
  m.def("routes_sp_gather", [](const py::sequence& pieces, int64_t num_experts) {
    const TablesArg in = to_tables(pieces, num_experts, "sp_gather");
    return py_bridge::to_torch(sp_gather(in.tables).topk_idx);
  });
  m.def("routes_slice_layers", [](py::handle table, int64_t begin, int64_t end,
                                  int64_t num_experts) {
    const TableArg in = to_table(table, num_experts, "slice_layers", "table");
    return py_bridge::to_torch(slice_layers(in.table, begin, end).topk_idx);
  });
  m.def("routes_concat_layers", [](const py::sequence& pieces, int64_t num_experts) {
    const TablesArg in = to_tables(pieces, num_experts, "concat_layers");
    return py_bridge::to_torch(concat_layers(in.tables).topk_idx);
  });
  m.def("routes_concat_tokens", [](const py::sequence& pieces, int64_t num_experts) {
    const TablesArg in = to_tables(pieces, num_experts, "concat_tokens");
    return py_bridge::to_torch(concat_tokens(in.tables).topk_idx);
  });
  m.def("routes_pp_moe_layer_range",
        [](const std::vector<int64_t>& moe_layers, int64_t num_hidden_layers, int64_t pp_size,
           int64_t pp_rank, int64_t vpp_size, int64_t vpp_rank, int64_t first_stage_layers,
           int64_t last_stage_layers) {
          PipelineOptions o;
          o.pp_size = pp_size;
          o.pp_rank = pp_rank;
          o.vpp_size = vpp_size;
          o.vpp_rank = vpp_rank;
          o.first_stage_layers = first_stage_layers;
          o.last_stage_layers = last_stage_layers;
          return pp_moe_layer_range(moe_layers, num_hidden_layers, o);
        });

  // ---- statistics ----
  m.def("routes_drift", [](py::handle a, py::handle b, int64_t num_experts) {
    const TableArg ta = to_table(a, num_experts, "drift", "a");
    const TableArg tb = to_table(b, num_experts, "drift", "b");
    return drift_dict(route_drift(ta.table, tb.table));
  });
  m.def("routes_drift_many", [](const py::sequence& a, const py::sequence& b, int64_t num_experts) {
    if (a.size() != b.size()) {
      throw py::value_error("[drift] a and b must hold the same number of tables, got " +
                            std::to_string(a.size()) + " and " + std::to_string(b.size()));
    }
    RouteDrift d;
    const TablesArg ta = to_tables(a, num_experts, "drift");
    const TablesArg tb = to_tables(b, num_experts, "drift");
    for (size_t i = 0; i < ta.tables.size(); ++i) {
      accumulate_route_drift(ta.tables[i], tb.tables[i], d);
    }
    return drift_dict(d);
  });
  m.def("routes_row_mismatch",
        [](py::handle reference, const py::sequence& tables, py::handle token_mask,
           const std::vector<int64_t>& top_ks) {
          const char* op = "row_mismatch";
          const py_bridge::Arg ref = py_bridge::borrow(reference, op, "reference", {DType::int32});
          const py_bridge::Arg mask = py_bridge::borrow_optional(
              token_mask, op, "token_mask", {DType::boolean, DType::uint8});
          std::vector<py_bridge::Arg> keep;  // (alive until the engine call returns)
          std::vector<Tensor> ts;
          for (size_t i = 0; i < tables.size(); ++i) {
            const std::string name = "tables[" + std::to_string(i) + "]";
            keep.push_back(py_bridge::borrow(tables[i], op, name.c_str(), {DType::int32}));
            ts.push_back(keep.back().t);
          }
          RowMismatch r;
          {
            py::gil_scoped_release nogil;
            r = row_mismatch(ref.t, mask.t, ts, top_ks);
          }
          return py::make_tuple(r.num_compared_rows, r.num_differing_rows);
        });
  m.def("routes_expert_load", [](const py::sequence& tables, int64_t num_experts) {
    ExpertLoad load;
    const TablesArg in = to_tables(tables, num_experts, "expert_load");
    for (const RouteTable& t : in.tables) accumulate_expert_load(t, load);
    Tensor counts =
        Tensor::from_vector(load.num_tokens_per_expert, {load.num_moe_layers, load.num_experts});
    std::vector<double> imbalance;
    for (int64_t l = 0; l < load.num_moe_layers; ++l) imbalance.push_back(load_imbalance(load, l));
    return py::make_tuple(py_bridge::to_torch(counts), load.num_none_rows, imbalance);
  });
}

}  // namespace switchyard::py_bind

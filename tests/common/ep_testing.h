// Helpers of the MPI tests (tests/mpi): the world communicator every case shares, a rank's rows of
// a global batch, sums over the ranks, the dispatcher kinds' names. Every rank builds the same
// global batch from a seed and takes its own rows, so a case can compare with one process computing
// the whole batch.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "switchyard/dispatcher.h"
#include "switchyard/dist.h"
#include "switchyard/tensor.h"

namespace switchyard::testing {

/// The world communicator, made once per process (every case of a binary shares it).
inline const std::shared_ptr<dist::Communicator>& world_ptr() {
  static const std::shared_ptr<dist::Communicator> c = dist::world();
  return c;
}
inline dist::Communicator& world() { return *world_ptr(); }
/// A Dispatcher over the world communicator with fresh scratch memory, for one-off calls (a case
/// that runs several steps keeps one instead).
inline dist::Dispatcher fresh_dispatcher() { return dist::Dispatcher(world_ptr()); }

inline const char* kind_name(dist::DispatcherKind k) {
  return k == dist::DispatcherKind::all_to_all ? "all_to_all" : "all_gather";
}

/// Rows [begin, end) of a tensor of any rank >= 1 (dimension 0 is the row), copied.
inline Tensor rows(const Tensor& t, int64_t begin, int64_t end) {
  Shape s = t.shape();
  const size_t row_bytes = t.size(0) ? t.nbytes() / static_cast<size_t>(t.size(0)) : 0;
  s[0] = end - begin;
  Tensor out = Tensor::empty(s, t.dtype());
  if (end > begin) {
    std::memcpy(out.raw(), static_cast<const unsigned char*>(t.raw()) + begin * row_bytes,
                static_cast<size_t>(end - begin) * row_bytes);
  }
  return out;
}

/// Sum over the ranks of one double per rank, added in rank order (the same bits everywhere).
inline double sum_over_ranks(double v) {
  dist::Communicator& c = world();
  std::vector<double> all(static_cast<size_t>(c.size()));
  c.allgather(&v, all.data(), 1, sizeof(double));
  double s = 0;
  for (double x : all) s += x;
  return s;
}

/// <a, b> over this rank's elements, in double (NaN when the element counts differ, so that a
/// comparison with it fails).
inline double local_dot(const Tensor& a, const Tensor& b) {
  const auto va = a.to_double_vector(), vb = b.to_double_vector();
  if (va.size() != vb.size()) return std::numeric_limits<double>::quiet_NaN();
  double s = 0;
  for (size_t i = 0; i < va.size(); ++i) s += va[i] * vb[i];
  return s;
}

}  // namespace switchyard::testing

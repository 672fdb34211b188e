// Internal helpers of the dispatchers: the collective error agreement and the receive layout
// derived from the count matrix every rank holds after the header exchange.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "switchyard/dispatcher.h"

namespace switchyard::dist::detail {

/// Collective: every rank passes its local error message ("" = none) and the result of gathering
/// every rank's message length (`err_lens`, one per rank). When any rank failed, the messages are
/// gathered and every rank throws the same std::invalid_argument: "[op] on rank r: <message>" for
/// the lowest failing rank r. Returns normally when nobody failed.
void raise_if_any(const char* op, const std::string& local_error,
                  const std::vector<int64_t>& err_lens, Communicator& comm);

/// Collective flag exchange for ops that move no counts (combine and the backwards): gathers
/// (error length, dtype, weight mode) and throws on every rank when any rank failed or when the
/// dtypes or weight modes differ between ranks.
void agree(const char* op, const std::string& local_error, DType dtype, const char* what,
           WeightMode mode, Communicator& comm);

/// Receive layout of rank `r`: block (local expert el, source s) starts at
/// block_offset[(r*L + el) * EP + s]; table over all experts (each owner's own layout).
std::vector<int64_t> block_offsets(const DispatchHandle& h);

/// Rows each rank receives (sum over its experts and all sources).
std::vector<int64_t> rows_per_rank(const DispatchHandle& h);

}  // namespace switchyard::dist::detail

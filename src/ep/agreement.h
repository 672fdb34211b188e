// The collective error agreement shared by every comm-taking API (the dispatchers, the router's
// losses, the expert-bias and quantile-balancing updates): one small allgather per rank of
// {error length, ...} before any payload or reduction, so a local error or a setting that differs
// between ranks makes every rank throw the same std::invalid_argument instead of one rank failing
// in MPI (MPI_ERR_TRUNCATE), another computing a wrong value, or all of them waiting forever.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "switchyard/dist.h"

namespace switchyard::dist::detail {

/// Collective: every rank passes its local error message ("" = none) and the result of gathering
/// every rank's message length (`err_lens`, one per rank). When any rank failed, the messages are
/// gathered and every rank gets the same "[op] on rank r: <message>" for the lowest failing rank
/// r. Returns "" when nobody failed.
std::string first_error(const char* op, const std::string& local_error,
                        const std::vector<int64_t>& err_lens, Communicator& comm);

/// first_error, thrown as std::invalid_argument on every rank when not empty.
void raise_if_any(const char* op, const std::string& local_error,
                  const std::vector<int64_t>& err_lens, Communicator& comm);

/// One value every rank of a communicator must agree on (a size, an option, a loss type).
struct Setting {
  const char* name;
  int64_t value;
  bool flag = false;  ///< printed as true/false
};

/// Collective over `comm` (the caller's name of it in `what`, e.g. "loss_comm"): one allgather of
/// {error length, error agreed elsewhere, settings...} (the same number of settings on every rank,
/// a few int64 each), plus the messages when some rank failed. Returns "" when no rank failed and
/// every setting is the same on every rank; else the same message on every rank: the lowest
/// failing rank's error ("[op] on rank r: <error>", or as is when `error_agreed`: a message this
/// rank already agreed on with another communicator), or for the first setting that differs
/// "[op] <what> ranks disagree: <name>=<value> on rank 0, <value> on rank r". On a size-1
/// communicator: the local error as is, without an exchange.
std::string agreed_error(const char* op, const char* what, const std::string& local_error,
                         bool error_agreed, const std::vector<Setting>& settings,
                         Communicator& comm);

}  // namespace switchyard::dist::detail

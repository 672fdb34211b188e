#include "agreement.h"

#include <stdexcept>

#include "check.h"

namespace switchyard::dist::detail {

namespace {

// Gathers the messages of the failing ranks; the lowest one's, formatted by `format(rank, text)`.
template <class Format>
std::string lowest_error(const std::string& local_error, const std::vector<int64_t>& err_lens,
                         Communicator& comm, Format format) {
  bool any = false;
  int64_t total = 0;
  for (int64_t n : err_lens) {
    any = any || n > 0;
    total += n;
  }
  if (!any) return {};
  std::string all(static_cast<size_t>(total), '\0');
  comm.allgatherv(local_error.data(), static_cast<int64_t>(local_error.size()), all.data(),
                  err_lens, 1);
  int64_t off = 0;
  for (size_t r = 0; r < err_lens.size(); ++r) {
    if (err_lens[r] > 0) {
      return format(r, all.substr(static_cast<size_t>(off), static_cast<size_t>(err_lens[r])));
    }
    off += err_lens[r];
  }
  return {};  // not reached
}

}  // namespace

std::string first_error(const char* op, const std::string& local_error,
                        const std::vector<int64_t>& err_lens, Communicator& comm) {
  return lowest_error(local_error, err_lens, comm, [&](size_t r, const std::string& text) {
    return switchyard::detail::cat("[", op, "] on rank ", r, ": ", text);
  });
}

void raise_if_any(const char* op, const std::string& local_error,
                  const std::vector<int64_t>& err_lens, Communicator& comm) {
  const std::string e = first_error(op, local_error, err_lens, comm);
  if (!e.empty()) throw std::invalid_argument(e);
}

std::string agreed_error(const char* op, const char* what, const std::string& local_error,
                         bool error_agreed, const std::vector<Setting>& settings,
                         Communicator& comm) {
  if (comm.size() == 1) return local_error;  // nobody to tell, nothing to disagree with
  const size_t n = 2 + settings.size();
  std::vector<int64_t> mine;
  mine.reserve(n);
  mine.push_back(static_cast<int64_t>(local_error.size()));
  mine.push_back(error_agreed ? 1 : 0);
  for (const Setting& s : settings) mine.push_back(s.value);
  const std::vector<int64_t> all = comm.allgather(mine);
  const size_t P = static_cast<size_t>(comm.size());
  std::vector<int64_t> lens(P);
  for (size_t r = 0; r < P; ++r) lens[r] = all[r * n];
  const std::string e =
      lowest_error(local_error, lens, comm, [&](size_t r, const std::string& text) {
        if (all[r * n + 1] != 0) return text;
        return switchyard::detail::cat("[", op, "] on rank ", r, ": ", text);
      });
  if (!e.empty()) return e;
  // Computed from the same gathered table everywhere, so every rank returns the same message.
  auto show = [](const Setting& s, int64_t v) {
    return s.flag ? std::string(v != 0 ? "true" : "false") : std::to_string(v);
  };
  for (size_t i = 0; i < settings.size(); ++i) {
    for (size_t r = 1; r < P; ++r) {
      const int64_t v0 = all[2 + i], vr = all[r * n + 2 + i];
      if (vr != v0) {
        return switchyard::detail::cat("[", op, "] ", what, " ranks disagree: ", settings[i].name,
                                       "=", show(settings[i], v0), " on rank 0, ",
                                       show(settings[i], vr), " on rank ", r);
      }
    }
  }
  return {};
}

}  // namespace switchyard::dist::detail

// The verified reader under every reading `switchyard routes` command (see route_input.h).
#include "route_input.h"

#include <exception>
#include <string>

#include "commands.h"
#include "switchyard/error.h"

using switchyard::DataError;
using switchyard::RouteDecodeOptions;
using switchyard::RouteFileReader;
using switchyard::RouteTable;

void add_route_input_options(CLI::App* cmd, RouteInputOptions& o) {
  cmd->add_flag("--salvage", o.salvage,
                "Use the readable sequences of a damaged file, report the lost ones, exit 1");
  cmd->add_option("--max-decoded-bytes", o.max_decoded_bytes, kMaxDecodedBytesHelp)
      ->check(kMaxDecodedBytesRange);
}

namespace {

std::string salvage_hint(bool writes) {
  return std::string(writes ? "; nothing was written" : "") +
         "; rerun with --salvage to use the readable sequences (the command then still exits 1)";
}

bool writes_output(const std::string& command) {
  return command == "routes align" || command == "routes export";
}

}  // namespace

RouteInput::RouteInput(const std::string& path, const RouteInputOptions& o, const char* command)
    : path_(path),
      command_(command),
      salvage_(o.salvage),
      reader_(RouteFileReader::open(path, RouteDecodeOptions{o.max_decoded_bytes})) {
  if (!reader_.complete() && !salvage_) {
    throw DataError("[" + command_ + "] " + path_ + " is damaged (" +
                    std::to_string(reader_.num_sequences()) +
                    " sequences readable before the damage): " + reader_.status() +
                    salvage_hint(writes_output(command_)));
  }
}

std::optional<RouteTable> RouteInput::read(int64_t i) {
  try {
    return reader_.read(i);
  } catch (const DataError& e) {
    if (!salvage_) {
      throw DataError("[" + command_ + "] " + path_ + ": sequence " + std::to_string(i) +
                      " cannot be read: " + e.what() + salvage_hint(writes_output(command_)));
    }
    lost_.emplace_back(i, e.what());
    return std::nullopt;
  }
}

std::vector<RouteTable> RouteInput::read_all() {
  std::vector<RouteTable> out;
  for (int64_t i = 0; i < num_sequences(); ++i) {
    if (auto t = read(i)) out.push_back(std::move(*t));
  }
  return out;
}

void RouteInput::finish(std::ostream& err) const {
  if (!damaged()) return;
  finish_inputs(err, {this});
}

void finish_inputs(std::ostream& err, const std::vector<const RouteInput*>& inputs) {
  bool any = false;
  for (const RouteInput* in : inputs) {
    if (!in->damaged()) continue;
    any = true;
    const RouteFileReader& r = in->reader();
    const int64_t n = r.num_sequences();
    const int64_t lost = static_cast<int64_t>(in->lost_count());
    err << "[" << in->command() << "] salvaged " << in->path() << ": recovered " << n - lost
        << " of the " << n << " sequences found, lost " << lost << " damaged";
    if (!r.complete()) {
      // Without the index nobody knows how many sequences the writer stored after the last
      // readable block: say where the readable part ends and how many bytes follow it.
      const int64_t end = n > 0 ? r.entry(n - 1).offset + r.entry(n - 1).stored_bytes
                                : 48 + 4 * static_cast<int64_t>(r.info().moe_layers.size());
      err << ", and the file is incomplete (" << r.status() << "): ";
      if (r.file_size() > end) {
        err << r.file_size() - end << " unreadable bytes follow byte offset " << end
            << " (a cut block or a damaged index: how many sequences they held is unknown)";
      } else {
        err << "it ends after sequence " << n - 1
            << " without its index (sequences written after it, if any, are lost)";
      }
    }
    err << "\n";
    for (const auto& [seq, why] : in->lost()) err << "  lost sequence " << seq << ": " << why << "\n";
  }
  if (any) throw CLI::RuntimeError(kExitBad);
}

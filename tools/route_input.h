// The one verified reader under every `switchyard routes` command that reads a route file
// (inspect, stats, diff, align, export). A command never works on part of a file silently: a file
// that is cut, whose writer was killed, or whose index is damaged, and any sequence whose block
// fails its checks, end the command with exit code 1 and a message naming the file and the
// damaged record, before any output is written. `--salvage` reads what is readable instead, says
// how many sequences it recovered and what was lost, and still exits 1 once the command is done.
#pragma once

#include <CLI/CLI.hpp>
#include <cstdint>
#include <limits>
#include <optional>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include "switchyard/route_file.h"

/// What every reading command takes: --salvage and --max-decoded-bytes.
struct RouteInputOptions {
  bool salvage = false;
  /// RouteDecodeOptions::max_decoded_bytes of every read (0: the reader's default).
  int64_t max_decoded_bytes = 0;
};

/// The help text of --max-decoded-bytes (validate takes the option without --salvage).
inline constexpr const char* kMaxDecodedBytesHelp =
    "Decode limit of one sequence in bytes (0: max(64 MiB, 1024 x file size))";

/// Its range (CLI::NonNegativeNumber printed the double range, up to 1.8e308).
inline const CLI::Range kMaxDecodedBytesRange(int64_t{0}, std::numeric_limits<int64_t>::max());

/// Adds --salvage and --max-decoded-bytes to `cmd`, stored in `o`.
void add_route_input_options(CLI::App* cmd, RouteInputOptions& o);

/// One route file read by a command (`command` names it in messages: "routes align").
class RouteInput {
 public:
  /// Opens `path`. A file that is not complete (no valid index and footer) is a
  /// switchyard::DataError naming the file and what the reader found (the first damaged record
  /// and its byte offset) unless `o.salvage`; BackendError when it cannot be opened.
  RouteInput(const std::string& path, const RouteInputOptions& o, const char* command);

  const switchyard::RouteFileInfo& info() const { return reader_.info(); }
  const std::string& path() const { return path_; }
  const std::string& command() const { return command_; }
  const switchyard::RouteFileReader& reader() const { return reader_; }
  /// Sequences found (the index's, or those a scan recovered under --salvage).
  int64_t num_sequences() const { return reader_.num_sequences(); }

  /// Sequence `i`, decoded and verified (checksums, structure, the decode limit). A damaged one
  /// is a DataError naming the file and the sequence; under --salvage it is counted as lost,
  /// its reason kept for finish(), and nullopt returned.
  std::optional<switchyard::RouteTable> read(int64_t i);
  /// Every readable sequence, in order (under --salvage the lost ones are left out).
  std::vector<switchyard::RouteTable> read_all();

  /// The sequences lost under --salvage so far, with why.
  const std::vector<std::pair<int64_t, std::string>>& lost() const { return lost_; }
  size_t lost_count() const { return lost_.size(); }
  /// True when anything was lost or the file is incomplete (only possible under --salvage).
  bool damaged() const { return !reader_.complete() || !lost_.empty(); }
  /// Under --salvage, when the file was damaged: prints on `err` how many sequences were
  /// recovered and what was lost (each damaged sequence and why; the unreadable tail of a cut
  /// file), and throws CLI::RuntimeError(kExitBad). Call once the command's output is committed.
  /// Does nothing for an intact file.
  void finish(std::ostream& err) const;

 private:
  std::string path_;
  std::string command_;
  bool salvage_ = false;
  switchyard::RouteFileReader reader_;
  std::vector<std::pair<int64_t, std::string>> lost_;  // sequence, why
};

/// finish() of several inputs (diff): every report printed, then one exit code 1.
void finish_inputs(std::ostream& err, const std::vector<const RouteInput*>& inputs);

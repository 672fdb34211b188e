// The route file: a compact, versioned, checksummed, append-only store of route tables, one record
// per sequence, with random access.
//
// Layout (little-endian): a header (magic "SYROUTES", version, num_experts, top_k, num_moe_layers,
// id width, num_hidden_layers, the hidden-layer index of every MoE layer, an XXH3 checksum); then
// one block per sequence (a fixed block header with its own checksum, then a zstd-compressed
// payload with its checksum (XXH3-64 throughout): ids in the narrowest unsigned width — 1 byte for
// num_experts <= 256 — laid out layer-major, plus a bitmap of `-1` entries when there are any);
// then, when the writer closes, a trailing index (offset and token count of every block) and a
// fixed footer. A writer killed mid-way leaves a file without index: the reader then scans the
// blocks and recovers every sequence whose block is complete. Any corruption or truncation is a
// switchyard::DataError naming what is wrong (block, sequence, byte offset), never a crash or a
// wrong table.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "switchyard/routes.h"

namespace switchyard {

/// Fixed properties of a route file, shared by all its sequences.
struct RouteFileInfo {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t num_moe_layers = 0;
  /// Hidden-layer index of each MoE layer (length num_moe_layers); empty when unknown.
  std::vector<int64_t> moe_layers;
  /// Decoder layers of the model (MTP excluded), for pipeline slicing; 0 when unknown.
  int64_t num_hidden_layers = 0;
  /// Bytes per stored id: 1, 2 or 4 (derived from num_experts; informational when writing).
  int64_t id_width = 0;
  int64_t version = 0;
};

/// Options of a RouteFileWriter.
struct RouteFileWriterOptions {
  /// zstd level (1..19). Level 1 (default) encodes ~800 MB/s of raw int32 on this machine at 5.2x;
  /// level 3 gains ~5% in size at a third of the speed (bench_routes).
  int compression_level = 1;
};

/// A file committed atomically: written to `partial_path(path)` (`<path>.partial`, same
/// directory), which holds an exclusive advisory lock (flock) while open; `commit()` fsyncs it,
/// renames it over `path` and fsyncs the directory. Until then `path` is never opened: an existing
/// file there stays as it was whatever happens to the writer. The commit protocol of
/// RouteFileWriter, and of any other output that must never be left half written (the CLI's
/// `routes export`). Not thread-safe on its own (RouteFileWriter serialises its use).
class PartialFile {
 public:
  /// Opens `partial_path(path)` (created or, once locked, truncated). Throws
  /// std::invalid_argument ("[op] ...") for an empty path, one holding a NUL byte, or one that
  /// exists and is not a regular file; BackendError when the partial file cannot be created or
  /// another writer (an `owner`, named in the message) holds its lock.
  PartialFile(const std::string& path, const char* op, const char* owner);
  /// Closes; an uncommitted partial file stays where it is (as after abort()).
  ~PartialFile();
  PartialFile(const PartialFile&) = delete;
  PartialFile& operator=(const PartialFile&) = delete;

  static std::string partial_path(const std::string& path) { return path + ".partial"; }

  /// Appends all of `bytes` (handed to the OS before returning). BackendError on failure; the
  /// file then refuses to commit (failed() is true).
  void write(std::string_view bytes);
  /// fsync of the partial file. On failure: BackendError, and the file is closed uncommitted.
  void sync();
  /// Renames the partial file over `path`, fsyncs the directory and closes. Call after sync().
  /// On failure: BackendError, and the file is closed uncommitted.
  void publish();
  /// sync() then publish().
  void commit() {
    sync();
    publish();
  }
  /// Closes without committing; the partial file keeps what was written (fsynced, best effort).
  void abort() noexcept;
  /// Closes without committing and removes the partial file (while still holding its lock).
  void discard() noexcept;

  bool is_open() const { return fd_ >= 0; }
  /// A write, sync or publish failed: nothing will be committed.
  bool failed() const { return failed_; }
  /// Bytes written so far.
  int64_t size() const { return size_; }
  const std::string& path() const { return path_; }
  const std::string& partial() const { return partial_; }

 private:
  void release() noexcept;
  int fd_ = -1;
  std::string path_, partial_;
  int64_t size_ = 0;
  bool failed_ = false;
};

/// Appends sequences to a route file, committed atomically (through a PartialFile). Everything is
/// written to `partial_path(path)` (`<path>.partial`, same directory); `close()` writes the index
/// and footer, fsyncs, renames the partial file over `path` and fsyncs the directory. Until then
/// `path` is not touched: an existing file there stays as it was if the writer fails, is aborted or
/// is killed. Each `append` writes one complete block (header, payload, checksums) to the partial
/// file before returning, so a killed process leaves every acknowledged sequence recoverable there
/// (the reader opens it in recovery: complete() false). One writer per path: the partial file holds
/// an exclusive advisory lock (flock) for the writer's lifetime, and a second writer on the same
/// path throws BackendError instead of interleaving. The destructor commits like `close()` (without
/// throwing), except while an exception unwinds the stack past it: then it calls `abort()`, so a
/// failed job never publishes a partial file as complete. After a failed write the writer refuses
/// further appends and `close()` throws without committing. Thread-safe: calls from several threads
/// are serialised by a lock held for the whole call, so concurrent appends each land as one whole
/// sequence (numbered in the order they took the lock), and a close() / abort() / discard() racing
/// an append runs before or after it, never inside it (an append after it throws
/// std::invalid_argument: the writer is closed).
class RouteFileWriter {
 public:
  /// Opens `partial_path(path)` (created or, once locked, truncated). Throws
  /// std::invalid_argument for bad info (num_experts < 1, top_k < 1, num_moe_layers < 1,
  /// moe_layers of the wrong length) or a `path` that exists and is not a regular file, and
  /// BackendError when the partial file cannot be created or another writer holds its lock.
  RouteFileWriter(const std::string& path, const RouteFileInfo& info,
                  const RouteFileWriterOptions& options = {});
  ~RouteFileWriter();
  RouteFileWriter(const RouteFileWriter&) = delete;
  RouteFileWriter& operator=(const RouteFileWriter&) = delete;

  /// Where a writer of `path` writes until it commits: `path + ".partial"`.
  static std::string partial_path(const std::string& path) {
    return PartialFile::partial_path(path);
  }

  /// Appends one sequence. Throws std::invalid_argument when the table's num_experts, layers or
  /// top_k differ from the file's, an id is out of range or the table decodes to more than 4 GiB;
  /// BackendError on a write failure.
  void append(const RouteTable& table);
  /// Commits: index and footer, fsync, rename over `path`, fsync of the directory. Idempotent.
  /// Throws BackendError (and commits nothing) after a failed write.
  void close();
  /// Stops without committing: `path` is untouched, the partial file keeps the appended sequences
  /// (without index: it opens in recovery) until the next writer of `path`. Idempotent.
  void abort();
  /// Stops without committing and removes the partial file. Idempotent.
  void discard();
  /// Sequences appended so far.
  int64_t num_sequences() const;
  /// Bytes written so far.
  int64_t bytes_written() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Limits of a decode (RouteFileReader, verify_route_file / verify_route_bytes, decode_route_file).
/// Every size a header declares (a block's tokens and payload, its zstd frames, the index's token
/// counts) is checked against the bytes actually present and against this limit before anything
/// is allocated, so a small crafted file or message cannot ask for gigabytes (the format's best
/// ratio is about 10^6: zstd turns 4 bytes into 128 KiB of payload, and one match bit into a 4-byte
/// id). Past the limit: switchyard::DataError naming the declared size, the bytes present, the
/// limit and how to raise it.
struct RouteDecodeOptions {
  /// Most bytes one decode may produce: the decompressed payloads plus the int32 tables, per
  /// sequence for RouteFileReader::read (and verify), for the whole message for
  /// decode_route_file. 0 (default): the larger of kDefaultMinDecodedBytes (64 MiB) and
  /// kDefaultDecodedRatio (1024) x the size of the file or message, which every route file a
  /// rollout produces stays far below (real routes decode to ~20x their stored size; a sequence
  /// whose routes repeat the same experts token after token, or are all -1, can go past it: raise
  /// the limit for such data). A positive value is the limit itself; negative values are refused
  /// (std::invalid_argument). Never above the format's own bound of 4 GiB of ids per sequence.
  int64_t max_decoded_bytes = 0;
};
/// The default limit's floor and ratio (RouteDecodeOptions::max_decoded_bytes = 0).
inline constexpr int64_t kDefaultMinDecodedBytes = int64_t{64} << 20;
inline constexpr int64_t kDefaultDecodedRatio = 1024;
/// The limit `options` sets for a decode of `input_bytes` bytes (resolves the default; throws
/// std::invalid_argument for a negative max_decoded_bytes, naming `op`).
int64_t decode_limit(const RouteDecodeOptions& options, int64_t input_bytes, const char* op);

/// Where one stored sequence lives.
struct RouteFileEntry {
  int64_t offset = 0;        ///< byte offset of its block header
  int64_t num_tokens = 0;    ///< tokens of the sequence
  int64_t stored_bytes = 0;  ///< block size on disk (header + payload)
};

/// Reads a route file: random access by sequence index. `read` is const and safe to call from
/// several threads at once (positional reads, no shared cursor). Decoding is deterministic.
class RouteFileReader {
 public:
  /// Opens a file on disk. Throws BackendError when it cannot be opened and DataError when the
  /// header is corrupt or truncated. A file without a valid trailing index (writer killed, file
  /// cut) opens in recovery: complete() is false, status() says why, and every complete block
  /// found by scanning is readable. `options` bounds what each read() may decode (the default
  /// limit is derived from the file's size).
  static RouteFileReader open(const std::string& path, const RouteDecodeOptions& options = {});
  /// The same over bytes in memory (copied).
  static RouteFileReader from_bytes(std::string_view bytes,
                                    const RouteDecodeOptions& options = {});

  RouteFileReader(RouteFileReader&&) noexcept;
  RouteFileReader& operator=(RouteFileReader&&) noexcept;
  ~RouteFileReader();

  const RouteFileInfo& info() const;
  int64_t num_sequences() const;
  const RouteFileEntry& entry(int64_t sequence) const;
  /// True when the file was closed by its writer and its index and footer are intact.
  bool complete() const;
  /// "ok", or what is wrong with the file's tail (missing index, trailing partial block, ...).
  const std::string& status() const;
  /// Total file size in bytes.
  int64_t file_size() const;

  /// Decodes one sequence. Throws std::out_of_range for an index beyond num_sequences() and
  /// DataError when its block is corrupt (message names block, sequence and byte offset) or
  /// declares more than the reader's max_decoded_bytes (checked before allocating).
  RouteTable read(int64_t sequence) const;

 private:
  struct Impl;
  friend std::vector<RouteTable> decode_route_file(std::string_view, RouteFileInfo*,
                                                  const RouteDecodeOptions&);
  explicit RouteFileReader(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Result of verify_route_file: every block decoded and checked.
struct RouteFileCheck {
  bool ok = false;                    ///< complete file and every block intact
  int64_t num_sequences = 0;          ///< sequences found (index or scan)
  int64_t num_readable = 0;           ///< sequences that decode
  int64_t num_tokens = 0;             ///< tokens over readable sequences
  std::vector<std::string> problems;  ///< one line per problem, empty when ok
};

/// Opens and fully decodes a file, collecting every problem instead of throwing on the first
/// (BackendError still propagates when the file cannot be opened at all). A block past the
/// decode limit of `options` is one problem (its sequence is not readable).
RouteFileCheck verify_route_file(const std::string& path, const RouteDecodeOptions& options = {});
/// The same over bytes in memory.
RouteFileCheck verify_route_bytes(std::string_view bytes, const RouteDecodeOptions& options = {});

// ---- The route file in memory: switchyard's wire format for route data ------------------------
//
// A batch's routes travel between processes (torch.distributed, Ray) as the bytes of a complete
// route file: the same header (version, E, K, layer map), blocks (narrowest id width, per-layer
// rank transform, zstd, XXH3 checksums) and index (tokens of every sequence) a RouteFileWriter
// writes, built in memory. One codec for files and messages: what reads one reads the other.

/// The bytes of a complete route file holding `tables` (uint8 1-D tensor), identical to the file a
/// RouteFileWriter with `info` and `options` writes for them. Tables are encoded on the engine's
/// OpenMP threads (one zstd context each); the bytes do not depend on the thread count. Throws
/// std::invalid_argument (op "routes.encode") as the writer's constructor and append do (bad
/// info, a table whose ids, layers or top_k do not fit), naming the table.
Tensor encode_route_file(const std::vector<RouteTable>& tables, const RouteFileInfo& info,
                         const RouteFileWriterOptions& options = {});

/// Every table of a route file in memory, decoded on the engine's threads; `bytes` is read in
/// place (not copied). Fills `*info` when given. A message must be complete: a missing or corrupt
/// header, block or index, a cut, trailing bytes — anything but the file a writer closed — throws
/// switchyard::DataError naming what is wrong (block, sequence, byte offset); never a wrong table.
/// A message whose blocks declare more than `options.max_decoded_bytes` in all (payloads + tables;
/// the default is derived from `bytes.size()`) is a DataError before any block is decompressed.
std::vector<RouteTable> decode_route_file(std::string_view bytes, RouteFileInfo* info = nullptr,
                                          const RouteDecodeOptions& options = {});

}  // namespace switchyard

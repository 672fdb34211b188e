// Route file writer and reader (layout in route_file.h and route_codec.h).
#include "switchyard/route_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>
#define ZSTD_STATIC_LINKING_ONLY  // ZSTD_c_literalCompressionMode (the literal frame at level 1)
#include <zstd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <mutex>
#include <optional>
#include <stdexcept>

#include "check.h"
#include "route_codec.h"
#include "switchyard/error.h"

namespace switchyard {

using detail::cat;
using detail::get_u32;
using detail::get_u64;
using detail::put_u32;
using detail::put_u64;

namespace {

std::string encode_header(const RouteFileInfo& info) {
  std::string h(detail::kFileMagic, 8);
  const auto n_layers = static_cast<uint32_t>(info.moe_layers.size());
  put_u32(h, detail::kFormatVersion);
  put_u32(h, static_cast<uint32_t>(8 + 8 * 4 + 4 * n_layers + 8));
  put_u32(h, static_cast<uint32_t>(info.num_experts));
  put_u32(h, static_cast<uint32_t>(info.top_k));
  put_u32(h, static_cast<uint32_t>(info.num_moe_layers));
  put_u32(h, static_cast<uint32_t>(detail::id_width_for(info.num_experts)));
  put_u32(h, n_layers);
  put_u32(h, static_cast<uint32_t>(info.num_hidden_layers));
  for (int64_t l : info.moe_layers) put_u32(h, static_cast<uint32_t>(l));
  put_u64(h, detail::checksum(h.data(), h.size()));
  return h;
}

// Compresses `n` bytes at `src` as one zstd frame appended to `comp` (sized by the caller) at
// `at`; returns the new end. Level 1 (routes.encode's default) Huffman-codes the frame without a
// match search (zstd level -1000 with literal compression on): the token delta already removed
// the repeats that matter, and the search was half of zstd's time for 4% of the bytes
// (notes/routes.md). Levels 2-19 are zstd's own.
size_t compress_frame(ZSTD_CCtx* cctx, const char* src, size_t n, int level, std::string& comp,
                      size_t at) {
  ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
  const bool fast = level == 1;
  size_t r = ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, fast ? -1000 : level);
  if (!ZSTD_isError(r) && fast) {
    // Negative levels store literals raw unless told: Huffman them (an older libzstd without the
    // parameter still writes a valid, larger frame).
    (void)ZSTD_CCtx_setParameter(cctx, ZSTD_c_literalCompressionMode, ZSTD_ps_enable);
  }
  if (!ZSTD_isError(r)) {
    ZSTD_CCtx_setPledgedSrcSize(cctx, n);
    r = ZSTD_compress2(cctx, comp.data() + at, comp.size() - at, src, n);
  }
  if (ZSTD_isError(r)) throw BackendError(cat("ZSTD_compress2: ", ZSTD_getErrorName(r)));
  return at + r;
}

// Appends sequence `seq`'s block (header, zstd payload, checksums) to `out`; `raw` and `comp` are
// scratch buffers kept between calls. The one block encoder of the file and of the wire format.
// The payload is up to three zstd frames (permutation + match bits, literals, -1 bitmap; see
// route_codec.h) whose decompressed concatenation is the raw payload.
// An id outside [-1, num_experts) is an std::invalid_argument naming `op`, `name` and the id.
void encode_block(const RouteTable& table, int64_t seq, const RouteFileInfo& info, int level,
                  ZSTD_CCtx* cctx, std::string& raw, std::string& comp, std::string& out,
                  const char* op, const char* name) {
  const int64_t T = table.num_tokens();
  detail::PayloadPieces pc;
  const uint32_t flags =
      detail::encode_payload(table.topk_idx.data<int32_t>(), T, info.num_moe_layers, info.top_k,
                             info.num_experts, raw, pc);
  if (flags == detail::kBadIds) {
    check_route_table(table, op, name);  // names the first bad id
    detail::fail_arg(op, name, ": ids must be -1 or in [0, num_experts=", info.num_experts, ")");
  }
  const auto head = static_cast<size_t>(pc.head_size);
  const auto lits = static_cast<size_t>(pc.lit_size);
  const auto none = static_cast<size_t>(pc.none_size);
  size_t c = head;
  const std::string* stored = &raw;  // a set-coded payload is stored as is (its own entropy code)
  if (!pc.stored) {
    comp.resize(ZSTD_compressBound(head) + ZSTD_compressBound(lits) + ZSTD_compressBound(none));
    c = compress_frame(cctx, raw.data(), head, level, comp, 0);
    if (lits) c = compress_frame(cctx, raw.data() + pc.lit_offset, lits, level, comp, c);
    if (none) c = compress_frame(cctx, raw.data() + pc.none_offset, none, level, comp, c);
    stored = &comp;
  }
  const size_t at = out.size();
  put_u32(out, detail::kBlockMagic);
  put_u32(out, flags);
  put_u64(out, static_cast<uint64_t>(seq));
  put_u64(out, static_cast<uint64_t>(T));
  put_u64(out, static_cast<uint64_t>(head + lits + none));
  put_u64(out, static_cast<uint64_t>(c));
  put_u64(out, detail::checksum(stored->data(), c));
  put_u64(out, detail::checksum(out.data() + at, out.size() - at));
  out.append(stored->data(), c);
}

// The trailing index (offset, tokens and size of every block) and the footer, for blocks that
// end at byte `end`.
std::string encode_index(const std::vector<RouteFileEntry>& entries, int64_t end) {
  std::string ix;
  put_u32(ix, detail::kIndexMagic);
  put_u32(ix, 0);
  put_u64(ix, static_cast<uint64_t>(entries.size()));
  for (const auto& e : entries) {
    put_u64(ix, static_cast<uint64_t>(e.offset));
    put_u64(ix, static_cast<uint64_t>(e.num_tokens));
    put_u64(ix, static_cast<uint64_t>(e.stored_bytes));
  }
  put_u64(ix, detail::checksum(ix.data(), ix.size()));
  put_u64(ix, static_cast<uint64_t>(end));
  put_u64(ix, detail::checksum(ix.data() + ix.size() - 8, 8));
  ix.append(detail::kFooterMagic, 8);
  return ix;
}

// The writer's arguments (the file's and the wire format's: one set of rules).
void check_writer_args(const RouteFileInfo& info, const RouteFileWriterOptions& options,
                       const char* op) {
  if (info.num_experts < 1 || info.num_experts > detail::kMaxExperts) {
    detail::fail_arg(op, "num_experts must be in [1, ", detail::kMaxExperts, "], got ",
                     info.num_experts);
  }
  if (info.top_k < 1 || info.top_k > detail::kMaxTopK) {
    detail::fail_arg(op, "top_k must be in [1, ", detail::kMaxTopK, "], got ", info.top_k);
  }
  if (info.num_moe_layers < 1 || info.num_moe_layers > detail::kMaxLayers) {
    detail::fail_arg(op, "num_moe_layers must be in [1, ", detail::kMaxLayers, "], got ",
                     info.num_moe_layers);
  }
  if (!info.moe_layers.empty() &&
      static_cast<int64_t>(info.moe_layers.size()) != info.num_moe_layers) {
    detail::fail_arg(op, "moe_layers must be empty or have num_moe_layers=", info.num_moe_layers,
                     " entries, got ", info.moe_layers.size());
  }
  if (info.num_hidden_layers < 0 || info.num_hidden_layers > detail::kMaxLayers) {
    detail::fail_arg(op, "num_hidden_layers must be in [0, ", detail::kMaxLayers, "], got ",
                     info.num_hidden_layers);
  }
  for (size_t i = 0; i < info.moe_layers.size(); ++i) {
    const int64_t l = info.moe_layers[i];
    if (l < 0 || (info.num_hidden_layers > 0 && l >= info.num_hidden_layers) ||
        (i > 0 && l <= info.moe_layers[i - 1]) || l > detail::kMaxLayers) {
      detail::fail_arg(op,
                       "moe_layers must be ascending hidden-layer indices below num_hidden_layers=",
                       info.num_hidden_layers, ", got ", l, " at ", i);
    }
  }
  if (options.compression_level < 1 || options.compression_level > 19) {
    detail::fail_arg(op, "compression_level must be in [1, 19], got ", options.compression_level);
  }
}

// A table appended to a file of `info` (layout, size; encode_block checks the ids while encoding
// them); `name` names it in errors.
void check_append(const RouteTable& table, const RouteFileInfo& info, const char* op,
                  const char* name) {
  detail::check_defined(table.topk_idx, op, name);
  detail::check_dtype(table.topk_idx, op, name, {DType::int32});
  detail::check_dim(table.topk_idx, op, name, 3);
  if (table.num_experts != info.num_experts || table.num_moe_layers() != info.num_moe_layers ||
      table.top_k() != info.top_k) {
    detail::fail_arg(op, name, " must have num_experts=", info.num_experts,
                     ", num_moe_layers=", info.num_moe_layers, ", top_k=", info.top_k,
                     " like the file, got num_experts=", table.num_experts,
                     ", num_moe_layers=", table.num_moe_layers(), ", top_k=", table.top_k());
  }
  const int64_t T = table.num_tokens();
  if (T > detail::kMaxTableBytes / (4 * info.num_moe_layers * info.top_k)) {
    detail::fail_arg(op, name, " must decode to at most ", detail::kMaxTableBytes,
                     " bytes per sequence (the reader's limit), got ", T, " tokens x ",
                     info.num_moe_layers, " layers x top_k ", info.top_k, " x 4 bytes");
  }
}

[[noreturn]] void io_fail(const std::string& call, const std::string& path) {
  throw BackendError(
      cat(call, "(", path, "): ", std::strerror(errno), " (", SY_SOURCE_FILE, ":", __LINE__, ")"));
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// PartialFile
//
// Commit protocol: everything goes to `<path>.partial` (same directory, so the rename is atomic),
// which holds an exclusive flock while open. commit() fsyncs the file, renames it over `path` and
// fsyncs the directory. Until then `path` is never opened.

PartialFile::PartialFile(const std::string& path, const char* op, const char* owner) {
  detail::check_path(path, op, "path");
  struct stat st {};
  if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
    // The rename at commit would replace it (a device, a directory): refuse up front.
    detail::fail_arg(op, "path must be a regular file or not exist, got ", path,
                     S_ISDIR(st.st_mode) ? " (a directory)" : " (not a regular file)");
  }
  path_ = path;
  partial_ = partial_path(path);
  // Lock, then check that the locked inode is still the one named `partial` (a writer that just
  // committed renamed it away); only then truncate. Never O_TRUNC before holding the lock.
  for (int attempt = 0;; ++attempt) {
    fd_ = ::open(partial_.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) io_fail("open", partial_);
    if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
      const int e = errno;
      release();
      if (e == EWOULDBLOCK) {
        throw BackendError(cat("[", op, "] ", path, " is being written by another ", owner,
                               " (lock on ", partial_, " held); one writer per path at a time"));
      }
      errno = e;
      io_fail("flock", partial_);
    }
    struct stat held {};
    struct stat named {};
    if (::fstat(fd_, &held) != 0) {
      const int e = errno;
      release();
      errno = e;
      io_fail("fstat", partial_);
    }
    if (::stat(partial_.c_str(), &named) == 0 && named.st_ino == held.st_ino &&
        named.st_dev == held.st_dev) {
      break;
    }
    release();
    if (attempt >= 16) {
      throw BackendError(cat("[", op, "] ", partial_, " keeps being replaced while locking"));
    }
  }
  if (::ftruncate(fd_, 0) != 0) {
    const int e = errno;
    release();
    errno = e;
    io_fail("ftruncate", partial_);
  }
}

PartialFile::~PartialFile() { release(); }

void PartialFile::release() noexcept {
  if (fd_ >= 0) ::close(fd_);  // releases the lock
  fd_ = -1;
}

void PartialFile::write(std::string_view bytes) {
  if (fd_ < 0) throw BackendError(cat("write(", partial_, "): the file is closed"));
  // One write per block, handed to the OS before returning, so a writer killed later leaves this
  // block complete in the partial file.
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(fd_, bytes.data() + done, bytes.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      if (w == 0) errno = EIO;
      // Stop here: later blocks or an index after a partial block would be misplaced. The
      // blocks written so far stay recoverable by the reader's scan.
      failed_ = true;
      io_fail("write", partial_);
    }
    done += static_cast<size_t>(w);
  }
  size_ += static_cast<int64_t>(bytes.size());
}

void PartialFile::sync() {
  if (fd_ < 0) throw BackendError(cat("fsync(", partial_, "): the file is closed"));
  if (::fsync(fd_) != 0) {
    const int e = errno;
    failed_ = true;
    release();
    errno = e;
    io_fail("fsync", partial_);
  }
}

void PartialFile::publish() {
  if (fd_ < 0) throw BackendError(cat("rename(", partial_, "): the file is closed"));
  if (::rename(partial_.c_str(), path_.c_str()) != 0) {
    const int e = errno;
    failed_ = true;
    release();
    errno = e;
    io_fail("rename", partial_);
  }
  // The rename is durable once the directory is: fsync it (best effort where unsupported).
  const size_t slash = path_.find_last_of('/');
  std::string dir = path_.substr(0, slash == std::string::npos ? 0 : slash + 1);
  if (dir.empty()) dir = ".";
  const int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  const int derr = dfd < 0 ? errno : (::fsync(dfd) != 0 ? errno : 0);
  if (dfd >= 0) ::close(dfd);
  release();  // after the rename: the lock covers the whole commit
  if (derr != 0 && derr != EINVAL && derr != EROFS) {
    errno = derr;
    io_fail("fsync", dir);
  }
}

void PartialFile::abort() noexcept {
  if (fd_ < 0) return;
  ::fsync(fd_);  // best effort: keep what was written for recovery
  release();
}

void PartialFile::discard() noexcept {
  if (fd_ < 0) return;
  // Unlink while still holding the lock, so no other writer's file is removed.
  ::unlink(partial_.c_str());
  release();
}

// ---------------------------------------------------------------------------------------------
// Writer: a PartialFile of blocks, then the index and footer. One mutex serialises every call.

struct RouteFileWriter::Impl {
  std::mutex mu;
  std::optional<PartialFile> file;
  std::string path;
  RouteFileInfo info;
  RouteFileWriterOptions options;
  std::vector<RouteFileEntry> entries;
  std::string raw, comp, block;
  ZSTD_CCtx* cctx = nullptr;
  int uncaught_at_open = 0;  // std::uncaught_exceptions() when constructed (see ~RouteFileWriter)

  ~Impl() { ZSTD_freeCCtx(cctx); }  // accepts nullptr; ~PartialFile releases the lock

  bool open() const { return file && file->is_open(); }
  int64_t offset() const { return file ? file->size() : 0; }
};

RouteFileWriter::RouteFileWriter(const std::string& path, const RouteFileInfo& info,
                                 const RouteFileWriterOptions& options)
    : impl_(std::make_unique<Impl>()) {
  const char* op = "route_file";
  check_writer_args(info, options, op);
  Impl& s = *impl_;
  s.path = path;
  s.info = info;
  s.info.id_width = detail::id_width_for(info.num_experts);
  s.info.version = detail::kFormatVersion;
  s.options = options;
  s.cctx = ZSTD_createCCtx();
  if (!s.cctx) throw BackendError("ZSTD_createCCtx failed");
  s.file.emplace(path, op, "RouteFileWriter");
  s.uncaught_at_open = std::uncaught_exceptions();
  s.file->write(encode_header(s.info));
}

RouteFileWriter::~RouteFileWriter() {
  if (!impl_) return;
  try {
    // Unwinding from an exception (an append or the caller's own code failed): the sequences so
    // far may not be all there is, so never commit; the partial file stays for recovery.
    if (std::uncaught_exceptions() > impl_->uncaught_at_open) {
      abort();
    } else {
      close();
    }
  } catch (...) {
    // A destructor never throws; call close() to see the error. ~Impl releases the rest.
  }
}

void RouteFileWriter::append(const RouteTable& table) {
  const char* op = "route_file.append";
  Impl& s = *impl_;
  // s.info is fixed at construction: the table checks need no lock (encode_block checks the ids).
  check_append(table, s.info, op, "table");
  const int64_t T = table.num_tokens();
  // The zstd context, the buffers, the offset and the index are shared: one append at a time.
  const std::lock_guard<std::mutex> lock(s.mu);
  if (!s.open()) detail::fail_arg(op, "the writer of ", s.path, " is closed");
  if (s.file->failed()) {
    throw BackendError(cat("[route_file] an earlier write to ", s.file->partial(), " failed"));
  }
  s.block.clear();
  encode_block(table, static_cast<int64_t>(s.entries.size()), s.info, s.options.compression_level,
               s.cctx, s.raw, s.comp, s.block, op, "table");
  RouteFileEntry e{s.offset(), T, static_cast<int64_t>(s.block.size())};
  s.file->write(s.block);
  s.entries.push_back(e);
}

void RouteFileWriter::close() {
  Impl& s = *impl_;
  const std::lock_guard<std::mutex> lock(s.mu);
  if (!s.open()) return;
  if (s.file->failed()) {  // no index after a partial block: nothing is committed
    const std::string partial = s.file->partial();
    s.file->abort();
    throw BackendError(cat("[route_file] ", s.path, " was not written: an earlier write to ",
                           partial, " failed (its complete blocks stay there for recovery)"));
  }
  const std::string tail = encode_index(s.entries, s.offset());
  try {
    s.file->write(tail);
  } catch (...) {
    s.file->abort();
    throw;
  }
  s.file->commit();  // closes the file, committed or not
}

void RouteFileWriter::abort() {
  Impl& s = *impl_;
  const std::lock_guard<std::mutex> lock(s.mu);
  if (s.file) s.file->abort();
}

void RouteFileWriter::discard() {
  Impl& s = *impl_;
  const std::lock_guard<std::mutex> lock(s.mu);
  if (s.file) s.file->discard();
}

int64_t RouteFileWriter::num_sequences() const {
  const std::lock_guard<std::mutex> lock(impl_->mu);
  return static_cast<int64_t>(impl_->entries.size());
}
int64_t RouteFileWriter::bytes_written() const {
  const std::lock_guard<std::mutex> lock(impl_->mu);
  return impl_->offset();
}

// ---------------------------------------------------------------------------------------------
// Reader

struct RouteFileReader::Impl {
  std::string name;  // path or "<memory>", for messages
  // The decode limit (RouteDecodeOptions: bytes of payload + table one read may produce, or a
  // whole message for decode_route_file) and whether it is the default one (for the message).
  int64_t limit = 0;
  bool default_limit = true;
  std::string mem;   // the bytes of from_bytes (a copy)
  std::string_view view;  // the bytes read when fd < 0: mem, or the caller's (decode_route_file)
  int fd = -1;
  int64_t size = 0;
  RouteFileInfo info;
  int64_t header_size = 0;
  std::vector<RouteFileEntry> entries;
  bool complete = false;
  std::string status = "ok";

  ~Impl() {
    if (fd >= 0) ::close(fd);
  }

  [[noreturn]] void fail(const std::string& what) const {
    throw DataError(cat("[route_file] ", name, ": ", what));
  }

  void set_limit(const RouteDecodeOptions& options) {
    limit = decode_limit(options, size, "route_file");
    default_limit = options.max_decoded_bytes == 0;
  }

  // "more than max_decoded_bytes=N (...); how to raise it": the tail of every size-limit error.
  std::string over_limit() const {
    return cat(", more than max_decoded_bytes=", limit,
               default_limit ? cat(" (the default: the larger of ", kDefaultMinDecodedBytes,
                                   " bytes and ", kDefaultDecodedRatio, " x the ", size,
                                   " bytes present)")
                             : std::string(),
               "; if the data is trusted, raise the limit (C++ RouteDecodeOptions::"
               "max_decoded_bytes, Python max_decoded_bytes=, CLI --max-decoded-bytes)");
  }

  // Bytes a block decodes to: its payload (raw_size) plus its int32 table. The header's sizes
  // are already bounded (parse_block_header), so this does not overflow.
  int64_t decoded_bytes(int64_t tokens, int64_t raw_size) const {
    return raw_size + tokens * info.num_moe_layers * info.top_k * 4;
  }

  // Reads exactly n bytes at offset, or returns false when the file is shorter.
  bool read_at(int64_t offset, int64_t n, char* dst) const {
    if (offset < 0 || n < 0 || offset > size || n > size - offset) return false;
    if (fd < 0) {
      std::memcpy(dst, view.data() + offset, static_cast<size_t>(n));
      return true;
    }
    int64_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(fd, dst + done, static_cast<size_t>(n - done), offset + done);
      if (r < 0) {
        if (errno == EINTR) continue;
        io_fail("pread", name);
      }
      if (r == 0) return false;
      done += r;
    }
    return true;
  }

  void parse_header() {
    char fixed[40];
    if (read_at(0, 8, fixed) && std::memcmp(fixed, detail::kFileMagic, 8) != 0) {
      fail("not a route file (bad magic at byte offset 0)");
    }
    if (!read_at(0, 40, fixed)) {
      fail(cat("truncated header: file has ", size, " bytes, a header needs at least 48"));
    }
    if (std::memcmp(fixed, detail::kFileMagic, 8) != 0)
      fail("not a route file (bad magic at byte offset 0)");
    const uint32_t version = get_u32(fixed + 8);
    if (version < detail::kFormatVersionMin || version > detail::kFormatVersion) {
      fail(cat("unsupported format version ", version, " (this build reads versions ",
               detail::kFormatVersionMin, " to ", detail::kFormatVersion, ")"));
    }
    const int64_t hsize = get_u32(fixed + 12);
    const int64_t n_layers = get_u32(fixed + 32);
    if (n_layers > detail::kMaxLayers || hsize != 8 + 8 * 4 + 4 * n_layers + 8) {
      fail(cat("corrupt header: header size ", hsize, " does not match its ", n_layers,
               " layer entries"));
    }
    std::string h(static_cast<size_t>(hsize), '\0');
    if (!read_at(0, hsize, h.data())) {
      fail(cat("truncated header: needs ", hsize, " bytes, file has ", size));
    }
    if (detail::checksum(h.data(), size_t(hsize - 8)) != get_u64(h.data() + hsize - 8)) {
      fail("corrupt header: checksum mismatch (bytes 0.." + std::to_string(hsize) + ")");
    }
    info.version = version;
    info.num_experts = get_u32(fixed + 16);
    info.top_k = get_u32(fixed + 20);
    info.num_moe_layers = get_u32(fixed + 24);
    info.id_width = get_u32(fixed + 28);
    info.num_hidden_layers = get_u32(fixed + 36);
    if (info.num_experts < 1 || info.num_experts > detail::kMaxExperts || info.top_k < 1 ||
        info.top_k > detail::kMaxTopK || info.num_moe_layers < 1 ||
        info.num_moe_layers > detail::kMaxLayers ||
        info.id_width != detail::id_width_for(info.num_experts) ||
        (n_layers != 0 && n_layers != info.num_moe_layers) ||
        info.num_hidden_layers > detail::kMaxLayers) {
      fail(cat("corrupt header: inconsistent num_experts=", info.num_experts, ", top_k=",
               info.top_k, ", num_moe_layers=", info.num_moe_layers, ", id_width=", info.id_width));
    }
    for (int64_t l = 0; l < n_layers; ++l)
      info.moe_layers.push_back(get_u32(h.data() + 40 + 4 * l));
    header_size = hsize;
  }

  // Parses a block header at `offset`; returns "" or what is wrong. Fills entry and flags.
  std::string parse_block_header(int64_t offset, int64_t expected_seq, RouteFileEntry& e,
                                 uint32_t& flags, int64_t& raw_size, uint64_t& payload_sum) const {
    char b[detail::kBlockHeaderSize];
    if (!read_at(offset, detail::kBlockHeaderSize, b)) {
      return cat("truncated block header (", size - offset, " of ", detail::kBlockHeaderSize,
                 " bytes present)");
    }
    if (get_u32(b) != detail::kBlockMagic) return "bad block magic";
    if (detail::checksum(b, 48) != get_u64(b + 48)) return "block header checksum mismatch";
    flags = get_u32(b + 4);
    const uint64_t seq = get_u64(b + 8);
    const uint64_t tokens = get_u64(b + 16);
    raw_size = static_cast<int64_t>(std::min<uint64_t>(get_u64(b + 24), uint64_t{1} << 62));
    const uint64_t comp = get_u64(b + 32);
    payload_sum = get_u64(b + 40);
    if (seq != static_cast<uint64_t>(expected_seq)) {
      return cat("block holds sequence ", seq, ", expected ", expected_seq);
    }
    if (!detail::block_flags_valid(static_cast<uint32_t>(info.version), flags)) {
      return cat("unknown block flags ", flags, " for format version ", info.version);
    }
    const uint64_t row = static_cast<uint64_t>(info.num_moe_layers * info.top_k);
    if (tokens > static_cast<uint64_t>(detail::kMaxRawBlockBytes) / row ||
        raw_size > detail::kMaxRawBlockBytes ||
        !detail::payload_size_ok(static_cast<int64_t>(tokens), info.num_moe_layers, info.top_k,
                                 info.num_experts, flags, raw_size)) {
      return cat("inconsistent sizes: ", tokens, " tokens, payload ", raw_size, " bytes");
    }
    if (tokens * row > static_cast<uint64_t>(detail::kMaxTableBytes) / 4) {
      return cat("declares ", tokens, " tokens x ", info.num_moe_layers, " layers x top_k ",
                 info.top_k, ", more than the ", detail::kMaxTableBytes,
                 " bytes a sequence may decode to");
    }
    if (comp > static_cast<uint64_t>(size)) {
      return cat("truncated block: payload of ", comp, " bytes runs past the end of the file (",
                 size, " bytes)");
    }
    const uint64_t min_comp = static_cast<uint64_t>(detail::kZstdMinBlockBytes) *
                              ((static_cast<uint64_t>(raw_size) + detail::kZstdMaxBlock - 1) /
                               detail::kZstdMaxBlock);
    if (detail::block_is_set_coded(flags)) {
      if (comp != static_cast<uint64_t>(raw_size)) {  // stored as is
        return cat("inconsistent sizes: a set-coded payload of ", raw_size, " bytes stored in ",
                   comp, " bytes");
      }
    } else if (comp < min_comp) {
      return cat("inconsistent sizes: a payload of ", raw_size, " bytes cannot come from ", comp,
                 " compressed bytes (zstd needs at least ", min_comp, ")");
    }
    e.offset = offset;
    e.num_tokens = static_cast<int64_t>(tokens);
    e.stored_bytes = detail::kBlockHeaderSize + static_cast<int64_t>(comp);
    if (e.stored_bytes > size - offset) {
      return cat("truncated block: needs ", e.stored_bytes, " bytes from offset ", offset,
                 ", file has ", size - offset);
    }
    return {};
  }

  // Uses the trailing index; returns "" or why it cannot.
  std::string load_index() {
    if (size < header_size + 16 + 8 + detail::kFooterSize) return "no index (file too short)";
    char f[detail::kFooterSize];
    read_at(size - detail::kFooterSize, detail::kFooterSize, f);
    if (std::memcmp(f + 16, detail::kFooterMagic, 8) != 0)
      return "no index footer (file was not closed, or is cut)";
    if (detail::checksum(f, 8) != get_u64(f + 8)) return "index footer checksum mismatch";
    const uint64_t ix_off = get_u64(f);
    if (ix_off < static_cast<uint64_t>(header_size) ||
        ix_off > static_cast<uint64_t>(size - detail::kFooterSize - 24)) {
      return cat("index offset ", ix_off, " out of range");
    }
    const int64_t ix_len = size - detail::kFooterSize - static_cast<int64_t>(ix_off);
    std::string ix(static_cast<size_t>(ix_len), '\0');
    read_at(static_cast<int64_t>(ix_off), ix_len, ix.data());
    if (get_u32(ix.data()) != detail::kIndexMagic)
      return cat("bad index magic at byte offset ", ix_off);
    const uint64_t n = get_u64(ix.data() + 8);
    if (n > static_cast<uint64_t>(ix_len) / detail::kIndexEntrySize ||
        static_cast<int64_t>(16 + n * detail::kIndexEntrySize + 8) != ix_len) {
      return cat("index size does not match its ", n, " entries");
    }
    if (detail::checksum(ix.data(), size_t(ix_len - 8)) != get_u64(ix.data() + ix_len - 8)) {
      return cat("index checksum mismatch (index at byte offset ", ix_off, ")");
    }
    std::vector<RouteFileEntry> es(n);
    int64_t expect = header_size;
    for (uint64_t i = 0; i < n; ++i) {
      const char* p = ix.data() + 16 + i * detail::kIndexEntrySize;
      es[i].offset = static_cast<int64_t>(get_u64(p));
      es[i].num_tokens = static_cast<int64_t>(get_u64(p + 8));
      es[i].stored_bytes = static_cast<int64_t>(get_u64(p + 16));
      if (es[i].offset != expect || es[i].stored_bytes < detail::kBlockHeaderSize ||
          es[i].stored_bytes > static_cast<int64_t>(ix_off) - expect || es[i].num_tokens < 0) {
        return cat("index entry ", i, " is inconsistent with the block layout");
      }
      expect += es[i].stored_bytes;
    }
    if (expect != static_cast<int64_t>(ix_off))
      return "index does not cover the blocks up to the index";
    entries = std::move(es);
    return {};
  }

  // Scans the blocks from the header on; keeps every complete one.
  std::string scan(const std::string& why) {
    entries.clear();
    int64_t off = header_size;
    while (off < size) {
      char magic[4];
      if (read_at(off, 4, magic) && get_u32(magic) == detail::kIndexMagic) {
        return cat(why, "; index at byte offset ", off, " unusable; ", entries.size(),
                   " sequences recovered by scanning");
      }
      RouteFileEntry e;
      uint32_t flags;
      int64_t raw;
      uint64_t sum;
      const std::string err =
          parse_block_header(off, static_cast<int64_t>(entries.size()), e, flags, raw, sum);
      if (!err.empty()) {
        return cat(why, "; block ", entries.size(), " at byte offset ", off, ": ", err, "; ",
                   entries.size(), " sequences recovered by scanning");
      }
      entries.push_back(e);
      off += e.stored_bytes;
    }
    return cat(why, "; ", entries.size(), " complete sequences recovered by scanning");
  }

  void open() {
    parse_header();
    const std::string why = load_index();
    if (why.empty()) {
      complete = true;
      status = "ok";
    } else {
      complete = false;
      status = scan(why);
    }
  }
};

RouteFileReader::RouteFileReader(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
RouteFileReader::RouteFileReader(RouteFileReader&&) noexcept = default;
RouteFileReader& RouteFileReader::operator=(RouteFileReader&&) noexcept = default;
RouteFileReader::~RouteFileReader() = default;

RouteFileReader RouteFileReader::open(const std::string& path, const RouteDecodeOptions& options) {
  detail::check_path(path, "route_file", "path");
  (void)decode_limit(options, 0, "route_file");  // a bad option before the file is touched
  auto impl = std::make_unique<Impl>();
  impl->name = path;
  impl->fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (impl->fd < 0) io_fail("open", path);
  const off_t end = ::lseek(impl->fd, 0, SEEK_END);
  if (end < 0) io_fail("lseek", path);
  impl->size = static_cast<int64_t>(end);
  impl->set_limit(options);
  impl->open();
  return RouteFileReader(std::move(impl));
}

RouteFileReader RouteFileReader::from_bytes(std::string_view bytes,
                                            const RouteDecodeOptions& options) {
  auto impl = std::make_unique<Impl>();
  impl->name = "<memory>";
  impl->size = static_cast<int64_t>(bytes.size());
  impl->set_limit(options);
  impl->mem.assign(bytes.data(), bytes.size());
  impl->view = impl->mem;
  impl->open();
  return RouteFileReader(std::move(impl));
}

const RouteFileInfo& RouteFileReader::info() const { return impl_->info; }
int64_t RouteFileReader::num_sequences() const {
  return static_cast<int64_t>(impl_->entries.size());
}
const RouteFileEntry& RouteFileReader::entry(int64_t sequence) const {
  if (sequence < 0 || sequence >= num_sequences()) {
    throw std::out_of_range(
        cat("[route_file] sequence ", sequence, " out of range [0, ", num_sequences(), ")"));
  }
  return impl_->entries[static_cast<size_t>(sequence)];
}
bool RouteFileReader::complete() const { return impl_->complete; }
const std::string& RouteFileReader::status() const { return impl_->status; }
int64_t RouteFileReader::file_size() const { return impl_->size; }

RouteTable RouteFileReader::read(int64_t sequence) const {
  const RouteFileEntry& want = entry(sequence);
  const Impl& s = *impl_;
  const auto where = [&] {
    return cat("block ", sequence, " (sequence ", sequence, ") at byte offset ", want.offset, ": ");
  };
  RouteFileEntry e;
  uint32_t flags = 0;
  int64_t raw_size = 0;
  uint64_t payload_sum = 0;
  std::string err = s.parse_block_header(want.offset, sequence, e, flags, raw_size, payload_sum);
  if (!err.empty()) s.fail(where() + err);
  if (e.num_tokens != want.num_tokens || e.stored_bytes != want.stored_bytes) {
    s.fail(where() + "block header disagrees with the index");
  }
  // The decode limit, before the compressed bytes are read or anything is allocated.
  if (s.decoded_bytes(e.num_tokens, raw_size) > s.limit) {
    s.fail(where() + cat("declares ", e.num_tokens, " tokens x ", s.info.num_moe_layers,
                         " layers x top_k ", s.info.top_k, " (",
                         e.num_tokens * s.info.num_moe_layers * s.info.top_k * 4,
                         " bytes of int32 ids) and a payload of ", raw_size, " bytes: ",
                         s.decoded_bytes(e.num_tokens, raw_size), " bytes decoded from ",
                         e.stored_bytes, " bytes stored", s.over_limit()));
  }
  const int64_t comp_size = e.stored_bytes - detail::kBlockHeaderSize;
  std::string comp_buf;
  std::string_view comp;  // in memory: the bytes themselves, no copy
  if (s.fd < 0 && e.offset + e.stored_bytes <= s.size) {
    comp = s.view.substr(static_cast<size_t>(e.offset + detail::kBlockHeaderSize),
                         static_cast<size_t>(comp_size));
  } else {
    comp_buf.resize(static_cast<size_t>(comp_size));
    if (!s.read_at(e.offset + detail::kBlockHeaderSize, comp_size, comp_buf.data())) {
      s.fail(where() + "truncated payload");
    }
    comp = comp_buf;
  }
  if (detail::checksum(comp.data(), comp.size()) != payload_sum) {
    s.fail(where() + cat("payload checksum mismatch (bytes ", e.offset + detail::kBlockHeaderSize,
                         "..", e.offset + e.stored_bytes, ")"));
  }
  RouteTable t;
  t.num_experts = s.info.num_experts;
  if (detail::block_is_set_coded(flags)) {  // stored as is: decoded in place
    t.topk_idx = Tensor::empty({e.num_tokens, s.info.num_moe_layers, s.info.top_k}, DType::int32);
    err =
        detail::decode_payload(comp.data(), raw_size, e.num_tokens, s.info.num_moe_layers,
                               s.info.top_k, s.info.num_experts, flags, t.topk_idx.data<int32_t>());
    if (!err.empty()) s.fail(where() + err);
    return t;
  }
  // Version 2 payloads are several frames: their declared sizes must add up to the block's.
  const unsigned long long content = ZSTD_findDecompressedSize(comp.data(), comp.size());
  if (content != static_cast<unsigned long long>(raw_size)) {
    s.fail(where() + "compressed frames do not declare the block's payload size");
  }
  // Not zero-filled: zstd writes every byte it reports (checked below).
  // (plus the decoder's kPayloadSlack bytes, zeroed).
  std::unique_ptr<char[]> raw(new char[static_cast<size_t>(raw_size + detail::kPayloadSlack)]);
  std::memset(raw.get() + raw_size, 0, size_t(detail::kPayloadSlack));
  const size_t got =
      ZSTD_decompress(raw.get(), static_cast<size_t>(raw_size), comp.data(), comp.size());
  if (ZSTD_isError(got)) s.fail(where() + cat("zstd: ", ZSTD_getErrorName(got)));
  if (static_cast<int64_t>(got) != raw_size)
    s.fail(where() + "payload decompressed to the wrong size");
  t.topk_idx = Tensor::empty({e.num_tokens, s.info.num_moe_layers, s.info.top_k}, DType::int32);
  err = detail::decode_payload(raw.get(), raw_size, e.num_tokens, s.info.num_moe_layers,
                               s.info.top_k, s.info.num_experts, flags, t.topk_idx.data<int32_t>());
  if (!err.empty()) s.fail(where() + err);
  return t;
}

// ---------------------------------------------------------------------------------------------

namespace {

RouteFileCheck verify_reader(const RouteFileReader& r) {
  RouteFileCheck c;
  c.num_sequences = r.num_sequences();
  if (!r.complete()) c.problems.push_back(r.status());
  for (int64_t i = 0; i < r.num_sequences(); ++i) {
    try {
      const RouteTable t = r.read(i);
      ++c.num_readable;
      c.num_tokens += t.num_tokens();
    } catch (const DataError& e) {
      c.problems.emplace_back(e.what());
    }
  }
  c.ok = c.problems.empty();
  return c;
}

// verify_reader on the reader `open()` makes; a file that cannot even be opened is one problem.
template <class Open>
RouteFileCheck verify_opened(Open open) {
  try {
    return verify_reader(open());
  } catch (const DataError& e) {
    RouteFileCheck c;
    c.problems.emplace_back(e.what());
    return c;
  }
}

}  // namespace

RouteFileCheck verify_route_file(const std::string& path, const RouteDecodeOptions& options) {
  return verify_opened([&] { return RouteFileReader::open(path, options); });
}

RouteFileCheck verify_route_bytes(std::string_view bytes, const RouteDecodeOptions& options) {
  return verify_opened([&] { return RouteFileReader::from_bytes(bytes, options); });
}

int64_t decode_limit(const RouteDecodeOptions& options, int64_t input_bytes, const char* op) {
  if (options.max_decoded_bytes < 0) {
    detail::fail_arg(op, "max_decoded_bytes must be > 0 (or 0 for the default limit), got ",
                     options.max_decoded_bytes);
  }
  if (options.max_decoded_bytes > 0) return options.max_decoded_bytes;
  const int64_t scaled = input_bytes > std::numeric_limits<int64_t>::max() / kDefaultDecodedRatio
                             ? std::numeric_limits<int64_t>::max()
                             : std::max<int64_t>(input_bytes, 0) * kDefaultDecodedRatio;
  return std::max(kDefaultMinDecodedBytes, scaled);
}

// ---------------------------------------------------------------------------------------------
// The file in memory (switchyard.routes.encode / decode)

Tensor encode_route_file(const std::vector<RouteTable>& tables, const RouteFileInfo& info,
                         const RouteFileWriterOptions& options) {
  const char* op = "routes.encode";
  check_writer_args(info, options, op);
  RouteFileInfo in = info;
  in.id_width = detail::id_width_for(info.num_experts);
  in.version = detail::kFormatVersion;
  const int64_t n = static_cast<int64_t>(tables.size());
  for (int64_t i = 0; i < n; ++i) {  // layout first (cheap); ids are checked while encoding
    const RouteTable& t = tables[size_t(i)];
    const std::string name = cat("tables[", i, "]");
    detail::check_defined(t.topk_idx, op, name.c_str());
    detail::check_dtype(t.topk_idx, op, name.c_str(), {DType::int32});
    detail::check_dim(t.topk_idx, op, name.c_str(), 3);
  }
  // Blocks are independent: each thread encodes whole tables with its own zstd context; the blocks
  // are then laid end to end, so the bytes do not depend on the thread count.
  std::vector<std::string> blocks(static_cast<size_t>(n));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
  int64_t raw_bytes = 0;
  for (const RouteTable& t : tables) raw_bytes += static_cast<int64_t>(t.topk_idx.nbytes());
#pragma omp parallel if (n > 1 && raw_bytes >= (int64_t{1} << 20))
  {
    ZSTD_CCtx* cctx = ZSTD_createCCtx();
    std::string raw, comp;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      try {
        if (!cctx) throw BackendError("ZSTD_createCCtx failed");
        const std::string name = cat("tables[", i, "]");
        check_append(tables[size_t(i)], in, op, name.c_str());
        encode_block(tables[size_t(i)], i, in, options.compression_level, cctx, raw, comp,
                     blocks[size_t(i)], op, name.c_str());
      } catch (...) {  // kept as thrown (bad input, zstd, memory), raised in table order below
        errors[size_t(i)] = std::current_exception();
      }
    }
    ZSTD_freeCCtx(cctx);
  }
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  const std::string header = encode_header(in);
  std::vector<RouteFileEntry> entries(static_cast<size_t>(n));
  int64_t offset = static_cast<int64_t>(header.size());
  for (int64_t i = 0; i < n; ++i) {
    const int64_t size = static_cast<int64_t>(blocks[size_t(i)].size());
    entries[size_t(i)] = {offset, tables[size_t(i)].num_tokens(), size};
    offset += size;
  }
  const std::string tail = encode_index(entries, offset);
  Tensor out = Tensor::empty({offset + static_cast<int64_t>(tail.size())}, DType::uint8);
  auto* p = static_cast<char*>(out.raw());
  std::memcpy(p, header.data(), header.size());
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(p + entries[size_t(i)].offset, blocks[size_t(i)].data(), blocks[size_t(i)].size());
  }
  std::memcpy(p + offset, tail.data(), tail.size());
  return out;
}

std::vector<RouteTable> decode_route_file(std::string_view bytes, RouteFileInfo* info,
                                          const RouteDecodeOptions& options) {
  auto impl = std::make_unique<RouteFileReader::Impl>();
  impl->name = "<wire>";
  impl->view = bytes;  // borrowed for this call: no copy
  impl->size = static_cast<int64_t>(bytes.size());
  impl->set_limit(options);
  impl->open();
  // A message is whole or wrong: a cut or a missing index is an error here, never a recovery.
  if (!impl->complete) {
    throw DataError(cat("[route_file] <wire>: incomplete message: ", impl->status));
  }
  // The whole message against the limit, from every block's checked header, before any block is
  // decompressed or any table allocated (each read() checks its own block again).
  int64_t decoded = 0;  // from the checked block headers: the index's token counts may lie
  {
    const RouteFileReader::Impl& s = *impl;
    int64_t tokens = 0, raw_total = 0;
    for (size_t i = 0; i < s.entries.size(); ++i) {
      RouteFileEntry e;
      uint32_t flags = 0;
      int64_t raw_size = 0;
      uint64_t sum = 0;
      if (!s.parse_block_header(s.entries[i].offset, static_cast<int64_t>(i), e, flags, raw_size,
                                sum)
               .empty()) {
        continue;  // read(i) names what is wrong with this block, in sequence order
      }
      tokens += e.num_tokens;
      raw_total += raw_size;
      decoded += s.decoded_bytes(e.num_tokens, raw_size);  // <= 2^33 a block, < 2^63 in all
      if (decoded > s.limit) {
        throw DataError(cat(
            "[route_file] <wire>: blocks 0..", i, " of ", s.entries.size(), " declare ", tokens,
            " tokens x ", s.info.num_moe_layers, " layers x top_k ", s.info.top_k, " (",
            tokens * s.info.num_moe_layers * s.info.top_k * 4, " bytes of int32 ids) and ",
            raw_total, " bytes of payload: ", decoded, " bytes decoded from a message of ",
            s.size, " bytes", s.over_limit()));
      }
    }
  }
  RouteFileReader r(std::move(impl));
  const int64_t n = r.num_sequences();
  std::vector<RouteTable> out(static_cast<size_t>(n));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(n));
#pragma omp parallel for schedule(dynamic, 1) if (n > 1 && decoded >= (int64_t{1} << 20))
  for (int64_t i = 0; i < n; ++i) {
    try {
      out[size_t(i)] = r.read(i);
    } catch (...) {  // DataError naming the block (or bad_alloc), raised in sequence order below
      errors[size_t(i)] = std::current_exception();
    }
  }
  for (const std::exception_ptr& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  if (info) *info = r.info();
  return out;
}

}  // namespace switchyard

#pragma once
// libarchive, loaded when a box first writes or reads an archive (a checkpoint, a restore, an
// import), not at every start: with the libraries it pulls in (libxml2, ICU, nettle, lzma, lz4,
// bz2, acl) it was ~1.3 MiB of the supervisor's resident memory and ~0.7 ms of its exec, paid by
// boxes that never checkpoint (issue 18). The functions archive.cpp calls, by their own names.
#include <archive.h>
#include <archive_entry.h>

#include "base/result.hpp"

namespace sbx::archive {

#define SBX_LIBARCHIVE_FUNCTIONS(X)        \
  X(archive_entry_copy_hardlink)           \
  X(archive_entry_copy_pathname)           \
  X(archive_entry_copy_symlink)            \
  X(archive_entry_filetype)                \
  X(archive_entry_free)                    \
  X(archive_entry_hardlink)                \
  X(archive_entry_new)                     \
  X(archive_entry_pathname)                \
  X(archive_entry_perm)                    \
  X(archive_entry_set_filetype)            \
  X(archive_entry_set_gid)                 \
  X(archive_entry_set_mtime)               \
  X(archive_entry_set_perm)                \
  X(archive_entry_set_size)                \
  X(archive_entry_set_uid)                 \
  X(archive_entry_size)                    \
  X(archive_entry_size_is_set)             \
  X(archive_entry_sparse_add_entry)        \
  X(archive_entry_symlink)                 \
  X(archive_error_string)                  \
  X(archive_read_data)                     \
  X(archive_read_free)                     \
  X(archive_read_new)                      \
  X(archive_read_next_header)              \
  X(archive_read_open)                     \
  X(archive_read_support_format_tar)       \
  X(archive_write_close)                   \
  X(archive_write_data)                    \
  X(archive_write_free)                    \
  X(archive_write_header)                  \
  X(archive_write_new)                     \
  X(archive_write_open2)                   \
  X(archive_write_set_bytes_in_last_block) \
  X(archive_write_set_bytes_per_block)     \
  X(archive_write_set_format_pax_restricted)

struct LibArchive {
#define SBX_LIBARCHIVE_MEMBER(name) decltype(&::name) name = nullptr;
  SBX_LIBARCHIVE_FUNCTIONS(SBX_LIBARCHIVE_MEMBER)
#undef SBX_LIBARCHIVE_MEMBER
};

/// The library, loaded at the first call (by its soname, SBX_LIBARCHIVE_SONAME, through the
/// caller's run path as the loader finds any library), or why it cannot be: the error names the
/// soname and the loader's message. Thread-safe.
const base::Result<const LibArchive*>& libarchive();

}  // namespace sbx::archive

#pragma once
// libwebsockets, loaded when a box first listens (`--listen`), not at every start: with what it
// pulls in beside OpenSSL (zlib, libdl, libpthread) it was part of every box's exec and resident
// memory, paid by boxes that never serve a client (issue 18). The functions server.cpp calls, by
// their own names. Debian's libwebsockets loads its libuv glue as a plugin linked against the
// shared libwebsockets by soname: the plugin finds this copy, already loaded, and no other.
#include <libwebsockets.h>

#include "base/result.hpp"

namespace sbx::supervisor {

#define SBX_LWS_FUNCTIONS(X)        \
  X(lws_callback_http_dummy)        \
  X(lws_callback_on_writable)       \
  X(lws_context_destroy)            \
  X(lws_context_user)               \
  X(lws_create_context)             \
  X(lws_create_vhost)               \
  X(lws_frame_is_binary)            \
  X(lws_get_context)                \
  X(lws_get_peer_simple)            \
  X(lws_get_socket_fd)              \
  X(lws_get_vhost_listen_port)      \
  X(lws_hdr_copy)                   \
  X(lws_hdr_total_length)           \
  X(lws_http_transaction_completed) \
  X(lws_is_final_fragment)          \
  X(lws_partial_buffered)           \
  X(lws_return_http_status)         \
  X(lws_rx_flow_control)            \
  X(lws_send_pipe_choked)           \
  X(lws_set_log_level)              \
  X(lws_set_timeout)                \
  X(lws_write)

struct LibWebsockets {
#define SBX_LWS_MEMBER(name) decltype(&::name) name = nullptr;
  SBX_LWS_FUNCTIONS(SBX_LWS_MEMBER)
#undef SBX_LWS_MEMBER
};

/// The library, loaded at the first call (by its soname, SBX_LWS_SONAME, as the loader finds any
/// library), or why it cannot be: the error names the soname and the loader's message.
/// Thread-safe.
const base::Result<const LibWebsockets*>& libwebsockets();

/// The loaded library: only where libwebsockets() has succeeded (the Server's constructor).
inline const LibWebsockets& ws_lib() { return **libwebsockets(); }

}  // namespace sbx::supervisor

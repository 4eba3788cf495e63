#pragma once
// `sandboxer ui`'s page server: the embedded page (ui/web, bundled at build time) on 127.0.0.1,
// behind a random secret in its address, and the page's WebSocket. The page speaks sandboxer.v1
// to it (the same request and reply shapes as the box's API) plus ops of its own over the events
// this process keeps (ui/store.hpp): `ui.info`, `events.range{branch, proc, types, from, count}`
// (a slice of the filtered list and its total), `events.find{..., seq}` (the index of a seq in
// it) and `events.procs`; `subscribe{since, branch}` is answered from the same events.
//
// For a box's URL, this process holds the box's token and one subscription to the box, and relays
// the page's actions (exec, stdin, signal, resize, stats, checkpoint, fork, restore,
// snapshot.list, shutdown) on a connection of the page's own; the token never reaches the page,
// and a frame from the box that holds it is redacted. For a state dir, the journal is served
// read-only (followed while another process writes it) and every action is refused.
#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "base/result.hpp"

namespace sbx::ui {

struct ServerOptions {
  uint16_t port = 0;        ///< 0: a free port
  std::string box_url;      ///< live: ws://HOST:PORT[/PATH] of the box...
  std::string box_token;    ///< ...and its token
  bool insecure = false;    ///< wss: accept a self-signed certificate (SANDBOXER_INSECURE)
  std::string journal_dir;  ///< replay: the journal directory of a state dir
  std::string secret;       ///< the page's secret; empty: a random one
  std::string spool_dir;    ///< where the events' lines are spooled (ui/store.hpp); empty: in memory
};

class Server {
 public:
  /// Binds 127.0.0.1:port and loads what it serves. Errors: `bind` (the port), `no_bundle` (this
  /// binary was built without the page), `bad_request` (a URL that is not ws[s]://HOST:PORT).
  static base::Result<std::unique_ptr<Server>> start(ServerOptions opts);
  ~Server();
  /// http://127.0.0.1:PORT/SECRET/
  std::string address() const;
  /// Serves until stop() or SIGINT/SIGTERM.
  void run();
  void stop();

  struct Impl;

 private:
  explicit Server(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sbx::ui

#pragma once
// What every subcommand that talks to a box shares (attach, exec, cp, stats, checkpoint, restore,
// fork, snapshots, export, import): the box's endpoint (its URL; the token from --token-file,
// else SANDBOXER_TOKEN, else the store, see tokens.hpp; SANDBOXER_INSECURE to accept a
// self-signed wss certificate), one libuv loop on which SIGINT and SIGTERM are events, one
// request or one file transfer over a connection of sdk/cpp's Client, and the one way a failure
// is reported: "sandboxer CMD: <message> (<code>)" on stderr and exit 1 (kExitFailed).
#include <uv.h>

#include <boost/json.hpp>
#include <functional>
#include <optional>
#include <sandboxer/client.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "base/result.hpp"
#include "cli/args.hpp"

namespace sbx::cli {

/// A remote subcommand's spec with the options every remote subcommand takes (--token-file F).
ArgSpec remote_spec(ArgSpec spec);

/// A path in a box: "ws://HOST:PORT:PATH" (or wss://...), as cp, ls, rm, mkdir and mv take it.
struct RemotePath {
  std::string url, path;  ///< path "" where it was given as the URL alone and may be
};
/// `s` as URL:PATH; nullopt for what is not a ws:// or wss:// URL (a local path). A URL without
/// the ":PATH" is an error (UsageError, with an example) unless `path_optional`.
std::optional<RemotePath> split_remote(const std::string& s, bool path_optional = false);

/// The string at `key` of a reply, or "" where there is none (or it is not a string).
std::string text_field(const boost::json::object& o, std::string_view key);
/// An fs.list entry's name as it is on disk: the bytes of name_b64 where the box gave them (a
/// name that is not UTF-8), else name.
std::string entry_name(const boost::json::object& entry);
/// fs.list's entries sorted by entry_name (what is not an object first).
boost::json::array sorted_entries(boost::json::array entries);

/// A reply's error as an Error: its message and code, or (no error object) the whole reply.
base::Error reply_error(const boost::json::object& reply);
/// An Error as the server would have replied it: {"ok": false, "error": {"code", "message"}}.
boost::json::object error_reply(const base::Error& e);
/// The reply said ok.
bool reply_ok(const boost::json::object& reply);

/// The boxes named by --to URL, each with its token: one --to-token-file for every target, or one
/// per --to in the same order; none: each target's is SANDBOXER_TOKEN or the one stored for its
/// URL (send, fork and migrate onto boxes some host started). Throws UsageError on a bad URL or a
/// count that does not pair.
std::vector<sdk::Endpoint> target_endpoints(const Args& a, bool insecure);

/// The files of --trust-key, each checked readable here (UsageError naming the one that is not).
std::vector<std::string> readable_keys(const Args& a);

/// Why a TCP connection to `url`'s host and port is not made (a URL that does not parse, a host
/// without an address, "Connection refused (nothing listens on HOST:PORT)", 2 s without an answer);
/// nullopt where one is accepted (and closed at once).
std::optional<std::string> unreachable(const std::string& url);

/// What a failed connect to `url` says, from the client's `err`: libwebsockets reports a refused
/// or unanswered TCP connect as "closed before established", as it does a server that accepted
/// and closed, so a plain connect (2 s at most) says which it was ("Connection refused (nothing
/// listens on HOST:PORT)"). Any other `err` is returned as it is.
std::string connect_error(const std::string& url, const std::string& err);

/// A path field of the request (path, from, to, target) whose bytes are not UTF-8 (a name the box
/// listed in name_b64, a local file's name, an argument) goes as its bytes in `key`_b64, which
/// the box takes in place of `key`. Done by every request the Session sends, before not_text.
void name_by_bytes(boost::json::object& req);

/// The request's first string that is not UTF-8, as an error naming its field ("argv[1]",
/// "path") and its bytes (\xNN): the API's JSON carries text only, and the box would refuse the
/// whole frame as "not valid JSON". None where every string is UTF-8.
std::optional<base::Error> not_text(const boost::json::object& req);

/// A box's error message in the CLI's words: the hints of the fs ops that name an op or a field
/// ("(use fs.list)", "set replace to replace it") name the command or flag instead.
std::string in_cli_words(std::string message);

class Session;

/// Who asked for a snapshot, from its manifest's origin: "operator" (a client, the CLI, the box's
/// own schedule), "agent:BRANCH" (the agent channel of that branch: a name the agent chose), or ""
/// where the box does not say (an imported snapshot; one made before 2026-11).
std::string snapshot_origin(const boost::json::object& manifest);

/// The id of the snapshot the user named: `given` as it is where it is an id (s- and 16 hex
/// digits), else the one of the box's snapshots whose name it is (asked with snapshot.list; the
/// choice is said on stderr, and that the agent made it, where it did). Error: no snapshot has
/// that name (not_found), or several do (ambiguous, listing their ids).
base::Result<std::string> snapshot_id(Session& s, const std::string& given);

class Session {
 public:
  /// Resolves the endpoint of `url` with --token-file from `args`; throws (exit 2) when there
  /// is no token or the URL is not ws[s]://HOST:PORT[/PATH].
  Session(std::string cmd, std::string url, const Args& args);
  Session(std::string cmd, std::string url, const std::string& token_file);
  ~Session();
  Session(const Session&) = delete;
  Session& operator=(const Session&) = delete;

  const std::string& url() const { return endpoint_.url; }
  const sdk::Endpoint& endpoint() const { return endpoint_; }
  uv_loop_t* loop() { return &loop_; }
  /// What SIGINT or SIGTERM does while run() runs; by default it stops the loop.
  void on_interrupt(std::function<void()> fn) { on_interrupt_ = std::move(fn); }
  /// Runs the loop until nothing is left or stop().
  void run() { uv_run(&loop_, UV_RUN_DEFAULT); }
  void stop() { uv_stop(&loop_); }

  /// One request on a connection of its own: the box's reply, ok or not; an error only when
  /// no reply came (the connection failed or closed first, or an interrupt).
  base::Result<boost::json::object> request(boost::json::object req) { return request_to(endpoint_, std::move(req)); }
  /// As request(), and a reply that is not ok is an error too.
  base::Result<boost::json::object> call(boost::json::object req) { return call_to(endpoint_, std::move(req)); }
  /// The same, to another box (a target of send, fork or migrate).
  base::Result<boost::json::object> request_to(const sdk::Endpoint& box, boost::json::object req);
  base::Result<boost::json::object> call_to(const sdk::Endpoint& box, boost::json::object req);
  /// fs.list of `path`, kListPage entries a request (no reply holds a whole large directory, nor
  /// holds up the box's loop for it): every page's entries in one ok reply, or the first reply
  /// that is not ok. A box that does not page (no `more`) answers whole at the first.
  base::Result<boost::json::object> list(const std::string& path);
  static constexpr int64_t kListPage = 10000;
  /// One file out of the box: `req`'s reply, then binary frames written to `local_path`
  /// (created or truncated). Error: the box's, the connection's or the local file's.
  base::Result<boost::json::object> download(boost::json::object req, const std::string& local_path);
  /// One file into the box: `local_path` in binary frames after `req`, and the reply after the last.
  base::Result<boost::json::object> upload(boost::json::object req, const std::string& local_path);

  /// A file to move: `req` (fs.read or fs.write, ...) and the local file it reads or writes.
  struct LocalTransfer {
    boost::json::object req;
    std::string local_path;
    bool upload = false;
    bool fresh = false;  // a download into a new file only: nothing at the path is written through
    int fd = -1;         // an open file used from its start instead of local_path's (which names it)
  };
  /// Each of `batch` in turn on one connection, as download() and upload() do one: the results
  /// in order, up to and including the first that failed (an upload whose local file cannot be
  /// opened is refused before its request, and ends the batch there).
  std::vector<base::Result<boost::json::object>> transfer_batch(std::vector<LocalTransfer> batch);

  /// "sandboxer CMD: <what>" on stderr.
  void report(std::string_view what) const;
  /// An event stream's end: 1000 and 1001 (the box ended, or is going away) are a clean end, any
  /// other close is reported as a failure. Stops the loop; returns the exit status.
  int stream_closed(int code, const std::string& reason);
  /// "sandboxer CMD: [<what>: ]<message> (<code>)" on stderr, the message in_cli_words; returns
  /// kExitFailed.
  int fail(const base::Error& e, std::string_view what = {}) const;
  int fail(const boost::json::object& reply) const { return fail(reply_error(reply)); }

 private:
  base::Result<boost::json::object> transfer(boost::json::object req, const std::string& local_path, bool upload);
  // A transfer's result with the local path in a local error and the box's refusal as an error.
  base::Result<boost::json::object> transfer_result(base::Result<boost::json::object> r, const std::string& local_path);

  std::string cmd_;
  sdk::Endpoint endpoint_;
  uv_loop_t loop_;
  uv_signal_t sigint_, sigterm_;
  std::function<void()> on_interrupt_;
};

}  // namespace sbx::cli

#pragma once
// The Docker host (docs/architecture.md, "Hosts"): a box is one container of the runtime image with
// sandboxer-init as its entrypoint. The shim drives the docker CLI through Boost.Process rather
// than the Engine API socket: the CLI already resolves DOCKER_HOST, contexts and TLS the way the
// user set them up, its flags are the documented interface people check a box's set-up against,
// and the host side has no reaper of its own to conflict with Boost.Process's waitpid.
//
// What a box gets:
// - capabilities only when its profile needs live checkpoint (docs/architecture.md, "Hosts");
// - the WebSocket on 127.0.0.1 only: host networking with a picked loopback port when dockerd has
//   no bridge, else `-p 127.0.0.1:PORT:7777`;
// - the token as a read-only bind-mounted file (never on a command line, never in the image), and
//   so the archive signing key and the keys it trusts (the user's pair unless told otherwise);
// - `--stop-timeout` above the profile's grace period, so the journal is complete on `docker stop`;
// - the profile's memory, cpus and pids as Docker's --memory, --cpus, --pids-limit;
// - its state dir (journal, branches, snapshots) bind-mounted from the host, so the journal
//   outlives it (on a dockerd on another machine, DOCKER_HOST tcp:// or ssh://: a volume of its
//   own there, with the token, profile and keys copied in before it starts), and, when its profile persists
//   (`checkpoint`), `--restart on-failure`: the box comes back after a crash and resumes its agent from the newest
//   snapshot.
#include <cstdint>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include <boost/json.hpp>

namespace sbx::shims::docker {

struct UpOptions {
  std::string profile = "default";     // a name or a path to a profile file
  std::vector<std::string> overrides;  // --set FIELD=VALUE
  std::string image;                   // "" : sandboxer/agent:<version>
  std::string name;                    // "" : sbx-<random>
  std::vector<std::string> volumes;    // -v SRC:DST[:ro], passed to docker run
  std::vector<std::string> argv;       // the agent's command
  std::vector<std::string> env;        // --env K=V for the agent (the container's own
                                       // environment does not reach it)
  bool idle = false;                   // instead of argv: a box with no agent yet
                                       // (`sandboxer-init --idle`), that a snapshot is moved
                                       // into over its API (fork, issue 17)
  std::string profile_text;            // the profile's JSON, instead of looking `profile` up
                                       // (a fork repeats its source's, overrides applied)
  std::string publish_address;         // a remote dockerd: the address its boxes' APIs are
                                       // published on ("": the DOCKER_HOST's host)
  std::vector<std::string> labels;     // extra --label K=V
  int port = 0;                        // the API's loopback port; 0: a free one is picked (a
                                       // remote dockerd's boxes: always picked there). Another
                                       // is picked if another server takes it before the box.
  std::string box_root;                // host dir for per-box state: BOX_ROOT/NAME/{state,token}
  // Signed archives: the private key the box signs with and the public keys it trusts, host
  // files bound in read-only (the key beside the token, masked from the agent like it). An
  // empty signing_key: the user's key pair (checkpoint/signing.hpp), which it then also trusts.
  std::string signing_key;
  std::vector<std::string> trust_keys;
  bool allow_unsigned = false;
};

struct BoxRecord {
  std::string name;       // the container's name
  std::string url;        // ws://127.0.0.1:PORT
  std::string state_dir;  // on the host
  std::string image;
  std::string status;  // docker's words
  std::string token;   // filled by `up` only
};

/// What `up` decides from the profile, before anything runs (unit-testable).
struct RunPlan {
  bool live_checkpoint_caps = false;
  // A profile that wants namespaces but not checkpoint: the capabilities the supervisor needs to
  // make them (SYS_ADMIN; NET_ADMIN for the loopback of a network namespace of its own; seccomp
  // unconfined, as Docker's profile refuses pivot_root), so its masks hold and `network: none` is
  // enforced. The agent's bounding set is cleared to its
  // profile's whatever the container gets.
  bool namespace_caps = false;
  int64_t grace_ms = 10000;
  int stop_timeout_s = 15;
  // The profile's `checkpoint` section asks for persistence: a restart policy brings the box back
  // after a crash, and the supervisor resumes its agent from the state dir on the host.
  bool persist = false;
  std::vector<std::string> limit_args;  // --memory, --cpus, --pids-limit; --restart when it persists
  boost::json::object profile;          // with the overrides applied
};

/// The profile as JSON with `overrides` applied, checked by the supervisor's own parser; throws
/// std::runtime_error (or ProfileError) naming the bad field.
RunPlan plan_for_profile(boost::json::object profile, const std::vector<std::string>& overrides);

/// Docker's flags for a profile's `resources` (memory, cpus, pids; the fields of profiles with
/// ceilings): --memory and --memory-swap (the same: no swap beyond the ceiling), --cpus,
/// --pids-limit (with a margin for the supervisor, ns-init, `docker exec` and the health check).
std::vector<std::string> docker_limits(const boost::json::object& resources);

/// What a fork onto new containers must repeat of the box it forks, read from `docker inspect` of
/// the box's container (found by its io.sandboxer.url label).
struct BoxSpec {
  std::string name;                  // the container
  std::string image;                 // the image's id (sha256:...): the very image, not a tag
  std::string profile_text;          // the profile `up` gave it, overrides applied (the file
                                     // beside a local box, the label of a remote one)
  std::vector<std::string> volumes;  // the user's own volumes (-v), as docker run takes them
  std::vector<std::string> env;      // its --env K=V (a cold restart's agent gets them again)
};
BoxSpec inspect_box(const std::string& url);
/// The same, or nothing when this dockerd has no box container for `url` (a box elsewhere).
std::optional<BoxSpec> find_box(const std::string& url);
/// The image on this dockerd that `sandboxer image build` made with this sandboxer image id (its
/// io.sandboxer.image.id label, the id a snapshot's manifest names); throws naming the id when
/// there is none.
std::string image_with_id(const std::string& sandboxer_image_id);

/// `n` distinct free loopback ports (all held open while they are picked, so boxes started side
/// by side do not race for one).
std::vector<int> free_loopback_ports(int n);

/// Starts a box; progress lines go to `log`; throws std::runtime_error with docker's own words.
BoxRecord up(const UpOptions& o, std::ostream& log);
/// Stops (within the container's stop timeout) and removes the box with this URL or name.
BoxRecord down(const std::string& url_or_name);
/// Every box container, running or not.
std::vector<BoxRecord> ps();

/// The docker CLI's result.
struct DockerResult {
  int status = -1;
  std::string out, err;
};
/// Runs `docker ARGS...` ($SANDBOXER_DOCKER, else docker on PATH); stdin is closed.
DockerResult run_docker(const std::vector<std::string>& args);
/// Whether there is a docker CLI to run: $SANDBOXER_DOCKER is set, or docker is on PATH.
bool docker_installed();

}  // namespace sbx::shims::docker

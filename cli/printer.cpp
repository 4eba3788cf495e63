#include "cli/printer.hpp"

#include <unistd.h>

#include <charconv>
#include <cstdio>
#include <cstring>
#include <string>

#include "base/encoding.hpp"

namespace sbx::cli {

namespace {
namespace json = boost::json;

// JSON as boost::json writes it, but for its doubles, which it writes in exponent form (69.1 as
// 6.91E1, 0 as 0E0): for a person, the shortest plain form that reads back the same (to_chars).
void plain_json(const json::value& v, std::string& out) {
  switch (v.kind()) {
    case json::kind::double_: {
      char buf[64];
      auto r = std::to_chars(buf, buf + sizeof buf, v.get_double());
      out.append(buf, r.ptr);
      return;
    }
    case json::kind::object: {
      out += '{';
      bool first = true;
      for (auto& [k, x] : v.get_object()) {
        if (!first) out += ',';
        first = false;
        out += json::serialize(json::string(k)) + ':';
        plain_json(x, out);
      }
      out += '}';
      return;
    }
    case json::kind::array: {
      out += '[';
      bool first = true;
      for (auto& x : v.get_array()) {
        if (!first) out += ',';
        first = false;
        plain_json(x, out);
      }
      out += ']';
      return;
    }
    default:
      out += json::serialize(v);
  }
}
std::string plain_json(const json::value& v) {
  std::string out;
  plain_json(v, out);
  return out;
}

// A field as the lines for a person show it: a text's control bytes escaped (printable), since
// names, argv words, hosts and errors come from clients and the agent, and must not act on the
// terminal (the agent's own output is shown as it wrote it).
std::string str(const boost::json::object& o, std::string_view k) {
  auto* v = o.if_contains(k);
  if (!v) return {};
  if (v->is_string()) return printable(v->as_string(), false);
  return plain_json(*v);
}
std::string clock_of(const boost::json::object& ev) {
  std::string ts = str(ev, "ts");  // 2026-11-21T23:58:47.123456Z
  return ts.size() >= 23 ? ts.substr(11, 12) : ts;
}
}  // namespace

std::string human_bytes(double bytes) {
  char buf[32];
  if (bytes >= 1024.0 * 1024 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f GiB", bytes / (1024.0 * 1024 * 1024));
  else if (bytes >= 1024.0 * 1024)
    std::snprintf(buf, sizeof buf, "%.1f MiB", bytes / (1024.0 * 1024));
  else if (bytes >= 1024.0)
    std::snprintf(buf, sizeof buf, "%.1f KiB", bytes / 1024.0);
  else
    std::snprintf(buf, sizeof buf, "%.0f B", bytes);
  return buf;
}

std::string printable(std::string_view name, bool escape_backslash) {
  std::string out;
  out.reserve(name.size());
  auto escape = [&](unsigned char c) {
    char esc[8];
    std::snprintf(esc, sizeof esc, "\\x%02x", c);
    out += esc;
  };
  while (!name.empty()) {
    // What is valid UTF-8 is copied but for the controls in it: C0, DEL, a backslash, and C1
    // (U+0080..U+009F, 0xC2 0x80..0x9F, which some terminals take as ESC [ and the like); the byte
    // that stops it is escaped.
    size_t ok = base::utf8_valid_prefix(name);
    for (size_t i = 0; i < ok; ++i) {
      auto c = static_cast<unsigned char>(name[i]);
      bool c1 = c == 0xc2 && static_cast<unsigned char>(name[i + 1]) < 0xa0;
      if (c < 0x20 || c == 0x7f || (c == '\\' && escape_backslash)) {
        escape(c);
      } else if (c1) {
        escape(c);
        escape(static_cast<unsigned char>(name[++i]));
      } else {
        out += static_cast<char>(c);
      }
    }
    if (ok < name.size()) escape(static_cast<unsigned char>(name[ok++]));
    name.remove_prefix(ok);
  }
  return out;
}

void EventPrinter::output(const boost::json::object& ev) {
  std::string proc = str(ev, "proc"), stream = str(ev, "stream");
  std::string key = proc + "/" + stream;
  std::string data;
  if (auto* d = ev.if_contains("data")) {
    data = d->as_string();
  } else if (auto* b = ev.if_contains("data_b64")) {
    std::string raw;
    sbx::base::base64_decode(b->as_string(), raw);
    data = "[" + std::to_string(raw.size()) + " bytes, not UTF-8]\n";
  }
  std::string prefix = proc + (stream == "stderr" ? " ! " : " | ");
  bool& mid = midline_[key];
  std::string out;
  size_t pos = 0;
  while (pos < data.size()) {
    if (!mid) out += prefix;
    size_t nl = data.find('\n', pos);
    if (nl == std::string::npos) {
      out.append(data, pos, std::string::npos);
      mid = true;
      break;
    }
    out.append(data, pos, nl - pos + 1);
    mid = false;
    pos = nl + 1;
  }
  std::fwrite(out.data(), 1, out.size(), out_);
}

std::string json_for_terminal(std::string_view json) { return base::json_escape_c1(json); }

std::string json_line(const boost::json::value& v) { return json_for_terminal(boost::json::serialize(v)); }

void EventPrinter::print(std::string_view line, const boost::json::object& ev) {
  if (json_) {
    if (std::memchr(line.data(), 0xC2, line.size())) {
      std::string safe = json_for_terminal(line);
      std::fwrite(safe.data(), 1, safe.size(), out_);
    } else {
      std::fwrite(line.data(), 1, line.size(), out_);
    }
    std::fputc('\n', out_);
    std::fflush(out_);
    return;
  }
  try {
    print_human(ev);
  } catch (const std::exception& e) {
    // A field of a type this CLI does not expect (a box of another version, or a hostile one):
    // the line as it came, escaped. The exception once ended the connection with no reason, the
    // event already counted as read, and `attach` reconnected for ever.
    std::string safe = json_for_terminal(line);
    std::fprintf(out_, "%s (an event this CLI cannot show: %s)\n", safe.c_str(), e.what());
  }
}

void EventPrinter::print_human(const boost::json::object& ev) {
  std::string type = str(ev, "type");
  std::string t = clock_of(ev);
  std::string branch = str(ev, "branch");
  std::string where = branch.empty() || branch == "main" ? "" : "[" + branch + "] ";
  if (type == "proc.output") {
    output(ev);
  } else if (type == "proc.message") {
    // The line itself was shown as output already.
  } else if (type == "box.started") {
    auto& c = ev.at("capabilities").as_object();
    std::string net;  // the network policy, when the box has one
    if (auto* n = ev.if_contains("network"); n && n->is_object()) net = ", network " + str(n->as_object(), "mode");
    std::fprintf(out_, "%s box %s started (profile %s, isolation %s, namespaces %s%s%s)\n", t.c_str(),
                 str(ev, "box").c_str(), str(ev, "profile").c_str(), str(ev, "isolation").c_str(),
                 c.at("namespaces").as_bool() ? "yes" : "no",
                 c.at("namespaces").as_bool() ? "" : (": " + str(c, "namespaces_why_not")).c_str(), net.c_str());
  } else if (type == "policy.denied") {
    // "main denied dns evil.com (not on the allow list), pid 7"
    std::string what = str(ev, "what"), host = str(ev, "host"), port = str(ev, "port");
    std::string extra = ev.contains("pid") ? ", pid " + str(ev, "pid") : "";
    if (ev.contains("suppressed_before")) extra += ", " + str(ev, "suppressed_before") + " more refused before this";
    std::fprintf(out_, "%s %s%s denied %s %s%s (%s%s)\n", t.c_str(), where.c_str(), str(ev, "proc").c_str(),
                 what.c_str(), host.c_str(), port.empty() ? "" : (":" + port).c_str(), str(ev, "reason").c_str(),
                 extra.c_str());
  } else if (type == "proc.started") {
    std::string argv;
    for (auto& a : ev.at("argv").as_array()) argv += (argv.empty() ? "" : " ") + printable(a.as_string(), false);
    std::fprintf(out_, "%s %s%s started, pid %s: %s\n", t.c_str(), where.c_str(), str(ev, "proc").c_str(),
                 str(ev, "pid").c_str(), argv.c_str());
  } else if (type == "proc.exited") {
    std::string how = ev.contains("signal") ? "signal " + str(ev, "signal") : "code " + str(ev, "code");
    std::string extra = ev.contains("escalated") ? ", killed after the grace period" : "";
    // Who ended it, where it was not the agent's own doing (a checkpoint --stop: "killed by checkpoint").
    if (ev.contains("by")) extra += " by " + str(ev, "by");
    if (ev.contains("error")) extra += ": " + str(ev, "error");
    std::fprintf(out_, "%s %s%s exited, %s (%s%s)\n", t.c_str(), where.c_str(), str(ev, "proc").c_str(), how.c_str(),
                 str(ev, "reason").c_str(), extra.c_str());
  } else if (type == "box.exited") {
    std::fprintf(out_, "%s box %s exited, code %s (%s)\n", t.c_str(), str(ev, "box").c_str(), str(ev, "code").c_str(),
                 str(ev, "reason").c_str());
  } else if ((type == "limit.warning" || type == "limit.hit") && ev.contains("limit")) {
    // "memory at 60.5 MiB of 64.0 MiB", "pids at 32 of 32"
    auto num = [&](const char* k) {
      return ev.contains(k) && ev.at(k).is_number() ? ev.at(k).to_number<double>() : 0.0;
    };
    std::string lim = str(ev, "limit");
    char what[160];
    if (lim == "memory")
      std::snprintf(what, sizeof what, "memory at %.1f MiB of %.1f MiB", num("value") / 1048576,
                    num("ceiling") / 1048576);
    else
      std::snprintf(what, sizeof what, "%s at %.0f of %.0f", lim.c_str(), num("value"), num("ceiling"));
    std::fprintf(out_, "%s %s%s %s: %s\n", t.c_str(), where.c_str(), str(ev, "proc").c_str(),
                 type == "limit.hit" ? "hit its ceiling" : "is near its ceiling", what);
  } else {
    boost::json::object rest = ev;
    for (auto k : {"seq", "ts", "type", "box", "branch"}) rest.erase(k);
    // JSON escapes C0 controls; C1 ones (U+0080..U+009F, which some terminals take as ESC [)
    // need printable's escape too.
    std::fprintf(out_, "%s %s%s %s\n", t.c_str(), where.c_str(), type.c_str(),
                 printable(plain_json(rest), false).c_str());
  }
  std::fflush(out_);
}

}  // namespace sbx::cli

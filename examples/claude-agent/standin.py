"""A local stand-in for the Anthropic Messages API, for running examples/claude-agent without a
key or a network: answers POST /v1/messages (streamed or not) with a fixed reply when the
request carries the expected key, 401 otherwise; records every request it saw.

    python3 standin.py --port 8443 --key sk-test-... [--cert srv.pem --keyfile srv.key]
"""
import argparse
import http.server
import json
import ssl
import threading

REPLY = "Hello from the stand-in API."


def sse(events):
    return "".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n" for e in events).encode()


def message_events(model):
    return [
        {"type": "message_start", "message": {"id": "msg_standin", "type": "message", "role": "assistant",
                                              "model": model, "content": [], "stop_reason": None,
                                              "stop_sequence": None,
                                              "usage": {"input_tokens": 10, "output_tokens": 1}}},
        {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": REPLY}},
        {"type": "content_block_stop", "index": 0},
        {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
         "usage": {"output_tokens": 8}},
        {"type": "message_stop"},
    ]


class StandIn:
    def __init__(self, key, port=0, cert=None, keyfile=None):
        self.requests = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def send(self, status, body, ctype):
                self.send_response(status)
                self.send_header("content-type", ctype)
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("content-length") or 0))
                got = self.headers.get("x-api-key") or self.headers.get("authorization", "").removeprefix("Bearer ")
                outer.requests.append({"path": self.path, "key_ok": got == key,
                                       "headers": {k.lower(): v for k, v in self.headers.items()}})
                if got != key:
                    return self.send(401, json.dumps({"type": "error", "error": {
                        "type": "authentication_error", "message": "invalid x-api-key"}}).encode(), "application/json")
                if not self.path.startswith("/v1/messages") or self.path.startswith("/v1/messages/count_tokens"):
                    return self.send(404, b'{"type":"error","error":{"type":"not_found_error","message":"no"}}',
                                     "application/json")
                req = json.loads(raw or b"{}")
                model = req.get("model", "claude-standin")
                if req.get("stream"):
                    return self.send(200, sse(message_events(model)), "text/event-stream")
                msg = dict(message_events(model)[0]["message"], content=[{"type": "text", "text": REPLY}],
                           stop_reason="end_turn")
                self.send(200, json.dumps(msg).encode(), "application/json")

            def do_GET(self):
                outer.requests.append({"path": self.path, "key_ok": False, "headers": dict(self.headers)})
                self.send(404, b"{}", "application/json")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
        if cert:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(cert, keyfile)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8443)
    ap.add_argument("--key", required=True)
    ap.add_argument("--cert")
    ap.add_argument("--keyfile")
    a = ap.parse_args()
    s = StandIn(a.key, a.port, a.cert, a.keyfile)
    print(f"stand-in API on 127.0.0.1:{s.port}", flush=True)
    s.thread.join()

"""A stand-in for llama-server in tests of `ngramcache llama-follow`: the same flags and routes, no model.

    python tests/helpers/llama_stand_in.py --spec-type ngram-cache [--load-seconds S] [--fail] \
        --host 127.0.0.1 --port N [-lcs FILE]

It reads the -lcs file once at start, as llama-server does, and every answer says which file it
read (its SHA-256) and its pid, so a test sees which generation served each request. Routes:
GET /health (503 "Loading model" for --load-seconds, then 200), POST /completion (JSON body:
``delay`` seconds to take, ``stream`` for a chunked answer of three server-sent events), POST
/crash (body ``{"pid": N}``: the process of that pid exits at once with status 3, answering
nothing; another answers 200). --fail exits with status 1 before
listening, as a llama-server with a bad argument does. Other flags (-m, -c, ...) are ignored.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("-lcs", "--lookup-cache-static", dest="lcs")
    ap.add_argument("--spec-type", default="")
    ap.add_argument("--load-seconds", type=float, default=0.0)
    ap.add_argument("--fail", action="store_true")
    args, _ = ap.parse_known_args()
    if args.fail:
        print("stand-in: failing as asked (--fail)", file=sys.stderr)
        return 1
    lcs_sha = hashlib.sha256(open(args.lcs, "rb").read()).hexdigest() if args.lcs else None
    loaded_at = time.monotonic() + args.load_seconds

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a: object) -> None:
            pass

        def reply(self, code: int, payload: dict[str, object]) -> None:
            body = json.dumps(payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                if time.monotonic() < loaded_at:
                    self.reply(503, {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
                else:
                    self.reply(200, {"status": "ok"})
            else:
                self.reply(404, {"error": {"code": 404, "message": "File Not Found"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            if self.path == "/crash":
                if body.get("pid") == os.getpid():
                    os._exit(3)
                self.reply(200, {"crashed": False, "pid": os.getpid()})
                return
            if self.path != "/completion":
                self.reply(404, {"error": {"code": 404, "message": "File Not Found"}})
                return
            time.sleep(float(body.get("delay", 0)))
            answer = {"content": "ok", "lcs_sha256": lcs_sha, "pid": os.getpid()}
            if not body.get("stream"):
                self.reply(200, answer)
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                event = f"data: {json.dumps({**answer, 'index': i})}\n\n".encode()
                self.wfile.write(f"{len(event):x}\r\n".encode() + event + b"\r\n")
                self.wfile.flush()
                time.sleep(0.01)
            self.wfile.write(b"0\r\n\r\n")

    server = ThreadingHTTPServer((args.host, args.port), Handler)
    server.daemon_threads = True
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""An engine stand-in for ``prewarm exec --ready-url/--ready-file`` tests.

argv: MODE [PORT]. Writes one artifact into the inductor cache the agent's
environment points at, as a compiling engine would, then:

- ``crash``: exits with status 3 before it is ever ready;
- ``serve PORT``: serves ``GET /health`` on 127.0.0.1:PORT, answering 503 until
  a line ``ready`` arrives on stdin and 200 after; prints ``serving``; exits 0
  after a line ``exit``;
- ``serve PORT vllm``: the same, first printing the start-up lines vLLM 0.16 prints
  (weights, torch.compile from the cache, init engine), with the figures in VLLM_LINES.
"""

from __future__ import annotations

import http.server
import os
import sys
import threading
from pathlib import Path

READY = threading.Event()
# What vLLM 0.16 prints on a relaunch whose compile cache was restored (its formats).
VLLM_LINES = (
    "INFO 12-03 10:00:01 [default_loader.py:294] Loading weights took 1.25 seconds",
    "INFO 12-03 10:00:01 [gpu_model_runner.py:4222] Model loading took 1.9 GiB memory and "
    "1.500000 seconds",
    "INFO 12-03 10:00:02 [backends.py:268] Directly load the compiled graph(s) for compile "
    "range (1, 8192) from the cache, took 0.812 s",
    "INFO 12-03 10:00:04 [monitor.py:35] torch.compile takes 3.20 s in total",
    "INFO 12-03 10:00:09 [core.py:279] init engine (profile, create kv cache, warmup model) "
    "took 7.50 seconds",
)


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if READY.is_set() else 503)
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:
        pass  # the test reads the launcher's stderr; keep it to prewarm's lines


def main() -> int:
    artifact = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"]) / "fxgraph" / "graph-1"
    artifact.parent.mkdir(parents=True, exist_ok=True)
    artifact.write_bytes(os.urandom(2048))
    if sys.argv[1] == "crash":
        return 3
    server = http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[2])), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    if sys.argv[3:] == ["vllm"]:
        for line in VLLM_LINES:
            print(line, flush=True)
    print("serving", flush=True)
    for line in sys.stdin:
        if line.strip() == "ready":
            READY.set()
        elif line.strip() == "exit":
            break
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A stand-in for ``python -m vllm.entrypoints.openai.api_server``, run by the launcher tests
(tests/engines/test_vllm_server.py) through a fake venv interpreter. Stdlib only.

It takes the real command line (only ``--port`` matters) and behaves as ``FAKE_VLLM_MODE``
says: ``ok`` answers ``/health`` 200, ``sick`` answers 503 forever, ``exit`` dies at once with
status 3, ``orphan`` is ``ok`` but leaves its child behind when terminated. Like the real server
it has a child in its process group (vLLM's EngineCore), whose PID it prints, and on SIGTERM it
stops that child and exits, so a test can check that stopping the server leaves nothing behind.
"""

from __future__ import annotations

import http.server
import os
import signal
import subprocess
import sys


def main() -> None:
    mode = os.environ.get("FAKE_VLLM_MODE", "ok")
    print(f"fake vllm: mode {mode}, argv {sys.argv[1:]}", flush=True)
    if mode == "exit":
        print("fake vllm: ImportError: the engine is broken", flush=True)
        sys.exit(3)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    print(f"fake vllm: engine core pid {child.pid}", flush=True)
    status = 503 if mode == "sick" else 200

    def terminate(signum: int, frame: object) -> None:
        print("fake vllm: SIGTERM", flush=True)
        if mode != "orphan":
            child.terminate()
            child.wait()
        os._exit(0)

    signal.signal(signal.SIGTERM, terminate)

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status if self.path == "/health" else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    with http.server.HTTPServer(("127.0.0.1", port), Health) as server:
        server.serve_forever()


if __name__ == "__main__":
    main()

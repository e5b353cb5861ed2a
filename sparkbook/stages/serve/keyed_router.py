"""vllm-router behind the API key (serve.api_key_env), run in the router's place from its install as
`python3 -m sparkbook_keyed_router <vllm-router's own arguments>`: this file is copied there (router.ensure) and
imports nothing of sparkbook.

vllm-router 0.1.17's core checks every request's bearer token on every route, /add_worker and /remove_worker
included, when it is given validation URLs (`api_key_validation_urls`: a URL that answers 200 to the token accepts
it), but its command line does not expose them. This launcher parses the command line as vllm-router does, answers
the one validation URL itself on the loopback (the bearer compared in constant time with the key), from a child
process (the router's start holds the GIL, so no thread of this one would answer), and starts the router with it. The
key comes from KEY_ENV, which the runtime gives this process alone: never an argv. The child is in the router's
session, which the runtime ends as one, and it leaves by itself once the router is gone."""
from __future__ import annotations

import hmac
import os
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

KEY_ENV = "SPARKBOOK_ROUTER_KEY"


def validator(key: str) -> ThreadingHTTPServer:
    """The validation URL's server, bound on 127.0.0.1 (a port the kernel picks): 200 where the request's
    Authorization is `Bearer <key>`, else 401."""
    expected = f"Bearer {key}".encode()

    class Check(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            given = self.headers.get("Authorization", "").encode()
            self.send_response(200 if hmac.compare_digest(given, expected) else 401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 (http.server's name)
            """Quiet: the router asks once per request, and its own log says what it refused."""

    return ThreadingHTTPServer(("127.0.0.1", 0), Check)


def serve_while(server: ThreadingHTTPServer, parent: int) -> None:
    """In the child: answer the validation URL until `parent` (the router) is gone."""
    threading.Thread(target=server.serve_forever, daemon=True).start()
    while os.getppid() == parent:
        time.sleep(1)
    os._exit(0)


def main(argv: list[str]) -> int:
    key = os.environ.pop(KEY_ENV, "")
    if not key:
        print(f"sparkbook_keyed_router: {KEY_ENV} is empty or not set; the router was not started", file=sys.stderr)
        return 2
    import setproctitle
    from vllm_router.launch_router import parse_router_args
    from vllm_router.router import Router

    args = parse_router_args(argv)
    server = validator(key)
    args.api_key_validation_urls = [f"http://127.0.0.1:{server.server_address[1]}/"]
    parent = os.getpid()
    if os.fork() == 0:
        setproctitle.setproctitle("vllm::router key check")
        serve_while(server, parent)
    server.server_close()
    setproctitle.setproctitle("vllm::router")  # as vllm-router's own launcher names it (ps, the env probe)
    Router.from_args(args).start()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

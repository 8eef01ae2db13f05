"""A tiny HTTP server serving hand-written Prometheus text, standing in for gateways' and workers' /metrics."""

from __future__ import annotations

import http.server
import threading


def serve_locally(handler: type[http.server.BaseHTTPRequestHandler]) -> tuple[http.server.ThreadingHTTPServer, str]:
    """`handler` served on a free loopback port from a daemon thread: (the server, its base URL)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


def stop(server: http.server.ThreadingHTTPServer) -> None:
    server.shutdown()
    server.server_close()


class MetricsServer:
    """Serves `pages[path]` at GET path (404 for others); tests edit `pages` between observations."""

    def __init__(self) -> None:
        pages: dict[str, str] = {}
        self.pages = pages

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = pages.get(self.path)
                if body is None:
                    self.send_error(404)
                    return
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *_: object) -> None:
                pass

        self.server, self.url = serve_locally(Handler)

    def close(self) -> None:
        stop(self.server)

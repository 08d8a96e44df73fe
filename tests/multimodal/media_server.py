"""A real HTTP server on a loopback address for the media-fetching tests.

It serves a PNG, an oversized body, an image with too many pixels, a slow answer, a page
that is not an image and redirects, and records every request it gets (path and Host
header), so a test can tell a refusal made before connecting from one made after.
"""

from __future__ import annotations

import io
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image

SLOW_RELEASE_S = 30.0  # a slow answer gives up after this, whatever happens to the test


def png_bytes(width: int, height: int, color: tuple[int, int, int] = (200, 30, 90)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buffer, format="PNG")
    return buffer.getvalue()


class MediaServer:
    """Routes: /image.png (8x6), /big-bytes (a PNG padded to BIG_BODY bytes), /big-pixels
    (3000x3000, small once compressed), /slow (waits until released), /page.html (text/html),
    /no-type (a PNG without Content-Type), /redirect?to=URL (302), /loop (redirects to
    itself)."""

    BIG_BODY = 300_000

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.requests: list[tuple[str, str]] = []  # (path, Host header)
        self.release = threading.Event()
        self.image = png_bytes(8, 6)
        self.big_pixels = png_bytes(3000, 3000, (0, 0, 0))
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                server.requests.append((self.path, self.headers.get("Host", "")))
                path, _, query = self.path.partition("?")
                if path == "/image.png":
                    self._send(200, "image/png", server.image)
                elif path == "/big-bytes":
                    self._send(200, "image/png", server.image.ljust(server.BIG_BODY, b"\0"))
                elif path == "/big-pixels":
                    self._send(200, "image/png", server.big_pixels)
                elif path == "/slow":
                    server.release.wait(SLOW_RELEASE_S)
                    self._send(200, "image/png", server.image)
                elif path == "/page.html":
                    self._send(200, "text/html", b"<html>not an image</html>")
                elif path == "/no-type":
                    self._send(200, None, server.image)
                elif path == "/redirect":
                    target = urllib.parse.parse_qs(query)["to"][0]
                    self._redirect(target)
                elif path == "/loop":
                    self._redirect("/loop")
                else:
                    self._send(404, "text/plain", b"not found")

            def _send(self, status: int, content_type: str | None, body: bytes) -> None:
                self.send_response(status)
                if content_type is not None:
                    self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    self.wfile.write(body)
                except OSError:
                    pass  # the client stopped reading (over the byte limit)

            def _redirect(self, location: str) -> None:
                self.send_response(302)
                self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer((host, 0), Handler)
        self.httpd.daemon_threads = True
        self.host = host
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str, host: str | None = None) -> str:
        return f"http://{host or self.host}:{self.port}{path}"

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def stop(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()

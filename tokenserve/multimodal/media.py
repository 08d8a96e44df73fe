"""`MediaConnector`: an image URL in a request → a decoded PIL image, within the limits.

Schemes: `data:` (base64 image/*), `http(s):` and `file:` (only under
`--allowed-local-media-path`). HTTP redirects are followed here, one hop at a time, so that
each hop's host and resolved addresses pass `media_security` before anything connects to
it; the connection then goes to the address that was checked (the Host header and TLS SNI
carry the name), so a second DNS answer cannot redirect it (DNS rebinding). Bytes are
counted as they stream in, the whole fetch runs under one deadline, the content type must
be image/*, and the pixel count is read from the image header before it is decoded. The
decoders are limited to common image formats. Runs in the API process, never the engine.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import io
import os
import socket
import stat
import urllib.parse
import urllib.request
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import httpx
from PIL import Image

from tokenserve.multimodal.media_security import (
    MediaConnectorConfig,
    MediaError,
    MediaFetchFailed,
    MediaTimeout,
    MediaTooLarge,
    MediaTypeRefused,
    MediaURLRefused,
    first_allowed,
    parse_address,
)

T = TypeVar("T")
# Formats decoded; others (EPS runs Ghostscript, exotic decoders) are refused unopened.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_REDIRECT_STATUSES = {301, 302, 303, 307, 308}
_DEFAULT_PORTS = {"http": 80, "https": 443}
# One request's images are fetched at most this many at a time (sockets and threads).
MAX_CONCURRENT_FETCHES = 8


class MediaConnector:
    """Fetches and decodes images for requests, refusing what its config does not allow."""

    def __init__(self, config: MediaConnectorConfig | None = None) -> None:
        self.config = config or MediaConnectorConfig()

    async def fetch_image_async(self, url: str) -> Image.Image:
        """The image at `url`, in RGB; a `MediaError` (a ValueError) naming why if refused."""
        if not isinstance(url, str) or not url:
            raise MediaURLRefused("An image URL must be a non-empty string.")
        scheme = url.split(":", 1)[0].lower() if ":" in url else ""
        if scheme == "data":
            data = self._data_url_bytes(url)
        elif scheme in ("http", "https"):
            try:
                async with asyncio.timeout(self.config.media_fetch_timeout):
                    data = await self._fetch_http(url)
            except TimeoutError:
                raise MediaTimeout(
                    f"Fetching the image took longer than {self.config.media_fetch_timeout:g} s "
                    "(--media-fetch-timeout)."
                ) from None
        elif scheme == "file":
            data = await asyncio.to_thread(self._read_local_file, url)
        else:
            raise MediaURLRefused(
                f"Image URL scheme {scheme or url[:16]!r} is not supported: use http(s), data "
                "or file."
            )
        # Decoding takes milliseconds to a second (bounded by the pixel limit): off the loop.
        return await asyncio.to_thread(self.decode_image, data)

    def fetch_image(self, url: str) -> Image.Image:
        """`fetch_image_async` for synchronous callers (`LLM.chat`)."""
        return run_sync(self.fetch_image_async(url))

    async def fetch_images_async(self, items: Sequence[str | Image.Image]) -> list[Image.Image]:
        """Every URL fetched concurrently, `MAX_CONCURRENT_FETCHES` at a time (an image given
        as a PIL image is kept as it is); the first refusal cancels the others and is raised."""
        slots = asyncio.Semaphore(MAX_CONCURRENT_FETCHES)

        async def image_of(item: str | Image.Image) -> Image.Image:
            if isinstance(item, Image.Image):
                return item
            async with slots:
                return await self.fetch_image_async(item)

        tasks = [asyncio.ensure_future(image_of(item)) for item in items]
        if not tasks:
            return []
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in tasks:  # the first failure in request order, when several failed
                if task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            return [task.result() for task in tasks]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def fetch_images(self, items: Sequence[str | Image.Image]) -> list[Image.Image]:
        return run_sync(self.fetch_images_async(items))

    def decode_image(self, data: bytes) -> Image.Image:
        """Bytes → RGB image: pixels counted from the header before the image is decoded."""
        try:
            # Reads the header only; PIL's own bomb guard refuses far too large images here.
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
            width, height = image.size
            if width * height > self.config.max_image_pixels:
                raise MediaTooLarge(
                    f"The image is {width}x{height} = {width * height} pixels, over the "
                    f"limit of {self.config.max_image_pixels} (--max-image-pixels)."
                )
            image.load()
            return image.convert("RGB")
        except MediaError:
            raise
        except Image.DecompressionBombError as error:
            raise MediaTooLarge(f"The image is too large to decode: {error}") from None
        except Image.UnidentifiedImageError:
            raise MediaTypeRefused(
                f"The data is not an image in a supported format ({', '.join(IMAGE_FORMATS)})."
            ) from None
        except (OSError, ValueError, SyntaxError) as error:
            raise MediaTypeRefused(f"The image could not be decoded: {error}") from None

    def _data_url_bytes(self, url: str) -> bytes:
        header, comma, payload = url.partition(",")
        if not comma:
            raise MediaURLRefused("A data: URL needs a ',' before its data.")
        media_type, *options = header[len("data:"):].split(";")
        if not media_type.strip().lower().startswith("image/"):
            raise MediaTypeRefused(
                f"A data: URL must carry an image/* type, got {media_type or 'none'!r}."
            )
        if "base64" not in (option.strip().lower() for option in options):
            raise MediaURLRefused("A data: image URL must be base64-encoded (';base64,').")
        if len(payload) * 3 // 4 > self.config.max_media_bytes:
            raise self._too_many_bytes()
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise MediaURLRefused("The data: URL's base64 data is not valid.") from None

    def _read_local_file(self, url: str) -> bytes:
        parsed = urllib.parse.urlsplit(url)
        if parsed.netloc not in ("", "localhost"):
            raise MediaURLRefused("A file: URL may not name a host.")
        path = self.config.local_file(urllib.request.url2pathname(parsed.path))
        try:
            # The checked real path, opened without following a link swapped in since.
            descriptor = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as error:
            raise MediaFetchFailed(f"The local image could not be opened: {error.strerror}.") from None
        if not stat.S_ISREG(os.fstat(descriptor).st_mode):  # no directory, FIFO or device
            os.close(descriptor)
            raise MediaURLRefused("A file: media URL must name a regular file.")
        with os.fdopen(descriptor, "rb") as file:
            data = file.read(self.config.max_media_bytes + 1)
        if len(data) > self.config.max_media_bytes:
            raise self._too_many_bytes()
        return data

    async def _fetch_http(self, url: str) -> bytes:
        """The body at `url`, every redirect hop checked before it is connected."""
        config = self.config
        current = self._parse_http_url(url)
        # trust_env=False: no proxy or netrc from the environment may reroute the fetch.
        async with httpx.AsyncClient(
            follow_redirects=False, trust_env=False, timeout=config.media_fetch_timeout
        ) as client:
            for _ in range(config.max_media_redirects + 1):
                request = await self._pinned_request(client, current)
                try:
                    response = await client.send(request, stream=True)
                except httpx.TimeoutException:
                    raise TimeoutError from None  # reported as MediaTimeout by the caller
                except httpx.HTTPError as error:
                    raise MediaFetchFailed(f"Fetching the image failed: {error}") from None
                try:
                    if response.status_code in _REDIRECT_STATUSES:
                        location = response.headers.get("location")
                        if not location:
                            raise MediaFetchFailed("A media redirect had no Location header.")
                        current = self._parse_http_url(
                            str(current.join(location)), redirected=True
                        )
                        continue
                    return await self._read_body(response)
                finally:
                    await response.aclose()
        raise MediaFetchFailed(
            f"The image URL redirected more than {config.max_media_redirects} times."
        )

    def _parse_http_url(self, url: str, redirected: bool = False) -> httpx.URL:
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, ValueError) as error:
            raise MediaURLRefused(f"The image URL is not valid: {error}") from None
        if parsed.scheme not in ("http", "https"):
            where = "A redirect" if redirected else "The image URL"
            raise MediaURLRefused(f"{where} to scheme {parsed.scheme!r} is refused.")
        if not parsed.host:
            raise MediaURLRefused("The image URL has no host.")
        if parsed.userinfo:
            raise MediaURLRefused("Credentials in an image URL are refused.")
        self.config.check_host(parsed.host)
        return parsed

    async def _pinned_request(self, client: httpx.AsyncClient, url: httpx.URL) -> httpx.Request:
        """A GET to the checked address of `url`'s host, carrying the name in Host and SNI."""
        host = url.host
        literal = parse_address(host)
        if literal is not None:
            addresses = [literal]
        else:
            port = url.port or _DEFAULT_PORTS[url.scheme]
            try:
                infos = await asyncio.get_running_loop().getaddrinfo(
                    host, port, type=socket.SOCK_STREAM
                )
            except OSError as error:
                raise MediaFetchFailed(f"Media URL host {host!r} did not resolve: {error}.") from None
            addresses = [parse_address(str(info[4][0])) for info in infos]
        address = first_allowed(
            self.config, host, [address for address in addresses if address is not None]
        )
        name = f"[{host}]" if ":" in host else host  # an IPv6 literal keeps its brackets
        host_header = name if url.port is None else f"{name}:{url.port}"
        extensions = {"sni_hostname": host} if url.scheme == "https" and literal is None else {}
        return client.build_request(
            "GET",
            url.copy_with(host=str(address)),
            headers={"Host": host_header, "Accept": "image/*"},
            extensions=extensions,
        )

    async def _read_body(self, response: httpx.Response) -> bytes:
        if response.status_code != 200:
            raise MediaFetchFailed(f"Fetching the image failed: HTTP {response.status_code}.")
        content_type = response.headers.get("content-type", "")
        if not content_type.split(";", 1)[0].strip().lower().startswith("image/"):
            raise MediaTypeRefused(
                f"The URL's content type is {content_type or 'missing'!r}, not image/*."
            )
        length = response.headers.get("content-length", "")
        if length.isdigit() and int(length) > self.config.max_media_bytes:
            raise self._too_many_bytes()
        chunks: list[bytes] = []
        received = 0
        try:
            async for chunk in response.aiter_bytes():
                received += len(chunk)
                if received > self.config.max_media_bytes:
                    raise self._too_many_bytes()  # stops reading; the connection is closed
                chunks.append(chunk)
        except httpx.TimeoutException:
            raise TimeoutError from None
        except httpx.HTTPError as error:
            raise MediaFetchFailed(f"Fetching the image failed: {error}") from None
        return b"".join(chunks)

    def _too_many_bytes(self) -> MediaTooLarge:
        return MediaTooLarge(
            f"The image is larger than {self.config.max_media_bytes} bytes (--max-media-bytes)."
        )


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to its end from synchronous code, inside a running loop or not."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    # Called from a running loop (a notebook): run on a loop of its own in another thread.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coroutine).result()

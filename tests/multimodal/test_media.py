"""MediaConnector against a real HTTP server on 127.0.0.1: what it fetches, and every
refusal (address, redirect hop, domain, bytes, pixels, time, content type, local path)."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import os
from collections.abc import Iterator

import httpx
import pytest
from PIL import Image, ImageFile

from tests.multimodal.media_server import MediaServer, png_bytes
from tokenserve.multimodal.media import MediaConnector
from tokenserve.multimodal.media_security import (
    MediaAddressRefused,
    MediaConnectorConfig,
    MediaFetchFailed,
    MediaTimeout,
    MediaTooLarge,
    MediaTypeRefused,
    MediaURLRefused,
    non_public_reason,
)

LOOPBACK = ("127.0.0.1/32",)


@pytest.fixture(scope="module")
def server() -> Iterator[MediaServer]:
    media_server = MediaServer()
    yield media_server
    media_server.stop()


@pytest.fixture(scope="module")
def other_server() -> Iterator[MediaServer]:
    """A second loopback server (127.0.0.2) that must never be reached."""
    media_server = MediaServer("127.0.0.2")
    yield media_server
    media_server.stop()


def connector(**config) -> MediaConnector:
    return MediaConnector(MediaConnectorConfig(**config))


def fetched_paths(server: MediaServer, action) -> list[str]:
    """The paths the server was asked for while `action` ran."""
    before = len(server.requests)
    action()
    return server.paths()[before:]


def test_png_is_fetched_and_decoded_from_an_allowed_network(server):
    image = connector(allowed_media_networks=LOOPBACK).fetch_image(server.url("/image.png"))
    assert image.size == (8, 6) and image.mode == "RGB"
    assert image.getpixel((3, 2)) == (200, 30, 90)


# A name, and the numeric spellings the resolver takes for 127.0.0.1.
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "2130706433", "0x7f.0.0.1", "127.1"])
def test_loopback_is_refused_unless_allowed_without_connecting(server, host):
    url = server.url("/image.png", host)

    def refused() -> None:
        with pytest.raises(MediaAddressRefused, match="loopback.*--allowed-media-networks"):
            connector().fetch_image(url)

    assert fetched_paths(server, refused) == []


@pytest.mark.parametrize(
    ("target", "reason"),
    [("http://169.254.169.254/latest/meta-data/", "link-local"), ("http://10.0.0.1/", "private")],
)
def test_redirect_to_a_private_address_is_refused(server, target, reason):
    url = server.url(f"/redirect?to={target}", "localhost")
    # Any public host allowed: the hop's address is refused.
    with pytest.raises(MediaAddressRefused, match=reason):
        connector(allowed_media_networks=LOOPBACK).fetch_image(url)
    # Only an allowed domain: the hop's host is refused already.
    media = connector(allowed_media_domains=("localhost",), allowed_media_networks=LOOPBACK)
    with pytest.raises(MediaURLRefused, match="not in --allowed-media-domains"):
        media.fetch_image(url)


def test_an_allowed_domain_resolving_to_loopback_is_refused(server):
    with pytest.raises(MediaAddressRefused, match=r"localhost \((127\.0\.0\.1|::1)\).*loopback"):
        connector(allowed_media_domains=("localhost",)).fetch_image(
            server.url("/image.png", "localhost")
        )


def test_a_redirect_hop_is_refused_before_it_is_connected(server, other_server):
    """127.0.0.2 is outside the allowed 127.0.0.1/32: the hop there is never connected."""
    target = other_server.url("/image.png")
    media = connector(allowed_media_networks=LOOPBACK)

    def refused() -> None:
        with pytest.raises(MediaAddressRefused, match="127.0.0.2"):
            media.fetch_image(server.url(f"/redirect?to={target}"))

    assert fetched_paths(other_server, refused) == []
    assert server.paths()[-1].startswith("/redirect")  # the first hop was fetched


def test_every_hop_checks_the_allowed_domains(server):
    media = connector(allowed_media_domains=("localhost",), allowed_media_networks=LOOPBACK)
    # Same host as an IP literal: not an allowed name.
    with pytest.raises(MediaURLRefused, match="--allowed-media-domains"):
        media.fetch_image(server.url(f"/redirect?to={server.url('/image.png')}", "localhost"))
    with pytest.raises(MediaURLRefused, match="scheme 'file'"):
        media.fetch_image(server.url("/redirect?to=file:///etc/passwd", "localhost"))
    with pytest.raises(MediaURLRefused, match="--allowed-media-domains"):
        media.fetch_image("http://example.com/image.png")


def test_the_checked_address_is_connected_with_the_name_in_the_host_header(server):
    """DNS is asked once per hop; the connection goes to that address, named in Host."""
    media = connector(allowed_media_domains=("localhost",), allowed_media_networks=LOOPBACK)
    assert media.fetch_image(server.url("/redirect?to=/image.png", "localhost")).size == (8, 6)
    assert server.requests[-2:] == [
        ("/redirect?to=/image.png", f"localhost:{server.port}"),
        ("/image.png", f"localhost:{server.port}"),
    ]


def test_redirect_loops_end(server):
    with pytest.raises(MediaFetchFailed, match="redirected more than 2 times"):
        connector(allowed_media_networks=LOOPBACK, max_media_redirects=2).fetch_image(
            server.url("/loop")
        )


def test_oversized_bytes_are_refused(server):
    media = connector(allowed_media_networks=LOOPBACK, max_media_bytes=100_000)
    with pytest.raises(MediaTooLarge, match="100000 bytes"):
        media.fetch_image(server.url("/big-bytes"))
    data_url = "data:image/png;base64," + base64.b64encode(b"\0" * 200_000).decode()
    with pytest.raises(MediaTooLarge, match="--max-media-bytes"):
        media.fetch_image(data_url)


def test_too_many_pixels_are_refused_before_decoding(server, monkeypatch):
    def never(self):
        raise AssertionError("the image was decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", never)
    media = connector(allowed_media_networks=LOOPBACK, max_image_pixels=1_000_000)
    with pytest.raises(MediaTooLarge, match="3000x3000 = 9000000 pixels.*--max-image-pixels"):
        media.fetch_image(server.url("/big-pixels"))


def test_a_slow_server_times_out(server):
    media = connector(allowed_media_networks=LOOPBACK, media_fetch_timeout=0.5)
    with pytest.raises(MediaTimeout, match="--media-fetch-timeout"):
        media.fetch_image(server.url("/slow"))


@pytest.mark.parametrize(("path", "shown"), [("/page.html", "text/html"), ("/no-type", "missing")])
def test_non_image_content_types_are_refused(server, path, shown):
    with pytest.raises(MediaTypeRefused, match=f"{shown}.*not image"):
        connector(allowed_media_networks=LOOPBACK).fetch_image(server.url(path))


def test_http_errors_are_refusals(server):
    with pytest.raises(MediaFetchFailed, match="HTTP 404"):
        connector(allowed_media_networks=LOOPBACK).fetch_image(server.url("/missing"))


def test_data_urls_decode_and_are_checked():
    media = connector()
    png = base64.b64encode(png_bytes(5, 4)).decode()
    assert media.fetch_image(f"data:image/png;base64,{png}").size == (5, 4)
    with pytest.raises(MediaTypeRefused, match="image/"):
        media.fetch_image(f"data:text/plain;base64,{png}")
    with pytest.raises(MediaURLRefused, match="base64"):
        media.fetch_image("data:image/png,rawbytes")
    with pytest.raises(MediaTypeRefused, match="not an image"):
        media.fetch_image("data:image/png;base64," + base64.b64encode(b"hello").decode())
    with pytest.raises(MediaURLRefused, match="scheme 'ftp'"):
        media.fetch_image("ftp://example.com/a.png")


def test_formats_outside_the_list_are_not_opened():
    """EPS (Ghostscript) and the like are refused before any decoder runs."""
    eps = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
    with pytest.raises(MediaTypeRefused, match="supported format"):
        connector().decode_image(eps)


def test_local_files_only_under_the_allowed_path(tmp_path):
    allowed = tmp_path / "media"
    allowed.mkdir()
    (allowed / "cat.png").write_bytes(png_bytes(3, 2))
    outside = tmp_path / "secret.png"
    outside.write_bytes(png_bytes(1, 1))
    os.symlink(outside, allowed / "link.png")

    with pytest.raises(MediaURLRefused, match="--allowed-local-media-path"):
        connector().fetch_image(f"file://{allowed}/cat.png")
    media = connector(allowed_local_media_path=str(allowed))
    assert media.fetch_image(f"file://{allowed}/cat.png").size == (3, 2)
    for url in (f"file://{allowed}/link.png", f"file://{allowed}/../secret.png"):
        with pytest.raises(MediaURLRefused, match="outside --allowed-local-media-path"):
            media.fetch_image(url)
    with pytest.raises(MediaURLRefused, match="regular file"):
        media.fetch_image(f"file://{allowed}")
    with pytest.raises(MediaURLRefused, match="host"):
        media.fetch_image(f"file://example.com{allowed}/cat.png")


def test_images_are_fetched_together_and_the_first_refusal_is_raised(server):
    media = connector(allowed_media_networks=LOOPBACK)
    given = Image.new("RGB", (2, 2))
    images = media.fetch_images([server.url("/image.png"), given, server.url("/image.png")])
    assert [image.size for image in images] == [(8, 6), (2, 2), (8, 6)]
    with pytest.raises(MediaTypeRefused):
        media.fetch_images([server.url("/image.png"), server.url("/page.html")])


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("10.1.2.3", "private"),
        ("172.16.0.1", "private"),
        ("192.168.1.1", "private"),
        ("169.254.169.254", "link-local"),
        ("224.0.0.1", "multicast"),
        ("0.0.0.0", "unspecified"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "non-public"),
        ("::1", "loopback"),
        ("fe80::1", "link-local"),
        ("fc00::1", "private"),
        ("::ffff:10.0.0.1", "private (IPv4 inside IPv6)"),
        ("64:ff9b::7f00:1", "loopback (IPv4 inside IPv6)"),
        ("2002:a9fe:a9fe::", "link-local (IPv4 inside IPv6)"),
        ("8.8.8.8", None),
        ("2606:4700:4700::1111", None),
    ],
)
def test_non_public_addresses(address, reason):
    assert non_public_reason(ipaddress.ip_address(address)) == reason


def test_config_is_checked():
    with pytest.raises(ValueError, match="not a network"):
        MediaConnectorConfig(allowed_media_networks=("intranet",))
    with pytest.raises(ValueError, match="not a directory"):
        MediaConnectorConfig(allowed_local_media_path="/nonexistent/media")
    with pytest.raises(ValueError, match="media_fetch_timeout"):
        MediaConnectorConfig(media_fetch_timeout=0)


def test_https_connects_to_the_checked_address_with_the_name_for_sni():
    """The request goes to the IP that was checked; Host and the TLS server name (so the
    certificate check) keep the URL's name."""

    async def build():
        media = connector(allowed_media_networks=LOOPBACK)
        async with httpx.AsyncClient() as client:
            return await media._pinned_request(client, httpx.URL("https://localhost:8443/a.png"))

    request = asyncio.run(build())
    assert request.url.host in ("127.0.0.1", "::1") and request.url.port == 8443
    assert request.headers["Host"] == "localhost:8443"
    assert request.extensions["sni_hostname"] == "localhost"

"""What a media URL may reach: the refusals of `MediaConnector` and the checks behind them.

A URL in a request is chosen by an untrusted client, and the server fetches it from inside
the operator's network. So every hop is checked before it is connected: the scheme, the
host against `--allowed-media-domains`, and every address the host resolves to against
the non-public ranges (loopback, private, link-local, multicast, reserved, unspecified,
shared / carrier-grade NAT, and IPv4 addresses embedded in IPv6 ones), unless the operator
opted a network in with `--allowed-media-networks`. Local files are read only under
`--allowed-local-media-path`, after symlinks are resolved. docs/MEDIA_SECURITY.md.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


class MediaError(ValueError):
    """A media input was refused; the message says why (HTTP 400 on the server)."""


class MediaURLRefused(MediaError):
    """The URL itself is refused: its scheme, credentials, domain or local path."""


class MediaAddressRefused(MediaError):
    """The host resolves to an address the server does not fetch from."""


class MediaTooLarge(MediaError):
    """The media is over a byte or pixel limit."""


class MediaTimeout(MediaError):
    """Fetching took longer than the time limit."""


class MediaFetchFailed(MediaError):
    """The server could not get the media: DNS, connection, HTTP status, too many redirects."""


class MediaTypeRefused(MediaError):
    """The content is not an image the server decodes."""


@dataclass(frozen=True)
class MediaConnectorConfig:
    """What `MediaConnector` may fetch and how much (each a `tokenserve serve` flag).

    `allowed_media_domains`: hosts (exact names) http(s) URLs may name, on every redirect
    hop; None allows any public host. `allowed_local_media_path`: the directory `file:` URLs
    may read under; None refuses `file:`. `allowed_media_networks`: CIDR ranges fetched
    from even though they are not public (an internal image store, the tests' 127.0.0.1).
    """

    allowed_media_domains: tuple[str, ...] | None = None
    allowed_local_media_path: str | None = None
    allowed_media_networks: tuple[str, ...] = ()
    media_fetch_timeout: float = 5.0  # seconds for one URL, all hops and the body included
    max_media_bytes: int = 20 * 1024**2
    max_image_pixels: int = 4096 * 4096
    max_media_redirects: int = 5
    _networks: tuple[IPNetwork, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.allowed_media_domains is not None:
            domains = tuple(normalize_host(domain) for domain in self.allowed_media_domains)
            if not all(domains):
                raise ValueError("allowed_media_domains must not hold an empty name.")
            object.__setattr__(self, "allowed_media_domains", domains)
        object.__setattr__(self, "allowed_media_networks", tuple(self.allowed_media_networks))
        networks = []
        for value in self.allowed_media_networks:
            try:
                networks.append(ipaddress.ip_network(value, strict=False))
            except ValueError:
                raise ValueError(
                    f"allowed_media_networks: {value!r} is not a network such as 10.0.0.0/8."
                ) from None
        object.__setattr__(self, "_networks", tuple(networks))
        if self.allowed_local_media_path is not None:
            path = os.path.realpath(self.allowed_local_media_path)
            if not os.path.isdir(path):
                raise ValueError(
                    f"allowed_local_media_path {self.allowed_local_media_path!r} is not a "
                    "directory."
                )
            object.__setattr__(self, "allowed_local_media_path", path)
        if self.media_fetch_timeout <= 0:
            raise ValueError(
                f"media_fetch_timeout must be positive, got {self.media_fetch_timeout}."
            )
        for name in ("max_media_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}.")
        if self.max_media_redirects < 0:
            raise ValueError(
                f"max_media_redirects must be non-negative, got {self.max_media_redirects}."
            )

    @classmethod
    def field_names(cls) -> set[str]:
        """The keyword arguments `LLM(...)` passes here rather than to the engine."""
        return {name for name in cls.__dataclass_fields__ if not name.startswith("_")}

    def check_host(self, host: str) -> None:
        """Refuse a host outside `allowed_media_domains` (when set)."""
        name = normalize_host(host)
        if self.allowed_media_domains is not None and name not in self.allowed_media_domains:
            raise MediaURLRefused(
                f"Media URL host {name!r} is not in --allowed-media-domains."
            )

    def check_address(self, address: IPAddress, host: str) -> None:
        """Refuse an address that is not public, unless an allowed network holds it."""
        if any(address in network for network in self._networks):
            return
        reason = non_public_reason(address)
        if reason is not None:
            shown = host if host == str(address) else f"{host} ({address})"
            raise MediaAddressRefused(
                f"Media URL host {shown} is not a public address ({reason}); fetching from it "
                "is refused (an operator may allow a network with --allowed-media-networks)."
            )

    def local_file(self, path: str) -> str:
        """The real path of a `file:` URL's path, refused outside the allowed directory."""
        root = self.allowed_local_media_path
        if root is None:
            raise MediaURLRefused(
                "file: media URLs are refused: the server was not started with "
                "--allowed-local-media-path."
            )
        if not os.path.isabs(path):
            raise MediaURLRefused("A file: media URL must hold an absolute path.")
        # Symlinks resolved first, so a link inside the directory cannot lead out of it.
        real = os.path.realpath(path)
        if os.path.commonpath([real, root]) != root:
            raise MediaURLRefused(
                "file: media URL points outside --allowed-local-media-path (after resolving "
                "symlinks)."
            )
        return real


def normalize_host(host: str) -> str:
    """Lower case without the trailing dot: how names are compared."""
    return host.strip().rstrip(".").lower()


def non_public_reason(address: IPAddress) -> str | None:
    """Why an address is not a public one ("loopback", "private", ...), or None."""
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        reason = non_public_reason(embedded)
        return f"{reason} (IPv4 inside IPv6)" if reason else None
    for reason, flag in (
        ("unspecified", address.is_unspecified),
        ("loopback", address.is_loopback),
        ("link-local", address.is_link_local),
        ("multicast", address.is_multicast),
        ("reserved", address.is_reserved),
        ("private", address.is_private),
    ):
        if flag:
            return reason
    # Shared address space (100.64.0.0/10), documentation and benchmarking ranges, ...
    return None if address.is_global else "non-public"


def _embedded_ipv4(address: IPAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, Teredo, NAT64), if any."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address.teredo is not None:
        return address.teredo[1]
    if address in _NAT64:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None


_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def parse_address(host: str) -> IPAddress | None:
    """The host as an IP address when it is a literal one (brackets and zone dropped)."""
    literal = host.strip("[]").split("%", 1)[0]
    try:
        return ipaddress.ip_address(literal)
    except ValueError:
        return None


def first_allowed(
    config: MediaConnectorConfig, host: str, addresses: Sequence[IPAddress]
) -> IPAddress:
    """The first resolved address the server may connect to; refused when none may be.

    Only that address is connected to (the name is never resolved again), so an address
    list mixing public and private entries cannot steer the fetch to the private one.
    """
    first_error: MediaAddressRefused | None = None
    for address in addresses:
        try:
            config.check_address(address, host)
        except MediaAddressRefused as error:
            first_error = first_error or error
            continue
        return address
    if first_error is not None:
        raise first_error
    raise MediaFetchFailed(f"Media URL host {host!r} did not resolve to any address.")

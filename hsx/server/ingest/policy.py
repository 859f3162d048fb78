"""Which dataset URIs a job may name, checked without transferring anything (the URI policy).

Accepted forms, each only while its scheme is in ``settings.allowed_uri_schemes``:

* a plain path or ``file://`` URI: must resolve, symlinks included, to a regular file (or a Hugging Face
  ``datasets`` folder, ``save_to_disk``) under one of ``settings.resolved_dataset_roots``, no larger than
  ``settings.max_dataset_bytes``. A relative plain path is taken relative to the first root. ``..`` segments
  and NUL bytes are refused at every percent-decoding level, so ``%2e%2e`` and ``%252e%252e`` are refused
  too; the realpath containment check is what actually holds the line, the early refusal only makes the
  reason clear.
* ``http://`` and ``https://``: the host must resolve to public addresses only (:func:`ensure_public_host`);
  :mod:`hsx.server.ingest.fetch` checks every hop again and connects only to an address that was checked.
* ``s3://bucket/key``: refused unless the bucket is in ``settings.allowed_buckets``; no request is made.

:func:`check_dataset_uri` is the whole policy for one URI. Every refusal is a :class:`UriRefused` (a
:class:`~hsx.errors.BadRequest` or :class:`~hsx.errors.Forbidden`) with a stable ``error`` code.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit, urlunsplit

from hsx.errors import BadRequest, Forbidden, HsxError
from hsx.server.settings import Settings

HTTP_SCHEMES = frozenset({"http", "https"})
_DEFAULT_PORTS = {"http": 80, "https": 443}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_CONTROL_CHARACTER = re.compile(r"[\x00-\x1f\x7f]")
# Decoding more layers than this is no longer a plausible file name, only an attempt to outlast the check.
_MAX_DECODE_ROUNDS = 4

# Blocks refused on top of what ``ipaddress`` flags, because its lists vary across Python patch releases
# (multicast and 100.64/10, for one, were not "private" in every version).
_NOT_PUBLIC_NETWORKS = tuple(
    ipaddress.ip_network(block)
    for block in (
        "0.0.0.0/8",
        "10.0.0.0/8",
        "100.64.0.0/10",  # carrier-grade NAT
        "127.0.0.0/8",
        "169.254.0.0/16",  # link-local, where cloud metadata services live
        "172.16.0.0/12",
        "192.0.0.0/24",
        "192.0.2.0/24",
        "192.88.99.0/24",
        "192.168.0.0/16",
        "198.18.0.0/15",
        "198.51.100.0/24",
        "203.0.113.0/24",
        "224.0.0.0/4",
        "240.0.0.0/4",  # reserved, and the limited broadcast address
        "::/8",  # unspecified, loopback, IPv4-compatible
        "64:ff9b:1::/48",  # local-use NAT64
        "100::/64",
        "2001::/23",  # IETF protocol assignments, Teredo among them
        "2001:db8::/32",
        "fc00::/7",  # unique local
        "fe80::/10",
        "fec0::/10",
        "ff00::/8",
    )
)
_NAT64_WELL_KNOWN = ipaddress.IPv6Network("64:ff9b::/96")

HostCheck = Callable[[str], list[str]]


class UriRefused(HsxError):
    """Base of every refusal here, so a caller can catch them all while each keeps its status code."""


class InvalidUri(UriRefused, BadRequest):
    pass


class ForbiddenUri(UriRefused, Forbidden):
    pass


@dataclass(frozen=True)
class ResolvedDataset:
    uri: str  # as the client gave it
    path: Path  # real path (no symlinks) of a regular file
    size_bytes: int
    sha256: str | None  # known for downloads; local files are not hashed here, they may be many GiB
    source_url: str | None = None  # downloads: the URL the bytes came from, after redirects


def check_dataset_uri(uri: str, settings: Settings) -> None:
    """Refuse what :func:`hsx.server.ingest.fetch.resolve_dataset_uri` would refuse, without transferring
    anything.

    For the API at submit time, so a download of many GiB happens in a worker rather than in a request. A
    remote URI can still fail later (redirects, size, the server); a local one is checked in full.
    """
    scheme = uri_scheme(uri, settings)
    if scheme == "file":
        resolve_local_dataset(uri, settings)
    elif scheme in HTTP_SCHEMES:
        ensure_public_host(HttpTarget.parse(uri, settings).host)
    elif scheme == "s3":
        check_s3_uri(uri, settings)
    else:
        raise InvalidUri(
            f"scheme {scheme!r} is allowed but hsx cannot read it", error="uri_scheme_not_supported"
        )


def uri_scheme(uri: str, settings: Settings) -> str:
    """The lower-cased scheme, ``file`` for a plain path, once the allow-list and the characters pass."""
    return _checked_scheme(uri, settings)[0]


def _checked_scheme(uri: str, settings: Settings) -> tuple[str, bool]:
    """The lower-cased scheme (``file`` for a plain path) and whether ``uri`` was a URI at all."""
    if not uri.strip():
        raise InvalidUri("the dataset URI is empty", error="invalid_uri")
    if "\x00" in uri:
        raise InvalidUri("the dataset URI contains a NUL byte", error="nul_byte")
    # urlsplit silently drops tabs and newlines, so ".\n." would reach the path as ".." after every check.
    if _CONTROL_CHARACTER.search(uri):
        raise InvalidUri("the dataset URI contains a control character", error="invalid_uri")
    match = _SCHEME.match(uri)
    scheme, is_uri = (match.group(1).lower(), True) if match else ("file", False)
    # A plain path is a local file: it is refused with file:// so it cannot be a way around that setting.
    if scheme not in {allowed.lower() for allowed in settings.allowed_uri_schemes}:
        raise ForbiddenUri(f"URI scheme {scheme!r} is not allowed here", error="uri_scheme_not_allowed")
    return scheme, is_uri


# Local files


def resolve_local_dataset(uri: str, settings: Settings, *, allow_folder: bool = True) -> ResolvedDataset:
    """A local path or file URI as a vetted regular file or, when ``allow_folder``, ``datasets`` folder
    (``save_to_disk``)."""
    scheme, is_uri = _checked_scheme(uri, settings)
    if scheme != "file":
        raise InvalidUri(f"{scheme}:// is not a local dataset", error="invalid_uri")
    return _resolve_local(uri, is_uri, settings, allow_folder)


def _resolve_local(uri: str, is_uri: bool, settings: Settings, allow_folder: bool = False) -> ResolvedDataset:
    _refuse_traversal(uri)
    if is_uri:
        parts = urlsplit(uri)
        if parts.netloc not in ("", "localhost"):
            raise InvalidUri("a file URI must name a local path, as file:///path", error="invalid_uri")
        if parts.query or parts.fragment:
            raise InvalidUri("a file URI takes no query or fragment", error="invalid_uri")
        text = unquote(parts.path)
    else:
        text = uri
    roots = settings.resolved_dataset_roots
    if not roots:
        raise ForbiddenUri("no dataset roots are configured", error="path_outside_roots")
    path = Path(text)
    if not path.is_absolute():
        path = roots[0] / path
    real = Path(os.path.realpath(path))
    # Containment before existence, so the answer says nothing about files outside the roots.
    if not any(real.is_relative_to(root) for root in roots):
        shown = ", ".join(str(root) for root in roots)
        raise ForbiddenUri(
            f"the dataset path is outside the dataset roots ({shown}); the API reads datasets only under "
            "HSX_DATASET_ROOTS (a path or comma-separated paths, set where the API runs)",
            error="path_outside_roots",
        )
    try:
        info = os.stat(real)
    except FileNotFoundError as exc:
        raise InvalidUri(f"no such dataset file: {text}", error="dataset_not_found") from exc
    except OSError as exc:
        raise InvalidUri(
            f"the dataset file cannot be read: {exc.strerror}", error="dataset_unreadable"
        ) from exc
    if allow_folder and stat.S_ISDIR(info.st_mode) and is_datasets_folder(real):
        size = _folder_bytes(real, roots)
    elif not stat.S_ISREG(info.st_mode):
        what = "regular file or datasets folder" if allow_folder else "regular file"
        raise InvalidUri(f"the dataset path is not a {what}", error="not_a_file")
    else:
        size = info.st_size
    if size > settings.max_dataset_bytes:
        raise InvalidUri(
            f"the dataset is {size} bytes, over the limit of {settings.max_dataset_bytes}",
            error="dataset_too_large",
        )
    if not os.access(real, os.R_OK):
        raise InvalidUri("the dataset file is not readable by the service", error="dataset_unreadable")
    return ResolvedDataset(uri=uri, path=real, size_bytes=size, sha256=None)


DATASETS_FOLDER_MARKERS = ("state.json", "dataset_dict.json")


def is_datasets_folder(path: Path) -> bool:
    """A folder written by Hugging Face ``datasets``' ``save_to_disk`` (a Dataset or a DatasetDict)."""
    return any((path / marker).is_file() for marker in DATASETS_FOLDER_MARKERS)


def _folder_bytes(folder: Path, roots: list[Path]) -> int:
    """Bytes of the regular files below ``folder``; a link leading out of the roots is refused."""
    total = 0
    for current, _dirs, names in os.walk(folder):
        for name in names:
            real = Path(os.path.realpath(Path(current) / name))
            if not any(real.is_relative_to(root) for root in roots):
                raise ForbiddenUri(
                    "the dataset folder links outside the dataset roots", error="path_outside_roots"
                )
            with contextlib.suppress(OSError):
                total += os.stat(real).st_size
    return total


def _refuse_traversal(text: str) -> None:
    """Refuse ``..`` segments and NUL bytes in ``text`` and in each of its percent-decodings."""
    layer = text
    for _ in range(_MAX_DECODE_ROUNDS + 1):
        if "\x00" in layer:
            raise InvalidUri("the dataset path contains a NUL byte", error="nul_byte")
        if ".." in re.split(r"[/\\]", layer):
            raise InvalidUri("the dataset path contains a '..' segment", error="path_traversal")
        decoded = unquote(layer)
        if decoded == layer:
            return
        layer = decoded
    raise InvalidUri("the dataset path has too many layers of percent-encoding", error="path_traversal")


# S3


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str  # no leading slash; may end with "/" (a prefix)


def check_s3_uri(uri: str, settings: Settings) -> S3Location:
    """``s3://bucket/key`` with an allowed bucket and a plain key, or a refusal. No request is made."""
    _checked_scheme(uri, settings)
    parts = urlsplit(uri)
    if parts.scheme.lower() != "s3":
        raise InvalidUri("an S3 URI is s3://bucket/key", error="invalid_uri")
    bucket = parts.netloc
    key = unquote(parts.path).lstrip("/")
    # Credentials in the URI would be stored with the job; a query or fragment has no meaning for S3 here.
    if not _S3_BUCKET.match(bucket) or not key.strip("/") or parts.query or parts.fragment:
        raise InvalidUri("an S3 URI is s3://bucket/key", error="invalid_uri")
    _refuse_traversal(key)
    if bucket not in settings.allowed_buckets:
        raise ForbiddenUri(f"bucket {bucket!r} is not in the allowed buckets", error="bucket_not_allowed")
    return S3Location(bucket, key)


# Remote addresses


def is_public_address(address: str) -> bool:
    """Whether ``address`` (an IP literal) is a globally routable unicast address.

    IPv6 forms that carry an IPv4 address (mapped, 6to4, well-known NAT64) are judged by that address.
    """
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.teredo is not None:
            return False
        embedded = ip.ipv4_mapped or ip.sixtofour
        if embedded is None and ip in _NAT64_WELL_KNOWN:
            embedded = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
        if embedded is not None:
            return is_public_address(str(embedded))
    if any(ip in network for network in _NOT_PUBLIC_NETWORKS):
        return False
    flagged = ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_multicast
    return ip.is_global and not (flagged or ip.is_reserved or ip.is_unspecified)


def ensure_public_host(host: str) -> list[str]:
    """Resolve ``host`` (a name or an IP literal) and return its addresses if every one is public.

    Raises :class:`ForbiddenUri` (``address_not_public``) when any address is not public: the connection may
    pick any of them. Numeric shorthands that the system resolver accepts (``127.1``, ``0x7f000001``) are
    judged by what they resolve to. Connect only to the returned addresses.
    """
    name = host.strip()
    if name.startswith("[") and name.endswith("]"):
        name = name[1:-1]
    if not name:
        raise InvalidUri("the URI names no host", error="invalid_uri")
    try:
        infos = socket.getaddrinfo(name, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError) as exc:
        raise InvalidUri(f"host {host!r} does not resolve", error="host_not_resolvable") from exc
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))  # ordered, without duplicates
    if not addresses:
        raise InvalidUri(f"host {host!r} does not resolve", error="host_not_resolvable")
    for address in addresses:
        if not is_public_address(address):
            raise ForbiddenUri(
                f"host {host!r} resolves to {address}, which is not a public address",
                error="address_not_public",
            )
    return addresses


# http(s) URIs


@dataclass(frozen=True)
class HttpTarget:
    """An http(s) URI that passed the policy: an allowed scheme, no credentials, a host and a port."""

    url: str
    scheme: str
    host: str  # ASCII (IDNA) host, without brackets
    port: int
    host_header: str
    path_and_query: tuple[str, str]

    @classmethod
    def parse(cls, url: str, settings: Settings) -> HttpTarget:
        parts = urlsplit(url)
        scheme = parts.scheme.lower()
        allowed = {allowed.lower() for allowed in settings.allowed_uri_schemes}
        if scheme not in HTTP_SCHEMES or scheme not in allowed:
            raise ForbiddenUri(f"URI scheme {scheme!r} is not allowed here", error="uri_scheme_not_allowed")
        # Credentials would be stored with the job and shown back in its record.
        if parts.username is not None or parts.password is not None:
            raise InvalidUri("the URI must not carry credentials", error="invalid_uri")
        if not parts.hostname:
            raise InvalidUri("the URI names no host", error="invalid_uri")
        try:
            host = parts.hostname.encode("idna").decode("ascii")
            port = parts.port or _DEFAULT_PORTS[scheme]
        except (UnicodeError, ValueError) as exc:
            raise InvalidUri(f"the URI is malformed: {exc}", error="invalid_uri") from exc
        bracketed = f"[{host}]" if ":" in host else host
        host_header = bracketed if parts.port is None else f"{bracketed}:{port}"
        return cls(url, scheme, host, port, host_header, (parts.path or "/", parts.query))

    def pinned_url(self, address: str) -> str:
        netloc = f"[{address}]:{self.port}" if ":" in address else f"{address}:{self.port}"
        return urlunsplit((self.scheme, netloc, *self.path_and_query, ""))

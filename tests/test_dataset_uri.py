"""Dataset URI resolution: local containment, address checks, and downloads from real loopback servers.

No test sends traffic off the machine: remote addresses are only ever checked (the checks refuse them before
any connection), and downloads go to servers on 127.0.0.1, reached through an injected host check.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import shutil
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from hsx.errors import BadRequest, Forbidden
from hsx.server.ingest import (
    ForbiddenUri,
    InvalidUri,
    UriRefused,
    check_dataset_uri,
    download_dataset,
    ensure_public_host,
    is_public_address,
    resolve_dataset_uri,
)
from hsx.server.ingest.fetch import MAX_REDIRECTS
from hsx.server.settings import Settings

ROWS = b'{"messages": [{"role": "user", "content": "hi"}]}\n' * 50


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A dataset root with one file, and a secret outside it."""
    root = tmp_path / "root"
    (root / "sub").mkdir(parents=True)
    (root / "chats.jsonl").write_bytes(ROWS)
    (root / "sub" / "more.jsonl").write_bytes(ROWS)
    (tmp_path / "secret.txt").write_text("outside")
    return tmp_path


def make_settings(tree: Path, **overrides: object) -> Settings:
    values: dict[str, object] = {"data_dir": tree / "data", "dataset_roots": [tree / "root"]}
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


def refusal(uri: str, settings: Settings) -> UriRefused:
    with pytest.raises(UriRefused) as caught:
        resolve_dataset_uri(uri, settings)
    return caught.value


# Local files


def test_plain_absolute_relative_and_file_uris_resolve(tree: Path) -> None:
    settings = make_settings(tree)
    target = (tree / "root" / "chats.jsonl").resolve()
    for uri in (
        str(target),
        "chats.jsonl",
        "./chats.jsonl",
        f"file://{target}",
        f"file://localhost{target}",
        f"FILE://{target}",
    ):
        resolved = resolve_dataset_uri(uri, settings)
        assert resolved.path == target
        assert resolved.size_bytes == len(ROWS)
        assert resolved.uri == uri
        assert resolved.sha256 is None
    encoded = f"file://{(tree / 'root' / 'sub').resolve()}/more%2Ejsonl"
    assert resolve_dataset_uri(encoded, settings).path.name == "more.jsonl"


@pytest.mark.parametrize(
    "uri",
    [
        "../secret.txt",
        "sub/../../secret.txt",
        "sub/..",
        "%2e%2e/secret.txt",
        "%2E%2E/secret.txt",
        "..%2fsecret.txt",
        "%252e%252e/secret.txt",
        "%25252e%25252e/secret.txt",
        "..\\secret.txt",
        "file:///ROOT/../secret.txt",
        "file:///ROOT/%2e%2e/secret.txt",
        "file:///ROOT/%252e%252e/secret.txt",
        "file:///ROOT/sub%2f%2e%2e%2f%2e%2e/secret.txt",
    ],
)
def test_traversal_is_refused_at_every_encoding(tree: Path, uri: str) -> None:
    error = refusal(uri.replace("/ROOT", str(tree / "root")), make_settings(tree))
    assert error.error == "path_traversal"
    assert isinstance(error, BadRequest)


def test_encoding_nested_too_deep_is_refused(tree: Path) -> None:
    deep = "%63hats.jsonl"  # "chats.jsonl" with its "c" encoded, then the "%" encoded six more times
    for _ in range(6):
        deep = deep.replace("%", "%25")
    assert refusal(deep, make_settings(tree)).error == "path_traversal"


@pytest.mark.parametrize(
    "uri", ["chats.jsonl\x00.txt", "chats%00.jsonl", "file:///ROOT/chats.jsonl%00", "a%2500b"]
)
def test_nul_bytes_are_refused(tree: Path, uri: str) -> None:
    assert refusal(uri.replace("/ROOT", str(tree / "root")), make_settings(tree)).error == "nul_byte"


def test_paths_outside_the_roots_are_refused(tree: Path) -> None:
    settings = make_settings(tree)
    for uri in (str(tree / "secret.txt"), "/etc/passwd", f"file://{tree / 'secret.txt'}", "/nonexistent/x"):
        error = refusal(uri, settings)
        assert error.error == "path_outside_roots"
        assert isinstance(error, Forbidden)


def test_symlink_escaping_the_roots_is_refused(tree: Path) -> None:
    root = tree / "root"
    (root / "escape.jsonl").symlink_to(tree / "secret.txt")
    (root / "escape_dir").symlink_to(tree, target_is_directory=True)
    settings = make_settings(tree)
    assert refusal("escape.jsonl", settings).error == "path_outside_roots"
    assert refusal("escape_dir/secret.txt", settings).error == "path_outside_roots"
    assert refusal(f"file://{root / 'escape.jsonl'}", settings).error == "path_outside_roots"


def test_symlink_inside_the_roots_resolves_to_its_real_path(tree: Path) -> None:
    root = tree / "root"
    (root / "alias.jsonl").symlink_to(root / "sub" / "more.jsonl")
    resolved = resolve_dataset_uri("alias.jsonl", make_settings(tree))
    assert resolved.path == (root / "sub" / "more.jsonl").resolve()


def test_missing_directory_fifo_and_oversized_are_refused(tree: Path) -> None:
    root = tree / "root"
    os.mkfifo(root / "pipe.jsonl")
    settings = make_settings(tree)
    assert refusal("missing.jsonl", settings).error == "dataset_not_found"
    assert refusal("sub", settings).error == "not_a_file"
    assert refusal(str(root), settings).error == "not_a_file"
    assert refusal("pipe.jsonl", settings).error == "not_a_file"
    small = make_settings(tree, max_dataset_bytes=len(ROWS) - 1)
    assert refusal("chats.jsonl", small).error == "dataset_too_large"
    assert resolve_dataset_uri("chats.jsonl", make_settings(tree, max_dataset_bytes=len(ROWS))).size_bytes


def test_file_uri_must_be_local(tree: Path) -> None:
    settings = make_settings(tree)
    assert refusal("file://fileserver/share/chats.jsonl", settings).error == "invalid_uri"
    assert refusal(f"file://{tree / 'root' / 'chats.jsonl'}?x=1", settings).error == "invalid_uri"
    assert refusal("   ", settings).error == "invalid_uri"


@pytest.mark.parametrize(
    "uri", ["file:///ROOT/sub/.\n./chats.jsonl", "sub/.\t./chats.jsonl", "http://8.8.8.8/\r\nx", "a\x7fb"]
)
def test_control_characters_are_refused(tree: Path, uri: str) -> None:
    # urlsplit would drop the tab or newline, turning ".\n." into ".." after the traversal check.
    assert refusal(uri.replace("/ROOT", str(tree / "root")), make_settings(tree)).error == "invalid_uri"


# Schemes


@pytest.mark.parametrize(
    "uri",
    ["ftp://example.com/x.jsonl", "gopher://example.com/", "data:,hello", "javascript:alert(1)", "jar:x"],
)
def test_schemes_outside_the_allowed_list_are_refused(tree: Path, uri: str) -> None:
    error = refusal(uri, make_settings(tree))
    assert error.error == "uri_scheme_not_allowed"
    assert error.status_code == 403


def test_plain_paths_count_as_file_scheme(tree: Path) -> None:
    https_only = make_settings(tree, allowed_uri_schemes=["https"])
    assert refusal("chats.jsonl", https_only).error == "uri_scheme_not_allowed"
    assert refusal(f"FiLe://{tree / 'root' / 'chats.jsonl'}", https_only).error == "uri_scheme_not_allowed"
    assert refusal("http://8.8.8.8/x.jsonl", https_only).error == "uri_scheme_not_allowed"


def test_allowed_but_unknown_scheme_is_refused(tree: Path) -> None:
    settings = make_settings(tree, allowed_uri_schemes=["ftp"])
    assert refusal("ftp://example.com/x", settings).error == "uri_scheme_not_supported"


def test_s3_needs_the_scheme_an_allowed_bucket_and_a_plain_key(tree: Path) -> None:
    assert refusal("s3://datasets/chats.jsonl", make_settings(tree)).error == "uri_scheme_not_allowed"
    with_s3 = make_settings(tree, allowed_uri_schemes=["s3"], allowed_buckets=["datasets"])
    error = refusal("s3://other-bucket/chats.jsonl", with_s3)
    assert (error.error, error.status_code) == ("bucket_not_allowed", 403)
    assert refusal("s3://datasets/", with_s3).error == "invalid_uri"
    assert refusal("s3://key:secret@datasets/chats.jsonl", with_s3).error == "invalid_uri"
    for bad in ("s3://datasets/a/../../b.jsonl", "s3://datasets/a/%2e%2e/b", "s3://datasets/x?versionId=1"):
        with pytest.raises(UriRefused):
            check_dataset_uri(bad, with_s3)
    with pytest.raises(ForbiddenUri):
        check_dataset_uri("s3://other-bucket/chats.jsonl", with_s3)
    # Submit-time: shape and bucket only, nothing is fetched. A local file is what resolve answers with,
    # and an s3 object is read by the worker, so resolve says so.
    check_dataset_uri("s3://datasets/chats.jsonl", with_s3)
    assert refusal("s3://datasets/chats.jsonl", with_s3).error == "s3_read_by_worker"


def test_a_datasets_folder_passes_the_check_and_other_folders_do_not(tree: Path) -> None:
    settings = make_settings(tree)
    folder = tree / "root" / "saved"
    folder.mkdir()
    (folder / "data-00000-of-00001.arrow").write_bytes(b"x" * 100)
    with pytest.raises(UriRefused) as caught:
        check_dataset_uri("saved", settings)
    assert caught.value.error == "not_a_file"
    (folder / "state.json").write_text("{}")
    check_dataset_uri("saved", settings)
    check_dataset_uri(f"file://{folder}", settings)
    assert refusal("saved", settings).error == "not_a_file"  # resolve answers only with a regular file
    assert refusal("sub", settings).error == "not_a_file"
    small = make_settings(tree, max_dataset_bytes=50)
    with pytest.raises(UriRefused) as caught:
        check_dataset_uri("saved", small)
    assert caught.value.error == "dataset_too_large"
    (folder / "escape.arrow").symlink_to(tree / "secret.txt")
    with pytest.raises(ForbiddenUri):
        check_dataset_uri("saved", settings)


# Addresses


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "127.255.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # CGNAT
        "100.127.255.254",
        "0.0.0.0",
        "192.0.2.1",
        "198.18.0.1",
        "224.0.0.1",
        "239.255.255.250",
        "240.0.0.1",
        "255.255.255.255",
        "::",
        "::1",
        "::127.0.0.1",  # IPv4-compatible
        "fc00::1",
        "fd12:3456::1",
        "fe80::1",
        "fe80::1%1",
        "fec0::1",
        "ff02::1",
        "2001:db8::1",
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo
        "::ffff:127.0.0.1",
        "::ffff:169.254.169.254",
        "::ffff:10.0.0.1",
        "::ffff:100.64.0.1",
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "64:ff9b:1::1",
        "2002:7f00:1::1",  # 6to4 of 127.0.0.1
        "2002:a9fe:a9fe::1",  # 6to4 of 169.254.169.254
        "not an address",
    ],
)
def test_non_public_addresses(address: str) -> None:
    assert not is_public_address(address)


@pytest.mark.parametrize(
    "address",
    ["8.8.8.8", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8", "64:ff9b::808:808", "2002:808:808::1"],
)
def test_public_addresses(address: str) -> None:
    assert is_public_address(address)


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "localhost",
        "127.1",  # shorthands the system resolver expands
        "0x7f000001",
        "2130706433",
        "0177.0.0.1",
        "169.254.169.254",
        "[::1]",
        "::1",
        "[::ffff:127.0.0.1]",
        "[::ffff:a9fe:a9fe]",
        "0.0.0.0",
        "10.0.0.1",
    ],
)
def test_ensure_public_host_refuses_what_resolves_privately(host: str) -> None:
    with pytest.raises(ForbiddenUri) as caught:
        ensure_public_host(host)
    assert caught.value.error == "address_not_public"


def test_ensure_public_host_returns_checked_addresses() -> None:
    # Numeric hosts: getaddrinfo answers these without asking any DNS server.
    assert ensure_public_host("8.8.8.8") == ["8.8.8.8"]
    assert ensure_public_host("[2606:4700:4700::1111]") == ["2606:4700:4700::1111"]
    with pytest.raises(InvalidUri):
        ensure_public_host("")


@pytest.mark.parametrize(
    "uri",
    [
        "http://127.0.0.1/x.jsonl",
        "http://localhost:8080/x.jsonl",
        "http://169.254.169.254/latest/meta-data/",
        "https://[::1]/x.jsonl",
        "http://[::ffff:7f00:1]/x.jsonl",
        "http://[fd00::1]/x.jsonl",
        "http://100.64.0.1/x.jsonl",
        "http://127.1/x.jsonl",
    ],
)
def test_production_path_refuses_private_hosts_before_connecting(tree: Path, uri: str) -> None:
    settings = make_settings(tree)
    assert refusal(uri, settings).error == "address_not_public"
    with pytest.raises(ForbiddenUri):
        check_dataset_uri(uri, settings)


def test_credentials_in_http_uris_are_refused(tree: Path) -> None:
    assert refusal("https://user:pw@8.8.8.8/x.jsonl", make_settings(tree)).error == "invalid_uri"
    assert refusal("https://8.8.8.8:99999/x.jsonl", make_settings(tree)).error == "invalid_uri"


def test_check_dataset_uri_validates_local_paths_in_full(tree: Path) -> None:
    settings = make_settings(tree)
    check_dataset_uri("chats.jsonl", settings)
    check_dataset_uri("https://8.8.8.8/x.jsonl", settings)  # numeric: checked without any traffic
    with pytest.raises(UriRefused):
        check_dataset_uri("../secret.txt", settings)
    with pytest.raises(UriRefused):
        check_dataset_uri("missing.jsonl", settings)


# Downloads, from real servers on 127.0.0.1

Route = Callable[[http.server.BaseHTTPRequestHandler], None]


@dataclass
class LoopbackSite:
    routes: dict[str, Route] = field(default_factory=dict)
    seen: list[tuple[str, str]] = field(default_factory=list)  # (path, Host header)
    port: int = 0
    scheme: str = "http"

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"{self.scheme}://{host}:{self.port}{path}"


@contextmanager
def serve(site: LoopbackSite, tls: ssl.SSLContext | None = None) -> Iterator[LoopbackSite]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            site.seen.append((self.path, self.headers.get("Host", "")))
            route = site.routes.get(self.path.split("?")[0])
            if route is None:
                self.send_error(404)
                return
            route(self)

        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    if tls is not None:
        server.socket = tls.wrap_socket(server.socket, server_side=True)
        site.scheme = "https"
    site.port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield site
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def site() -> Iterator[LoopbackSite]:
    with serve(LoopbackSite()) as running:
        yield running


def body(payload: bytes, content_type: str = "application/jsonl", length: int | None = None) -> Route:
    def route(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(200)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(payload) if length is None else length))
        handler.end_headers()
        handler.wfile.write(payload)

    return route


def chunked(payload: bytes, pieces: int = 8) -> Route:
    def route(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.protocol_version = "HTTP/1.1"
        handler.send_response(200)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.end_headers()
        step = max(1, len(payload) // pieces)
        for start in range(0, len(payload), step):
            piece = payload[start : start + step]
            handler.wfile.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
        handler.wfile.write(b"0\r\n\r\n")

    return route


def redirect(location: str, status: int = 302) -> Route:
    def route(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(status)
        handler.send_header("Location", location)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    return route


def allow_loopback(host: str) -> list[str]:
    """Test-only host check: loopback names pass, everything else gets the production check."""
    if host in ("127.0.0.1", "localhost"):
        return ["127.0.0.1"]
    return ensure_public_host(host)


def first_hop_only(allowed: str) -> Callable[[str], list[str]]:
    """Test-only host check letting exactly the first hop through to loopback; later hops are strict."""
    calls: list[str] = []

    def check(host: str) -> list[str]:
        calls.append(host)
        if len(calls) == 1 and host == allowed:
            return ["127.0.0.1"]
        return ensure_public_host(host)

    return check


def download_refusal(url: str, settings: Settings, check: Callable[[str], list[str]]) -> UriRefused:
    with pytest.raises(UriRefused) as caught:
        download_dataset(url, settings, check_host=check)
    return caught.value


def leftovers(settings: Settings) -> list[str]:
    downloads = settings.data_dir / "downloads"
    return sorted(p.name for p in downloads.iterdir()) if downloads.exists() else []


def test_download_is_staged_under_its_sha256(tree: Path, site: LoopbackSite) -> None:
    site.routes["/data/chats.jsonl"] = body(ROWS)
    settings = make_settings(tree)
    resolved = download_dataset(site.url("/data/chats.jsonl?sig=abc"), settings, check_host=allow_loopback)
    digest = hashlib.sha256(ROWS).hexdigest()
    assert resolved.sha256 == digest
    assert resolved.size_bytes == len(ROWS)
    assert resolved.path == (tree / "data" / "downloads" / f"{digest}.jsonl").resolve()
    assert resolved.path.read_bytes() == ROWS
    assert resolved.source_url == site.url("/data/chats.jsonl?sig=abc")
    assert leftovers(settings) == [f"{digest}.jsonl"]  # no partial file left behind
    assert site.seen == [("/data/chats.jsonl?sig=abc", f"127.0.0.1:{site.port}")]


def test_download_connects_to_the_checked_address_with_the_original_host_header(
    tree: Path, site: LoopbackSite
) -> None:
    # "dataset.test" resolves nowhere: the download works only because it connects to the address the
    # check returned instead of looking the name up again.
    site.routes["/x.jsonl"] = chunked(ROWS)

    def pinned(host: str) -> list[str]:
        assert host == "dataset.test"
        return ["127.0.0.1"]

    resolved = download_dataset(
        site.url("/x.jsonl", host="dataset.test"), make_settings(tree), check_host=pinned
    )
    assert resolved.path.read_bytes() == ROWS
    assert site.seen == [("/x.jsonl", f"dataset.test:{site.port}")]


def test_redirect_to_metadata_address_is_refused(tree: Path, site: LoopbackSite) -> None:
    site.routes["/start"] = redirect("http://169.254.169.254/latest/meta-data/iam/")
    error = download_refusal(site.url("/start"), make_settings(tree), first_hop_only("127.0.0.1"))
    assert error.error == "address_not_public"
    assert "169.254.169.254" in error.detail


def test_redirect_back_to_loopback_is_refused_on_the_second_hop(tree: Path, site: LoopbackSite) -> None:
    site.routes["/internal"] = body(b"secret")
    # The relative one stays on the same loopback host, which is now checked strictly.
    for target in (
        "/internal",
        f"http://localhost:{site.port}/internal",
        f"http://[::1]:{site.port}/internal",
    ):
        site.routes["/start"] = redirect(target)
        error = download_refusal(site.url("/start"), make_settings(tree), first_hop_only("127.0.0.1"))
        assert error.error == "address_not_public"
    assert [path for path, _ in site.seen] == ["/start"] * 3  # /internal was never fetched


def test_redirect_to_another_scheme_is_refused(tree: Path, site: LoopbackSite) -> None:
    for location in ("file:///etc/passwd", "gopher://127.0.0.1/", "s3://bucket/key"):
        site.routes["/start"] = redirect(location, status=301)
        error = download_refusal(site.url("/start"), make_settings(tree), allow_loopback)
        assert error.error == "uri_scheme_not_allowed"


def test_redirects_are_followed_up_to_the_limit(tree: Path, site: LoopbackSite) -> None:
    for hop in range(MAX_REDIRECTS):
        site.routes[f"/hop{hop}"] = redirect(f"/hop{hop + 1}", status=(301, 302, 303, 307, 308)[hop % 5])
    site.routes[f"/hop{MAX_REDIRECTS}"] = body(ROWS)
    resolved = download_dataset(site.url("/hop0"), make_settings(tree), check_host=allow_loopback)
    assert resolved.source_url == site.url(f"/hop{MAX_REDIRECTS}")

    site.routes[f"/hop{MAX_REDIRECTS}"] = redirect("/hop0")
    error = download_refusal(site.url("/hop0"), make_settings(tree), allow_loopback)
    assert error.error == "too_many_redirects"


def test_oversized_downloads_are_refused_and_cleaned_up(tree: Path, site: LoopbackSite) -> None:
    settings = make_settings(tree, max_dataset_bytes=len(ROWS) - 1)
    site.routes["/declared"] = body(ROWS)
    site.routes["/streamed"] = chunked(ROWS)
    assert download_refusal(site.url("/declared"), settings, allow_loopback).error == "dataset_too_large"
    assert download_refusal(site.url("/streamed"), settings, allow_loopback).error == "dataset_too_large"
    assert leftovers(settings) == []


def test_failed_downloads(tree: Path, site: LoopbackSite) -> None:
    settings = make_settings(tree, http_timeout_seconds=0.5)
    timed_out = threading.Event()

    def slow(handler: http.server.BaseHTTPRequestHandler) -> None:
        # Answers only once the client has given up (the test is over): its timeout runs out whatever the
        # host's load, and no thread sleeps on after the test.
        timed_out.wait(60)
        body(ROWS)(handler)

    site.routes["/slow"] = slow
    site.routes["/truncated"] = body(ROWS[:100], length=len(ROWS))

    def no_location(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.end_headers()

    site.routes["/nolocation"] = no_location
    try:
        for path in ("/missing", "/slow", "/truncated", "/nolocation"):
            assert download_refusal(site.url(path), settings, allow_loopback).error == "download_failed", path
    finally:
        timed_out.set()
    assert leftovers(settings) == []


def test_connection_refused_is_a_download_failure(tree: Path, site: LoopbackSite) -> None:
    def closed_port(host: str) -> list[str]:
        return ["127.0.0.1"]

    url = "http://dataset.test:1/x.jsonl"  # nothing listens on port 1 of loopback
    assert download_refusal(url, make_settings(tree), closed_port).error == "download_failed"


# HTTPS: the connection is pinned to the checked address while TLS is verified against the host name.


def _certificate(tmp_path: Path, name: str) -> tuple[Path, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / f"{name}.crt", tmp_path / f"{name}.key"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", f"/CN={name}",
         "-addext", f"subjectAltName=DNS:{name}", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key


@pytest.mark.parametrize(("served_name", "ok"), [("dataset.test", True), ("elsewhere.test", False)])
def test_https_download_verifies_the_host_name_not_the_address(
    tree: Path, served_name: str, ok: bool
) -> None:
    cert, key = _certificate(tree, served_name)
    server_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server_tls.load_cert_chain(cert, key)
    client_tls = ssl.create_default_context(cafile=str(cert))
    with serve(LoopbackSite(routes={"/x.jsonl": body(ROWS)}), tls=server_tls) as site:
        url = site.url("/x.jsonl", host="dataset.test")
        settings = make_settings(tree)
        if ok:
            resolved = download_dataset(
                url, settings, check_host=lambda _: ["127.0.0.1"], tls_context=client_tls
            )
            assert resolved.path.read_bytes() == ROWS
        else:
            with pytest.raises(UriRefused) as caught:
                download_dataset(url, settings, check_host=lambda _: ["127.0.0.1"], tls_context=client_tls)
            assert caught.value.error == "download_failed"

"""Serving an ASGI app (the API, an engine) on a socket this process binds itself, so that ``--port 0`` works:
the kernel picks a free port, and ``--port-file`` tells whoever started the server which one. A port picked
elsewhere and handed over (bind, close, start the server, hope) can be taken by anyone in between; a port
bound here cannot."""

from __future__ import annotations

import argparse
import os
import socket
from pathlib import Path
from typing import Any


def add_port_file_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--port-file",
        default=None,
        help="write the port served on to this file once it is bound (with --port 0: the one the kernel "
        "picked)",
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one), as uvicorn would bind it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)  # from now on a client's connection waits for the server instead of failing
    except OSError:
        sock.close()
        raise
    return sock


def write_port_file(path: str | os.PathLike[str], port: int) -> None:
    """The port, written whole: a reader sees no file or the whole number, never a part of it."""
    target = Path(path)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(f"{port}\n")
    partial.replace(target)


def serve(app: Any, host: str, port: int, port_file: str | None = None, **config: Any) -> None:
    """``uvicorn.run(app, host=host, port=port, **config)`` on a socket bound here; the port it got is
    written to ``port_file`` (when given) before the app starts serving."""
    import uvicorn

    sock = bind(host, port)
    if port_file:
        write_port_file(port_file, int(sock.getsockname()[1]))
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, **config))
    server.run(sockets=[sock])

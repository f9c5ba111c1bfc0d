"""Network addresses of workers and coordinators: `tcp://HOST:PORT`, parsed here and nowhere else.

Addresses come from the command line (`--listen`, `--workers`, `--link`), cluster files and plans,
and end up as ZeroMQ endpoints. ZeroMQ itself says only "Invalid argument" about a bad one, after
the socket is made (and a socket left open then keeps its context from ever terminating), so every
address is checked here first, where the message can name the form it should have.

    tcp://192.0.2.10:5555     a host by IPv4 address
    tcp://phone.local:5555    a host by name (or a network interface, when listening)
    tcp://*:5555              listening only: every interface
    tcp://127.0.0.1:0         listening only: port 0 (or *) picks a free port

`parse_address(text)` and `str(address)` round-trip.
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

SCHEME = "tcp://"
FORM = "tcp://HOST:PORT"
MAX_PORT = 65535
_LABEL = re.compile(r"[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")
_MAX_HOST_CHARS = 253


class AddressError(ValueError):
    """An address that is not `tcp://HOST:PORT`; the message quotes it, gives the form and the problem."""


@dataclass(frozen=True)
class Address:
    """`host` is a name or dotted IPv4 address, or "*" (every interface, listening only); `port` is
    1-65535, or 0 for any free port (listening only)."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{SCHEME}{self.host}:{self.port}"


def parse_address(text: object, *, listen: bool = False) -> Address:
    """`text` as an Address; raises AddressError saying what is wrong with it. With `listen`, the
    forms only a bound address may take (`*` for the host, 0 or `*` for the port) are allowed too."""
    def bad(problem: str) -> AddressError:
        return AddressError(f"{str(text)[:100]!r} is not of the form {FORM} ({problem})")

    if not isinstance(text, str):
        raise AddressError(f"{text!r:.100} is not of the form {FORM} (it is not a string but {type(text).__name__})")
    if not text.startswith(SCHEME):
        scheme = text.partition("://")[0] if "://" in text else ""
        raise bad(f"the transport {scheme!r} is not tcp" if scheme else "it does not start with tcp://")
    rest = text[len(SCHEME):]
    host, colon, port_text = rest.rpartition(":")
    if not colon:
        raise bad("no :PORT after the host")
    if not host:
        raise bad("no host before the :PORT")
    if listen and port_text == "*":
        port = 0
    elif re.fullmatch(r"[0-9]{1,5}", port_text) and int(port_text) <= MAX_PORT:
        port = int(port_text)
    else:
        raise bad(f"port {port_text!r} is not a number from 0 to {MAX_PORT}, or *" if listen
                  else f"port {port_text!r} is not a number from 1 to {MAX_PORT}")
    if port == 0 and not listen:
        raise bad("port 0 only picks a free port when listening; give the peer's port")
    problem = _host_problem(host, listen)
    if problem is not None:
        raise bad(problem)
    return Address(host, port)


def _host_problem(host: str, listen: bool) -> str | None:
    if host == "*":
        return None if listen else "host * means every interface, which only a listening address may use"
    if host.startswith("["):
        return "IPv6 addresses are not supported; give an IPv4 address or a host name"
    labels = host.split(".")
    if len(host) > _MAX_HOST_CHARS or not all(_LABEL.fullmatch(label) for label in labels):
        return f"host {host[:100]!r} is not a host name or IPv4 address"
    if all(label.isdigit() for label in labels):
        try:
            ipaddress.IPv4Address(host)
        except ValueError:
            return f"host {host!r} is not an IPv4 address"
    return None

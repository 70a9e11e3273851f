"""Outbound requests to addresses a token holder chose (agent runtimes' callback URLs), kept from becoming SSRF.

- **At registration** (``check_callback_url``): http or https only, a host, no user-info (``http://user@host`` hides
  the real host from a reader), no fragment; a literal private/loopback/link-local address is refused at once
  unless private destinations are allowed.
- **At send time** (``Egress.post``): the host is resolved once; if *any* of its addresses is not a public unicast
  address the request is refused before a byte is sent (a decimal IP such as ``2130706433``, ``localhost`` or a
  name with one private A record among public ones all end here). The request then goes to the address that was
  checked — the URL's host replaced by the IP, ``Host`` and the TLS server name kept — so a second DNS answer
  (rebinding) cannot redirect it. Redirects are not followed.
- **Answers** are read as raw bytes (``Accept-Encoding: identity``, so a compressed bomb is not inflated) up to
  ``max_response_bytes``; the connection is closed after that and the answer marked truncated.

Private destinations are allowed only when the operator says so (``Settings.webhook_allow_private``,
``DSEC_WEBHOOK_ALLOW_PRIVATE=1``, ``dsec serve --webhook-allow-private``): tests, the demo and receivers on the same
host need it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from dsec.errors import TransportError

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]


class EgressRefused(TransportError):
    """The destination is not one DSec may send to; the message says why (no request was sent)."""


def address_problem(addr: IPAddress) -> str | None:
    """Why ``addr`` is not a public unicast address, or None when it is."""
    mapped = getattr(addr, "ipv4_mapped", None)
    if mapped is not None:
        addr = mapped
    for attr, what in (
        ("is_loopback", "a loopback address"),
        ("is_link_local", "a link-local address"),
        ("is_private", "a private address"),
        ("is_multicast", "a multicast address"),
        ("is_unspecified", "the unspecified address"),
        ("is_reserved", "a reserved address"),
    ):
        if getattr(addr, attr):
            return what
    if not addr.is_global:
        return "not a globally routable address"
    return None


def _literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def check_callback_url(url: str, allow_private: bool) -> str:
    """The URL if it may be registered; ValueError naming what is wrong otherwise."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise ValueError(f"scheme {parts.scheme!r} is not allowed: expected http or https")
    if parts.username is not None or parts.password is not None or "@" in parts.netloc:
        raise ValueError("user-info (user@host) is not allowed in a callback URL")
    if not parts.hostname:
        raise ValueError("the URL has no host")
    if parts.fragment:
        raise ValueError("a fragment (#...) is not allowed in a callback URL")
    if port == 0:
        raise ValueError("port 0 is not a destination")
    literal = _literal(parts.hostname)
    if literal is not None and not allow_private:
        problem = address_problem(literal)
        if problem is not None:
            raise ValueError(f"{parts.hostname} is {problem}; private destinations need webhook_allow_private")
    return url


def system_resolver(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    truncated: bool
    address: str  # the address the request went to


class Egress:
    """A synchronous sender for one thread (the webhook delivery thread). ``close()`` closes its connections."""

    def __init__(
        self,
        allow_private: bool = False,
        max_response_bytes: int = 64 * 1024,
        timeout_s: float = 3.0,
        resolver: Resolver = system_resolver,
    ) -> None:
        self.allow_private = allow_private
        self.max_response_bytes = max_response_bytes
        self.timeout_s = timeout_s
        self.resolver = resolver
        # trust_env=False: an HTTP(S)_PROXY in the environment would move the connection (and the address check)
        # to the proxy. A private CA for https receivers still comes from SSL_CERT_FILE, as everywhere else.
        cafile = os.environ.get("SSL_CERT_FILE")
        verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=cafile) if cafile else True
        self._client = httpx.Client(
            timeout=timeout_s,
            follow_redirects=False,
            trust_env=False,
            verify=verify,
            headers={"User-Agent": "dsec-webhooks"},
        )

    def resolve(self, url: httpx.URL) -> str:
        """The checked address to connect to for ``url``; EgressRefused when any of its addresses is refused."""
        host = url.host
        port = url.port or (443 if url.scheme == "https" else 80)
        literal = _literal(host)
        if literal is not None:
            addresses = [str(literal)]
        else:
            try:
                addresses = self.resolver(host, port)
            except OSError as exc:
                raise EgressRefused(f"cannot resolve {host}: {exc}") from None
            if not addresses:
                raise EgressRefused(f"{host} has no address")
        if not self.allow_private:
            for a in addresses:
                problem = address_problem(ipaddress.ip_address(a))
                if problem is not None:
                    raise EgressRefused(f"{host} resolves to {a}, {problem}: refused (webhook_allow_private is off)")
        return addresses[0]

    def post(self, url: str, body: bytes, headers: Mapping[str, str]) -> Answer:
        target = httpx.URL(url)
        if target.userinfo:
            raise EgressRefused("user-info in a callback URL is refused")
        address = self.resolve(target)
        pinned = target.copy_with(host=address)
        default_port = 443 if target.scheme == "https" else 80
        host_header = target.host if target.port in (None, default_port) else f"{target.host}:{target.port}"
        if ":" in target.host and target.port not in (None, default_port):
            host_header = f"[{target.host}]:{target.port}"
        extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
        send_headers = {**headers, "Host": host_header, "Accept-Encoding": "identity"}
        deadline = time.monotonic() + 2 * self.timeout_s
        with self._client.stream("POST", pinned, content=body, headers=send_headers, extensions=extensions) as r:
            data = bytearray()
            truncated = False
            for chunk in r.iter_raw(16384):
                data += chunk
                if len(data) > self.max_response_bytes or time.monotonic() > deadline:
                    truncated = True
                    del data[self.max_response_bytes :]
                    break
            return Answer(r.status_code, bytes(data), truncated, address)

    def close(self) -> None:
        self._client.close()

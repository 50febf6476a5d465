"""Remote (``http``, ``https``) image URLs, fetched by the gateway only from hosts the operator lists.

Off by default: with no ``--allowed-media-domains`` every remote URL is a 400 and nothing is fetched. With a list,
a URL is fetched only if its host is on it (``images.example.com`` exactly; ``*.example.com`` for any name under
``example.com``), and only from public addresses: every address its name resolves to is checked, and one that
is loopback, link-local (cloud metadata services: 169.254.169.254), private, shared, multicast, reserved or
unspecified refuses the URL. The connection then goes to the addresses checked, never to a second lookup's
(``_PinnedResolver``), so a name that answers a public address to the check and a private one to the connection
(DNS rebinding) reaches nothing it should not. Redirects are followed (at most ``MAX_REDIRECTS``), each hop
checked as the first; proxies from the environment are not used.

A request's remote images are fetched together, under one deadline (``RemoteImagePolicy.timeout_s``) and the
request's byte limits (``ImageLimits``: a declared ``Content-Length`` over them is refused before the body is
read, a body that grows past them is cut off); the pixel limits then apply as to inline images
(``gateway.chat_images.decode_images``). Every refusal is a 400 naming the content part.

``allow_private_addresses`` turns the address check off. It is DANGEROUS: any client could then make the gateway
fetch from the machine itself or its network (admin ports, metadata services). It exists for tests that serve
images from loopback, and for closed networks whose image store has a private address and whose clients are all
trusted.
"""

import asyncio
import ipaddress
import socket
from dataclasses import dataclass

import aiohttp
from aiohttp import web
from aiohttp.abc import AbstractResolver, ResolveResult
from yarl import URL

from gateway.chat_images import ImageLimits, ImageRef, remote_scheme
from gateway.errors import APIError

MAX_REDIRECTS = 3


@dataclass(frozen=True)
class RemoteImagePolicy:
    """Which remote image URLs the gateway fetches, and how long a request's fetches may take together."""

    allowed_domains: tuple[str, ...] = ()  # lower-case host names; "*.example.com": any name under example.com
    timeout_s: float = 10.0
    allow_private_addresses: bool = False  # DANGEROUS: see the module's docstring

    @classmethod
    def of(cls, config) -> "RemoteImagePolicy":
        """The policy a ``GatewayConfig`` sets."""
        domains = tuple(d.strip().lower().rstrip(".") for d in config.allowed_media_domains)
        return cls(domains, config.media_fetch_timeout_s, config.allow_private_media_addresses)

    def allows(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        return any(host == d or (d.startswith("*.") and host.endswith(d[1:])) for d in self.allowed_domains)


REMOTE_IMAGES = web.AppKey("remote_images", RemoteImagePolicy)  # the app's policy, read by each request


def parse_domains(value: str | None) -> tuple[str, ...]:
    """``--allowed-media-domains``: host names separated by commas, ``*.example.com`` for a domain's names;
    ValueError naming the first entry that is not a host name."""
    if value is None or not value.strip():
        return ()
    out = []
    for entry in (e.strip().lower().rstrip(".") for e in value.split(",")):
        if not entry:
            continue
        name = entry[2:] if entry.startswith("*.") else entry
        if not name or any(c in name for c in "/:@*?# ") or name.startswith("."):
            raise ValueError(f"--allowed-media-domains: {entry!r} is not a host name; give names such as "
                             "images.example.com or *.example.com, separated by commas (no scheme, port or path)")
        out.append(entry)
    return tuple(out)


def forbidden_address(address: str) -> str | None:
    """Why ``address`` (an IP address) may not be fetched from, or None for a public address."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope (fe80::1%eth0) is not part of it
    if ip.version == 6:
        embedded = ip.ipv4_mapped or ip.sixtofour or (ip.teredo[1] if ip.teredo else None)
        if embedded is not None:  # an IPv6 form of an IPv4 address reaches that address
            return forbidden_address(str(embedded))
    for kind in ("loopback", "link_local", "unspecified", "multicast", "reserved", "private"):
        if getattr(ip, f"is_{kind}"):
            return kind.replace("_", "-")
    return None if ip.is_global else "not public"  # 100.64.0.0/10 (shared) and the like


class _PinnedResolver(AbstractResolver):
    """Answers the one host name it was made for with the addresses already checked, and nothing else: the
    connection goes where the check looked."""

    def __init__(self, host: str, results: list[ResolveResult]) -> None:
        self.host, self.results = host, results

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
                      ) -> list[ResolveResult]:
        if host != self.host:
            raise OSError(f"{host!r} was not checked")
        return [r for r in self.results if family in (socket.AF_UNSPEC, r["family"])] or self.results

    async def close(self) -> None:
        pass


def pinned_session(host: str, results: list[ResolveResult]) -> aiohttp.ClientSession:
    """A client session whose connections to ``host`` go to ``results`` (the addresses checked), and to no other
    host. Bodies are read as sent (no decompression: a small compressed body must not grow past the limits in one
    chunk before it is counted; images are compressed already); the environment's proxies are not used."""
    connector = aiohttp.TCPConnector(resolver=_PinnedResolver(host, results), use_dns_cache=False, force_close=True,
                                     limit=1)
    return aiohttp.ClientSession(connector=connector, trust_env=False, auto_decompress=False)


class _Budget:
    """Bytes a request's images may still take together (its fetches run at once on one event loop)."""

    def __init__(self, limits: ImageLimits) -> None:
        self.limits, self.left = limits, limits.max_request_image_bytes

    def take(self, ref: ImageRef, n: int, image_total: int) -> None:
        if image_total > self.limits.max_image_bytes:
            raise APIError(400, f"{ref.where}: the image is over {self.limits.max_image_bytes:,} bytes",
                           param=ref.where, code="image_too_large")
        self.left -= n
        if self.left < 0:
            raise APIError(400, f"{ref.where}: the request's images are over "
                                f"{self.limits.max_request_image_bytes:,} bytes together", param=ref.where,
                           code="image_too_large")


def _refused(ref: ImageRef, why: str, code: str = "image_url_refused") -> APIError:
    return APIError(400, f"{ref.where}: {why}", param=ref.where, code=code)


async def _checked_addresses(ref: ImageRef, url: URL, policy: RemoteImagePolicy) -> list[ResolveResult]:
    host, port = url.raw_host, url.port
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError) as e:
        raise _refused(ref, f"the image URL's host {host!r} could not be resolved ({e})") from None
    results = []
    for family, _, proto, _, sockaddr in infos:
        address = sockaddr[0]
        why = None if policy.allow_private_addresses else forbidden_address(address)
        if why is not None:
            raise _refused(ref, f"the image URL's host {host!r} is at {address.split('%', 1)[0]}, a {why} address; "
                                "images are fetched from public addresses only", code="image_address_not_allowed")
        results.append(ResolveResult(hostname=host, host=address, port=port, family=family, proto=proto,
                                     flags=socket.AI_NUMERICHOST))
    if not results:
        raise _refused(ref, f"the image URL's host {host!r} has no address")
    return results


def _checked_url(ref: ImageRef, text: str | URL, policy: RemoteImagePolicy) -> URL:
    try:
        url = text if isinstance(text, URL) else URL(text)
    except (ValueError, TypeError):
        raise _refused(ref, "the image URL is not a valid URL") from None
    if url.scheme not in ("http", "https") or not url.raw_host:
        raise _refused(ref, "an image URL must be http(s)://host/... or a data: URL")
    if url.user is not None or url.password is not None:
        raise _refused(ref, "an image URL may not carry credentials (user:password@)")
    if not policy.allows(url.raw_host):
        raise _refused(ref, f"images are not fetched from {url.raw_host!r}: it is not among the hosts this server's "
                            "operator allows (--allowed-media-domains); send the image inline as a data: URL",
                       code="image_host_not_allowed")
    return url


def _joined(url: URL, location: str) -> str:
    try:
        return str(url.join(URL(location)))
    except (ValueError, TypeError):
        return location  # refused by _checked_url, naming the part


async def _fetch(ref: ImageRef, policy: RemoteImagePolicy, limits: ImageLimits, budget: _Budget) -> bytes:
    url = _checked_url(ref, ref.url, policy)
    for _ in range(MAX_REDIRECTS + 1):
        results = await _checked_addresses(ref, url, policy)
        async with pinned_session(url.raw_host, results) as session:
            try:
                async with session.get(url, allow_redirects=False,
                                       headers={"Accept": "image/*", "Accept-Encoding": "identity"}) as reply:
                    if reply.status in (301, 302, 303, 307, 308) and "Location" in reply.headers:
                        url = _checked_url(ref, _joined(url, reply.headers["Location"]), policy)
                        continue
                    if reply.status != 200:
                        raise _refused(ref, f"fetching the image URL answered HTTP {reply.status}",
                                       code="image_fetch_failed")
                    if reply.content_length is not None and reply.content_length > limits.max_image_bytes:
                        budget.take(ref, 0, reply.content_length)
                    chunks, size = [], 0
                    async for chunk in reply.content.iter_chunked(1 << 16):
                        size += len(chunk)
                        budget.take(ref, len(chunk), size)
                        chunks.append(chunk)
                    return b"".join(chunks)
            except aiohttp.ClientError as e:
                raise _refused(ref, f"the image URL could not be fetched ({type(e).__name__}: {e})",
                               code="image_fetch_failed") from None
    raise _refused(ref, f"the image URL redirected more than {MAX_REDIRECTS} times", code="image_fetch_failed")


async def fetch_images(refs: list[ImageRef], policy: RemoteImagePolicy | None, limits: ImageLimits
                       ) -> dict[str, bytes]:
    """The encoded bytes of each remote image part of ``refs`` (by its place, ``ImageRef.where``), fetched at once
    under ``policy``'s deadline and ``limits``' bytes; a 400 naming the first part refused (a part still arriving
    at the deadline is refused as too slow). ``policy`` None, or one listing no hosts: remote URLs are off."""
    if len(refs) > limits.max_images:
        return {}  # nothing fetched: decode_images refuses the part past the count
    remote = [r for r in refs if remote_scheme(r.url)]
    if not remote:
        return {}
    if policy is None or not policy.allowed_domains:
        raise _refused(remote[0], "remote image URLs are off on this server (it fetches nothing); send the image "
                                  "inline as a data: URL (data:image/png;base64,...)", code="remote_image_url")
    budget = _Budget(limits)
    tasks = [asyncio.ensure_future(_fetch(r, policy, limits, budget)) for r in remote]
    try:
        done, pending = await asyncio.wait(tasks, timeout=policy.timeout_s, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # a request that failed, or went away, fetches nothing more
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if task in done and task.exception() is not None:
            raise task.exception()
    for ref, task in zip(remote, tasks):
        if task not in done:
            raise _refused(ref, f"the image URL did not answer in time (a request's remote images have "
                                f"{policy.timeout_s:g} s to arrive together)", code="image_fetch_timeout")
    return {ref.where: task.result() for ref, task in zip(remote, tasks)}

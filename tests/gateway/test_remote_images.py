"""The remote image guard's pieces without a server: which addresses are refused (IANA's special-purpose
registries, written out here), how ``--allowed-media-domains`` is read and matched, and that remote URLs are off
without a list. The fetches themselves run against a local server in ``tests/gateway/media_api_cases.py``."""

import asyncio

import pytest

from gateway.chat_images import ImageLimits, ImageRef
from gateway.errors import APIError
from gateway.remote_images import RemoteImagePolicy, fetch_images, forbidden_address, parse_domains

REFUSED = {
    "127.0.0.1": "loopback", "127.255.0.9": "loopback", "::1": "loopback",
    "169.254.169.254": "link-local", "fe80::1%eth0": "link-local",
    "10.0.0.1": "private", "172.16.5.4": "private", "192.168.1.1": "private", "fd00::1": "private",
    "0.0.0.0": "unspecified", "::": "unspecified",
    "224.0.0.1": "multicast", "ff02::1": "multicast", "240.0.0.1": "reserved",
    "100.64.0.1": "not public",  # shared address space (carrier-grade NAT)
    "::ffff:127.0.0.1": "loopback", "::ffff:169.254.169.254": "link-local",  # IPv4 in IPv6 forms
    "2002:a9fe:a9fe::": "link-local",  # 6to4 of 169.254.169.254
}
PUBLIC = ("8.8.8.8", "1.1.1.1", "93.184.215.14", "2606:4700:4700::1111", "::ffff:8.8.8.8")


def test_addresses_refused_and_public():
    for address, kind in REFUSED.items():
        assert forbidden_address(address) == kind, address
    for address in PUBLIC:
        assert forbidden_address(address) is None, address


def test_allowed_domains_are_read_and_matched():
    domains = parse_domains(" Images.Example.com, *.cdn.example.net ,,")
    assert domains == ("images.example.com", "*.cdn.example.net")
    policy = RemoteImagePolicy(domains)
    for host, allowed in {"images.example.com": True, "IMAGES.example.com.": True, "x.images.example.com": False,
                          "example.com": False, "a.cdn.example.net": True, "a.b.cdn.example.net": True,
                          "cdn.example.net": False, "evilcdn.example.net": False}.items():
        assert policy.allows(host) is allowed, host
    assert parse_domains(None) == parse_domains(" ") == ()
    for bad in ("https://images.example.com", "images.example.com:8080", "*", "a/b", "user@host"):
        with pytest.raises(ValueError, match="--allowed-media-domains"):
            parse_domains(bad)


def test_remote_urls_are_off_without_a_list():
    refs = [ImageRef("messages[0].content[0]", "data:image/png;base64,AAAA"),
            ImageRef("messages[0].content[1]", "https://images.example.com/cat.png")]
    for policy in (None, RemoteImagePolicy()):
        with pytest.raises(APIError) as info:
            asyncio.run(fetch_images(refs, policy, ImageLimits()))
        assert info.value.status == 400 and info.value.param == "messages[0].content[1]"
        assert "remote image URLs are off" in info.value.message
    # Past the image count nothing is fetched (decode_images then refuses the part past it).
    assert asyncio.run(fetch_images(refs, RemoteImagePolicy(("images.example.com",)), ImageLimits(max_images=1))) == {}

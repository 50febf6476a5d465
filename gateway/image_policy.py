"""The limits a request's images are read under: the server's (``moegate serve --max-images-per-request``,
``--max-image-pixels``), tightened by the request's tenant's quota (``moegate admin quota set NAME
--max-images-per-request N --max-image-pixels N``; none: the server's). A tenant's limit can only tighten the
server's: the lower of the two applies, and a refusal says whose limit it was
(``gateway.chat_images.decode_images``). The tenant's limits come through the quota manager's policy cache, so a
change applies within ``policy_cache_ttl_s``, and a request without images never asks for them."""

from collections.abc import Awaitable, Callable

from aiohttp import web

from gateway.chat_images import ImageLimits
from gateway.config import GatewayConfig
from tenants.quota import QuotaManager

IMAGE_LIMITS = web.AppKey("image_limits", ImageLimits)  # the server's, from its flags


def server_image_limits(config: GatewayConfig) -> ImageLimits:
    return ImageLimits(max_images=config.max_images_per_request, max_image_pixels=config.max_image_pixels)


async def tenant_image_limits(quotas: QuotaManager, server: ImageLimits, tenant_id: int) -> ImageLimits:
    """``server`` under tenant ``tenant_id``'s own image limits, read through the policy cache."""
    quota = await quotas.limits(tenant_id)
    return server.for_tenant(quota.max_images_per_request, quota.max_image_pixels)


def image_limits_for(quotas: QuotaManager, server: ImageLimits,
                     tenant_id: int) -> Callable[[], Awaitable[ImageLimits]]:
    """What ``gateway.pipeline.run`` asks (``image_limits``) for a request of tenant ``tenant_id``."""
    return lambda: tenant_image_limits(quotas, server, tenant_id)

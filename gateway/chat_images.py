"""A chat request's images: its ``image_url`` content parts checked, decoded and sized in the gateway, so the
engine only ever gets bytes that are an image of a size it takes, with the prompt's placeholders expanded to fit.

Inline ``data:`` URLs are read here; remote (http, https) URLs are fetched by ``gateway.remote_images`` for the
hosts the operator allows (none by default: refused, never fetched), and their bytes checked here as an inline
image's are. Each image is
decoded on a worker thread (never on the event loop), under ``ImageLimits``: encoded bytes per image and per
request, decoded pixels per image (a decompression bomb is refused from its header, before its pixels are read)
and images per request. Every refusal is a 400 naming the content part (``messages[0].content[1]``).
"""

import base64
import binascii
import functools
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from types import MappingProxyType, SimpleNamespace

from engine.core.model_config import IMAGE_ARCHITECTURES, VISION_CONFIG_IMAGE_ARCHITECTURES, serves_images
from engine.vision.image_files import ImageConfig, PixelLimitError, decode_image, image_config_for
from gateway.errors import APIError

MIB = 1024 * 1024


@dataclass(frozen=True)
class ImageLimits:
    """What a request's images may take in the gateway: the server's (``GatewayConfig.max_images_per_request``,
    ``max_image_pixels``), or a tenant's tighter ones (``for_tenant``). ``tenant_images`` / ``tenant_pixels``: the
    count or the pixel limit is the tenant's own, which its refusals say."""

    max_image_bytes: int = 20 * MIB  # one image, encoded
    max_request_image_bytes: int = 50 * MIB  # all of a request's images, encoded
    max_image_pixels: int = 4096 * 4096  # one image, decoded (width x height, read from its header first)
    max_images: int = 16  # per request
    tenant_images: bool = False
    tenant_pixels: bool = False

    def for_tenant(self, max_images: int | None, max_pixels: int | None) -> "ImageLimits":
        """These limits under a tenant's own (its quota's ``max_images_per_request`` and ``max_image_pixels``;
        None: none): the lower of each applies, so a tenant's limit can only tighten the server's."""
        tighter_images = max_images is not None and max_images < self.max_images
        tighter_pixels = max_pixels is not None and max_pixels < self.max_image_pixels
        if not (tighter_images or tighter_pixels):
            return self
        return replace(self, max_images=max_images if tighter_images else self.max_images,
                       max_image_pixels=max_pixels if tighter_pixels else self.max_image_pixels,
                       tenant_images=tighter_images, tenant_pixels=tighter_pixels)

    def whose(self, tenant: bool) -> str:
        return "this API key's tenant's limit" if tenant else "this server's limit"


DEFAULT_IMAGE_LIMITS = ImageLimits()


@dataclass(frozen=True)
class ImageRef:
    """One image part of a chat request: where it is (``messages[i].content[j]``) and its URL."""

    where: str
    url: str


@dataclass(frozen=True)
class ImageModel:
    """What the gateway needs of a model that reads images: its placeholder token and its processor's settings
    (the image's token count follows from its size: Qwen-VL's ``smart_resize``, Kimi-K2.5's ``navit_resize``)."""

    image_token_id: int
    config: ImageConfig

    def num_tokens(self, width: int, height: int) -> int:
        """Placeholder tokens an image of this size takes: grid_t * grid_h * grid_w / merge_size**2 (grid_t 1)."""
        grid_h, grid_w = self.config.grid(height, width)
        return grid_h * grid_w // (self.config.merge_size * self.config.merge_size)


@functools.lru_cache(maxsize=8)
def _image_model_at(model_dir: str, architecture: str, language_model_only: bool) -> ImageModel | None:
    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
    except (OSError, ValueError):
        return None
    vision = raw.get("vision_config")
    if not serves_images(architecture, raw, language_model_only) or not isinstance(vision, dict) \
            or raw.get("image_token_id") is None:
        return None
    defaults = {"patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2}
    vision_config = SimpleNamespace(**{**defaults, **vision})
    return ImageModel(int(raw["image_token_id"]), image_config_for(model_dir, vision_config))


def image_model_of(engine) -> ImageModel | None:
    """The served model's image settings; None for a model that reads text only (or an engine not started)."""
    info = getattr(engine, "info", None)
    if info is None or info.architecture not in (*IMAGE_ARCHITECTURES, *VISION_CONFIG_IMAGE_ARCHITECTURES):
        return None
    return _image_model_at(engine.config.model, info.architecture, engine.config.language_model_only)


def refuse_if_text_only(engine, refs: list[ImageRef]) -> ImageModel | None:
    """The model's image settings if ``refs`` is not empty; a 400 naming the first image part if it reads text only."""
    if not refs:
        return None
    model = image_model_of(engine)
    if model is None:
        architecture = engine.info.architecture if getattr(engine, "info", None) is not None else "this model"
        raise APIError(400, f"{refs[0].where}: {architecture} reads text only; send the message without images",
                       param=refs[0].where, code="images_not_supported")
    return model


@dataclass(frozen=True)
class DecodedImage:
    """An image part read and checked: its encoded bytes (what the engine decodes again) and its token count."""

    data: bytes
    num_tokens: int


_DATA_URL = re.compile(r"data:(?P<type>[^,;]*)(?P<params>(;[^,;]*)*),", re.IGNORECASE)


def remote_scheme(url: str) -> bool:
    """Whether ``url`` is a remote (http, https) URL rather than inline data."""
    return url[:8].lower().startswith(("http://", "https://"))


def _encoded(ref: ImageRef, limits: ImageLimits, fetched: Mapping[str, bytes]) -> bytes:
    url = ref.url
    if ref.where in fetched:
        return fetched[ref.where]
    if remote_scheme(url):
        raise APIError(400, f"{ref.where}: remote image URLs are off on this server (it fetches nothing); send the "
                            "image inline as a data: URL (data:image/png;base64,...)", param=ref.where,
                       code="remote_image_url")
    head = _DATA_URL.match(url)
    if head is None:
        raise APIError(400, f"{ref.where}: an image URL must be a data: URL (data:image/png;base64,...)",
                       param=ref.where)
    media, params = head.group("type").lower(), head.group("params").lower().split(";")
    if media and not media.startswith("image/"):
        raise APIError(400, f"{ref.where}: a data: URL of {media!r} is not an image", param=ref.where)
    if "base64" not in params:
        raise APIError(400, f"{ref.where}: the image's data: URL must be base64 (data:image/png;base64,...)",
                       param=ref.where)
    text = url[head.end():]
    if len(text) // 4 * 3 > limits.max_image_bytes:  # refused by the text's size, before decoding it
        raise APIError(400, f"{ref.where}: the image is over {limits.max_image_bytes:,} bytes", param=ref.where)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise APIError(400, f"{ref.where}: the image's data is not valid base64", param=ref.where) from None


def decode_images(refs: list[ImageRef], model: ImageModel, limits: ImageLimits = DEFAULT_IMAGE_LIMITS,
                  fetched: Mapping[str, bytes] = MappingProxyType({})) -> list[DecodedImage]:
    """Each image part read, fully decoded once (so the engine never gets a truncated or corrupt image) and sized;
    a 400 naming the first part that is refused. ``fetched``: the bytes of remote parts, by place
    (``gateway.remote_images.fetch_images``); a remote part not there is refused. Blocking: run it on a worker
    thread."""
    if len(refs) > limits.max_images:
        where = refs[limits.max_images].where
        most = f"{limits.max_images} image" + ("" if limits.max_images == 1 else "s")
        raise APIError(400, f"{where}: a request may carry at most {most} ({limits.whose(limits.tenant_images)}); "
                            f"this one has {len(refs)}", param=where, code="too_many_images")
    out, total = [], 0
    for ref in refs:
        data = _encoded(ref, limits, fetched)
        if len(data) > limits.max_image_bytes:
            raise APIError(400, f"{ref.where}: the image is over {limits.max_image_bytes:,} bytes", param=ref.where)
        total += len(data)
        if total > limits.max_request_image_bytes:
            raise APIError(400, f"{ref.where}: the request's images are over {limits.max_request_image_bytes:,} "
                                "bytes together", param=ref.where)
        try:
            image = decode_image(data, limits.max_image_pixels)
        except PixelLimitError as e:
            raise APIError(400, f"{ref.where}: {e} ({limits.whose(limits.tenant_pixels)})", param=ref.where,
                           code="image_too_large") from None
        except ValueError as e:
            raise APIError(400, f"{ref.where}: {e}", param=ref.where) from None
        with image:
            try:
                num_tokens = model.num_tokens(*image.size)
            except ValueError as e:  # an aspect ratio Qwen refuses
                raise APIError(400, f"{ref.where}: {e}", param=ref.where) from None
        out.append(DecodedImage(data, num_tokens))
    return out


def expand_placeholders(ids: list[int], image_token_id: int, images: list[DecodedImage]) -> list[int]:
    """The prompt with each image's one placeholder (written by the chat template) repeated to its token count.

    Client text never holds the placeholder token (``engine.text.control_tokens`` keeps it text), so the
    template's are the only ones; a template that did not write one per image is a 400."""
    at = [i for i, t in enumerate(ids) if t == image_token_id]
    if len(at) != len(images):
        raise APIError(400, f"the model's chat template placed {len(at)} image placeholders for {len(images)} "
                            "images; send images in user messages", param="messages")
    out, start = [], 0
    for i, image in zip(at, images):
        out += ids[start:i]
        out += [image_token_id] * image.num_tokens
        start = i + 1
    return out + ids[start:]

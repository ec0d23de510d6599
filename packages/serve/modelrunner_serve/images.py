"""Images in chat messages: ``data:`` URLs (base64 PNG, JPEG, …) decoded into PIL images.

The server fetches nothing over the network: an ``http(s)://`` URL is refused, saying so.
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from typing import Any

from .errors import bad_request

MAX_IMAGE_PIXELS = 64_000_000
"""Largest image accepted (width × height), checked before its pixels are decoded."""

_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


def decode_data_url(url: Any, param: str) -> Any:
    """The image a ``data:`` URL holds, fully decoded, as an RGB ``PIL.Image``.

    :param param: the request field it came from (named by every error).
    :raises APIError: 400 for anything that is not a base64 ``data:image/...`` URL of a readable image.
    """
    if not isinstance(url, str) or not url:
        raise bad_request(f"{param} must be a data: URL string (data:image/png;base64,...)", param=param)
    if url.startswith(("http://", "https://")):
        raise bad_request(f"{param}: this server fetches no URLs; send the image inline as a base64 data: URL "
                          "(data:image/png;base64,...)", param=param, code="unsupported")
    match = _DATA_URL.match(url)
    if match is None or not match.group("b64"):
        raise bad_request(f"{param} must be a base64 data: URL (data:image/png;base64,...), got "
                          f"{url[:40]!r}{'...' if len(url) > 40 else ''}", param=param)
    mime = (match.group("mime") or "").lower()
    if mime and not mime.startswith("image/"):
        raise bad_request(f"{param}: the data: URL holds {mime!r}, not an image (accepted: image/png, image/jpeg, "
                          "image/webp, image/gif, ...)", param=param)
    try:
        data = base64.b64decode(url[match.end():], validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{param}: the data: URL's payload is not valid base64", param=param) from None
    return _open(data, param)


def _open(data: bytes, param: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise bad_request(f"{param}: the data is not an image Pillow can read (PNG, JPEG, WebP, GIF, ...)",
                          param=param) from None
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise bad_request(f"{param}: cannot read the image ({e})", param=param) from None
    width, height = image.size
    if width * height > MAX_IMAGE_PIXELS:
        raise bad_request(f"{param}: the image is {width}x{height} pixels; accepted: at most "
                          f"{MAX_IMAGE_PIXELS} pixels", param=param)
    try:
        image.load()
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise bad_request(f"{param}: the image is damaged or truncated ({e})", param=param) from None


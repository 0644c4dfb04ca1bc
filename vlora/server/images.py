"""Check the images of a request: where they may come from, how large, whether they decode.

Accepted sources: ``data:image/...;base64,...`` URIs, and local files (``file://``
URLs or plain paths) inside the configured image directory. Remote URLs are not
fetched. Size limits are checked before decoding (bytes from the base64 length or
the file size, pixels from the image header), so an oversized image costs nothing.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import warnings
from dataclasses import dataclass
from urllib.parse import unquote, urlparse


class ImageError(ValueError):
    """An image was refused; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    image_dir: str | None


def load_image(url: str, limits: ImageLimits):
    """Fetch, check and decode one image; returns a PIL image or raises ImageError."""
    return _decode(_read(url, limits), limits)


def _read(url: str, limits: ImageLimits) -> bytes:
    if url.startswith("data:"):
        header, sep, payload = url[5:].partition(",")
        if not sep:
            raise ImageError("malformed data: URI (no comma)")
        mime, *params = header.split(";")
        if "base64" not in params:
            raise ImageError("data: URI images must be base64-encoded (data:image/png;base64,...)")
        if mime and not mime.lower().startswith("image/"):
            raise ImageError(f"data: URI has media type {mime!r}, not an image")
        if len(payload) * 3 // 4 > limits.max_bytes + 3:
            raise ImageError(f"image is larger than {limits.max_bytes} bytes", 413)
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError("image data is not valid base64") from None
        if len(data) > limits.max_bytes:
            raise ImageError(f"image is larger than {limits.max_bytes} bytes", 413)
        return data
    parsed = urlparse(url)
    if parsed.scheme in ("http", "https"):
        raise ImageError("remote image URLs are not fetched by this server; send the image as a data: URI")
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ImageError("file:// URLs must name a local path")
        path = unquote(parsed.path)
    elif parsed.scheme and len(parsed.scheme) > 1:         # (one letter: a Windows drive)
        raise ImageError(f"unsupported image URL scheme {parsed.scheme!r}; use a data: URI")
    else:
        path = url
    return _read_file(path, limits)


def _read_file(path: str, limits: ImageLimits) -> bytes:
    if "\x00" in path:
        raise ImageError("image path must not contain a NUL character")
    if limits.image_dir is None:
        raise ImageError("local image files are disabled on this server (no --image-dir); send a data: URI", 403)
    root = os.path.realpath(limits.image_dir)
    full = os.path.realpath(os.path.join(root, path))       # an absolute path replaces root
    if os.path.commonpath([root, full]) != root:
        raise ImageError("image path is outside the server's image directory", 403)
    try:
        size = os.path.getsize(full)
        if size > limits.max_bytes:
            raise ImageError(f"image is larger than {limits.max_bytes} bytes", 413)
        with open(full, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        raise ImageError("image file not found", 404) from None
    except OSError as e:
        raise ImageError(f"image file cannot be read ({e.strerror})") from None


def _decode(data: bytes, limits: ImageLimits):
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            im = Image.open(io.BytesIO(data))
            w, h = im.size
            if w * h > limits.max_pixels:
                raise ImageError(f"image is {w}x{h} = {w * h} pixels; the limit is {limits.max_pixels}", 413)
            im.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise ImageError(f"image has too many pixels (limit {limits.max_pixels})", 413) from None
    except Exception as e:      # PIL raises UnidentifiedImageError, OSError, SyntaxError, ValueError, ...
        raise ImageError(f"image cannot be decoded ({type(e).__name__}: {e})") from None
    return im

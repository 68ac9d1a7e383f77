"""Which HTTP proxy, if any, the standard environment sets for an S3 endpoint.

The same rule botocore follows for the daemon's own requests (listing, HEAD):
``https_proxy``/``HTTPS_PROXY`` for an https endpoint, ``http_proxy``/
``HTTP_PROXY`` for an http one (``ALL_PROXY`` is not read), none when
``no_proxy``/``NO_PROXY`` names the endpoint's host (a suffix, an address,
``host:port``, or ``*``). So the range workers' GETs take the path the control
plane takes, and one variable moves both.

A proxy given without a scheme (``proxy:3128``) is ``http://proxy:3128``, as
botocore reads it. One the range workers cannot use (an ``https://`` proxy, a
path, a bad port, control characters) is refused here, in the daemon, with a
message that never repeats its credentials.
"""

from __future__ import annotations

import contextlib
import urllib.parse
import urllib.request

from agent._exceptions import SourceUnavailable
from agent.source.range_worker import Proxy

__all__ = ["proxy_for"]


def proxy_for(endpoint_url: str) -> str | None:
    """The proxy URL for ``endpoint_url`` (HTTPS_PROXY/HTTP_PROXY less NO_PROXY), or None.

    SourceUnavailable when the environment names a proxy the range workers cannot use.
    """
    parts = urllib.parse.urlsplit(endpoint_url)
    scheme = (parts.scheme or "https").lower()
    netloc = parts.netloc.rpartition("@")[2]
    if netloc and _bypassed(netloc):
        return None
    proxy = urllib.request.getproxies().get(scheme)
    if not proxy:
        return None
    if "://" not in proxy:
        proxy = f"http:{proxy}" if proxy.startswith("//") else f"http://{proxy}"
    try:
        Proxy.parse(proxy)
    except ValueError as exc:
        variable = f"{scheme.upper()}_PROXY"
        raise SourceUnavailable(
            f"The proxy that {variable} (or {variable.lower()}) sets for {scheme}://{netloc} "
            f"cannot carry S3's GETs: {exc}. Set it to http://[user:password@]host:port, or "
            "name the endpoint in NO_PROXY."
        ) from None
    return proxy


def _bypassed(netloc: str) -> bool:
    """Whether NO_PROXY names ``netloc`` (``host`` or ``host:port``), as botocore asks it."""
    # proxy_bypass reads the environment on Linux; elsewhere it may ask the system, and fail.
    with contextlib.suppress(TypeError, OSError):
        return bool(urllib.request.proxy_bypass(netloc))
    return False

"""A dataset by its HuggingFace hub name, on a machine that may not reach the hub.

Behind a firewall or on a cluster's compute nodes, `datasets.load_dataset("wmt14", ...)` retried
each request five times with back-off before it gave up: half a minute of "Retrying in 8s" lines
before the one that mattered. One connection to the hub, with a short timeout, tells first; when it
fails, the load runs in the libraries' offline mode (what HF_HUB_OFFLINE=1 sets), which reads a
dataset cached by an earlier download at once, and a dataset that is not cached is one line saying so.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import urllib.request
from collections.abc import Iterator
from urllib.parse import urlsplit

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 3.0  # a reachable hub answers in well under a second; a firewall that drops waits for this


def hub_unreachable() -> str | None:
    """Why the hub cannot be reached from here (the host tried and the socket's error), or None when
    it can. Behind a proxy (HTTPS_PROXY, unless NO_PROXY exempts the hub), the proxy is what must
    answer: a network that lets nothing else out still reaches the hub through it."""
    import huggingface_hub.constants

    hub = urlsplit(huggingface_hub.constants.ENDPOINT)
    proxy = None if urllib.request.proxy_bypass(hub.hostname) else urllib.request.getproxies().get(hub.scheme)
    if proxy and "://" not in proxy:
        proxy = f"http://{proxy}"  # HTTPS_PROXY=host:port, as curl takes it
    address = urlsplit(proxy) if proxy else hub
    port = address.port or (443 if address.scheme == "https" else 80)
    try:
        socket.create_connection((address.hostname, port), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as error:
        through = f" (the proxy for {hub.hostname})" if proxy else ""
        return f"{address.hostname}{through}: {error.strerror or error}"
    return None


def _offline_already() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


@contextlib.contextmanager
def offline_unless_reachable(name: str) -> Iterator[str | None]:
    """Within: the hub's libraries are offline when the hub cannot be reached. Yields why it cannot
    (None: it can, or offline mode was set by the user) for the caller's message if the load fails."""
    import datasets.config
    import huggingface_hub.constants

    if _offline_already():
        yield None
        return
    reason = hub_unreachable()
    if reason is None:
        yield None
        return
    log.warning("the HuggingFace hub cannot be reached (%s): %s is read from the local cache only", reason, name)
    modules = (datasets.config, huggingface_hub.constants)
    before = [module.HF_HUB_OFFLINE for module in modules]
    for module in modules:
        module.HF_HUB_OFFLINE = True
    try:
        yield reason
    finally:
        for module, value in zip(modules, before):
            module.HF_HUB_OFFLINE = value

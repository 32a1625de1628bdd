"""Process groups a schedule creates once per process and reuses: their factories are cached
with :func:`cached_groups`, and :func:`forget_all` empties every such cache.

``new_group`` is collective (every rank of the world calls it, in the same order), so a
schedule that builds its groups on first use keeps them for the process's lifetime. When the
groups are destroyed (:func:`megatron.plugin.launch.reset`, before the next layout of a test
launch) the caches must forget them too, or a later call would hand out a destroyed group.
"""
from __future__ import annotations

import functools
from typing import Callable

_CACHES: list = []


def cached_groups(maxsize: int) -> Callable:
    """``functools.lru_cache(maxsize)`` for a function that creates process groups, registered
    for :func:`forget_all`."""
    def decorate(factory):
        cached = functools.lru_cache(maxsize=maxsize)(factory)
        _CACHES.append(cached)
        return cached
    return decorate


def forget_all() -> None:
    """Empty the cache of every factory decorated with :func:`cached_groups`."""
    for cached in _CACHES:
        cached.cache_clear()

"""Prefix-cache keying: the adapter incarnation and the namespace are part of the key."""

from __future__ import annotations

from engines.local.prefix_cache import PrefixCache


def test_longest_prefix_of_the_same_adapter_and_namespace() -> None:
    cache: PrefixCache[str] = PrefixCache(8)
    cache.store("id-a", "", (1, 2, 3), "short")
    cache.store("id-a", "", (1, 2, 3, 4, 5), "long")
    hit = cache.lookup("id-a", "", (1, 2, 3, 4, 5, 6))
    assert hit is not None and (hit.state, hit.usable) == ("long", 5)


def test_last_prompt_token_is_never_served_from_cache() -> None:
    cache: PrefixCache[str] = PrefixCache(8)
    cache.store("id-a", "", (1, 2, 3), "s")
    hit = cache.lookup("id-a", "", (1, 2, 3))
    assert hit is not None and hit.usable == 2
    assert cache.lookup("id-a", "", (1,)) is None


def test_other_adapter_or_namespace_never_hits() -> None:
    cache: PrefixCache[str] = PrefixCache(8)
    cache.store("id-a", "", (1, 2, 3, 4), "a")
    assert cache.lookup("id-b", "", (1, 2, 3, 4)) is None
    assert cache.lookup("id-a", "salt", (1, 2, 3, 4)) is None
    # a namespace equal to another adapter's id cannot reach it (SGLang #24638)
    assert cache.lookup("__base__", "id-a", (1, 2, 3, 4)) is None


def test_invalidate_and_lru_bound() -> None:
    cache: PrefixCache[str] = PrefixCache(2)
    cache.store("id-a", "", (1, 2), "a1")
    cache.store("id-b", "", (1, 2), "b1")
    assert cache.invalidate("id-a") == 1
    assert cache.lookup("id-a", "", (1, 2, 3)) is None
    cache.store("id-c", "", (1, 2), "c1")
    cache.store("id-d", "", (1, 2), "d1")
    assert len(cache) == 2
    assert cache.lookup("id-b", "", (1, 2, 3)) is None  # evicted, oldest first
    disabled: PrefixCache[str] = PrefixCache(0)
    disabled.store("id-a", "", (1, 2), "x")
    assert disabled.lookup("id-a", "", (1, 2, 3)) is None

"""The test suite's own machinery: the compilation cache it shares between runs."""

from __future__ import annotations

import os

from conftest import jax_cache_dir, prune_cache


def test_prune_cache_drops_least_recently_used_entries_first(tmp_path):
    for i, name in enumerate(["old", "mid", "new"]):
        path = tmp_path / name
        path.write_bytes(b"x" * 100)
        os.utime(path, (1000 + i, 1000 + i))
    prune_cache(tmp_path, 250)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mid", "new"]
    prune_cache(tmp_path, 1000)  # within the bound: nothing goes
    assert len(list(tmp_path.iterdir())) == 2
    prune_cache(tmp_path, 0)
    assert list(tmp_path.iterdir()) == []


def test_cache_dir_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert jax_cache_dir() == tmp_path / "scalescope" / "jax-cache"
    assert jax_cache_dir().is_dir()

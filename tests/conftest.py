"""Shared fixtures: `dist2` / `dist3` / `dist4` are session-wide pools of 2 / 3 / 4 gloo ranks (see launcher.py)."""
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from launcher import RankPool  # noqa: E402


def _pool(world_size):
    pool = RankPool(world_size)
    yield pool
    pool.close(kill=True)


@pytest.fixture(scope="session")
def dist2():
    """RankPool of 2 ranks: `dist2.run(fn, *args)` -> [fn(rank, 2, *args) for each rank]."""
    yield from _pool(2)


@pytest.fixture(scope="session")
def dist3():
    """RankPool of 3 ranks (a degree that divides few sizes): `dist3.run(fn, *args)`."""
    yield from _pool(3)


@pytest.fixture(scope="session")
def dist4():
    """RankPool of 4 ranks: `dist4.run(fn, *args)` -> [fn(rank, 4, *args) for each rank]."""
    yield from _pool(4)

"""The rank pool reports a failing rank with its traceback and recovers after failures and timeouts."""
import time

import pytest

from launcher import RankError


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError(f"boom on {rank} of {world_size}")
    return rank


def _sleep_on_rank_zero(rank, world_size, seconds):
    if rank == 0:
        time.sleep(seconds)
    return rank


def _unpicklable(rank, world_size):
    import types
    return types.MappingProxyType({"rank": rank})


def _ranks(rank, world_size):
    return (rank, world_size)


def test_failure_carries_rank_and_traceback_then_pool_recovers(dist2):
    with pytest.raises(RankError, match=r"(?s)_fail_on_rank_one failed on rank\(s\) \[1\].*--- rank 1 ---.*"
                                        r"ValueError: boom on 1 of 2"):
        dist2.run(_fail_on_rank_one)
    assert dist2.run(_ranks) == [(0, 2), (1, 2)]


def test_timeout_kills_and_rebuilds(dist2):
    with pytest.raises(TimeoutError, match="_sleep_on_rank_zero did not finish"):
        dist2.run(_sleep_on_rank_zero, 5.0, timeout=1.0)
    assert dist2.run(_ranks) == [(0, 2), (1, 2)]


def test_unpicklable_result_is_reported_at_once(dist2):
    t0 = time.monotonic()
    with pytest.raises(RankError, match=r"(?s)_unpicklable failed.*cannot pickle 'mappingproxy'"):
        dist2.run(_unpicklable, timeout=60)
    assert time.monotonic() - t0 < 30        # reported by the rank, not by the timeout
    assert dist2.run(_ranks) == [(0, 2), (1, 2)]

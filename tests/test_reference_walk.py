"""The one reference walk (patcher/verify/judge/acceptance/reference_decode.py: ``walk``, ``floor``): verify's decoders
count rounds as upstream's loops do, the referee's engines as an engine does (``engine=True``); the referee calls it
(``referee/run.judge_prompt``), so both are checked here against the walks spelled out."""

from __future__ import annotations

import random

from patcher.verify.judge.acceptance.reference_decode import floor, walk


def _upstream_walk(at, n, stop_at=None):
    """Upstream's loop, spelled out: every round runs its whole block until n tokens are decided."""
    s, out = 0, []
    while s < n:
        out.append(at[s])
        if stop_at is not None and s < stop_at <= s + at[s]:
            break
        s += at[s]
    return out


def _engine_walk(at, n, stop_at=None):
    """An engine's loop, spelled out: the prefill decides the first token; a round commits at most the tokens left
    minus one; with fewer than two left the engine decodes plainly (no round)."""
    s, out = 0, []
    while n - 1 - s >= 2:
        a = min(at[s], n - 1 - s)
        out.append(a)
        if stop_at is not None and s < stop_at <= s + a:
            break
        s += a
    return out


def _lowest_by_search(reachable, n, stop_at, engine, pick=min):
    """Every decode enumerated (small n only): the lowest (``pick=max``: highest) mean of its rounds."""
    means = []

    def go(s, rounds):
        if (engine and n - 1 - s < 2) or (not engine and s >= n):
            if rounds:
                means.append(sum(rounds) / len(rounds))
            return
        for a in set(reachable[s]):
            a = min(a, n - 1 - s) if engine else a
            if stop_at is not None and s < stop_at <= s + a:
                means.append(sum(rounds + [a]) / len(rounds + [a]))
            else:
                go(s + a, rounds + [a])

    go(0, [])
    return pick(means) if means else None


def _cases(count=300, seed=7):
    rng = random.Random(seed)
    for _ in range(count):
        n = rng.randint(1, 12)
        reachable = [sorted({rng.randint(1, 5) for _ in range(rng.randint(1, 3))}) for _ in range(n)]
        stop_at = rng.choice([None, rng.randint(0, n)])
        yield n, reachable, stop_at, [r[0] for r in reachable]


def test_the_door_walks_as_the_referee_and_as_upstream_do():
    for n, _reachable, stop_at, at in _cases():
        assert walk(at, n, stop_at, engine=True) == _engine_walk(at, n, stop_at)
        assert walk(at, n, stop_at) == _upstream_walk(at, n, stop_at)


def test_the_floor_is_the_lowest_mean_of_any_decode():
    for n, reachable, stop_at, _ in _cases(150, seed=11):
        for engine in (False, True):
            for pick, lowest in ((min, True), (max, False)):  # the floor and the ceiling
                expected = _lowest_by_search(reachable, n, stop_at, engine, pick)
                got = floor(reachable, n, stop_at, engine=engine, lowest=lowest)
                assert (got is None and expected is None) or abs(got - expected) < 1e-12, (n, reachable, stop_at, engine)


def test_an_engine_decodes_its_last_token_plainly():
    assert walk([4, 4, 4, 4, 4], 5, engine=True) == [4]  # the prefill decided one; 4 left; a round commits them all
    assert walk([4, 4, 4, 4, 4], 5) == [4, 4]  # upstream's loop runs a whole block past the end
    assert floor([[1]] * 2, 2, engine=True) is None  # one token left after the prefill: no round at all

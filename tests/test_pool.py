"""readers.pool.map_unordered: every item once, bounded work in flight, errors on their turn, no thread left behind.

Real threads, no timing assertions: the bound is observed through a counter the function itself keeps.
"""

from __future__ import annotations

import threading

import pytest

from ckpt_audit.readers.pool import map_unordered


def _threads(name: str) -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(name)]


def test_every_item_once_with_its_result():
    out = list(map_unordered(lambda x: x * x, range(50), workers=3, name="t-all"))
    assert sorted(out) == [(i, i * i) for i in range(50)]
    assert _threads("t-all") == []


def test_at_most_twice_the_workers_in_flight_and_none_left_when_the_consumer_stops():
    started: list[int] = []
    gate = threading.Event()

    def slow(x: int) -> int:
        started.append(x)
        gate.wait(5)
        return x

    gen = map_unordered(slow, range(100), workers=2, name="t-bound")
    threading.Timer(0.2, gate.set).start()
    first = next(gen)
    gen.close()  # the consumer stops early: queued items are dropped, running ones finish
    assert first[0] in started
    assert len(started) <= 4 + 1  # 2*workers handed out, plus the one topped up after the first result
    assert _threads("t-bound") == []


def test_an_error_is_raised_on_its_turn_and_the_pool_winds_down():
    def fn(x: int) -> int:
        if x == 3:
            raise ValueError("bad item")
        return x

    seen = []
    with pytest.raises(ValueError, match="bad item"):
        for item, _ in map_unordered(fn, range(10), workers=1, name="t-err"):
            seen.append(item)
    assert seen == [0, 1, 2]  # one worker: completion order is item order
    assert _threads("t-err") == []


def test_no_items_no_work():
    assert list(map_unordered(lambda x: x, [], workers=4, name="t-none")) == []
    assert _threads("t-none") == []

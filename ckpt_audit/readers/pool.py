"""The file thread pool: one function over many files on a few threads, results as they complete.

Reading a checkpoint is I/O plus hashing, CRC and unpickling that mostly release the GIL, so a few threads keep the
disk and both cores busy. The scan (read_file), the prune survivor check and export's source check
(hashing.digest_files) and verify's deep checks all go through `map_unordered`, so they bound their work alike.

Plain threads and one condition rather than concurrent.futures: that package imports logging and traceback, a
tenth of `ckpt-audit scan`'s start-up before its first read (issue 16, bench/bench_startup.py).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_unordered(
    fn: Callable[[T], R], items: Iterable[T], *, workers: int = 2, name: str = "ckpt-read"
) -> Iterator[tuple[T, R]]:
    """(item, fn(item)) for each item, in completion order, on `workers` threads named `name`.

    At most 2*workers items are in flight (a long list does not become a long queue, and a consumer that stops
    early leaves little work behind: items not yet started are dropped, those running finish before it returns).
    An exception from `fn` is raised here, when its item's turn comes.
    """
    n = max(1, workers)
    it = iter(items)
    cond = threading.Condition()
    todo: deque[T] = deque()  # handed out, not started
    done: deque[tuple[T, BaseException | None, R | None]] = deque()  # finished, not yet yielded
    stop = threading.Event()

    def work() -> None:
        while True:
            with cond:
                while not todo and not stop.is_set():
                    cond.wait()
                if stop.is_set():
                    return
                item = todo.popleft()
            try:
                out: tuple[T, BaseException | None, R | None] = (item, None, fn(item))
            except BaseException as exc:  # noqa: BLE001 - handed to the consumer, raised on its turn
                out = (item, exc, None)
            with cond:
                done.append(out)
                cond.notify_all()

    threads = [threading.Thread(target=work, name=f"{name}_{i}", daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        in_flight = 0
        exhausted = False
        while True:
            while not exhausted and in_flight < 2 * n:
                try:
                    item = next(it)
                except StopIteration:
                    exhausted = True
                    break
                with cond:
                    todo.append(item)
                    cond.notify_all()
                in_flight += 1
            if in_flight == 0:
                return
            with cond:
                while not done:
                    cond.wait()
                item, exc, value = done.popleft()
            in_flight -= 1
            if exc is not None:
                raise exc
            yield item, value  # type: ignore[misc]
    finally:
        with cond:
            stop.set()
            todo.clear()
            cond.notify_all()
        for t in threads:
            t.join()

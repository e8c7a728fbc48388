"""The file thread pool: one function over many files on a few threads, results as they complete.

Reading a checkpoint is I/O plus hashing, CRC and unpickling that mostly release the GIL, so a few threads keep the
disk and both cores busy. The scan (read_file), the prune survivor check and export's source check
(hashing.digest_files) and verify's deep checks all go through `map_unordered`, so they bound their work alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


def map_unordered(
    fn: Callable[[T], R], items: Iterable[T], *, workers: int = 2, name: str = "ckpt-read"
) -> Iterator[tuple[T, R]]:
    """(item, fn(item)) for each item, in completion order, on `workers` threads named `name`.

    At most 2*workers items are in flight (a long list does not become a long queue of futures, and a consumer that
    stops early leaves little work behind). An exception from `fn` is raised here, when its item's turn comes.
    """
    n = max(1, workers)
    it = iter(items)
    with ThreadPoolExecutor(max_workers=n, thread_name_prefix=name) as pool:
        pending: dict[Future[R], T] = {}

        def submit_next() -> None:
            for item in it:
                pending[pool.submit(fn, item)] = item
                return

        for _ in range(2 * n):
            submit_next()
        while pending:
            done, _ = wait(pending, return_when=FIRST_COMPLETED)
            for fut in done:
                item = pending.pop(fut)
                yield item, fut.result()
                submit_next()

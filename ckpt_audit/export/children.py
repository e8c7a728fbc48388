"""Child processes and Ctrl-C: the terminal sends SIGINT to the whole process group, but only the export answers it
(one line, exit 130, its work directory removed); the children it started are ended by it."""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def sigint_held() -> Iterator[None]:
    """Start child processes inside this. They inherit SIGINT blocked (a signal mask survives fork and exec), so an
    interrupt never prints a traceback from a child starting up. In the main thread an interrupt meanwhile is held
    and sent again on the way out: raised inside a fork, Python's at-fork handlers swallowed it (the export went
    on and exited 0)."""
    held: list[int] = []
    main = threading.current_thread() is threading.main_thread()  # only the main thread may set a handler
    if main:
        previous = signal.signal(signal.SIGINT, lambda signum, _frame: held.append(signum))
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if main:
            signal.signal(signal.SIGINT, previous)
            if held:
                signal.raise_signal(signal.SIGINT)


def answer_sigint() -> None:
    """In a child that should stop at a Ctrl-C, once started: SIGINT ends it at once and silently."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})

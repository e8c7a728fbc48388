"""TUI responsiveness on a big run: one Space press (recompute plan_prune + redraw) on a 2000-checkpoint run.

Prints, measured in the same run: the toggle as a ratio to plan_prune alone (the floor: the TUI recomputes the
same plan on every toggle), and the incremental redraw against a full table rebuild per toggle (the naive way).
The run is built in memory from the model (W=8, 2000 steps): the cost measured is the TUI's, not the disk's.

Usage: python bench/bench_tui.py [--checkpoints 2000] [--presses 10]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from ckpt_audit.lifecycle.retention import Policy, plan_prune
from ckpt_audit.models import Checkpoint, Component, FileKind, Run, ShardFile, Status


def big_run(n: int, world_size: int = 8) -> Run:
    now = time.time_ns()
    ckpts = []
    for step in range(1, n + 1):
        path = f"/bench/p/e/global_step_{step}"
        files = tuple(
            ShardFile(
                path=f"{path}/actor/model_world_size_{world_size}_rank_{r}.pt",
                kind=FileKind.MODEL,
                size_bytes=10**9,
                mtime_ns=now,
                inode=step * 100 + r,
                rank=r,
                world_size=world_size,
            )
            for r in range(world_size)
        )
        comp = Component(role="actor", path=f"{path}/actor", layout="verl-fsdp", world_size=world_size, files=files)
        ckpts.append(
            Checkpoint(
                run_path="/bench/p/e", step=step, path=path, status=Status.COMPLETE, components=(comp,), mtime_ns=now
            )
        )
    return Run(path="/bench/p/e", layout="verl-fsdp", tracker_step=n, checkpoints=tuple(ckpts))


async def toggles(run: Run, presses: int, *, full_rebuild: bool) -> float:
    from tui.app import AuditApp
    from tui.snapshot import Snapshot

    app = AuditApp(catalog_path=None)
    async with app.run_test(size=(80, 24)) as pilot:
        app._set_snapshot(Snapshot(runs=(run,)), "bench")
        await pilot.press("enter")
        await pilot.pause()
        screen = app.screen
        await pilot.press("down")
        elapsed = 0.0
        for _ in range(presses):
            if full_rebuild:
                screen._shown = []  # what a naive redraw does on every keypress
            t = time.perf_counter()
            await pilot.press("space")
            await pilot.pause()
            elapsed += time.perf_counter() - t
        assert len(screen.plan.delete) == presses
    return elapsed / presses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=int, default=2000)
    parser.add_argument("--presses", type=int, default=10)
    args = parser.parse_args()
    run = big_run(args.checkpoints)

    t = time.perf_counter()
    for i in range(args.presses):
        plan_prune([run], Policy(), now_ns=time.time_ns(), select=frozenset({run.checkpoints[i].path}))
    plan_s = (time.perf_counter() - t) / args.presses

    incremental = asyncio.run(toggles(run, args.presses, full_rebuild=False))
    rebuild = asyncio.run(toggles(run, args.presses, full_rebuild=True))
    print(
        f"checkpoints={args.checkpoints}  plan_prune={plan_s * 1e3:.0f} ms  toggle={incremental * 1e3:.0f} ms  "
        f"full-rebuild toggle={rebuild * 1e3:.0f} ms"
    )
    print(f"toggle / plan_prune alone: {incremental / plan_s:.1f}x")
    print(f"full rebuild / incremental redraw: {rebuild / incremental:.1f}x")


if __name__ == "__main__":
    main()

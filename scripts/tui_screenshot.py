"""Save an SVG screenshot of the real TUI (80x24) for the README: docs/tui.svg.

Builds a demo run with the reference trainer (harness.tree.write_tree: real multi-process FSDP shards), damages
two checkpoints the way disks and crashes do (one shard truncated, one missing), opens the run in the TUI,
applies the "keep last 1" preset and saves what the screen shows.

Usage:
    python scripts/tui_screenshot.py                   # -> docs/tui.svg
    python scripts/tui_screenshot.py --root /ckpts     # screenshot an existing tree instead (nothing is changed)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def build_demo(root: Path) -> None:
    from harness.tree import write_tree

    run = write_tree(root, project="demo", experiment="qwen-ppo", world_size=2, steps=8, save_every=2)
    steps = sorted(run.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    # A bit flip's cousin: a shard cut short (corrupt); a crash before one rank saved (incomplete).
    shard = next((steps[1] / "actor").glob("model_world_size_*_rank_1.pt"))
    os.truncate(shard, shard.stat().st_size // 2)
    next((steps[0] / "actor").glob("optim_world_size_*_rank_0.pt")).unlink()


async def shoot(root: Path, catalog: Path, out: Path) -> None:
    from tui.app import AuditApp

    app = AuditApp(catalog_path=catalog, roots=[str(root)])
    async with app.run_test(size=(80, 24)) as pilot:
        await pilot.pause()
        await app.workers.wait_for_complete()
        await pilot.pause()
        if app.last_error:
            raise SystemExit(f"tui_screenshot: {app.last_error}")
        await pilot.press("enter")  # the first run's checkpoints
        await pilot.press("l")  # preset: keep the last N complete
        await pilot.pause()
        await pilot.press("backspace", "1", "enter")
        await pilot.pause()
        app.save_screenshot(filename=out.name, path=str(out.parent))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, help="an existing tree to show (default: build a damaged demo run)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "tui.svg")
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="tui-shot-") as tmp:
        root = args.root.resolve() if args.root else Path(tmp) / "ckpts"
        if args.root is None:
            build_demo(root)
        asyncio.run(shoot(root, Path(tmp) / "catalog.db", args.out.resolve()))
    print(args.out)


if __name__ == "__main__":
    main()

"""Real checkpoint trees for the scanner tests, and one-corruption helpers.

`base_run` is the harness's session tree (`verl_run` from tests/conftest.py: real multi-process FSDP, W=2). Each test
corrupts a private copy. `write_torch_tree` writes a verl-named tree with chosen steps by real torch.save calls
(test_prune_cli needs four saved steps).
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest


def write_torch_tree(root: Path, *, world_size: int = 2, steps: tuple[int, ...] = (2, 4, 6)) -> Path:
    import torch  # tests only; the scan path never imports torch

    run = root / "demo" / "exp"
    for step in steps:
        actor = run / f"global_step_{step}" / "actor"
        actor.mkdir(parents=True)
        for r in range(world_size):
            g = torch.Generator().manual_seed(step * 10 + r)
            torch.save(
                {
                    "model.embed.weight": torch.randn(64, 32, generator=g),
                    "lm_head.weight": torch.randn(16, 32, generator=g),
                },
                actor / f"model_world_size_{world_size}_rank_{r}.pt",
            )
            torch.save(
                {
                    "state": {0: {"step": torch.tensor(float(step)), "exp_avg": torch.zeros(64, 32)}},
                    "param_groups": [{"lr": 1e-3, "params": [0]}],
                },
                actor / f"optim_world_size_{world_size}_rank_{r}.pt",
            )
            torch.save(
                {"lr_scheduler": {"last_epoch": step}, "rng": {"cpu": torch.get_rng_state()}},
                actor / f"extra_state_world_size_{world_size}_rank_{r}.pt",
            )
        (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world_size}, indent=4))
        torch.save({"_num_yielded": step}, run / f"global_step_{step}" / "data.pt")
    (run / "latest_checkpointed_iteration.txt").write_text(str(steps[-1]))
    return run


@pytest.fixture(scope="session")
def base_run(verl_run) -> Path:
    return Path(verl_run)


@pytest.fixture
def run_copy(base_run, tmp_path):
    """A private copy of the session run at tmp_path/root/demo/exp (mtimes preserved); returns the run dir."""
    dst = tmp_path / "root" / base_run.parent.name / base_run.name
    shutil.copytree(base_run, dst, symlinks=True)
    return dst


def steps_of(run: Path) -> list[Path]:
    return sorted((p for p in run.iterdir() if p.name.startswith("global_step_")), key=lambda p: int(p.name[12:]))


def shard(step_dir: Path, kind: str = "model", rank: int = 0) -> Path:
    role = step_dir / "actor" if (step_dir / "actor").is_dir() else step_dir
    return next(role.glob(f"{kind}_world_size_*_rank_{rank}.pt"))


def flip_payload_byte(path: Path) -> None:
    """Flip one byte inside the largest tensor payload, keeping size, mtime and inode."""
    from harness.commands.demo import flip_payload_byte as flip

    flip(path, mask=0xFF)


def rewrite_zip(
    path: Path, *, drop: str | None = None, shorten: str | None = None, replace: dict[str, bytes] | None = None
) -> None:
    """Rebuild a .pt zip with one entry dropped, cut short or replaced (CRCs stay valid: zipfile recomputes them)."""
    with zipfile.ZipFile(path) as z:
        items = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    tmp = path.with_suffix(".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as out:
        for name, data in items:
            rec = name.split("/", 1)[1]
            if rec == drop:
                continue
            if rec == shorten:
                data = data[: len(data) // 2]
            if replace and rec in replace:
                data = replace[rec]
            out.writestr(name, data)
    tmp.replace(path)

"""Who saves and restores the reference trainer's checkpoints: its own writer, or the installed verl's manager.

`reference` is harness.checkpoint (verl's layout by our reading of verl, re-sharding on a world-size change).
`verl` hands model, optimizer and scheduler to the installed verl's own FSDPCheckpointManager (docs/harness.md), so
resume-test judges the verl version a team is about to deploy rather than our imitation of it.
Each rank builds one checkpointer after its roles are sharded; the trainer calls only save() and restore().
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from harness.config import CHECKPOINTERS

__all__ = ["CHECKPOINTERS", "Checkpointer", "describe", "open_checkpointer", "refuse", "warm"]


class Checkpointer(Protocol):
    def save(self, stream, *, step: int) -> Path:
        """Write global_step_<step> (every role, data.pt, then the tracker); every rank calls it."""

    def restore(self, folder: Path, stream) -> None:
        """Load every role and the data position from global_step_N `folder`; every rank calls it."""


def open_checkpointer(cfg, roles, *, rank: int, mesh_shape: tuple[int, ...]) -> Checkpointer:
    if cfg.checkpointer == "verl":
        from harness.checkpointers.verl_manager import VerlCheckpointer

        return VerlCheckpointer(cfg, roles, rank=rank)
    from harness.checkpointers.reference import ReferenceCheckpointer

    return ReferenceCheckpointer(cfg, roles, rank=rank, mesh_shape=mesh_shape)


def warm(cfgs) -> None:
    """Import what the ranks will need once, in the launcher, so every forked rank inherits it."""
    if any(cfg.checkpointer == "verl" for cfg in cfgs):
        from harness.checkpointers.verl_manager import import_manager

        import_manager()


def describe(name: str) -> str:
    """What saved and loaded, for the report: the installed verl's version, read without importing it."""
    if name != "verl":
        return name
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"verl {version('verl')} FSDPCheckpointManager"
    except PackageNotFoundError:
        return "verl (not installed) FSDPCheckpointManager"


def refuse(name: str, *, world_size: int, resume_world_size: int) -> str | None:
    """Why a resume-test cannot run with this checkpointer, or None."""
    if name == "verl" and resume_world_size != world_size:
        return (
            "verl's FSDPCheckpointManager loads only files of its own world size (verl #2265); "
            "--resume-world-size needs --checkpointer reference"
        )
    return None

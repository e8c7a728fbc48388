"""The reference checkpointer: harness.checkpoint's own writer and re-sharding loader."""

from __future__ import annotations

from pathlib import Path

from harness import checkpoint


class ReferenceCheckpointer:
    def __init__(self, cfg, roles, *, rank: int, mesh_shape: tuple[int, ...]) -> None:
        self.cfg, self.roles, self.rank, self.mesh_shape = cfg, roles, rank, mesh_shape

    def save(self, stream, *, step: int) -> Path:
        cfg = self.cfg
        return checkpoint.save_checkpoint(
            self.roles,
            stream,
            run_dir=cfg.run_path,
            step=step,
            rank=self.rank,
            world_size=cfg.world_size,
            sft=cfg.sft,
        )

    def restore(self, folder: Path, stream) -> None:
        cfg = self.cfg
        for role in self.roles:
            checkpoint.load_role(
                role,
                checkpoint.role_dir(folder, role.name, sft=cfg.sft),
                rank=self.rank,
                world_size=cfg.world_size,
                mesh_shape=self.mesh_shape,
                drop=cfg.drop,
            )
        data_file = folder / "data.pt"
        if "data" not in cfg.drop and data_file.is_file():
            stream.load_state_dict(checkpoint.load_file(data_file))

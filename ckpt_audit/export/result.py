"""What an export hands back (ExportResult, one ExportedFile per file written) and what its marker and the catalog
record of it."""

from __future__ import annotations

from dataclasses import dataclass

from ckpt_audit.models import Finding


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportedFile:
    path: str  # absolute, in the final directory
    size_bytes: int
    hash: str  # xxh3-128 hex


@dataclass(frozen=True, slots=True, kw_only=True)
class ExportResult:
    source: str  # the step (or role) directory asked for
    role_dir: str  # where the weights came from
    out_dir: str
    source_kind: str  # "fsdp-shards" | "megatron-dist-ckpt" | "hf-weights"
    world_size: int | None
    dtype: str  # torch dtype name of floating tensors in the export, e.g. "float32"
    tensors: int
    total_bytes: int  # tensor bytes in the export
    files: tuple[ExportedFile, ...] = ()
    lora_dir: str | None = None
    warnings: tuple[str, ...] = ()
    read_back: bool = False  # every tensor read back equals the concatenation of its shards
    source_check: str = "none"  # how the source's weights were re-read: "manifest" | "crc-only" | "none"
    source_files: tuple[tuple[str, str], ...] = ()  # (path, xxh3-128) of every source file, as re-read
    override: str = ""  # "allow-corrupt": exported although the source failed its check
    source_findings: tuple[Finding, ...] = ()  # what the source check found (overridden when exported)
    replaced: str = ""  # what --to held before: "" nothing | "empty-dir" | "export"
    export_id: int | None = None  # the catalog's exports.id
    # is it a model transformers loads as written (export.model)? "transformers": config.json agrees with the tensors
    # and transformers' own load gave them back; "config": it agrees, the load did not run (model_load says why);
    # "failed": it does not, exported with --allow-unverified; "none": not asked yet
    model_check: str = "none"
    model_findings: tuple[Finding, ...] = ()
    model_load: str = ""  # one line: what transformers loaded, or why the load did not run

    @property
    def verified(self) -> bool:
        """Read back equal to a source whose content was checked (manifest or CRCs) and passed, and a model that
        config.json describes (and transformers loads, where it is installed)."""
        return (
            self.read_back
            and self.source_check != "none"
            and not self.override
            and self.model_check in ("transformers", "config")
        )

    @property
    def source_verified(self) -> bool:
        return self.source_check == "manifest" and not self.override

    def to_dict(self) -> dict:
        return {
            "source": self.source,
            "role_dir": self.role_dir,
            "out_dir": self.out_dir,
            "source_kind": self.source_kind,
            "world_size": self.world_size,
            "dtype": self.dtype,
            "tensors": self.tensors,
            "total_bytes": self.total_bytes,
            "verified": self.verified,
            "read_back": self.read_back,
            "source_check": self.source_check,
            "source_verified": self.source_verified,
            "override": self.override,
            "source_findings": [f.to_dict() for f in self.source_findings],
            "replaced": self.replaced,
            "model_check": self.model_check,
            "model_findings": [f.to_dict() for f in self.model_findings],
            "model_load": self.model_load,
            "lora_dir": self.lora_dir,
            "warnings": list(self.warnings),
            "files": [{"path": f.path, "size_bytes": f.size_bytes, "hash": f.hash} for f in self.files],
        }

"""Trees written by verl 0.9.1's own `MegatronCheckpointManager.save_checkpoint` (layout v2), and what verl's own
`load_checkpoint` makes of each case.

`write_cases(root)` spawns two CPU processes (gloo) with tensor parallelism 2. Each builds the tiny `GPTModel` of
tests/_megatron_trees.py and hands it to verl's manager, which writes `global_step_N/actor/{model,optimizer,extra}/
dist_ckpt/`, `transformer_config.json` and, last, `ckpt_contents.json` (save_contents model, optimizer, extra;
`use_dist_checkpointing=True`, no bridge). Steps 2 and 4 are saved, one Adam step apart, step 2 with verl's
`dist_ckpt_optim_fully_reshardable` off and step 4 with it on, so each records its optimizer format flags in its
`common.pt` as verl writes them. An old-layout step 8 (one
`dist_ckpt/` directly under the role, as verl <= 0.8 wrote it) is written with megatron-core's `dist_checkpointing`
as tests/_megatron_trees.py writes it. Rank 0 then derives one run per case of CASES; the migrated case runs verl's
own `scripts/migrate_megatron_checkpoint_layout.py` (hardlink mode, and symlink mode: in place, and moved after it).
Both ranks then load the
tracker's step of every case through verl's `load_checkpoint` into zeroed state and record which saved step's
weights came back (`loads step N`) or the error (`fails: ...`), in `<root>/verdicts.json`.

What is stubbed, and why (CPU-only torch, no apex / Transformer Engine):
- `torch.cuda.synchronize` / `torch.cuda.current_device`: megatron-core's save finalize calls them.
- The optimizer: megatron-core's optimizer wrappers allocate CUDA tensors when built, so verl's manager gets a small
  stand-in (`_Optimizer`) whose `sharded_state_dict` is megatron-core's own helpers applied to a torch Adam (as
  tests/_megatron_trees.py saves optimizer state). The save's manager says `use_distributed_optimizer=True` so that
  verl records the distributed optimizer's format flags (`_build_sharded_state_dict_metadata`) as it does in
  training; the stand-in's state is per parameter whatever the flags say (they are what the test reads back).
- The load runs with `load_contents=[model, optimizer]`: verl's RNG restore needs the CUDA RNG tracker's states,
  which a CPU process has none of (`load_rng_states` raises KeyError on an empty tracker).
Everything else (state dicts, paths, manifest, ordering, the old-layout check) is verl's and megatron-core's code.

Run as: python tests/_verl_megatron_v2.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import _megatron_trees as mt  # noqa: E402  (the model, the CUDA stubs and the old-layout save)

TP = 2
TRACKER = "latest_checkpointed_iteration.txt"
V2_STEPS = (2, 4)
OLD_STEP = 8
CASES = (
    "clean",  # steps 2, 4; tracker 4
    "manifest-missing",  # step 4's ckpt_contents.json removed
    "content-missing",  # step 4's optimizer/dist_ckpt/ emptied
    "distcp-missing",  # a .distcp of step 4's model/dist_ckpt/ deleted
    "distcp-truncated",  # a .distcp of step 4's model/dist_ckpt/ cut to half
    "distcp-bitflip",  # one bit flipped inside step 4's word embeddings (tests/_megatron_trees.py's flip)
    "step-mismatch",  # global_step_6 is a copy of global_step_4 (its manifest says 4); tracker 6
    "old-layout",  # steps 2, 4 (v2) and 8 (old layout); tracker 8
    "migrated",  # the old-layout step 8 after verl's migration script (hardlinks); tracker 8
    "migrated-symlink",  # the same in symlink mode (absolute directory links), loaded where it was made; tracker 8
    "symlink-moved",  # migrated in symlink mode, then the run directory renamed (its links dangle); tracker 8
)
MIGRATED = ("migrated", "migrated-symlink", "symlink-moved")


def migrate(role_dir: Path, mode: str = "hardlink") -> None:
    """verl's own migration script, run as its docs say, from where verl installs it."""
    import subprocess
    from importlib.util import find_spec

    site = Path(find_spec("verl").submodule_search_locations[0]).parent
    script = site / "scripts" / "migrate_megatron_checkpoint_layout.py"
    cmd = [sys.executable, str(script), "--checkpoint", str(role_dir), "--mode", mode]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0 and "migrated" in out.stdout, out.stdout + out.stderr


class _Optimizer:
    """Stand-in for megatron-core's optimizer wrapper (which needs CUDA to be built): a torch Adam whose sharded
    state dict is made by megatron-core's own helpers, as tests/_megatron_trees.py saves it."""

    def __init__(self, model, opt):
        self.model, self.opt = model, opt

    def sharded_state_dict(self, model_sharded_state_dict, is_loading=False, metadata=None):
        from megatron.core.dist_checkpointing.optimizer import (
            get_param_id_to_sharded_param_map,
            optim_state_to_sharding_state,
        )

        osd = self.opt.state_dict()
        params = (p for g in self.opt.param_groups for p in g["params"])
        # the model's own sharded state dict, fresh: verl's load has by now loaded (and so replaced) the one it built
        id_map = get_param_id_to_sharded_param_map(self.model.sharded_state_dict(prefix=""), params)
        optim_state_to_sharding_state(osd, id_map, exclude_keys=("step",))
        return osd

    def load_state_dict(self, sd):
        # Adam's per-parameter 'step' is left out of the sharding (exclude_keys above) and does not come back: the
        # stand-in keeps its own (the verdict compares model weights)
        own = self.opt.state_dict()["state"]
        for i, st in sd["state"].items():
            st.setdefault("step", own[i]["step"])
        self.opt.load_state_dict(sd)


def _manager(model, opt, contents, fully_reshardable: bool | None = None):
    """verl's manager; `fully_reshardable` not None: as built for a distributed optimizer with verl's
    `megatron.dist_ckpt_optim_fully_reshardable` set so (it then records the optimizer format it saves)."""
    import torch
    from omegaconf import OmegaConf
    from verl.utils.checkpoint.megatron_checkpoint_manager import MegatronCheckpointManager

    return MegatronCheckpointManager(
        config=OmegaConf.create(
            {
                "model": {"path": "unused"},
                "megatron": {
                    "dist_ckpt_optim_fully_reshardable": bool(fully_reshardable),
                    "distrib_optim_fully_reshardable_mem_efficient": False,
                },
            }
        ),
        checkpoint_config=OmegaConf.create({"save_contents": contents, "load_contents": contents, "async_save": False}),
        model_config=None,
        transformer_config=model.config,
        role="actor",
        model=[model],
        arch="GPTModel",
        hf_config=None,
        param_dtype=torch.float32,
        share_embeddings_and_output_weights=False,
        processing_class=None,
        optimizer=_Optimizer(model, opt),
        optimizer_scheduler=None,
        use_distributed_optimizer=fully_reshardable is not None,
        use_dist_checkpointing=True,
    )


def _fingerprint(model) -> str:
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if hasattr(t, "numpy"):
            h.update(name.encode() + t.detach().float().numpy().tobytes())
    return h.hexdigest()[:16]


def _another_step(model, opt, seed: int) -> None:
    """One more Adam step on fixed gradients (the same on every rank: TP-replicated parameters stay replicas), so each
    saved step holds other weights and a load can be matched to the step it came from."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=g)
    opt.step()


def _derive(base: Path, case: str, root: Path) -> None:
    final = root / case / "exp"
    run = final.with_name("before-move") if case == "symlink-moved" else final
    shutil.copytree(base, run, symlinks=True)
    step4 = run / "global_step_4" / "actor"
    old = run / f"global_step_{OLD_STEP}"
    if case not in ("old-layout", *MIGRATED):
        shutil.rmtree(old)
    if case == "manifest-missing":
        (step4 / "ckpt_contents.json").unlink()
    elif case == "content-missing":
        for p in (step4 / "optimizer" / "dist_ckpt").iterdir():
            p.unlink()
    elif case == "distcp-missing":
        (step4 / "model" / "dist_ckpt" / "__1_0.distcp").unlink()
    elif case == "distcp-truncated":
        p = step4 / "model" / "dist_ckpt" / "__0_1.distcp"
        os.truncate(p, p.stat().st_size // 2)
    elif case == "distcp-bitflip":
        mt._flip_model_byte(step4 / "model" / "dist_ckpt")
    elif case == "step-mismatch":
        shutil.copytree(run / "global_step_4", run / "global_step_6")
        (run / TRACKER).write_text("6")
    elif case == "old-layout":
        (run / TRACKER).write_text(str(OLD_STEP))
    elif case in MIGRATED:
        migrate(old / "actor", "hardlink" if case == "migrated" else "symlink")
        (run / TRACKER).write_text(str(OLD_STEP))
    # everything old enough that no scan takes it for a save in progress
    past = time.time() - 86400
    for d, _dirs, files in os.walk(run):
        for n in files:
            os.utime(Path(d) / n, (past, past))
        os.utime(d, (past, past))
    if run != final:
        run.rename(final)


def _rank(rank: int, world: int, root: str, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    mt._stub_cuda()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=TP)
    base = Path(root) / "base" / "exp"
    model, opt = mt._build()
    saved = {}
    for step in V2_STEPS:
        _another_step(model, opt, seed=step)
        mgr = _manager(model, opt, ["model", "optimizer", "extra"], fully_reshardable=step == V2_STEPS[-1])
        mgr.save_checkpoint(str(base / f"global_step_{step}" / "actor"), global_step=step)
        saved[step] = _fingerprint(model)
    # the old layout, as verl <= 0.8 wrote it: one dist_ckpt/ under the role (tests/_megatron_trees.py's save)
    _another_step(model, opt, seed=OLD_STEP)
    old = base / f"global_step_{OLD_STEP}" / "actor" / "dist_ckpt"
    if rank == 0:
        old.mkdir(parents=True)
        (base / TRACKER).write_text(str(V2_STEPS[-1]))
    dist.barrier()
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    strategy = FullyParallelSaveStrategyWrapper(
        get_default_save_sharded_strategy("torch_dist"), ps.get_data_parallel_group(with_context_parallel=True)
    )
    dist_checkpointing.save(mt._sharded_state(model, opt), str(old), sharded_strategy=strategy)
    saved[OLD_STEP] = _fingerprint(model)
    dist.barrier()
    if rank == 0:
        for case in CASES:
            _derive(base, case, Path(root) / "cases")
    dist.barrier()
    verdicts = {}
    for case in CASES:
        run = Path(root) / "cases" / case / "exp"
        model, opt = mt._build()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        loader = _manager(model, opt, ["model", "optimizer"])
        step = int((run / TRACKER).read_text())
        try:
            loader.load_checkpoint(str(run / f"global_step_{step}" / "actor"))
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # noqa: BLE001 - the verdict is the exception
            first = str(exc).splitlines()[0] if isinstance(exc, RuntimeError) else mt._cause(exc)
            verdicts[case] = f"fails: {type(exc).__name__}: {first}"
            continue
        got = _fingerprint(model)
        verdicts[case] = next((f"loads step {s}" for s, fp in saved.items() if fp == got), "loads-changed")
    everyone = [None] * world
    dist.all_gather_object(everyone, verdicts)
    if rank == 0:
        merged = {}
        for case in CASES:
            seen = [v[case] for v in everyone]
            merged[case] = next((s for s in seen if s.startswith("fails")), None) or (
                seen[0] if len(set(seen)) == 1 else "loads-changed"
            )
        (Path(root) / "verdicts.json").write_text(json.dumps(merged, indent=2))
    dist.barrier()
    dist.destroy_process_group()


def write_cases(root: Path) -> dict:
    """Write the base run and every case under `root`; returns verl's load verdict per case."""
    import torch.multiprocessing as mp

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    mp.start_processes(_rank, args=(TP, str(root), mt._free_port()), nprocs=TP, join=True, start_method="spawn")
    return json.loads((root / "verdicts.json").read_text())


if __name__ == "__main__":
    print(json.dumps(write_cases(Path(sys.argv[1])), indent=2))

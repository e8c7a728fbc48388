"""Start W ranks and make sure none outlives a failure or a timeout.

The caller starts one launcher process in a new session (its own process group). The launcher imports torch and
transformers once (tens of seconds on a busy 2-core box) and forks the W ranks from that warm image, so they share
the import cost; ranks die with the launcher (PR_SET_PDEATHSIG), the launcher kills every rank as soon as one fails,
and the caller kills the whole group on timeout, on error and on Ctrl-C.

Run as: python -m harness.launch SPEC.json   (SPEC holds a TrainConfig)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from harness.config import TrainConfig


class HarnessError(RuntimeError):
    """The reference trainer failed or timed out; the message ends with the tail of its log."""

    def __init__(self, message: str, *, pgid: int | None = None) -> None:
        super().__init__(message)
        self.pgid = pgid
        """The killed process group (every rank was in it)."""


def run_training(cfg: TrainConfig, *, timeout_s: float = 300) -> None:
    """Run `cfg` to completion in fresh processes; raise HarnessError (group killed) on failure or timeout."""
    run_phases([cfg], timeout_s=timeout_s)


def run_phases(cfgs: list[TrainConfig], *, timeout_s: float = 300) -> None:
    """Run several trainings one after another, each in its own freshly forked ranks (a real restart: nothing of
    one phase survives in memory into the next), sharing one launcher's imports. All or nothing: the first
    failing phase stops the rest and raises HarnessError."""
    for cfg in cfgs:
        cfg.validate()
        if not cfg.copy_from:
            cfg.run_path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ckpt-audit-harness-") as tmp:
        spec = Path(tmp) / "spec.json"
        spec.write_text("[" + ",".join(cfg.to_json() for cfg in cfgs) + "]")
        log_path = Path(tmp) / "ranks.log"
        env = dict(
            os.environ,
            PYTHONUNBUFFERED="1",
            OMP_NUM_THREADS="1",
            MKL_NUM_THREADS="1",
            CUBLAS_WORKSPACE_CONFIG=":4096:8",
            PYTORCH_NVML_BASED_CUDA_CHECK="1",
            TOKENIZERS_PARALLELISM="false",
            TRANSFORMERS_VERBOSITY="error",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
        )
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parent.parent), env.get("PYTHONPATH")])
        )
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "harness.launch", str(spec)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
            try:
                rc = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                _kill_group(proc)
                raise HarnessError(
                    f"trainer timed out after {timeout_s:.0f}s (all ranks killed)\n" + _tail(log_path), pgid=proc.pid
                ) from None
            finally:
                _kill_group(proc)  # reap stragglers on every path, including KeyboardInterrupt
        if rc != 0:
            raise HarnessError(f"trainer failed (exit {rc})\n" + _tail(log_path), pgid=proc.pid)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def _tail(path: Path, lines: int = 25) -> str:
    text = path.read_text(errors="replace").splitlines()
    keep = [line for line in text if "Warning" not in line and "warnings.warn" not in line]
    return "\n".join(keep[-lines:])


def _die_with_parent() -> None:
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def main(spec_path: str) -> int:
    import json
    import warnings

    warnings.filterwarnings("ignore")
    cfgs = [TrainConfig.from_json(json.dumps(raw)) for raw in json.loads(Path(spec_path).read_text())]
    # Warm the image once; every forked rank inherits it.
    import torch  # noqa: F401
    import torch.distributed.fsdp  # noqa: F401
    import torch.distributed.tensor  # noqa: F401
    import torchdata.stateful_dataloader  # noqa: F401
    import transformers  # noqa: F401

    from harness import model as models
    from harness.checkpointers import warm

    for cfg in cfgs:
        models.build_actor(models.build_hf_config(cfg))  # imports the architecture's modeling module
    warm(cfgs)
    for phase, cfg in enumerate(cfgs):
        sys.stderr.write(f"[launcher] phase {phase}: {cfg.world_size} ranks, steps to {cfg.steps}\n")
        if code := run_ranks(cfg, Path(spec_path).with_name(f"pg-init-{phase}")):
            return code
    return 0


def run_ranks(cfg: TrainConfig, init_file: Path) -> int:
    """Fork one process per rank, wait for all; if one fails, kill the others at once (they would hang)."""
    if cfg.copy_from:
        import shutil

        shutil.copytree(cfg.copy_from, cfg.run_dir, symlinks=True)
    children: dict[int, int] = {}
    for rank in range(cfg.world_size):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                _die_with_parent()
                from harness.trainer import run_rank

                run_rank(cfg, rank, str(init_file))
            except BaseException:
                sys.stderr.write(f"[rank {rank}] " + traceback.format_exc())
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children[pid] = rank
    failed = 0
    while children:
        pid, status = os.wait()
        rank = children.pop(pid, None)
        code = os.waitstatus_to_exitcode(status)
        if code != 0 and rank is not None:
            sys.stderr.write(f"[launcher] rank {rank} exited {code}; stopping the other ranks\n")
            failed = 1
            for other in children:
                try:
                    os.kill(other, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

"""export --ray: each output shard written and read back by a Ray task, on the nodes of a cluster that share a store.

The driver plans, writes the index, the marker and swaps the export into place (export.orchestrator, exactly as with
--jobs); this module is only the executor it is handed (stream_write.export_tensors' `run_files`, with
stream_write._in_workers' signature). Each task runs stream_write.write_and_read_back on one output file: the same
bytes, CRC checks and read-back as a local worker.

The work directory and the sources must be the same files on every node (a shared store: NFS, Lustre, a FUSE mount).
Before any shard is written, one task pinned to each node that can run a shard task reads a probe file the driver
wrote into the work directory and stats every source file; a node that sees a different store refuses the export
(ExportRefused about "destination", exit 2), and only nodes that passed are given shards (pinned round robin).

Ray is imported inside the functions only (an export without --ray never loads it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ckpt_audit.export.guard import ExportRefused
from ckpt_audit.export.stream_plan import StreamError
from ckpt_audit.export.stream_write import write_and_read_back

from .ray_scan import _hold

CANCEL_WAIT_S = 60.0  # after a failure: how long the cancelled tasks may take to be gone


def _probe_node(probe: str, token: str, sources: dict[str, int]) -> str | None:
    """A node's check (runs on the node): None when it sees the driver's probe and every source as the driver
    does, else what differs, in a few words."""
    try:
        with open(probe) as fh:
            if fh.read() != token:
                return f"{probe} holds other content there"
    except OSError as exc:
        return f"cannot read {probe} there ({exc.strerror or exc})"
    for path, size in sources.items():
        try:
            got = os.stat(path).st_size
        except OSError as exc:
            return f"cannot stat {path} there ({exc.strerror or exc})"
        if got != size:
            return f"{path} is {got} bytes there, {size} here"
    return None


def _write_task(path: Path, group: list, target, check_crc: bool, verify: bool) -> tuple[int, str, str]:
    """One output shard (runs on a node): stream_write's worker body, and which node ran it."""
    import ray  # noqa: PLC0415 - on the worker, where ray is loaded already

    node = ray.get_runtime_context().get_node_id()
    _hold(node)  # test seam (ray_scan.HOLD_ENV): tests kill a task while it runs
    size, digest = write_and_read_back(path, group, target, check_crc, verify)
    return size, digest, node


@dataclass
class RayFiles:
    """The executor handed to stream_write.export_tensors (`run_files`). `jobs`: most shard tasks in flight at once
    (None: as many as there are files; Ray's CPU resources still decide how many run). After the export, `nodes`
    says how many files each node wrote."""

    jobs: int | None = None
    nodes: dict[str, int] = field(default_factory=dict)

    def __call__(self, files, jobs, target, check_crc, verify, tick, read_tick) -> list[tuple[int, str]]:
        del jobs  # export --jobs: the local pool's size; here self.jobs caps the tasks in flight
        import ray  # noqa: PLC0415 - connect() ran before the export began

        nodes = self._probe(ray, files)
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

        task = ray.remote(num_cpus=1, max_retries=0)(_write_task)
        cap = self.jobs or len(files)
        pending = list(enumerate(files))
        running: dict = {}
        done: dict[int, tuple[int, str]] = {}
        try:
            while pending or running:
                while pending and len(running) < cap:
                    i, (path, group) = pending.pop(0)
                    where = NodeAffinitySchedulingStrategy(node_id=nodes[i % len(nodes)], soft=False)
                    ref = task.options(scheduling_strategy=where).remote(path, group, target, check_crc, verify)
                    running[ref] = i
                ready, _ = ray.wait(list(running), num_returns=1)
                i = running.pop(ready[0])
                size, digest, node = _result(ray, ready[0], files[i][0])
                done[i] = (size, digest)
                self.nodes[node] = self.nodes.get(node, 0) + 1
                for t in files[i][1]:
                    tick(t.name)
                    if verify:
                        read_tick()
        finally:
            if running:  # a failure or an interrupt: nothing may write under the work directory once this returns
                _cancel(ray, list(running))
        return [done[i] for i in range(len(files))]

    def _probe(self, ray, files) -> list[str]:
        """The ids of the nodes that can run a shard task and see the work directory and every source as this
        process does. Raises ExportRefused (nothing written yet) when one of them does not."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy  # noqa: PLC0415

        nodes = [n["NodeID"] for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("CPU", 0) >= 1]
        if not nodes:
            raise StreamError("the Ray cluster has no alive node with a CPU to run an export task")
        work = files[0][0].parent
        token = os.urandom(16).hex()
        probe = work / f".ckpt-audit-ray-probe-{token[:8]}"
        probe.write_text(token)
        sources = {p.path: os.stat(p.path).st_size for _path, group in files for t in group for p in t.pieces}
        check = ray.remote(num_cpus=0, max_retries=0)(_probe_node)
        try:
            refs = {
                check.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=n, soft=False)).remote(
                    str(probe), token, sources
                ): n
                for n in nodes
            }
            for ref, node in refs.items():
                try:
                    why = ray.get(ref, timeout=120)
                except Exception as exc:  # noqa: BLE001 - a dead node or a lost task: it cannot be given shards
                    why = f"did not answer the probe ({type(exc).__name__})"
                if why is not None:
                    raise ExportRefused(
                        f"Ray node {node[:8]} does not see the export's work directory {work} and the sources as "
                        f"this process does: {why}; export --ray needs --to and the checkpoint on a store every "
                        "node mounts at the same path",
                        about="destination",
                    )
        finally:
            probe.unlink(missing_ok=True)
        return nodes


def _result(ray, ref, path: Path) -> tuple[int, str, str]:
    """A task's answer, or the worker's own exception (as export --jobs re-raises it), or one line for a task that
    died."""
    from ray import exceptions as rex  # noqa: PLC0415

    try:
        return ray.get(ref)
    except rex.RayTaskError as exc:
        cause = getattr(exc, "cause", None)
        if isinstance(cause, Exception) and not isinstance(cause, rex.RayError):
            raise cause from None
        raise StreamError(f"the Ray task writing {path.name} failed ({type(exc).__name__})") from None
    except rex.RayError as exc:  # the worker or its node died, the object was lost
        raise StreamError(
            f"the Ray task writing {path.name} died ({type(exc).__name__}: a source file truncated, out of memory, "
            "or its node lost?)"
        ) from None


def _cancel(ray, refs: Sequence) -> None:
    """Cancel (killing the running workers) and wait until each task is finished or gone."""
    for ref in refs:
        try:
            ray.cancel(ref, force=True)
        except Exception:  # noqa: BLE001, S112 - finished meanwhile
            continue
    deadline = time.monotonic() + CANCEL_WAIT_S
    left = list(refs)
    while left and time.monotonic() < deadline:
        _ready, left = ray.wait(left, num_returns=len(left), timeout=max(0.0, deadline - time.monotonic()))

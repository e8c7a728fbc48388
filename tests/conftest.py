"""Session fixtures: real verl checkpoint trees written by the reference trainer (multi-process FSDP2 on gloo).

Each tree costs one trainer run (about 25 s for W=2 on a quiet 2-core box, most of it importing torch and
transformers once). Trees are therefore cached between sessions under $CKPT_AUDIT_FIXTURES (default
/tmp/ckpt-audit-fixtures-<uid>), keyed by the harness source, the torch/transformers versions and the
parameters; a cached tree is re-used only if every file still has the size and mtime it was built with, so a test
that mutated a session tree by mistake costs a rebuild, not a wrong answer. CKPT_AUDIT_FIXTURES=off disables the
cache. Session trees are shared: tests that change files must work on `copy_run(tree)`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from ray_cluster import (  # noqa: F401 - the session Ray cluster's fixtures
    _ray_session,
    order_ray_tests,
    ray_cluster,
    ray_extra_node,
    register_marker,
)

REPO = Path(__file__).resolve().parent.parent
MANIFEST = ".fixture-manifest.json"


def _cache_root() -> Path | None:
    value = os.environ.get("CKPT_AUDIT_FIXTURES", "")
    if value.lower() in ("off", "0", "no"):
        return None
    return Path(value) if value else Path(tempfile.gettempdir()) / f"ckpt-audit-fixtures-{os.getuid()}"


def _key(params: dict) -> str:
    from importlib.metadata import version

    h = hashlib.sha256(json.dumps(params, sort_keys=True).encode())
    for pkg in ("torch", "transformers", "torchdata", "numpy"):
        h.update(f"{pkg}={version(pkg)}".encode())
    # Only harness/*.py, not its subpackages: harness/commands/ is the CLI wiring (demo, train, resume-test
    # commands), which parses flags and calls the trainer but never changes what trees are written, so editing it
    # must not cost every engineer a rebuild.
    for src in sorted((REPO / "harness").glob("*.py")):
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()[:16]


def _manifest(tree: Path) -> dict[str, list[int]]:
    out = {}
    for p in sorted(tree.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            st = p.stat()
            out[str(p.relative_to(tree))] = [st.st_size, st.st_mtime_ns]
    return out


def _intact(tree: Path) -> bool:
    try:
        return json.loads((tree / MANIFEST).read_text()) == _manifest(tree)
    except (OSError, ValueError):
        return False


def build_tree(tmp_path_factory, name: str, **params) -> Path:
    """The run directory of a real trainer run with `params` (write_tree's keywords), cached across sessions."""
    from harness.tree import write_tree

    return _run_dir(build_cached(tmp_path_factory, name, write_tree, **params), params)


def writer_key(writer: Path, packages: tuple[str, ...]) -> str:
    """The cache key of trees a test writer script makes: its source and the installed versions of `packages`."""
    from importlib.metadata import PackageNotFoundError, version

    h = hashlib.sha256(writer.read_bytes())
    for pkg in packages:
        try:
            h.update(f"{pkg}={version(pkg)}".encode())
        except PackageNotFoundError:
            pass
    return h.hexdigest()[:16]


def build_cached(tmp_path_factory, name: str, writer, key: str | None = None, **params) -> Path:
    """The directory `writer(dir, **params)` fills, cached across sessions. The key is `key` (see `writer_key`), or
    else hashes harness/*.py, where `writer` must then live (its source), and `params`."""
    cache = _cache_root()
    if cache is None:
        root = tmp_path_factory.mktemp(name)
        writer(root, **params)
        return root
    cache.mkdir(parents=True, exist_ok=True)
    final = cache / f"{name}-{key or _key(params)}"
    with open(cache / f"{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent session waits for this build instead of doubling it
        if final.is_dir() and _intact(final):
            os.utime(lock.name)  # last use, read by the sweep of stale trees below
            return final
        shutil.rmtree(final, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
        try:
            writer(staging, **params)
            (staging / MANIFEST).write_text(json.dumps(_manifest(staging)))
            os.rename(staging, final)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        _sweep_stale(cache, name, final)
    return final


STALE_AFTER_S = 2 * 86400


def _sweep_stale(cache: Path, name: str, final: Path) -> None:
    """Trees under other keys of `name` (older harness code) unused for two days. Not sooner: another checkout of
    the project (a worktree, a branch) may be using its own key right now, and deleting its tree under its tests
    would fail them or make the two checkouts rebuild each other's trees in turn."""
    now = time.time()
    for stale in cache.glob(f"{name}-*"):
        lock = stale.with_name(stale.name + ".lock")
        if not stale.is_dir() or stale == final or stale.name.count("-") != final.name.count("-"):
            continue
        try:
            idle = now - lock.stat().st_mtime
        except FileNotFoundError:
            idle = now - stale.stat().st_mtime
        if idle > STALE_AFTER_S:
            shutil.rmtree(stale, ignore_errors=True)
            lock.unlink(missing_ok=True)


def _run_dir(tree: Path, params: dict) -> Path:
    return tree / params.get("project", "demo") / params.get("experiment", "exp")


@pytest.fixture(scope="session")
def verl_run(tmp_path_factory) -> Path:
    """PPO layout, W=2 (embeddings Shard(1)), steps 1..6 saved at 2, 4, 6 (epoch boundary after step 4)."""
    return build_tree(tmp_path_factory, "verl_run", world_size=2, steps=6, save_every=2)


@pytest.fixture(scope="session")
def verl_run_w3(tmp_path_factory) -> Path:
    """W=3: uneven torch.chunk shards everywhere (131 and 32 rows split 44/44/43 and 11/11/10)."""
    return build_tree(tmp_path_factory, "verl_run_w3", world_size=3, steps=4, save_every=2)


@pytest.fixture(scope="session")
def verl_run_hsdp(tmp_path_factory) -> Path:
    """HSDP 2x2 ("ddp", "fsdp") mesh: placements (Replicate(), Shard(d)); ranks r and r+2 hold equal shards."""
    return build_tree(tmp_path_factory, "verl_run_hsdp", world_size=4, hsdp=True, steps=4, save_every=2)


@pytest.fixture(scope="session")
def verl_run_w1(tmp_path_factory) -> Path:
    """W=1: DTensors on a 1-rank mesh (FSDP2 keeps DTensors even unsharded)."""
    return build_tree(tmp_path_factory, "verl_run_w1", world_size=1, steps=4, save_every=2)


@pytest.fixture(scope="session")
def verl_run_critic(tmp_path_factory) -> Path:
    """PPO with a critic: global_step_N/{actor,critic}/; at W=3 the critic's score.weight [1, H] has empty shards."""
    return build_tree(tmp_path_factory, "verl_run_critic", world_size=3, steps=4, save_every=2, critic=True)


@pytest.fixture(scope="session")
def verl_run_sft(tmp_path_factory) -> Path:
    """verl's SFT layout: shards, fsdp_config.json, huggingface/ and data.pt directly in global_step_N/."""
    return build_tree(tmp_path_factory, "verl_run_sft", world_size=2, steps=4, save_every=2, sft=True)


@pytest.fixture(scope="session")
def dcp_trees(tmp_path_factory) -> dict[str, Path]:
    """harness/dcp_tree.py's gloo run (W=2), once per session for every module that reads it, cached like the trees
    above: {"megatron": verl Megatron run, "dcp": plain DCP checkpoint dir, "verl": verl FSDP2 run}. Shared: copy
    before changing anything."""
    from harness.dcp_tree import write_dcp_trees

    root = build_cached(tmp_path_factory, "dcp_trees", write_dcp_trees, world_size=2, fsdp_run=True)
    return {
        "megatron": root / "megatron" / "exp",
        "dcp": root / "dcp" / "checkpoint" / "step-1",
        "verl": root / "verl" / "exp",
    }


@pytest.fixture
def copy_run(tmp_path):
    """copy_run(src) -> a private copy of run directory `src` at tmp_path/<n>/<project>/<experiment>
    (mtimes preserved) that a test may corrupt."""
    count = 0

    def copy(src: Path) -> Path:
        nonlocal count
        count += 1
        src = Path(src)
        dst = tmp_path / f"copy{count}" / src.parent.name / src.name
        shutil.copytree(src, dst, symlinks=True)
        return dst

    return copy


# -- the fast tier --------------------------------------------------------------------------------------------
# `pytest -m "not slow"` is the fast tier; the full run (CI) runs everything. A test is `slow` when it needs a tree
# written by multi-process torch (on a cold cache each is a trainer run: minutes on 2 cores): marked here for the
# fixtures below, requested directly or through others (run_copy -> base_run -> verl_run) or named by a parametrized
# value (tests that call request.getfixturevalue(name)); tests that run the trainer themselves, or spend seconds
# otherwise, carry the mark where they are defined. The guard below fails a test that reaches one of these fixtures
# unmarked.
SLOW_FIXTURES = frozenset(
    {
        "verl_run",
        "verl_run_w3",
        "verl_run_hsdp",
        "verl_run_w1",
        "verl_run_critic",
        "verl_run_sft",
        "dcp_trees",  # harness.dcp_tree's gloo run (DCP, Megatron, FSDP2), cached like the trees above
        "trees",  # test_verify: dcp_trees
        "megatron_tree",  # test_resume_gate_trees: dcp_trees
        "trainer_logs",  # test_continuity: three trainer runs
        "dtensor_dir",  # test_pickles: a 2-process gloo group saving DTensors
        "hf_run",  # test_hf_trainer: a real transformers Trainer run (cached like the trees above)
        "ds_z2",  # test_deepspeed: trees DeepSpeed itself writes (2 gloo ranks), and Trainer with DeepSpeed
        "ds_z3",
        "ds_z1",
        "ds_z0",
        "hf_ds",
        "ds_moe",  # test_deepspeed_parallel: DeepSpeed's own MoE layers and PipelineModule (2 gloo ranks)
        "ds_pipe",
        "ds_export",  # test_export_zero: ZeRO 1/2/3 trees DeepSpeed writes for the export
        "openrlhf_tree",  # test_deepspeed_openrlhf: OpenRLHF's save sequence on two real DeepSpeed engines
        "ray_cluster",  # tests/ray_cluster.py: the session's local Ray cluster (tens of seconds to start)
    }
)


def pytest_configure(config):
    register_marker(config)  # tests/ray_cluster.py: ray_dead_node_ok


def pytest_collection_modifyitems(items):
    order_ray_tests(items)  # tests/ray_cluster.py: the tests that remove a node after the other Ray tests
    for item in items:
        callspec = getattr(item, "callspec", None)
        named = {v for v in callspec.params.values() if isinstance(v, str)} if callspec else set()
        if SLOW_FIXTURES & (set(item.fixturenames) | named):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _slow_fixtures_only_in_slow_tests(request):
    yield
    reached = SLOW_FIXTURES & set(request.fixturenames)  # includes fixtures fetched by request.getfixturevalue
    if reached and request.node.get_closest_marker("slow") is None:
        pytest.fail(f"uses {sorted(reached)} but is not marked slow: add @pytest.mark.slow", pytrace=False)

"""One local Ray cluster (ray.cluster_utils.Cluster, 3 nodes) for every Ray test of the session.

Starting a simulated node costs 3-15 s on 2 cores (30-50 s per cluster under load), and each node's first task pays
its worker's start-up too, so the Ray tests share one cluster, started when the first of them asks for
`ray_cluster` (a run without Ray tests, or without Ray, never starts it) and shut down after the last of them (or
at the end of the session), so that it does not idle through the rest of the suite.

What a test may change, and how it is put back:
- CKPT_AUDIT_NODE_ROOTS is `@<table>` for every node: a raylet's environment is fixed when the node starts, so the
  path is fixed and each test writes its own table into the file (reset to `{}` before each test). The test seams
  (ckpt_audit.cluster.ray_scan.HOLD_ENV, ray_prune.KILL_DIR_ENV) are directories, emptied before each test. The
  driver has the three variables for the test's duration only, as the nodes do.
- A node a test kills or removes is its own extra node (`ray_extra_node`), never a shared one. But Ray lists a
  removed node dead for as long as its GCS keeps it, and scan --ray counts a node Ray lists dead as silent: the
  other tests would see it. So the tests that remove a node run right after all the other Ray tests
  (`order_ray_tests`), and a test that finds a dead node listed gets a fresh cluster (`ensure`),
  unless it is marked `ray_dead_node_ok`: its assertions hold while one node an earlier test removed is listed dead
  (the GCS keeps one: DEAD_NODES_KEPT; the test's own removal evicts it). Marked tests run after the unmarked ones.
  In one run the cluster starts once; a fresh one is started only for tests run out of that order.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

# no dashboard, log monitor or autoscaler monitor: nothing here reads them, and each is a Python process polling
# on 2 shared cores
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * 2**20, "include_dashboard": False, "include_log_monitor": False}
DEAD_NODES_KEPT = 1  # the GCS forgets the older dead nodes (Ray's default keeps 1,000); 0 is refused by Ray
HEAD_ARGS = {**NODE_ARGS, "no_monitor": True, "_system_config": {"maximum_gcs_dead_node_cached_count": DEAD_NODES_KEPT}}
SHARED_NODES = 3  # tests/test_ray_scan.py splits ranks over three nodes; the others use two and leave one idle
RAY = "ray_cluster"
EXTRA = "ray_extra_node"  # the fixture that marks a test as one that removes a node
DEAD_OK = "ray_dead_node_ok"


class SharedCluster:
    """The session's cluster: `ids` are the shared nodes (the head first); `table`, `hold` and `kill` the files the
    nodes' environment names."""

    def __init__(self, base: Path) -> None:
        self.table, self.hold, self.kill = base / "node_roots.json", base / "hold", base / "kill"
        self.hold.mkdir()
        self.kill.mkdir()
        self.cluster = None
        self.ids: list[str] = []
        self.extra: list = []  # nodes added by the current test
        self.replaced = 0  # clusters replaced after a test removed a node (a figure for the report)

    def env(self) -> dict[str, str]:
        from ckpt_audit.cluster import ray_prune, ray_scan
        from ckpt_audit.cluster.noderoots import ENV

        return {ENV: f"@{self.table}", ray_scan.HOLD_ENV: str(self.hold), ray_prune.KILL_DIR_ENV: str(self.kill)}

    def ensure(self, *, dead_ok: bool = False) -> None:
        """Started, with exactly the shared nodes alive and none listed dead unless `dead_ok` (else replaced by a
        fresh cluster); the files reset. Call with env() set: nodes started now inherit it."""
        import ray

        if self.cluster is not None:
            listed = {n["NodeID"]: bool(n.get("Alive")) for n in ray.nodes()}
            alive = {n for n, up in listed.items() if up}
            if alive == set(self.ids) and (dead_ok or len(listed) == len(alive)):
                self._reset()
                return
            self.shutdown()
            self.replaced += 1
        from ray.cluster_utils import Cluster

        self._reset()
        self.cluster = Cluster(initialize_head=True, head_node_args=HEAD_ARGS)
        nodes = [self.cluster.head_node] + [self.cluster.add_node(**NODE_ARGS) for _ in range(SHARED_NODES - 1)]
        self.ids = [n.node_id for n in nodes]
        ray.init(address=self.cluster.address, logging_level="ERROR", log_to_driver=False)

    def _reset(self) -> None:
        self.table.write_text("{}")
        for d in (self.hold, self.kill):
            shutil.rmtree(d)
            d.mkdir()

    def add_node(self):
        """An extra node for the current test (it inherits env(), set while the test runs)."""
        node = self.cluster.add_node(**NODE_ARGS)
        self.extra.append(node)
        return node

    def remove(self, node_id: str) -> None:
        """Kill an extra node's raylet and workers (a shared node is refused: the other tests need it), and wait
        until Ray lists it dead (so the GCS has forgotten any older dead node: DEAD_NODES_KEPT)."""
        import ray

        assert node_id not in self.ids, "remove only the extra nodes a test added (ray_extra_node)"
        node = next(n for n in self.extra if n.node_id == node_id)
        self.cluster.remove_node(node)
        self.extra.remove(node)
        deadline = time.monotonic() + 60
        while any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes()) and time.monotonic() < deadline:
            time.sleep(0.1)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()
        self.cluster, self.ids, self.extra = None, [], []


@pytest.fixture(scope="session")
def _ray_session(tmp_path_factory):
    import ray  # noqa: F401  the test extra installs it: a broken install fails here, never skips

    shared = SharedCluster(tmp_path_factory.mktemp("ray_cluster"))
    yield shared
    if shared.cluster is not None:
        shared.shutdown()


@pytest.fixture
def ray_cluster(_ray_session, monkeypatch, request) -> SharedCluster:
    """The session's Ray cluster with the shared nodes alive (and no other node, alive or dead, unless the test is
    marked ray_dead_node_ok), an empty node-roots table and empty seam directories; ray is initialised here."""
    for name, value in _ray_session.env().items():
        monkeypatch.setenv(name, value)
    _ray_session.ensure(dead_ok=request.node.get_closest_marker(DEAD_OK) is not None)
    yield _ray_session
    items = request.session.items
    later = items[items.index(request.node) + 1 :] if request.node in items else ()
    if _ray_session.cluster is not None and not any(RAY in getattr(i, "fixturenames", ()) for i in later):
        _ray_session.shutdown()  # the last Ray test of this run


@pytest.fixture
def ray_extra_node(ray_cluster):
    """A node added to the shared cluster for this test alone, which the test may kill (`ray_cluster.remove`).
    Whether killed or not, it is removed after the test (and Ray then lists it dead: see the module docstring)."""
    node = ray_cluster.add_node()
    yield node
    if node in ray_cluster.extra:
        ray_cluster.remove(node.node_id)


def order_ray_tests(items: list) -> None:
    """Move the tests that use `ray_extra_node` (in their order, those marked ray_dead_node_ok last) to right after
    the last other Ray test: the shared cluster serves every other Ray test before the first node is removed."""

    def rank(item) -> int:
        if EXTRA not in getattr(item, "fixturenames", ()):
            return 0
        return 2 if item.get_closest_marker(DEAD_OK) is not None else 1

    moved = sorted((i for i in items if rank(i)), key=rank)
    if not moved:
        return
    first = next(k for k, i in enumerate(items) if rank(i))
    rest = [i for i in items if not rank(i)]
    ray = [k for k, i in enumerate(rest) if RAY in getattr(i, "fixturenames", ())]
    at = ray[-1] + 1 if ray else first  # no other Ray test: where the first of them was
    items[:] = rest[:at] + moved + rest[at:]


def register_marker(config) -> None:
    config.addinivalue_line(
        "markers",
        f"{DEAD_OK}: a Ray test whose assertions hold while Ray lists one node an earlier test removed as dead",
    )

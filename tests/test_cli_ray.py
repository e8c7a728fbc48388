"""scan --ray without Ray: a one-line error, exit 2; scan without --ray never imports Ray (runs without the extra)."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from cli_proc import ckpt_audit


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_ray_flag_without_the_extra_is_one_line_exit_2(tmp_path):
    code = (
        "import sys\n"
        "sys.modules['ray'] = None  # as if the extra were not installed: `import ray` raises ImportError\n"
        "from ckpt_audit.cli import cli\n"
        f"cli.main(['scan', '--ray', '--catalog', {str(tmp_path / 'c.db')!r}, {str(tmp_path)!r}])\n"
    )
    out = _run(code)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "ckpt-audit: scan --ray needs the optional extra: pip install 'ckpt-audit[ray]'"
    ]
    assert not (tmp_path / "c.db").exists()


def test_ray_address_nobody_answers_is_one_line_exit_3_at_once(tmp_path):
    """scan --ray (node-local and shared placement) and prune --ray at a port nobody listens on: Ray's own init
    retries for minutes, warning every few seconds; ours is one line, exit 3, before the catalog is created."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    catalog = str(tmp_path / "c.db")
    for args in (
        ["scan", "--ray", address, "--catalog", catalog, str(tmp_path)],
        ["scan", "--ray", address, "--placement", "shared", "--catalog", catalog, str(tmp_path)],
        ["prune", "--ray", address, "--keep-last", "1", "--dry-run", "--catalog", catalog, str(tmp_path)],
    ):
        out = _run(f"from ckpt_audit.cli import cli\ncli.main({args!r})\n")
        assert out.returncode == 3, (args, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ckpt-audit: error: cannot reach the Ray cluster at {address}")
        assert not (tmp_path / "c.db").exists()


def test_ray_flag_does_not_swallow_the_path_after_it(tmp_path):
    """`--ray PATH`: click hands the optional value the next word, which would make the root (or export's step
    directory) the address; a value that is no Ray address is a usage error naming the fix, and nothing is read."""
    catalog = str(tmp_path / "c.db")
    for args in (
        ["scan", "--catalog", catalog, "--ray", str(tmp_path)],
        ["prune", "--keep-last", "1", "--catalog", catalog, "--ray", str(tmp_path)],
        ["export", "--to", str(tmp_path / "hf"), "--catalog", catalog, "--ray", str(tmp_path)],
    ):
        out = _run(f"from ckpt_audit.cli import cli\ncli.main({args!r})\n")
        assert out.returncode == 2, (args, out.stderr)
        assert f"Invalid value for '--ray': '{tmp_path}' is not a Ray address" in out.stderr
        assert not (tmp_path / "c.db").exists() and not (tmp_path / "hf").exists()


def test_ray_values_that_are_no_address_are_usage_errors(tmp_path):
    """An empty host or port, a port that is no number or out of range, a bare scheme: each a usage error naming
    the forms, at once, before anything is read or created (Ray took ':' with a logged traceback, 'ray://' after
    30 s of gRPC errors, 'host:notaport' as exit 3)."""
    catalog = tmp_path / "c.db"
    for value in (":", ":6379", "host:", "host:notaport", "host:0", "host:65536", "ray://", "ray://:10001", "ray://h"):
        for cmd in (["scan", tmp_path], ["export", tmp_path, "--to", tmp_path / "hf"]):
            out = ckpt_audit(*cmd, "--ray", value, catalog=catalog, timeout=20)
            assert out.returncode == 2, (value, cmd, out.stderr)
            assert f"Invalid value for '--ray': '{value}' is not a Ray address" in out.stderr, out.stderr
            assert "Traceback" not in out.stderr
    assert not catalog.exists() and not (tmp_path / "hf").exists()


def test_ray_client_address_nobody_answers_is_one_line_exit_3_at_once(tmp_path):
    """ray://HOST:PORT at a port nobody listens on: Ray's client retried for 30 s and warned; the TCP check that
    HOST:PORT gets makes it one line, exit 3, before the catalog is created."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"ray://127.0.0.1:{s.getsockname()[1]}"
    out = ckpt_audit("scan", tmp_path, "--ray", address, catalog=tmp_path / "c.db", timeout=20)
    assert out.returncode == 3, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"ckpt-audit: error: cannot reach the Ray cluster at {address} (Connection refused)"
    ]
    assert not (tmp_path / "c.db").exists()


def test_ray_auto_at_a_recorded_cluster_that_is_gone_is_one_line_exit_3_at_once(tmp_path):
    """Bare --ray (auto) connects where RAY_ADDRESS (or the last `ray start`) points; a cluster gone since left Ray
    retrying for minutes with a page of C++ logs. The address auto resolves to gets the same TCP check."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        gone = f"127.0.0.1:{s.getsockname()[1]}"
    out = ckpt_audit("scan", tmp_path, "--ray", catalog=tmp_path / "c.db", env={"RAY_ADDRESS": gone}, timeout=20)
    assert out.returncode == 3, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"ckpt-audit: error: cannot reach the Ray cluster at {gone} (Connection refused)"
    ]
    assert not (tmp_path / "c.db").exists()


@pytest.mark.slow  # waits out the gRPC handshake's CONNECT_TIMEOUT_S (5 s) once
def test_ray_address_where_a_server_that_is_not_ray_listens_is_one_line_exit_3(tmp_path):
    """--ray at a port that takes TCP but is no Ray GCS (a plain TCP server; a gRPC server without Ray's services):
    the TCP check passed and Ray's connect retried past a minute. Now one line naming why, exit 3, no catalog."""
    import grpc

    plain = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: held.extend(plain.accept() for _ in range(4)), daemon=True).start()
    other = grpc.server(ThreadPoolExecutor(max_workers=1))
    other_port = other.add_insecure_port("127.0.0.1:0")
    other.start()
    catalog = tmp_path / "c.db"
    try:
        for cmd, address, why in (
            (["scan", tmp_path], f"127.0.0.1:{plain.getsockname()[1]}", "does not speak gRPC (no handshake in 5 s)"),
            (["export", tmp_path, "--to", tmp_path / "hf"], f"127.0.0.1:{other_port}", "is not a Ray GCS"),
        ):
            out = ckpt_audit(*cmd, "--ray", address, catalog=catalog, timeout=60)
            assert out.returncode == 3, out.stderr
            [line] = out.stderr.strip().splitlines()
            assert line.startswith(f"ckpt-audit: error: cannot reach the Ray cluster at {address}: the server there ")
            assert why in line
    finally:
        other.stop(None)
        plain.close()
    assert not catalog.exists() and not (tmp_path / "hf").exists()

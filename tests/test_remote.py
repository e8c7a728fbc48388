"""Object-store roots against a real S3 server (moto's standalone server, started by this module) through the real
clients (boto3 uploads the way trainers do, s3fs reads): remote scan, checksums without downloads, partial uploads,
and `compare` (prune: test_remote_prune.py). Objects read are counted in the server's own request log."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3
import pytest
import s3fs  # noqa: F401 - ckpt_audit reads s3:// through it: the test extra installs it, a broken install fails
from cli_json import age
from click.testing import CliRunner
from moto.server import ThreadedMotoServer

from ckpt_audit.cli import cli

BUCKET = "ckpt-bucket"
PART = 5 * 1024 * 1024


class RequestLog(logging.Handler):
    """The server's access log (werkzeug's), one line per request: the tests count object GETs in it."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def object_gets(self) -> list[str]:
        """Keys read by GET (a listing is a GET of the bucket with a query: not an object read)."""
        out = []
        for line in self.lines:
            m = re.search(r'"GET /([^ ?]+)(\?[^ ]*)? HTTP', line)
            if m and "/" in m.group(1) and not (m.group(2) or "").startswith(("?list", "?uploads")):
                out.append(m.group(1).split("/", 1)[1])
        return out


@pytest.fixture(scope="module")
def s3():
    log = RequestLog()
    logging.getLogger("werkzeug").addHandler(log)
    logging.getLogger("werkzeug").setLevel(logging.INFO)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    client = boto3.client("s3")
    client.create_bucket(Bucket=BUCKET)
    yield client, log
    server.stop()
    logging.getLogger("werkzeug").removeHandler(log)
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def upload(client, local: Path, prefix: str) -> None:
    """As trainers do: every rank's shards at once, .pt shards by multipart upload (CRC-64/NVME full-object, S3's
    default), the small files by one PUT with boto3's default CRC-32."""

    def one(path: Path) -> None:
        key = f"{prefix}/{path.relative_to(local)}"
        if path.suffix == ".pt":
            multipart(client, key, path.read_bytes())
        else:
            client.put_object(Bucket=BUCKET, Key=key, Body=path.read_bytes())

    with ThreadPoolExecutor(4) as pool:
        list(pool.map(one, sorted(p for p in local.rglob("*") if p.is_file())))


def multipart(client, key: str, data: bytes, *, algorithm="CRC64NVME", kind="FULL_OBJECT", complete=True) -> None:
    up = client.create_multipart_upload(Bucket=BUCKET, Key=key, ChecksumAlgorithm=algorithm, ChecksumType=kind)
    parts = []
    for n, lo in enumerate(range(0, max(len(data), 1), PART), 1):
        r = client.upload_part(
            Bucket=BUCKET, Key=key, UploadId=up["UploadId"], PartNumber=n, Body=data[lo : lo + PART],
            ChecksumAlgorithm=algorithm,
        )  # fmt: skip
        parts.append({"PartNumber": n, "ETag": r["ETag"], **{k: v for k, v in r.items() if k.startswith("Checksum")}})
        if not complete:
            return  # the trainer died here: the upload stays open, the object does not exist
    extra = {"ChecksumType": kind} if kind == "FULL_OBJECT" else {}
    client.complete_multipart_upload(
        Bucket=BUCKET, Key=key, UploadId=up["UploadId"], MultipartUpload={"Parts": parts}, **extra
    )


def cli_json(*args: str, catalog: Path) -> tuple[int, dict]:
    res = CliRunner().invoke(cli, [*args, "--json", "--catalog", str(catalog)])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.stdout)


def statuses(doc: dict) -> dict[int, str]:
    [run] = doc["runs"]
    return {c["step"]: c["status"] for c in run["checkpoints"]}


def codes(doc: dict, step: int) -> set[str]:
    [run] = doc["runs"]
    [c] = [c for c in run["checkpoints"] if c["step"] == step]
    return {f["code"] for f in c["findings"]} | {f["code"] for comp in c["components"] for f in comp["findings"]}


@pytest.fixture(scope="module")
def uploaded(s3, verl_run, tmp_path_factory):
    """verl_run scanned locally with --store-checksums, then uploaded under runs/demo/exp: (local run, catalog,
    the local scan's document)."""
    client, _log = s3
    local = tmp_path_factory.mktemp("remote") / "demo" / "exp"
    shutil.copytree(verl_run, local)
    age(local.parent.parent)
    catalog = local.parent.parent / "catalog.db"
    _, doc = cli_json("scan", "--store-checksums", str(local), catalog=catalog)
    upload(client, local, "runs/demo/exp")
    return local, catalog, doc


@pytest.mark.slow
def test_remote_scan_judges_as_local_without_downloading_shards(s3, uploaded):
    _client, log = s3
    local, catalog, local_doc = uploaded
    before = len(log.lines)
    _, doc = cli_json("scan", "--in-progress-window", "0", f"s3://{BUCKET}/runs", catalog=catalog)
    gets = RequestLog.object_gets(type("L", (), {"lines": log.lines[before:]})())  # this scan's requests only
    assert statuses(doc) == statuses(local_doc)
    assert set(statuses(doc).values()) == {"complete"}
    [run] = doc["runs"]
    assert run["path"] == f"s3://{BUCKET}/runs/demo/exp"
    assert run["tracker_step"] == local_doc["runs"][0]["tracker_step"] == 6
    assert gets, "the tracker is read"
    assert all(not g.endswith(".pt") for g in gets), gets  # no shard was downloaded
    assert all(os.path.basename(g) in ("latest_checkpointed_iteration.txt", "fsdp_config.json", "config.json")
               or g.endswith(".json") for g in gets), gets  # fmt: skip
    # ls and show answer for the URL from the catalog
    res = CliRunner().invoke(cli, ["ls", "--catalog", str(catalog)])
    assert f"s3://{BUCKET}/runs/demo/exp" in res.output or "demo/exp" in res.output
    step = f"s3://{BUCKET}/runs/demo/exp/global_step_6"
    res = CliRunner().invoke(cli, ["show", step, "--catalog", str(catalog)])
    assert res.exit_code == 0 and "complete" in res.output, res.output


@pytest.mark.slow
def test_planted_damage_is_found_from_metadata(s3, uploaded, tmp_path):
    client, log = s3
    local, catalog, _ = uploaded
    prefix = "damaged/demo/exp"
    upload(client, local, prefix)
    shard = "global_step_6/actor/model_world_size_2_rank_1.pt"
    data = bytearray((local / shard).read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte, same size
    multipart(client, f"{prefix}/{shard}", bytes(data))
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/global_step_4/actor/optim_world_size_2_rank_0.pt")
    # a zero-length object: known whole from the listing, judged as an empty local file
    client.put_object(Bucket=BUCKET, Key=f"{prefix}/global_step_4/actor/extra_state_world_size_2_rank_1.pt", Body=b"")
    # step 2's rank-1 model shard: the upload was begun and never completed (the object is gone before it)
    key2 = f"{prefix}/global_step_2/actor/model_world_size_2_rank_1.pt"
    client.delete_object(Bucket=BUCKET, Key=key2)
    multipart(client, key2, (local / "global_step_2/actor/model_world_size_2_rank_1.pt").read_bytes(), complete=False)
    before = len(log.lines)
    code, doc = cli_json("scan", "--in-progress-window", "0", f"s3://{BUCKET}/damaged", catalog=catalog)
    gets = RequestLog.object_gets(type("L", (), {"lines": log.lines[before:]})())
    assert code == 1
    st = statuses(doc)
    assert st[6] == "corrupt" and "remote-checksum-mismatch" in codes(doc, 6)
    assert st[4] != "complete" and {"missing-rank", "zero-byte"} <= codes(doc, 4)
    assert st[2] == "unknown" and "upload-in-progress" in codes(doc, 2)
    assert not [g for g in gets if g.endswith(".pt")]
    # the resume gate names none of them; --verified reads nothing it could name
    res = CliRunner().invoke(
        cli,
        ["latest", "--verified", "--in-progress-window", "0", f"s3://{BUCKET}/{prefix}", "--catalog", str(catalog)]
        + ["--json"],
    )
    assert res.exit_code == 1 and json.loads(res.stdout)["step"] is None, res.output


@pytest.mark.slow
def test_composite_checksum_is_unverified_until_read(s3, uploaded):
    client, _ = s3
    local, catalog, _ = uploaded
    prefix = "composite/demo/exp"
    upload(client, local, prefix)
    shard = "global_step_6/actor/optim_world_size_2_rank_0.pt"
    multipart(client, f"{prefix}/{shard}", (local / shard).read_bytes(), algorithm="CRC32C", kind="COMPOSITE")
    _, doc = cli_json("scan", "--in-progress-window", "0", f"s3://{BUCKET}/composite", catalog=catalog)
    assert statuses(doc)[6] == "unknown" and "remote-unverified" in codes(doc, 6)
    _, doc = cli_json("scan", "--read-data", "--in-progress-window", "0", f"s3://{BUCKET}/composite", catalog=catalog)
    assert statuses(doc)[6] == "complete"


@pytest.mark.slow
def test_compare_exact_copy_and_each_difference(s3, uploaded):
    client, _ = s3
    local, _catalog, _ = uploaded
    runner = CliRunner()
    res = runner.invoke(cli, ["compare", str(local), f"s3://{BUCKET}/runs/demo/exp"])
    assert res.exit_code == 0, res.output
    prefix = "copy/demo/exp"
    upload(client, local, prefix)
    shard = "global_step_4/actor/model_world_size_2_rank_0.pt"
    data = bytearray((local / shard).read_bytes())
    data[100] ^= 1
    multipart(client, f"{prefix}/{shard}", bytes(data))
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/global_step_2/data.pt")
    res = runner.invoke(cli, ["compare", str(local), f"s3://{BUCKET}/{prefix}", "--json"])
    assert res.exit_code == 1, res.output
    diffs = {d["path"]: d["reason"] for d in json.loads(res.stdout)["differences"]}
    assert set(diffs) == {shard, "global_step_2/data.pt"}
    assert "checksum differs" in diffs[shard] and "only in" in diffs["global_step_2/data.pt"]


def test_prune_refuses_remote_with_local_roots_and_read_data_on_local(tmp_path):
    res = CliRunner().invoke(
        cli, ["prune", "s3://bucket/ckpts", str(tmp_path), "--keep-last", "1", "--catalog", str(tmp_path / "c.db")]
    )
    assert res.exit_code == 2 and "s3://" in res.output
    res = CliRunner().invoke(cli, ["prune", str(tmp_path), "--read-data", "--catalog", str(tmp_path / "c.db")])
    assert res.exit_code == 2 and "--read-data" in res.output


def test_compare_of_a_missing_directory_is_an_error(tmp_path):
    res = CliRunner().invoke(cli, ["compare", str(tmp_path / "nope"), str(tmp_path)])
    assert res.exit_code == 3 and "not a directory" in res.output


@pytest.mark.slow
def test_latest_verified_never_names_a_partially_uploaded_step(s3, uploaded):
    client, log = s3
    local, catalog, _ = uploaded
    prefix = "partial/demo/exp"
    upload(client, local, prefix)
    shard = "global_step_6/actor/model_world_size_2_rank_1.pt"
    client.delete_object(Bucket=BUCKET, Key=f"{prefix}/{shard}")
    multipart(client, f"{prefix}/{shard}", (local / shard).read_bytes(), complete=False)
    before = len(log.lines)
    res = CliRunner().invoke(
        cli,
        ["latest", "--verified", "--in-progress-window", "0", f"s3://{BUCKET}/{prefix}", "--catalog", str(catalog)]
        + ["--json"],
    )
    gets = RequestLog.object_gets(type("L", (), {"lines": log.lines[before:]})())
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["step"] == 4, res.output
    # --verified read the step it names by content (GETs of its shards), and no other step's
    assert {g for g in gets if g.endswith(".pt")} >= {f"{prefix}/global_step_4/actor/{shard.split('/')[-1]}"}
    assert not [g for g in gets if g.endswith(".pt") and "global_step_4" not in g], res.output


def test_a_bucket_that_is_not_there_is_one_line_exit_3(s3, tmp_path):
    res = CliRunner().invoke(cli, ["scan", "s3://no-such-bucket-here/ckpts", "--catalog", str(tmp_path / "c.db")])
    assert res.exit_code == 3 and "no-such-bucket-here" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output


@pytest.mark.slow
def test_store_checksums_fill_in_on_a_catalog_scanned_without_them(verl_run, tmp_path):
    """A run whose verdict the catalog caches is still read for the checksums --store-checksums asks for, once."""
    import sqlite3

    local = tmp_path / "demo" / "exp"
    shutil.copytree(verl_run, local)
    age(tmp_path)
    catalog = tmp_path / "catalog.db"
    for _ in range(2):  # the second scan stores the run's verdict for reuse
        cli_json("scan", str(local), catalog=catalog)
    cli_json("scan", "--store-checksums", str(local), catalog=catalog)
    with sqlite3.connect(catalog) as db:
        rows = db.execute("SELECT path, store_checksums FROM files WHERE present = 1").fetchall()
    assert rows and all(s and "crc64nvme=" in s for _, s in rows), [p for p, s in rows if not s]
    _, doc = cli_json("scan", "--store-checksums", "--no-scrub", str(local), catalog=catalog)
    assert doc["files_reused"] == len(rows)  # every catalogued file now reused by stat, checksums and all
    cli_json("scan", "--rehash", str(local), catalog=catalog)  # re-read without the flag: the same bytes keep them
    with sqlite3.connect(catalog) as db:
        assert db.execute("SELECT path, store_checksums FROM files WHERE present = 1").fetchall() == rows

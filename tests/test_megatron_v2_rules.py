"""rules.megatron_v2 alone (fast tier): the HF content check of a layout-v2 manifest, on the names and index text a
scan hands it. The trees verl writes are in tests/test_megatron_v2.py; these are the HF contents a bridge writes,
which no CPU run here can make (mbridge needs a GPU)."""

from __future__ import annotations

import json

import pytest

from ckpt_audit.readers.megatron_meta import read_meta
from ckpt_audit.rules.megatron_v2 import check_hf, check_link, optimizer_format

INDEX = "model.safetensors.index.json"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def _index(*files: str) -> str:
    return json.dumps({"metadata": {"total_size": 8}, "weight_map": {f"w{i}": f for i, f in enumerate(files)}})


def test_whole_sharded_weights_pass():
    names = frozenset({"config.json", INDEX, *SHARDS})
    assert check_hf("/hf", names, {INDEX: (_index(*SHARDS), True)}, weights=True) == []


def test_a_shard_the_index_names_is_missing():
    names = frozenset({"config.json", INDEX, SHARDS[0]})
    [f] = check_hf("/hf", names, {INDEX: (_index(*SHARDS), True)}, weights=True)
    assert (f.code, f.path) == ("hf-shard-missing", f"/hf/{SHARDS[1]}")


def test_a_prefix_of_a_large_index_never_invents_an_absence():
    names = frozenset({"config.json", INDEX, SHARDS[0]})
    assert check_hf("/hf", names, {INDEX: (_index(*SHARDS)[:60], False)}, weights=True) == []


def test_config_only_where_weights_are_listed():
    [f] = check_hf("/hf", frozenset({"config.json", "tokenizer.json"}), {}, weights=True)
    assert f.code == "megatron-v2-content-missing" and "no model.safetensors" in f.message
    assert check_hf("/hf", frozenset({"config.json"}), {}, weights=False) == []  # hf_config / tokenizer contents


def test_weights_without_config():
    [f] = check_hf("/hf", frozenset({"model.safetensors"}), {}, weights=True)
    assert (f.code, f.path) == ("megatron-v2-content-missing", "/hf/config.json")


ROLE = "/runs/exp/global_step_8/actor"


@pytest.mark.parametrize(
    ("text", "exists", "code"),
    [
        ("/runs/exp/global_step_8/actor/dist_ckpt", True, "megatron-link-absolute"),  # verl's --mode symlink
        ("../../../../other/global_step_8/actor/dist_ckpt", True, "megatron-link-absolute"),  # out of the run
        ("../dist_ckpt", True, None),  # relative, inside the run: moves with it
        ("/old/place/exp/global_step_8/actor/dist_ckpt", False, "megatron-link-dangling"),
    ],
)
def test_links_in_a_v2_role(text, exists, code):
    f = check_link(f"{ROLE}/model/dist_ckpt", text, exists=exists, run_dir="/runs/exp")
    assert (f.code if f else None) == code


def test_optimizer_format_flags_as_common_pt_records_them():
    """The content_metadata megatron-core keeps in common.pt (as the restricted unpickler gives it) and what it
    lets a resume change."""
    tree = {"content_metadata": {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False}}
    meta = dict(read_meta(tree))
    assert meta == {"distrib_optim_sharding_type": "dp_reshardable", "singleton_local_shards": False}
    got = optimizer_format(meta)
    assert got["dist_ckpt_optim_fully_reshardable"] is False and "only the data-parallel size" in got["resharding"]
    assert optimizer_format({"distrib_optim_sharding_type": "fully_reshardable"})["dist_ckpt_optim_fully_reshardable"]
    plain = optimizer_format({"singleton_local_shards": False})  # no distributed optimizer
    assert plain["distrib_optim_sharding_type"] is None and plain["dist_ckpt_optim_fully_reshardable"] is None
    assert read_meta({"optimizer": {}}) == () and read_meta({"content_metadata": [1]}) == ()

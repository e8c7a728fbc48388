"""rules.megatron_v2 alone (fast tier): the HF content check of a layout-v2 manifest, on the names and index text a
scan hands it. The trees verl writes are in tests/test_megatron_v2.py; these are the HF contents a bridge writes,
which no CPU run here can make (mbridge needs a GPU)."""

from __future__ import annotations

import json

from ckpt_audit.rules.megatron_v2 import check_hf

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

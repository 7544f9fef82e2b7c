"""How a tensor-parallel build splits the weights (runtime/native/parallel/sharding.py), without starting ranks."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.engines.native.builder import build_native_engine
from kiln.runtime.errors import KilnError
from kiln.runtime.native.engine_format import EngineConfig
from kiln.runtime.native.parallel.sharding import rank_architecture, shard_weights, sharding_problems
from tests.model_factories import make_hf_checkpoint, tiny_plan

HEAD_DIM = 16


def fused_qkv(arch) -> dict[str, torch.Tensor]:
    """A qkv_proj whose every row holds its own index, and a bias likewise."""
    rows = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    index = torch.arange(rows, dtype=torch.float32)
    return {"layers.0.self_attn.qkv_proj.weight": index[:, None].expand(rows, 8).clone(),
            "layers.0.self_attn.qkv_proj.bias": index.clone(),
            "layers.0.self_attn.qkv_proj.input_scale": torch.tensor(0.5)}


def test_each_rank_gets_its_query_heads_and_the_kv_head_they_share_when_ranks_outnumber_kv_heads(tmp_path):
    arch = architecture(tmp_path, num_heads=4, num_kv_heads=1)
    shards = shard_weights(fused_qkv(arch), arch, 2)
    q, kv = 4 * HEAD_DIM, HEAD_DIM
    for rank, shard in enumerate(shards):
        rows = shard["layers.0.self_attn.qkv_proj.bias"].long().tolist()
        expected = [*range(rank * q // 2, (rank + 1) * q // 2), *range(q, q + kv), *range(q + kv, q + 2 * kv)]
        assert rows == expected
        assert shard["layers.0.self_attn.qkv_proj.weight"][:, 0].long().tolist() == expected
        assert shard["layers.0.self_attn.qkv_proj.input_scale"] == 0.5  # an input scale is replicated
    assert rank_architecture(arch, 2).num_kv_heads == 1 and rank_architecture(arch, 2).num_heads == 2


def test_row_parallel_linears_split_their_inputs_and_keep_the_bias_on_rank_zero(tmp_path):
    arch = architecture(tmp_path)
    weights = {"layers.0.mlp.down_proj.qweight": torch.arange(6 * 64, dtype=torch.uint8).reshape(6, 64),
               "layers.0.mlp.down_proj.scales": torch.arange(6 * 4.0).reshape(6, 4),
               "layers.0.mlp.down_proj.pre_quant_scale": torch.arange(128.0),
               "layers.0.mlp.down_proj.bias": torch.ones(6),
               "layers.0.mlp.down_proj.weight_scale": torch.ones(6)}
    first, second = shard_weights(weights, arch, 2)
    assert torch.equal(torch.cat([first["layers.0.mlp.down_proj.qweight"], second["layers.0.mlp.down_proj.qweight"]],
                                 dim=1), weights["layers.0.mlp.down_proj.qweight"])
    assert second["layers.0.mlp.down_proj.scales"].tolist() == [[4 * r + 2, 4 * r + 3] for r in range(6)]
    assert second["layers.0.mlp.down_proj.pre_quant_scale"][0] == 64
    assert first["layers.0.mlp.down_proj.bias"].sum() == 6 and second["layers.0.mlp.down_proj.bias"].sum() == 0
    assert torch.equal(second["layers.0.mlp.down_proj.weight_scale"], torch.ones(6))


def test_vocabulary_rows_split_with_the_last_rank_padded(tmp_path):
    arch = architecture(tmp_path, vocab_size=97)
    embedding = torch.arange(97.0)[:, None].expand(97, 4).clone()
    first, second = shard_weights({"embed_tokens.weight": embedding, "lm_head.weight": embedding}, arch, 2)
    assert first["embed_tokens.weight"].shape == second["lm_head.weight"].shape == (49, 4)
    assert second["embed_tokens.weight"][:, 0].tolist() == [*range(49, 97), 0]


def test_shapes_that_do_not_divide_are_named(tmp_path):
    arch = architecture(tmp_path, num_heads=4, num_kv_heads=2, intermediate_size=128)
    assert sharding_problems(arch, 1) == [] and sharding_problems(arch, 4) == []
    assert sharding_problems(arch, 3) == [
        "num_attention_heads (4) is not a multiple of tp_size 3",
        "num_key_value_heads (2) neither divides nor is a multiple of tp_size 3",
        "intermediate_size (128) is not a multiple of tp_size 3"]
    assert sharding_problems(arch, 2, group_size=128) == [
        "the attention output (64 features) over tp_size 2 splits an INT4 group of 128",
        "intermediate_size (128 features) over tp_size 2 splits an INT4 group of 128"]


def test_a_tp_build_writes_one_weight_file_per_rank_and_records_tp_size(tmp_path):
    make_hf_checkpoint(tmp_path / "checkpoint", 0, num_heads=4, num_kv_heads=2)
    (tmp_path / "engine").mkdir()
    build_native_engine(tmp_path / "checkpoint", tmp_path / "engine", tiny_plan(), "float32", tp_size=2)
    assert sorted(p.name for p in (tmp_path / "engine").glob("rank*.safetensors")) == \
        ["rank0.safetensors", "rank1.safetensors"]
    assert json.loads((tmp_path / "engine" / "engine.json").read_text())["parallel"] == {"tp_size": 2}
    assert EngineConfig.load(tmp_path / "engine").tp_size == 2


def test_a_tp_size_that_splits_heads_unevenly_is_refused_before_anything_is_written(tmp_path):
    make_hf_checkpoint(tmp_path / "checkpoint", 0, num_heads=4, num_kv_heads=2)
    (tmp_path / "engine").mkdir()
    with pytest.raises(KilnError, match=r"tp_size 3 cannot split this model: num_attention_heads \(4\)"):
        build_native_engine(tmp_path / "checkpoint", tmp_path / "engine", tiny_plan(), "float32", tp_size=3)
    assert not any((tmp_path / "engine").iterdir())


def architecture(tmp_path, **config):
    from kiln.engines.native.checkpoint import read_architecture

    make_hf_checkpoint(tmp_path / "arch", 0, **{"head_dim": HEAD_DIM, **config})
    arch, _ = read_architecture(tmp_path / "arch")
    return arch


def test_a_cuda_engine_needs_as_many_gpus_as_ranks(monkeypatch):
    from kiln.runtime.errors import FingerprintMismatchError
    from kiln.runtime.native.parallel.launch import check_devices

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(FingerprintMismatchError, match=r"split over 2 GPUs \(tp_size 2\) but this machine has 1"):
        check_devices(torch.device("cuda"), 2)
    check_devices(torch.device("cuda"), 1)
    check_devices(torch.device("cpu"), 8)  # CPU ranks are processes of one host


def test_the_bench_floor_of_a_tp_engine_counts_one_ranks_reads_on_gpus_and_every_ranks_on_one_cpu(tmp_path):
    from kiln.pipeline.bench.floor import decode_step_bytes, ranks_sharing_memory, tensor_bytes

    make_hf_checkpoint(tmp_path / "checkpoint", 0, num_heads=4, num_kv_heads=2)
    for tp_size in (1, 2):
        (tmp_path / f"tp{tp_size}").mkdir()
        build_native_engine(tmp_path / "checkpoint", tmp_path / f"tp{tp_size}", tiny_plan(), "float32",
                            tp_size=tp_size)
    assert ranks_sharing_memory("cuda", 2) == 1 and ranks_sharing_memory("cpu", 2) == 2  # one memory bus
    one, rank, both = (decode_step_bytes(tmp_path / f"tp{n}", 10, 10, ranks=ranks) for n, ranks in
                       ((1, 1), (2, 1), (2, 2)))
    shards = [tensor_bytes(tmp_path / "tp2" / f"rank{r}.safetensors") for r in (0, 1)]
    assert rank["weight_bytes"] == sum(shards[0].values()) - shards[0]["embed_tokens.weight"]
    assert rank["kv_bytes_per_token"] * 2 == one["kv_bytes_per_token"] and rank["tp_size"] == 2
    assert one["weight_bytes"] / 2 < rank["weight_bytes"] < one["weight_bytes"]  # norms are replicated
    assert both["weight_bytes"] == sum(sum(s.values()) - s["embed_tokens.weight"] for s in shards)
    assert both["weight_bytes"] > one["weight_bytes"]  # each rank reads its own copy of the norms
    assert both["kv_bytes_per_token"] == one["kv_bytes_per_token"] and both["ranks_counted"] == 2
    assert both["bytes_per_step"] == both["weight_bytes"] + both["kv_bytes"]

"""Native engine builder: engine.json contract, runtime weight layout, plan validation, fingerprint checks."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kiln.engines.eos import stopping_eos_ids
from kiln.engines.native import plan as native_plan
from kiln.engines.native.builder import build_native_engine
from kiln.runtime.errors import EngineFormatError, FingerprintMismatchError, KilnError
from kiln.runtime.native import kv_cache
from kiln.runtime.native.engine_format import ENGINE_FORMAT_VERSION, EngineConfig
from kiln.runtime.native.fingerprint import check_fingerprint, machine_fingerprint
from kiln.runtime.native.kv_cache import allocate_kv_cache, is_token_major, kv_bytes_per_block
from kiln.runtime.native.model.decoder import DecoderModel
from kiln.runtime.options import RuntimeOptions
from tests.model_factories import make_hf_checkpoint, make_hf_model, tiny_plan, write_tokenizer

ARCHITECTURE_KEYS = {"type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling", "tie_word_embeddings",
                     "max_position_embeddings", "bos_token_id", "eos_token_ids"}
H200 = {"device": "cuda", "gpu_name": "NVIDIA H200", "compute_capability": "9.0", "torch": "2.13",
        "triton": "3.5.0", "cuda": "12.8"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("hf"), hidden_size=64, num_heads=4, num_kv_heads=2)


def build(checkpoint, tmp_path, plan=None, dtype="float32", name="engine"):
    out = tmp_path / name
    out.mkdir()
    return build_native_engine(checkpoint, out, plan or tiny_plan(), dtype), out


def test_engine_json_has_every_contract_key(checkpoint, tmp_path):
    engine, out = build(checkpoint, tmp_path)
    on_disk = json.loads((out / "engine.json").read_text())
    assert on_disk == engine
    assert engine["format"] == "kiln-native" and engine["format_version"] == ENGINE_FORMAT_VERSION
    assert engine["architecture"].keys() >= ARCHITECTURE_KEYS
    assert engine["architecture"]["eos_token_ids"] == [2]
    assert engine["dtype"] == "float32"
    assert engine["quantization"].keys() >= {"format", "group_size", "kv_cache_dtype", "exclude_modules"}
    assert engine["plan"] == {**tiny_plan().to_dict(), "kv_cache_dtype": "float32"}
    assert engine["fingerprint"] == machine_fingerprint("cpu")
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}


def test_a_chat_template_jinja_file_is_copied_into_the_engine(checkpoint, tmp_path):
    source = shutil.copytree(checkpoint, tmp_path / "hf")
    template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (source / "chat_template.jinja").write_text(template)
    _, out = build(source, tmp_path)
    assert (out / "chat_template.jinja").read_text() == template


def test_a_checkpoint_folder_whose_name_is_not_utf8_is_refused_naming_the_fix(checkpoint, tmp_path):
    source = shutil.copytree(checkpoint, tmp_path / os.fsdecode(b"lat\xe9in1"))
    with pytest.raises(KilnError, match="not valid UTF-8, which the safetensors library cannot open; rename"):
        build(source, tmp_path)


def test_the_weights_get_the_mode_of_a_new_file_so_other_users_can_load_the_engine(checkpoint, tmp_path):
    from kiln.engines.cache.manifest import new_file_mode

    _, out = build(checkpoint, tmp_path)
    assert (out / "rank0.safetensors").stat().st_mode & 0o777 == new_file_mode()  # 0644 under umask 022, not 0600


def test_weights_are_fused_in_runtime_layout(checkpoint, tmp_path):
    _, out = build(checkpoint, tmp_path, dtype="bfloat16")
    with safe_open(str(out / "rank0.safetensors"), "pt") as f:
        qkv = f.get_tensor("layers.0.self_attn.qkv_proj.weight")
        gate_up = f.get_tensor("layers.1.mlp.gate_up_proj.weight")
        names = list(f.keys())
    assert not any("q_proj" in name or "gate_proj" in name for name in names)
    assert qkv.shape == (64 + 2 * 2 * 16, 64) and qkv.dtype == torch.bfloat16
    assert gate_up.shape == (2 * 128, 64)


def test_a_batch_whose_full_length_sequences_do_not_all_fit_builds_and_one_that_does_not_fit_is_refused(
        checkpoint, tmp_path, monkeypatch):
    """As in TensorRT-LLM and vLLM, max_batch_size sequences of max_seq_len need not fit at once (the scheduler
    admits what fits); a KV budget below one sequence is refused, saying which max_seq_len would fit."""
    config = EngineConfig.from_dict(build(checkpoint, tmp_path, name="fits")[0])
    per_seq = kv_bytes_per_block(config) * (64 // 4)
    monkeypatch.setattr(kv_cache, "CPU_KV_MAX_BYTES", 3 * per_seq + 1)  # the pool a CPU engine allocates at most
    assert native_plan.check_kv_cache_fits(config, "cpu", 0) == 3
    built = tmp_path / "three-of-four"
    built.mkdir()
    build_native_engine(checkpoint, built, tiny_plan(max_batch_size=4), "float32")
    assert (built / "engine.json").is_file()
    monkeypatch.setattr(kv_cache, "CPU_KV_MAX_BYTES", per_seq * 3 // 4)
    out = tmp_path / "engine"
    out.mkdir()
    with pytest.raises(KilnError, match=r"one sequence of build.max_seq_len 64 needs .* lower build.max_seq_len to "
                                        r"48"):
        build_native_engine(checkpoint, out, tiny_plan(max_batch_size=4), "float32")
    assert list(out.iterdir()) == []
    assert native_plan.check_kv_cache_fits(config, "cpu", 0, RuntimeOptions(num_kv_blocks=2 * 16)) == 2
    with pytest.raises(KilnError, match=r"holds 8 blocks .*, the num_kv_blocks given: lower build.max_seq_len to 32, "
                                        r"or give a larger num_kv_blocks$"):  # no FP8 cache: the blocks are counted
        build_native_engine(checkpoint, out, tiny_plan(max_batch_size=4), "float32",
                            options=RuntimeOptions(num_kv_blocks=8))
    assert list(out.iterdir()) == []


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("intermediate_size", 96, r"layers.0.mlp.gate_up_proj.weight has shape \[256, 64\], expected \[192, 64\]"),
    ("head_dim", 8, r"layers.0.self_attn.qkv_proj.weight has shape \[128, 64\], expected \[64, 64\]"),
])
def test_tensors_that_disagree_with_config_json_are_refused_before_anything_is_written(checkpoint, tmp_path, field,
                                                                                        value, problem):
    source = shutil.copytree(checkpoint, tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, field: value}))
    out = tmp_path / "engine"
    out.mkdir()
    with pytest.raises(KilnError, match=f"tensors do not match its config.json .*{problem}"):
        build_native_engine(source, out, tiny_plan(), "float32")
    assert list(out.iterdir()) == []


def test_sizes_that_overflow_torch_are_refused_naming_config_json_before_anything_is_written(checkpoint, tmp_path):
    source = shutil.copytree(checkpoint, tmp_path / "hf")
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "hidden_size": 2**40, "intermediate_size": 2**42,
                                                    "head_dim": 16}))  # before: RuntimeError, storage size overflowed
    with pytest.raises(KilnError, match=r"config.json: vocab_size \d+, hidden_size 1099511627776 make embed_tokens"):
        build(source, tmp_path)
    assert list((tmp_path / "engine").iterdir()) == []


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("num_layers", 1e9, "num_layers must be a positive integer, got 1000000000.0"),
    ("num_layers", 10**9, "num_layers 1000000000 is more than 10,000"),
    ("vocab_size", 2**40, "vocab_size 1099511627776, hidden_size 64 make embed_tokens a tensor of 7.04e+13"),
])
def test_an_engine_json_of_sizes_no_model_has_is_refused_before_anything_is_allocated(checkpoint, tmp_path, field,
                                                                                     value, problem):
    engine, out = build(checkpoint, tmp_path)
    (out / "engine.json").write_text(json.dumps({**engine, "architecture": {**engine["architecture"], field: value}}))
    with pytest.raises(EngineFormatError, match=f"engine.json: architecture: {re.escape(problem)}"):
        EngineConfig.load(out)  # before: LLM.load grew memory for a billion layers, or failed in the allocator


def test_an_architecture_of_no_supported_family_is_refused_naming_the_supported_ones(tmp_path):
    checkpoint = make_hf_checkpoint(tmp_path / "hf")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(KilnError, match="architecture 'GPT2LMHeadModel' is not supported by the native backend "
                                        r"\(supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, "
                                        r"Qwen3ForCausalLM, Gemma2ForCausalLM, Phi3ForCausalLM\)"):
        build(checkpoint, tmp_path)


@pytest.mark.parametrize(("overrides", "message"), [
    (dict(max_input_len=80, max_seq_len=64), r"build.max_input_len \(80\) must not exceed build.max_seq_len \(64\)"),
    (dict(max_seq_len=512, max_input_len=64), r"exceeds the model's max_position_embeddings \(256\)"),
    (dict(tokens_per_block=6), r"build.tokens_per_block \(6\) must be a power of two"),
    (dict(max_batch_size=0), r"build.max_batch_size must be a positive integer"),
    (dict(kv_cache_dtype="fp8"), r"needs a checkpoint with FP8 KV cache scales"),
])
def test_impossible_plans_are_refused(checkpoint, tmp_path, overrides, message):
    with pytest.raises(KilnError, match=message):
        build(checkpoint, tmp_path, tiny_plan(**overrides))


def test_token_budget_below_max_input_len_is_allowed_for_chunked_prefill(checkpoint, tmp_path):
    engine, _ = build(checkpoint, tmp_path, tiny_plan(max_num_tokens=16, max_input_len=48))
    assert engine["plan"]["max_num_tokens"] == 16


def test_older_rope_scaling_and_generation_config_eos_ids_are_read(tmp_path):
    checkpoint = make_hf_checkpoint(tmp_path / "hf")
    config = json.loads((checkpoint / "config.json").read_text())
    del config["rope_parameters"]
    config.update(rope_theta=500000.0, eos_token_id=[2, 5], rope_scaling={
        "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})
    (checkpoint / "config.json").write_text(json.dumps(config))
    (checkpoint / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2]}))
    arch = build(checkpoint, tmp_path)[0]["architecture"]
    assert arch["rope_theta"] == 500000.0 and arch["rope_scaling"]["rope_type"] == "llama3"
    assert arch["eos_token_ids"] == [7, 2]  # generation_config.json's replace config.json's, as in transformers
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "t9"}))
    # the tokenizer's EOS too, where it is another (a ChatML fine-tune's <|im_end|>), as vLLM stops on it
    assert build(checkpoint, tmp_path, name="chatml")[0]["architecture"]["eos_token_ids"] == [7, 2, 9]


def test_a_tokenizer_eos_past_the_models_vocabulary_is_no_stop_id(checkpoint):
    tokenizer_config = json.loads((checkpoint / "tokenizer_config.json").read_text())
    (checkpoint / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "eos_token": "t9"}))
    assert stopping_eos_ids(checkpoint, {"vocab_size": 10, "eos_token_id": 2}, {}) == [2, 9]
    # an added token the embeddings lack: banning it (min_tokens) would index past the logits
    assert stopping_eos_ids(checkpoint, {"vocab_size": 9, "eos_token_id": 2}, {}) == [2]


def test_kv_cache_allocation_matches_bytes_per_block(checkpoint, tmp_path):
    config = EngineConfig.from_dict(build(checkpoint, tmp_path)[0])
    caches = allocate_kv_cache(config, num_blocks=3, device="cpu")
    assert len(caches) == 2 and caches[0][0].shape == (3, 4, 2, 16)
    assert sum(k.nbytes + v.nbytes for k, v in caches) == 3 * kv_bytes_per_block(config)
    assert all(k.is_contiguous() and v.is_contiguous() for k, v in caches)  # bf16: both row-major


def test_an_fp8_v_cache_is_allocated_token_major(checkpoint, tmp_path):
    engine = build(checkpoint, tmp_path)[0]
    config = EngineConfig.from_dict({**engine, "plan": {**engine["plan"], "kv_cache_dtype": "float8_e4m3fn"}})
    (k, v), _ = allocate_kv_cache(config, num_blocks=3, device="cpu")
    assert k.dtype == v.dtype == torch.float8_e4m3fn and k.shape == v.shape == (3, 4, 2, 16)
    assert k.is_contiguous() and is_token_major(v) and v.stride() == (4 * 2 * 16, 1, 16 * 4, 4)


def test_foreign_newer_or_older_engine_json_is_refused_with_the_advice_that_fits(checkpoint, tmp_path):
    engine, out = build(checkpoint, tmp_path)
    (out / "engine.json").write_text(json.dumps({**engine, "format_version": ENGINE_FORMAT_VERSION + 1}))
    with pytest.raises(EngineFormatError, match="built by a newer kiln; upgrade kiln"):
        EngineConfig.load(out)
    (out / "engine.json").write_text(json.dumps({**engine, "format_version": 0}))
    with pytest.raises(EngineFormatError, match=f"is not {ENGINE_FORMAT_VERSION}; rebuild the engine with this"):
        EngineConfig.load(out)
    (out / "engine.json").write_text(json.dumps({**engine, "format_version": 1}))  # before the refusal of unknowns
    assert EngineConfig.load(out).architecture == EngineConfig.from_dict(engine).architecture
    for where, extra in (("architecture", {"attention_sinks": True}), ("quantization", {"rotation": "hadamard"}),
                         ("plan", {"speculative_tokens": 4}), ("parallel", {"pp_size": 2}), (None, {"draft": {}})):
        future = {**engine, **({where: {**engine.get(where, {}), **extra}} if where else extra)}
        (out / "engine.json").write_text(json.dumps(future))
        field_name = f"{where}.{next(iter(extra))}" if where else next(iter(extra))
        with pytest.raises(EngineFormatError, match=rf"{field_name} is not a field this version of kiln reads: the "
                                                    rf"engine was built by a newer kiln"):  # before: dropped, and the
            EngineConfig.load(out)  # engine computed as if the field were not there
    (out / "engine.json").write_text(json.dumps({**engine, "format": "trtllm"}))
    with pytest.raises(EngineFormatError, match="not a kiln native engine"):
        EngineConfig.load(out)


def test_a_folder_without_an_engine_says_what_to_load_instead(tmp_path):
    with pytest.raises(EngineFormatError, match="pass the directory `kiln build` printed"):
        EngineConfig.load(tmp_path)
    (tmp_path / "engine").mkdir()  # a cache entry's folder, which holds its engine in engine/
    with pytest.raises(EngineFormatError, match=f"load {tmp_path / 'engine'}"):
        EngineConfig.load(tmp_path)


def test_fingerprint_mismatch_names_each_differing_field():
    cpu = machine_fingerprint("cpu")
    with pytest.raises(FingerprintMismatchError) as e:
        check_fingerprint(H200, {**cpu, "torch": "2.12"})
    message = str(e.value)
    assert "engine built for NVIDIA H200 (sm 9.0), this machine has cpu" in message
    assert "engine built with torch 2.13, this machine has torch 2.12" in message
    assert "engine built with triton 3.5.0, this machine has no triton" in message


def test_fingerprint_of_the_same_machine_passes():
    check_fingerprint(machine_fingerprint("cpu"), machine_fingerprint("cpu"))
    check_fingerprint(H200, {**H200, "cuda": "12.9"})  # the CUDA runtime version alone is not a mismatch


def test_sharded_checkpoint_builds_the_same_weights(checkpoint, tmp_path):
    sharded = tmp_path / "sharded"
    make_hf_model(hidden_size=64, num_heads=4, num_kv_heads=2).save_pretrained(sharded, max_shard_size="40KB")
    write_tokenizer(sharded, 96)
    assert (sharded / "model.safetensors.index.json").is_file()
    _, single_dir = build(checkpoint, tmp_path, name="single")
    _, sharded_dir = build(sharded, tmp_path, name="from-shards")
    single, from_shards = (load_file(d / "rank0.safetensors") for d in (single_dir, sharded_dir))
    assert single.keys() == from_shards.keys()
    assert all(torch.equal(single[k], from_shards[k]) for k in single)


@pytest.mark.parametrize(("name", "text"), [("tokenizer.json", "{not json"), ("tokenizer.json", '{"model": 3}'),
                                          ("tokenizer_config.json", "[1, 2]")])
def test_a_tokenizer_that_does_not_load_is_refused_before_anything_is_written(checkpoint, tmp_path, name, text):
    source = shutil.copytree(checkpoint, tmp_path / "hf")
    (source / name).write_text(text)
    out = tmp_path / "engine"
    out.mkdir()
    with pytest.raises(EngineFormatError, match=f"{name}: "):
        build_native_engine(source, out, tiny_plan(), "float32")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("kept", [(), ("vocab.json",)])
def test_a_checkpoint_with_no_tokenizer_json_nor_files_to_make_one_from_is_refused(checkpoint, tmp_path, kept):
    source = shutil.copytree(checkpoint, tmp_path / "hf")
    (source / "tokenizer.json").unlink()
    for name in kept:  # merges.txt missing: no GPT-2-style tokenizer either
        (source / name).write_text("{}")
    out = tmp_path / "engine"
    out.mkdir()
    with pytest.raises(KilnError, match=r"no tokenizer.json \(nor vocab.json \+ merges.txt or tokenizer.model"):
        build_native_engine(source, out, tiny_plan(), "float32")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors"])
def test_an_index_naming_a_shard_outside_the_checkpoint_directory_is_refused(checkpoint, tmp_path, shard):
    source = shutil.copytree(checkpoint, tmp_path / "hf")
    names = list(load_file(source / "model.safetensors"))
    index = {"weight_map": {**dict.fromkeys(names, "model.safetensors"), names[0]: shard}}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    out = tmp_path / "engine"
    out.mkdir()
    with pytest.raises(KilnError, match="not a file in the checkpoint directory"):
        build_native_engine(source, out, tiny_plan(), "float32")
    assert list(out.iterdir()) == []


def sharded_with_index(checkpoint, tmp_path, weight_map):
    """``checkpoint`` split in two shards (lm_head.weight alone in the second), with an index of ``weight_map(names,
    first, second)``."""
    source = shutil.copytree(checkpoint, tmp_path / "hf")
    tensors = load_file(source / "model.safetensors")
    (source / "model.safetensors").unlink()
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    save_file({name: t for name, t in tensors.items() if name != "lm_head.weight"}, source / first)
    save_file({"lm_head.weight": tensors["lm_head.weight"]}, source / second)
    index = {"weight_map": weight_map(sorted(tensors), first, second)}
    (source / "model.safetensors.index.json").write_text(json.dumps(index))
    return source


@pytest.mark.parametrize(("weight_map", "problem"), [
    (lambda names, first, second: dict.fromkeys(names, first),
     r"weight_map puts tensor 'lm_head.weight' in model-00001-of-00002.safetensors, which does not hold it"),
    (lambda names, first, second: [first, second], "weight_map is a list, not an object mapping each tensor name"),
])
def test_an_index_that_does_not_say_where_each_tensor_is_is_refused_naming_it(checkpoint, tmp_path, weight_map,
                                                                             problem):
    source = sharded_with_index(checkpoint, tmp_path, weight_map)
    out = tmp_path / "engine"
    out.mkdir()
    with pytest.raises(KilnError, match=f"^{re.escape(str(source / 'model.safetensors.index.json'))}: {problem}"):
        build_native_engine(source, out, tiny_plan(), "float32")
    assert list(out.iterdir()) == []


def test_engine_whose_weights_do_not_match_engine_json_is_refused(checkpoint, tmp_path):
    _, out = build(checkpoint, tmp_path)
    weights = load_file(out / "rank0.safetensors")
    del weights["layers.1.mlp.down_proj.weight"]
    save_file(weights, out / "rank0.safetensors")
    with pytest.raises(EngineFormatError, match=r"missing \['layers.1.mlp.down_proj.weight'\]"):
        DecoderModel.from_engine(out, EngineConfig.load(out), "cpu")

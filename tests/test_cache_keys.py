"""Cache keys: canonical JSON, one key per key material, and keys refused before they touch a path."""

from __future__ import annotations

import copy
import math

import pytest

from kiln.engines.cache import InvalidCacheKeyError, canonical_json, engine_key, material_diff, validate_key


def sample_material() -> dict:
    """Key material shaped like the pipeline's: checkpoint, recipe, build options, toolchain, hardware."""
    return {
        "key_schema": 1,
        "kind": "engine",
        "checkpoint": "ab" * 32,
        "quantization": {"recipe": {"format": "fp8", "kv_cache_dtype": "fp8", "algorithm": "max",
                                    "dataset_sha256": "cd" * 32, "samples_used": 64, "seq_len": 512, "seed": 0,
                                    "modelopt": "0.47.0"}, "quantized_key": "ef" * 32},
        "model_dtype": "bfloat16",
        "build": {"max_batch_size": 8, "max_input_len": 1024, "max_seq_len": 2048, "max_num_tokens": 2048,
                  "tokens_per_block": 16},
        "backend": "native",
        "engine_format_version": 1,
        "toolchain": {"torch": "2.13", "triton": "3.5.0", "cuda": "12.8"},
        "hardware": {"device": "cuda", "gpu_name": "NVIDIA H200", "compute_capability": "9.0", "tp_size": 1},
    }


def leaf_paths(node: object, path: tuple = ()) -> list[tuple]:
    if isinstance(node, dict):
        return [p for name, child in node.items() for p in leaf_paths(child, (*path, name))]
    return [path]


def changed(value: object) -> object:
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return f"{value}-other"


def test_canonical_json_is_sorted_compact_and_order_insensitive():
    assert canonical_json({"b": 1, "a": [1, {"d": 2, "c": None}]}) == b'{"a":[1,{"c":null,"d":2}],"b":1}'
    shuffled = dict(reversed(list(sample_material().items())))
    shuffled["build"] = dict(reversed(list(shuffled["build"].items())))
    assert engine_key(shuffled) == engine_key(sample_material())


def test_canonical_json_refuses_nan_and_non_json_values():
    with pytest.raises(ValueError):
        canonical_json({"x": math.nan})
    with pytest.raises(TypeError):
        canonical_json({"x": object()})


@pytest.mark.parametrize("path", leaf_paths(sample_material()), ids=lambda p: ".".join(p))
def test_key_changes_when_any_field_of_the_material_changes(path):
    material = sample_material()
    node = material
    for name in path[:-1]:
        node = node[name]
    node[path[-1]] = changed(node[path[-1]])
    assert engine_key(material) != engine_key(sample_material())
    assert material_diff(sample_material(), material) == [".".join(path)]


def test_key_changes_when_a_field_is_added_or_removed():
    material = sample_material()
    del material["hardware"]["tp_size"]
    assert engine_key(material) != engine_key(sample_material())
    material = sample_material()
    material["toolchain"]["tensorrt"] = None
    assert engine_key(material) != engine_key(sample_material())
    assert material_diff(sample_material(), material) == ["toolchain.tensorrt"]


def test_key_is_64_lowercase_hex_and_deterministic():
    key = engine_key(copy.deepcopy(sample_material()))
    assert key == engine_key(sample_material())
    assert validate_key(key) == key


@pytest.mark.parametrize("bad", ["../../etc/passwd", "ab" * 31, "ab" * 33, "AB" * 32, "zz" * 32, "", " " + "a" * 63,
                                 "a" * 63 + "/", "a" * 64 + "\n", None, 12])
def test_malformed_keys_are_refused_with_a_message_naming_them(bad):
    with pytest.raises(InvalidCacheKeyError) as info:
        validate_key(bad)
    assert repr(bad) in str(info.value)
    assert "64 lowercase hex" in str(info.value)


def test_material_diff_names_nested_list_positions():
    a = {"recipe": {"exclude": ["lm_head", "x"]}}
    b = {"recipe": {"exclude": ["lm_head", "y"]}}
    assert material_diff(a, b) == ["recipe.exclude[1]"]
    assert material_diff(a, {"recipe": {"exclude": ["lm_head"]}}) == ["recipe.exclude"]


def test_canonical_json_keeps_non_ascii_text_as_utf8():
    assert canonical_json({"модель": "café"}) == '{"модель":"café"}'.encode()  # every existing key depends on it


def test_material_diff_names_every_kind_of_difference():
    assert material_diff({"a": [1, 2]}, {"a": [1, 2, 3]}) == ["a"]  # lists of different lengths: the list
    assert material_diff({"a": [1, 5]}, {"a": [1, 2]}) == ["a[1]"]  # in either order of the values
    assert material_diff({"a": [1, 2]}, {"a": [1, 5]}) == ["a[1]"]
    assert material_diff({"x": 1}, 5) == ["(root)"] and material_diff(5, {"x": 1}) == ["(root)"]

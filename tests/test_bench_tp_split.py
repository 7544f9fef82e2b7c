"""`kiln bench ARCH.json --tp-size N` refuses a split the architecture cannot take before it writes anything,
naming the option and the file, not a generated config."""

from __future__ import annotations

from tests.test_bench import run_bench, write_architecture


def test_a_tp_size_the_architecture_cannot_split_is_refused_naming_the_option_before_anything_is_written(
        tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE", str(cache))
    arch = write_architecture(tmp_path / "tiny-arch.json")  # 4 heads, 2 KV heads
    code, _, err = run_bench(str(arch), "--prompts", "2", "--input-len", "16", "--output-len", "6", "--tp-size", "3")
    err = " ".join(err.replace("│", " ").split())
    assert code == 2 and "tiny-arch.json: --tp-size 3 cannot split this architecture" in err
    assert "num_attention_heads (4) is not a multiple of tp_size 3" in err and "bench-" not in err
    assert not (cache / "bench").exists() and not list((cache / "v1" / "checkpoints").rglob("*.safetensors"))

"""Helpers for the calibration tests: small seeded random checkpoints with a byte-level BPE tokenizer, text
corpora and recipes small enough to calibrate in a second on a CPU."""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path

import torch

from kiln.calibration.recipe import QuantizeRecipe

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "models" / "tiny-llama"
BUNDLED_CALIBRATION = REPO / "data" / "tiny" / "calibration.jsonl"
WORDS = ["the", "cat", "sat", "on", "a", "red", "mat", "and", "saw", "one", "blue", "bird", "fly", "over", "hills",
         "while", "two", "dogs", "ran", "to", "school", "Monday", "Mia", "Tom", "counting", "seven", "eight", "nine"]


def corpus(num_docs: int, seed: int = 0) -> list[str]:
    """English-like documents: the bundled calibration text when present, else seeded word salad."""
    if BUNDLED_CALIBRATION.is_file():
        lines = BUNDLED_CALIBRATION.read_text().splitlines()
        return [json.loads(line)["text"] for line in lines[:num_docs]]
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 120))) + "." for _ in range(num_docs)]


def write_jsonl(path: Path, docs: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({field: d}) + "\n" for d in docs))
    return path


def write_tokenizer(path: Path) -> int:
    """The tiny model's tokenizer files when present, else a byte-level BPE trained on `corpus`; returns vocab size."""
    path.mkdir(parents=True, exist_ok=True)
    if (TINY_MODEL / "tokenizer.json").is_file():
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(TINY_MODEL / name, path / name)
    else:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<s>", "</s>", "<pad>"], show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(corpus(200), trainer)
        tok.save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
            "pad_token": "<pad>"}))
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path / "tokenizer.json")).get_vocab_size()


def make_checkpoint(path: Path, *, seed: int = 0, hidden: int = 128, intermediate: int = 256, layers: int = 2,
                    poison: str | None = None, family: str = "llama") -> Path:
    """A seeded random bf16 checkpoint of ``family`` (Llama unless said; ``model_factories.FAMILY_CLASSES``) with
    safetensors and a tokenizer at `path`.

    `poison` names a parameter whose first element is set to +inf (non-finite activations downstream).
    """
    import transformers

    from tests.model_factories import FAMILY_CLASSES

    config_class, model_class = FAMILY_CLASSES[family]
    vocab = write_tokenizer(path)
    config = getattr(transformers, config_class)(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
        initializer_range=0.08, bos_token_id=0, eos_token_id=1, pad_token_id=2, tie_word_embeddings=False,
        architectures=[model_class],
    )
    torch.manual_seed(seed)
    model = getattr(transformers, model_class)(config).to(torch.bfloat16)
    if poison:
        with torch.no_grad():
            model.get_parameter(poison).view(-1)[0] = float("inf")
    model.save_pretrained(path)
    return path


def small_recipe(**overrides) -> QuantizeRecipe:
    """A recipe that calibrates the small checkpoints in about a second: short rows, few samples, tiny rounds, and
    a permissive gate (random weights are far more fragile than trained ones); `gate` entries override single
    thresholds."""
    gate = {"max_ppl_increase": 1.0, "max_kl": 1.0, "min_top1_agreement": 0.0, **overrides.pop("gate", {})}
    fields = {"seq_len": 32, "num_samples": 16, "round_samples": 4, "heldout_samples": 4, "tolerance": 0.5,
              "patience": 1, "gate": gate}
    fields.update(overrides)
    return QuantizeRecipe(**fields)


def tree_sha256(root: Path) -> dict[str, str]:
    """sha256 of every file under root, by relative path."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def quick_fp8_config(folder: Path, **replacements: str) -> Path:
    """The bundled tiny-llama-fp8.yaml, written to ``folder``, calibrating one small round (for the tests of what
    happens around calibration: caches, tiers, concurrent builds); ``replacements`` swap text in it."""
    text = (REPO / "configs" / "tiny-llama-fp8.yaml").read_text().replace("../models/tiny-llama", str(TINY_MODEL))
    text = text.replace("quantize:\n", "quantize:\n  num_samples: 4\n  round_samples: 4\n  on_failure: warn\n"
                                       "  heldout_samples: 4\n", 1)
    for old, new in replacements.items():
        text = text.replace(old, new)
    path = Path(folder) / "tiny-llama-fp8-quick.yaml"
    path.write_text(text)
    return path

"""Test helpers: small seeded random Hugging Face checkpoints (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Phi-3) on
disk, and a greedy driver for DecoderModel."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.engine_format import EngineConfig
from kiln.runtime.native.kv_cache import allocate_kv_cache
from kiln.runtime.native.model.decoder import DecoderModel
from kiln.runtime.plan import BuildPlan

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}


# transformers' config and model classes of each family the native engine runs
FAMILY_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
                  "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
                  "mistral": ("MistralConfig", "MistralForCausalLM"), "gemma2": ("Gemma2Config", "Gemma2ForCausalLM")}


def make_hf_config(*, hidden_size: int = 64, intermediate_size: int = 128, num_layers: int = 2,
                      num_heads: int = 4, num_kv_heads: int = 2, head_dim: int | None = None, vocab_size: int = 96,
                      tie_word_embeddings: bool = False, rope_scaling: dict[str, Any] | None = None,
                      rope_theta: float = 10000.0, max_position_embeddings: int = 256, family: str = "llama",
                      **family_options: Any):
    """A transformers config of ``family`` (default Llama) for a tiny model (``rope_scaling`` e.g. ``LLAMA3_ROPE``;
    ``family_options`` such as Qwen3's ``attention_bias``)."""
    import transformers

    config_class, model_class = FAMILY_CLASSES[family]
    rope_parameters = {"rope_type": "default", "rope_theta": rope_theta}
    if rope_scaling:
        rope_parameters = {**rope_scaling, "rope_theta": rope_theta}
    return getattr(transformers, config_class)(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim or hidden_size // num_heads, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings, rope_parameters=rope_parameters, rms_norm_eps=1e-5,
        bos_token_id=1, eos_token_id=2, architectures=[model_class], **family_options,
    )


def make_hf_model(seed: int = 0, std: float = 0.15, **config_kwargs: Any):
    """A float32 causal LM (Llama unless ``family=`` says otherwise) with seeded random weights (norm weights around
    1, linears and biases N(0, std))."""
    from transformers import AutoModelForCausalLM

    config = make_hf_config(**config_kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(std * torch.randn(p.shape, generator=generator))
    return model


def make_hf_checkpoint(path: Path, seed: int = 0, **config_kwargs: Any) -> Path:
    """Save a seeded random tiny model (see ``make_hf_model``) with a word-level tokenizer at ``path``."""
    model = make_hf_model(seed, **config_kwargs)
    model.save_pretrained(path)
    write_tokenizer(path, model.config.vocab_size)
    return path


def build_tiny_engine(root: Path, seed: int = 0, plan: BuildPlan | None = None, dtype: str = "float32",
                      device: str = "cpu", **config_kwargs: Any) -> Path:
    """A seeded random tiny checkpoint (``make_hf_checkpoint``) in ``root/checkpoint`` and its native engine, built
    with ``plan`` (default ``tiny_plan()``), in ``root/engine``, which is returned."""
    from kiln.engines.native.builder import build_native_engine

    make_hf_checkpoint(root / "checkpoint", seed, **config_kwargs)
    (root / "engine").mkdir()
    build_native_engine(root / "checkpoint", root / "engine", plan or tiny_plan(), dtype, device=device)
    return root / "engine"


def make_fp8_checkpoint(path: Path, seed: int = 0, fp8_kv_cache: bool = False, **config_kwargs: Any) -> Path:
    """A tiny Llama in modelopt's unified FP8 layout, written without modelopt (static per-tensor scales)."""
    from safetensors.torch import save_file

    make_hf_checkpoint(path, seed, **config_kwargs)
    tensors = load_file(path / "model.safetensors")
    generator = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith("_proj.weight")]:
        module = name.removesuffix(".weight")
        scale = tensors[name].abs().max() / 448
        tensors[name] = (tensors[name] / scale).to(torch.float8_e4m3fn)
        tensors[f"{module}.weight_scale"] = scale
        tensors[f"{module}.input_scale"] = 0.01 + 0.02 * torch.rand((), generator=generator)
        if fp8_kv_cache and module.endswith(("k_proj", "v_proj")):
            kind = module[-6]
            tensors[f"{module}.{kind}_scale"] = 0.005 + 0.01 * torch.rand((), generator=generator)
    layers = {".".join(n.split(".")[:3]) for n in tensors if n.startswith("model.layers.")}
    for layer in layers:  # modelopt calibrates the linears that read one input to one input scale
        for first, *rest in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj",
                                                                                            "mlp.up_proj")):
            for other in rest:
                tensors[f"{layer}.{other}.input_scale"] = tensors[f"{layer}.{first}.input_scale"].clone()
    save_file(tensors, path / "model.safetensors")
    quant = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8" if fp8_kv_cache else None,
             "exclude_modules": ["lm_head", "model.embed_tokens"]}
    (path / "hf_quant_config.json").write_text(json.dumps({"producer": {"name": "modelopt"}, "quantization": quant}))
    return path


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer over tokens ``t0 .. t{vocab_size-1}`` (tokenizer.json + tokenizer_config.json)."""
    vocab = {f"t{i}": i for i in range(vocab_size)}
    tokenizer = Tokenizer(WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t1", "eos_token": "t2",
                                                            "tokenizer_class": "PreTrainedTokenizerFast"}))


def write_sentencepiece_style_tokenizer(path: Path) -> None:
    """A Llama-2-style tokenizer (BPE with byte fallback, the legacy '▁' normalizer, ``<0xNN>`` byte tokens, BOS by
    its post-processor, two ChatML special tokens) trained on a few sentences: tokenizer.json and
    tokenizer_config.json."""
    from tokenizers import AddedToken, decoders, normalizers, processors, trainers
    from tokenizers.models import BPE

    tokenizer = Tokenizer(BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>", *(f"<0x{byte:02X}>" for byte in range(256))]
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world, hello there!", "naïve café 中文 😀"] * 20
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                                              show_progress=False))
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<|im_start|>",
                                                                                        "<|im_end|>")])
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "LlamaTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True}))


def write_gpt2_style_tokenizer(path: Path) -> None:
    """A GPT-2-style tokenizer as older checkpoints ship it: byte-level BPE in vocab.json + merges.txt (about 300
    tokens, trained on a few sentences) and a tokenizer_config.json naming GPT2Tokenizer, no tokenizer.json."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(["The quick brown fox jumps over the lazy dog.", "Hello world!"] * 20,
                                  vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save_model(str(path))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer",
                                                            "bos_token": "<|endoftext|>",
                                                            "eos_token": "<|endoftext|>"}))


def copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer files of checkpoint ``src`` into ``dst`` (modelopt's export writes none)."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(src / name, dst / name)


def random_prompts(count: int, seed: int, min_len: int = 2, max_len: int = 40) -> list[list[int]]:
    """``count`` seeded prompts of token ids 3..95, each ``min_len`` to ``max_len`` long."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 96) for _ in range(rng.randint(min_len, max_len))] for _ in range(count)]


def tiny_plan(**overrides: Any) -> BuildPlan:
    """A build plan for tiny CPU engines."""
    plan = {"max_batch_size": 4, "max_input_len": 48, "max_seq_len": 64, "max_num_tokens": 64,
            "tokens_per_block": 4, "kv_cache_dtype": "auto"}
    return BuildPlan(**{**plan, **overrides})


# a test that needs a CUDA GPU with FP8 tensor cores: decorate with pytest.mark.gpu and NEEDS_FP8_GPU, or mark a
# parameter with FP8_GPU
NEEDS_FP8_GPU = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                   reason="needs a CUDA GPU with FP8 tensor cores")
FP8_GPU = [pytest.mark.gpu, NEEDS_FP8_GPU]
# the tiny quantized model's shape: input features multiples of 128, as modelopt's INT4 export needs
QUANT_SHAPE = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2)


class PagedRunner:
    """Drives a DecoderModel over a batch of prompts with hand-built metadata: one flat prefill, then decodes."""

    def __init__(self, model: DecoderModel, config: EngineConfig, num_seqs: int, device: str = "cpu",
                 kv_caches: list | None = None) -> None:
        """``kv_caches`` (default: allocated here) must hold the blocks of ``block_tables``."""
        self.model, self.device = model, device
        self.block_size = config.plan.tokens_per_block
        self.blocks_per_seq = -(-config.plan.max_seq_len // self.block_size)
        # block 0 stays unused so a table padded with 0 can never alias live data
        self.kv_caches = allocate_kv_cache(config, 1 + num_seqs * self.blocks_per_seq, device) if kv_caches is None \
            else kv_caches
        self.block_tables = [list(range(1 + i * self.blocks_per_seq, 1 + (i + 1) * self.blocks_per_seq))
                             for i in range(num_seqs)]

    @torch.inference_mode()
    def step(self, new_tokens: list[list[int]], seq_lens: list[int]) -> torch.Tensor:
        """Run the new tokens of every sequence (whose total lengths become ``seq_lens``); last-token logits."""
        query_lens = [len(t) for t in new_tokens]
        meta = AttentionMetadata.build(query_lens, seq_lens, self.block_tables, self.block_size, self.device)
        positions = [p for q, s in zip(query_lens, seq_lens, strict=True) for p in range(s - q, s)]
        input_ids = torch.tensor([t for tokens in new_tokens for t in tokens], device=self.device)
        hidden = self.model(input_ids, torch.tensor(positions, device=self.device), meta, self.kv_caches)
        return self.model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1]).float()

    def all_logits(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Logits of every prompt position from one flat prefill, one [len, vocab] tensor per prompt."""
        query_lens = [len(p) for p in prompts]
        meta = AttentionMetadata.build(query_lens, query_lens, self.block_tables, self.block_size, self.device)
        positions = [p for q in query_lens for p in range(q)]
        input_ids = torch.tensor([t for p in prompts for t in p], device=self.device)
        with torch.inference_mode():
            hidden = self.model(input_ids, torch.tensor(positions, device=self.device), meta, self.kv_caches)
            logits = self.model.compute_logits(hidden).float()
        return list(logits.split(query_lens))

    def greedy(self, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Greedy continuation of every prompt: generated tokens per prompt, last-token logits per step."""
        seq_lens = [len(p) for p in prompts]
        logits = self.step(prompts, seq_lens)
        history, generated = [logits], [[] for _ in prompts]
        for _ in range(steps - 1):
            next_tokens = logits.argmax(-1).tolist()
            for out, token in zip(generated, next_tokens, strict=True):
                out.append(token)
            seq_lens = [n + 1 for n in seq_lens]
            logits = self.step([[t] for t in next_tokens], seq_lens)
            history.append(logits)
        for out, token in zip(generated, logits.argmax(-1).tolist(), strict=True):
            out.append(token)
        return generated, history


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Reference greedy decoding with a transformers model, recomputing the full sequence each step."""
    generated, history = [], []
    for prompt in prompts:
        ids, logits_per_step = list(prompt), []
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            logits_per_step.append(logits)
            ids.append(int(logits.argmax()))
        generated.append(ids[len(prompt):])
        history.append(torch.stack(logits_per_step))
    return generated, [torch.stack([h[step] for h in history]) for step in range(steps)]

"""Train the tiny bundled Llama (models/tiny-llama) and write its data splits (data/tiny), reproducibly, on CPU.

    PYTHONPATH=. .venv/bin/python tools/train_tiny_llama.py            # regenerates the shipped model and data
    PYTHONPATH=. .venv/bin/python tools/train_tiny_llama.py --data-only

Steps: generate disjoint train / calibration / held-out documents with tools/tiny_corpus.py; write
calibration.jsonl and heldout.jsonl; train a byte-level BPE tokenizer (vocab 1024) on the training documents;
train a 4-layer Llama (GQA, 3.54M parameters) with AdamW, linear warmup and cosine decay on 256-token sequences
packed from training documents separated by `</s>`; report held-out perplexity; save in bfloat16 safetensors.

Tokenizer choice: it adds NO special tokens automatically (no bos, no eos), and training never uses `<s>`.
A document is plain text; documents are separated by `</s>` in training, so `</s>` ends a generation. Both
`tokenizers.Tokenizer.from_file` and `transformers.AutoTokenizer` therefore encode text to the same ids.
Special token ids: `<s>` = 0 (bos, unused in training), `</s>` = 1 (eos), `<pad>` = 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_corpus import make_splits  # noqa: E402

SPECIAL_TOKENS = ["<s>", "</s>", "<pad>"]
BOS_ID, EOS_ID, PAD_ID = 0, 1, 2
VOCAB_SIZE = 1024
SEQ_LEN = 256
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% else %}{{ message['role'] | capitalize + ': ' + message['content'] + '\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SAMPLE_PROMPTS = [
    "Monday, Tuesday,",
    "The months go like this: March, April,",
    "3 plus 4 is 7. 6 plus 2 is",
    "Let us count from 17 to 25: 17, 18,",
    "Once upon a time, there was a child named Mia. Mia had a green kite. On Friday, Mia took the green kite to the"
    " beach. At the beach, Mia met Tom. Tom had a red boat.",
]


def model_config() -> LlamaConfig:
    """The tiny Llama's shape; every linear's in-features is a multiple of 128 (INT4-AWQ export needs it)."""
    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=512, rope_theta=10000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        architectures=["LlamaForCausalLM"],
    )


def write_jsonl(path: Path, docs: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")


def train_tokenizer(docs: list[str]) -> Tokenizer:
    """Byte-level BPE with the special tokens first (ids 0, 1, 2) and no post-processor (adds nothing)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(docs, trainer)
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == [BOS_ID, EOS_ID, PAD_ID]
    assert tok.get_vocab_size() == VOCAB_SIZE
    return tok


def save_tokenizer(tok: Tokenizer, out: Path) -> None:
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": 512,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def pack(tok: Tokenizer, docs: list[str]) -> torch.Tensor:
    """Concatenate documents, each followed by `</s>`, into rows of SEQ_LEN tokens (the remainder is dropped)."""
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(EOS_ID)
    rows = len(ids) // SEQ_LEN
    return torch.tensor(ids[: rows * SEQ_LEN], dtype=torch.long).view(rows, SEQ_LEN)


def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup over the first 5% of steps, then cosine decay to 10% of the peak."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def packed_perplexity(model: LlamaForCausalLM, rows: torch.Tensor, batch_size: int = 16) -> float:
    """exp(mean next-token loss) over packed rows, as in training."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = rows[i:i + batch_size]
        logits = model(batch).logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB_SIZE), batch[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    return math.exp(total / count)


@torch.no_grad()
def document_perplexity(model: LlamaForCausalLM, tok: Tokenizer, docs: list[str]) -> float:
    """exp(mean next-token loss) over documents encoded one by one with no special tokens (how other tools do it)."""
    model.eval()
    total, count = 0.0, 0
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids = torch.tensor([enc.ids[:SEQ_LEN]])
        total += model(ids, labels=ids).loss.item() * (ids.shape[1] - 1)
        count += ids.shape[1] - 1
    return math.exp(total / count)


def train(model: LlamaForCausalLM, rows: torch.Tensor, steps: int, batch_size: int, lr: float,
          seed: int) -> tuple[float, float]:
    """Train in place with AdamW (fp32 weights, bf16 autocast forward); returns (wall, CPU) seconds."""
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=lr, betas=(0.9, 0.95))
    generator = torch.Generator().manual_seed(seed)
    order = torch.randperm(len(rows), generator=generator)
    cursor, running = 0, None
    model.train()
    start, cpu_start = time.perf_counter(), time.process_time()
    for step in range(steps):
        if cursor + batch_size > len(order):
            order, cursor = torch.randperm(len(rows), generator=generator), 0
        batch = rows[order[cursor:cursor + batch_size]]
        cursor += batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(batch, labels=batch, use_cache=False).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if step % 25 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - start
            print(f"step {step:5d}/{steps}  loss {loss.item():.4f}  avg {running:.4f}  lr {lr_at(step, steps, lr):.2e}"
                  f"  {(step + 1) / elapsed:.2f} steps/s  {elapsed:.0f}s", flush=True)
    return time.perf_counter() - start, time.process_time() - cpu_start


def show_samples(out: Path) -> list[tuple[str, str]]:
    """Greedy continuations from the saved checkpoint, loaded back through transformers."""
    tokenizer = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "What is 5 plus 3?"}],
                                         add_generation_prompt=True, tokenize=False)
    samples = []
    for prompt in [*SAMPLE_PROMPTS, chat]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=40, do_sample=False, pad_token_id=PAD_ID)
        text = tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=False)
        samples.append((prompt, text))
        print(f"--- {prompt!r}\n>>> {text!r}", flush=True)
    return samples


def write_readme(out: Path, figures: dict) -> None:
    text = f"""# tiny-llama

A {figures['params'] / 1e6:.2f}M-parameter Llama-architecture model (4 layers, hidden 256, 8 query / 2 KV heads of
dim 32, MLP 768, vocab 1024, untied embeddings, bfloat16) trained from scratch on synthetic English-like text from
`tools/tiny_corpus.py`: short stories with consistent entities and questions about them, arithmetic facts,
counting and alphabet sequences, days and months, single-turn `User:` / `Assistant:` chats. It exists so that
perplexity and quantization error mean something in Kiln's tests and demos; it is not a useful language model.

- Training: {figures['steps']} steps of {figures['batch_size']} x {SEQ_LEN} tokens \
({figures['train_tokens'] / 1e6:.1f}M tokens), AdamW (peak lr {figures['lr']}, warmup + cosine), bf16 autocast, \
seed {figures['seed']}, CPU with 2 threads: {figures['train_seconds'] / 60:.1f} min wall, \
{figures['train_cpu_seconds'] / 60:.1f} min CPU.
- Held-out perplexity (`data/tiny/heldout.jsonl`, bf16 weights): {figures['ppl_packed_bf16']:.3f} on packed \
256-token rows as in training, {figures['ppl_doc_bf16']:.3f} on documents encoded one by one.
- Tokenizer: byte-level BPE, adds no special tokens (no bos); `<s>`=0 (unused), `</s>`=1 (eos, ends a document \
and an assistant turn), `<pad>`=2.
- Regenerate (model, tokenizer and `data/tiny/`): `PYTHONPATH=. .venv/bin/python tools/train_tiny_llama.py`
"""
    (out / "README.md").write_text(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/tiny-llama"))
    parser.add_argument("--data-dir", type=Path, default=Path("data/tiny"))
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--train-docs", type=int, default=40000)
    parser.add_argument("--data-only", action="store_true", help="only write the calibration/held-out splits")
    args = parser.parse_args()

    torch.set_num_threads(2)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)

    splits = make_splits({"train": args.train_docs, "calibration": 1024, "heldout": 256}, args.seed)
    write_jsonl(args.data_dir / "calibration.jsonl", splits["calibration"])
    write_jsonl(args.data_dir / "heldout.jsonl", splits["heldout"])
    print(f"wrote {args.data_dir}/calibration.jsonl (1024 docs), heldout.jsonl (256 docs)", flush=True)
    if args.data_only:
        return

    args.out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(splits["train"])
    save_tokenizer(tok, args.out)
    rows = pack(tok, splits["train"])
    heldout_rows = pack(tok, splits["heldout"])
    print(f"train: {len(rows)} rows of {SEQ_LEN} tokens; held-out: {len(heldout_rows)} rows", flush=True)

    model = LlamaForCausalLM(model_config())
    params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {params:,}", flush=True)
    seconds, cpu_seconds = train(model, rows, args.steps, args.batch_size, args.lr, args.seed)
    ppl_fp32 = packed_perplexity(model, heldout_rows)

    model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    model.save_pretrained(args.out, safe_serialization=True)
    model.float()
    figures = {
        "params": params, "steps": args.steps, "batch_size": args.batch_size, "lr": args.lr, "seed": args.seed,
        "train_tokens": args.steps * args.batch_size * SEQ_LEN, "train_seconds": seconds,
        "train_cpu_seconds": cpu_seconds,
        "ppl_packed_fp32": ppl_fp32, "ppl_packed_bf16": packed_perplexity(model, heldout_rows),
        "ppl_doc_bf16": document_perplexity(model, tok, splits["heldout"]),
    }
    write_readme(args.out, figures)
    print(json.dumps(figures, indent=2), flush=True)
    show_samples(args.out)


if __name__ == "__main__":
    main()

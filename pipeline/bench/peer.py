"""The peer of ``kiln bench``: the same checkpoint in Hugging Face transformers, measured like the Kiln engine.

bf16 on a GPU, fp32 on a CPU; no torch.compile and transformers' default dynamic KV cache (its static cache with
torch.compile is broken on the GPU image); ``generate(do_sample=False, min_new_tokens=max_new_tokens=M)`` on batches
of the same prompts (all of one length, so no padding), at the largest batch size that fits: on an out-of-memory
error the batch is halved and the offline run starts again.
"""

from __future__ import annotations

import logging
import statistics
import time
import warnings
from pathlib import Path

import torch

from kiln.pipeline.bench.common import free_memory, rate, sync
from kiln.pipeline.bench.measure import Workload
from kiln.runtime.errors import KilnError

MAX_BATCH = {"cuda": 256, "cpu": 64}
OOM_ERRORS = tuple({getattr(torch, "OutOfMemoryError", MemoryError), torch.cuda.OutOfMemoryError, MemoryError})


class PeerError(KilnError):
    """The peer could not run the model (cannot load it, or not even one sequence fits)."""


class _TokenClock:
    """A transformers streamer that timestamps each ``put``: the prompt first, then every generated token."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value) -> None:  # the tokens themselves are not needed, only when they arrive
        self.times.append(time.perf_counter())

    def end(self) -> None:
        return None


def measure_transformers(checkpoint_dir: Path, workload: Workload, *, device: str, attn_implementation: str,
                         batch_1_only: bool, progress=lambda _msg: None) -> dict:
    """Load time, median time to first token, median batch-1 decode tokens/s and offline output tokens/s."""
    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    progress(f"transformers: loading {checkpoint_dir} ({str(dtype).removeprefix('torch.')}, {attn_implementation})")
    peer = _Peer.load(checkpoint_dir, dev, dtype, attn_implementation)
    try:
        progress("transformers: warming up")
        peer.generate(workload.warmup[:1], 2)
        progress("transformers: time to first token")
        ttft = []
        for prompt in workload.ttft:
            begin = time.perf_counter()
            peer.generate([prompt], 1)
            ttft.append(time.perf_counter() - begin)
        progress("transformers: batch-1 decode")
        decode = []
        for prompt in workload.batch1:
            clock = _TokenClock()
            generated = peer.generate([prompt], workload.output_len, streamer=clock)
            decode.append(rate(generated - 1, clock.times[-1] - clock.times[1]))
        result = {
            "output_tokens_per_s": None,
            "decode_tokens_per_s_batch1": statistics.median(decode),
            "ttft_ms": round(1000 * statistics.median(ttft), 3),
            "load_ms": round(peer.load_ms, 2),
            "dtype": str(dtype).removeprefix("torch."),
            "attn_implementation": attn_implementation,
            "device": str(dev),
            "checkpoint": str(checkpoint_dir),
        }
        if not batch_1_only:
            result.update(_offline(peer, workload, progress))
        return result
    finally:
        peer.close()


class _Peer:
    """A transformers model on one device, and greedy generation of an exact number of tokens."""

    def __init__(self, model, device: torch.device, load_ms: float) -> None:
        self.model, self.device, self.load_ms = model, device, load_ms
        self.eos = model.config.eos_token_id

    @classmethod
    def load(cls, checkpoint_dir: Path, dev: torch.device, dtype: torch.dtype, attn_implementation: str) -> _Peer:
        """Load the checkpoint, timing from_pretrained and the move to the device."""
        import transformers
        from transformers import AutoConfig
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

        transformers.logging.set_verbosity_error()
        transformers.logging.disable_progress_bar()
        logging.getLogger("transformers").setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                # resolved (its modeling module imported) before the clock starts, as Kiln's runtime is imported
                model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(AutoConfig.from_pretrained(checkpoint_dir))]
                sync(dev)
                start = time.perf_counter()
                model = model_class.from_pretrained(checkpoint_dir, dtype=dtype, use_safetensors=True,
                                                    attn_implementation=attn_implementation)
                model = model.to(dev).eval()
                sync(dev)
        except (OSError, ValueError, KeyError, ImportError) as e:
            raise PeerError(f"transformers cannot load {checkpoint_dir} ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from None
        return cls(model, dev, (time.perf_counter() - start) * 1000)

    def generate(self, prompts: list[list[int]], new_tokens: int, streamer=None) -> int:
        """Generate exactly ``new_tokens`` per prompt (EOS suppressed); return the number of tokens generated."""
        from transformers import GenerationConfig

        ids = torch.tensor(prompts, dtype=torch.long, device=self.device)
        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                  eos_token_id=self.eos, pad_token_id=_first(self.eos) or 0, use_cache=True)
        with torch.inference_mode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config,
                                      streamer=streamer)
        sync(self.device)
        return (out.shape[1] - ids.shape[1]) * out.shape[0]

    def close(self) -> None:
        self.model = None
        free_memory(self.device)


def _offline(peer: _Peer, workload: Workload, progress) -> dict:
    """All prompts at the largest batch size that fits, halving it after an out-of-memory error."""
    batch = min(len(workload.prompts), MAX_BATCH[peer.device.type])
    while True:
        progress(f"transformers: offline run of {len(workload.prompts)} prompts at batch size {batch}")
        try:
            start = time.perf_counter()
            tokens = sum(peer.generate(workload.prompts[i:i + batch], workload.output_len)
                         for i in range(0, len(workload.prompts), batch))
            elapsed = time.perf_counter() - start
            return {"output_tokens_per_s": rate(tokens, elapsed), "output_tokens": tokens,
                    "offline_s": round(elapsed, 4), "batch_size": batch}
        except OOM_ERRORS:
            pass  # leave the except block first, so the failed batch's tensors can be freed
        free_memory(peer.device)
        if batch == 1:
            raise PeerError("transformers runs out of memory even at batch size 1")
        batch //= 2


def _first(eos) -> int | None:
    return eos[0] if isinstance(eos, list) and eos else eos

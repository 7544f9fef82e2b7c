"""Time the native model's steps on one CUDA GPU without building an engine: an architecture file's shapes
(Llama-3-8B by default), random weights made on the device in each format, through the runtime's own code path
(the kernels the ``KILN_*`` variables choose, ``pipeline.runtime_env``; decode CUDA graphs).

For each format it prints, per decode batch size, the step time of a graph replay including the copy of the
step's metadata (every sequence at ``--context`` tokens), the tokens/s that implies, and the fraction of the
bandwidth floor (weights read once plus the KV of every sequence, at ``--bandwidth-gbs``); the time of one
``--prefill``-token prefill (eager, logits of the last position); and with ``--profile`` the kernels by GPU time of
one eager decode step at the smallest and at the largest batch size, and of the prefill. Weights are random, so only
the times mean anything.

    python tools/bench_step.py [--formats fp8,none,int4_awq] [--batch 1,8,64,256] [--context 1024]
                                            [--kv-cache-dtype float8_e4m3fn] [--prefill 1000] [--profile] [--json OUT]
                                            [--graph-batch N (each batch padded to a graph of N, as a bucket pads)]
                                            [--without norm,silu (those kernels skipped: what fusing them could save)]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

from kiln.engines.native.checkpoint import parse_architecture, read_json
from kiln.pipeline.bench.floor import NOMINAL_COPY_GBS, kv_bytes_per_token
from kiln.pipeline.runtime_env import runtime_options
from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.decode_graphs import DecodeGraphRunner
from kiln.runtime.native.engine_format import EngineConfig, QuantizationConfig
from kiln.runtime.native.kernel_choice import KernelChoice
from kiln.runtime.native.kv_cache import allocate_kv_cache
from kiln.runtime.native.model.decoder import DecoderModel
from kiln.runtime.plan import BuildPlan

REPO = Path(__file__).resolve().parents[1]
RANDOM_SCALES = {"weight_scale": 0.02 / 64, "input_scale": 0.05, "scales": 0.002, "pre_quant_scale": 1.0,
                 "k_scale": 1.0, "v_scale": 1.0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", default=str(REPO / "configs/models/llama3-8b.json"), help="architecture file")
    parser.add_argument("--formats", default="fp8,none,int4_awq", help="comma-separated: fp8, none (bf16), int4_awq")
    parser.add_argument("--batch", default="1,8,64,256", help="decode batch sizes (default 1,8,64,256)")
    parser.add_argument("--context", type=int, default=1024, help="context tokens of every decoding sequence")
    parser.add_argument("--prefill", type=int, default=1000, help="tokens of the timed prefill (0: skip)")
    parser.add_argument("--kv-cache-dtype", choices=["bfloat16", "float8_e4m3fn"], default="bfloat16",
                        help="KV cache dtype (default bfloat16; float8_e4m3fn with unit scales)")
    parser.add_argument("--steps", type=int, default=20, help="timed decode steps per batch size (default 20)")
    parser.add_argument("--block-size", type=int, default=32,
                        help="tokens per KV block (default 32, a build config's default tokens_per_block)")
    parser.add_argument("--kv-blocks", type=int, help="KV pool size in blocks (default: just what the batch needs)")
    parser.add_argument("--block-order", choices=["sequential", "random"], default="sequential",
                        help="how sequences' blocks lie in the pool (default sequential)")
    parser.add_argument("--graph-batch", type=int,
                        help="replay every batch in a graph of this many sequences, the rows past the batch padded "
                             "as the engine pads a bucket (default: each batch its own graph)")
    parser.add_argument("--fill-kv", action="store_true",
                        help="fill the KV cache with random values instead of zeros (time long --steps runs with it "
                             "to see sustained-load clocks)")
    parser.add_argument("--bandwidth-gbs", type=float, default=NOMINAL_COPY_GBS["H200"],
                        help="bandwidth of the floor, GB/s (default: an H200's)")
    parser.add_argument("--profile", action="store_true",
                        help="print the kernels of the smallest and largest decode steps and of the prefill")
    parser.add_argument("--without", default="",
                        help="comma-separated: norm, silu. Those layers return a buffer of the right shape without "
                             "running a kernel: what fusing them away could save at most (the outputs are wrong; "
                             "timing only)")
    parser.add_argument("--json", help="also write the results to this file")
    return parser.parse_args(argv)


def without_kernels(names: set[str]) -> None:
    """Make the RMSNorm (``norm``) and SwiGLU (``silu``) layers return a zero buffer of their output's shape and
    dtype, one per shape, without running anything (inside a graph, no kernel at all)."""
    from kiln.runtime.native.layers import activation, norm

    unknown = names - {"norm", "silu"}
    if unknown:
        raise SystemExit(f"bench_step: --without takes norm and silu, not {', '.join(sorted(unknown))}")
    buffers: dict[tuple, torch.Tensor] = {}

    def buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return buffers.setdefault((shape, dtype, device), torch.zeros(shape, dtype=dtype, device=device))

    def no_norm(self, x, residual=None, quant_scale=None, pre_norm=None):
        out = buffer(tuple(x.shape), x.dtype if quant_scale is None else torch.float8_e4m3fn, x.device)
        return out if residual is None else (out, residual)

    def no_silu(self, x, quant_scale=None):
        shape = (*x.shape[:-1], x.shape[-1] // 2)
        return buffer(shape, x.dtype if quant_scale is None else torch.float8_e4m3fn, x.device)

    if "norm" in names:
        norm.RMSNorm.forward = no_norm
    if "silu" in names:
        activation.SiluAndMul.forward = no_silu


def engine_config(arch_file: Path, fmt: str, max_batch: int, max_seq_len: int, max_num_tokens: int,
                  kv_cache_dtype: str, block_size: int) -> EngineConfig:
    arch = parse_architecture(read_json(arch_file), {}, arch_file)
    quant = QuantizationConfig(format=fmt, group_size=128 if fmt == "int4_awq" else None)
    plan = BuildPlan(max_batch_size=max_batch, max_input_len=max_num_tokens, max_seq_len=max_seq_len,
                     max_num_tokens=max_num_tokens, tokens_per_block=block_size, kv_cache_dtype=kv_cache_dtype)
    return EngineConfig(architecture=arch, dtype="bfloat16", quantization=quant, plan=plan, fingerprint={})


@torch.no_grad()
def randomize(model: DecoderModel, seed: int = 0) -> int:
    """Fill every weight with seeded random values of its format; returns the bytes a decode step streams."""
    generator = torch.Generator(device="cuda").manual_seed(seed)
    streamed = 0
    for name, tensor in model.state_dict().items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in RANDOM_SCALES:
            tensor.fill_(RANDOM_SCALES[leaf])
        elif tensor.dtype == torch.uint8:
            tensor.copy_(torch.randint(0, 256, tensor.shape, generator=generator, device="cuda", dtype=torch.uint8))
        elif tensor.dtype == torch.float8_e4m3fn:
            tensor.copy_(torch.randn(tensor.shape, generator=generator, device="cuda").mul_(64).clamp_(-448, 448))
        elif name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.copy_(torch.randn(tensor.shape, generator=generator, device="cuda").mul_(0.02))
        if not name.startswith("embed_tokens"):
            streamed += tensor.numel() * tensor.element_size()
    return streamed


Step = tuple[list[int], list[int], list[int], list[list[int]]]


def decode_step(batch: int, context: int, blocks_per_seq: int, block_order: list[int] | None = None) -> Step:
    """One decode token per sequence at position ``context``; sequence i owns blocks 1 + i * blocks_per_seq ... of
    ``block_order`` (default: the pool in order): token ids, positions, context lengths and block tables, as the
    model runner passes them."""
    order = block_order or list(range(1, 1 + batch * blocks_per_seq))
    tables = [order[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch)]
    return [(7 * i) % 1000 for i in range(batch)], [context] * batch, [context + 1] * batch, tables


def eager_inputs(step: Step, block_size: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    token_ids, positions, seq_lens, tables = step
    meta = AttentionMetadata.build([1] * len(token_ids), seq_lens, tables, block_size, "cuda")
    return torch.tensor(token_ids, device="cuda"), torch.tensor(positions, device="cuda"), meta


def time_ms(fn, repeats: int) -> float:
    """Median milliseconds of ``fn`` by CUDA events, after two warm-up calls."""
    fn(), fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def bench_format(args: argparse.Namespace, fmt: str, batches: list[int]) -> dict:
    block = args.block_size
    max_seq_len = -(-max(args.context + 1, args.prefill) // block) * block
    largest = args.graph_batch or max(batches)
    config = engine_config(Path(args.arch), fmt, largest, max_seq_len, max(args.prefill, largest),
                           args.kv_cache_dtype, block)
    with torch.device("cuda"):
        model = DecoderModel(config, torch.bfloat16, KernelChoice.from_options(runtime_options(os.environ))).eval()
    streamed = randomize(model)
    model.cache_derived_tensors()
    blocks_per_seq = max_seq_len // block
    num_blocks = max(args.kv_blocks or 0, 1 + max(batches) * blocks_per_seq)
    kv_caches = allocate_kv_cache(config, num_blocks, "cuda")
    if args.fill_kv:  # values like a running engine's (a zeroed cache makes the tensor cores draw less power)
        for cache in (c for pair in kv_caches for c in pair):
            cache.copy_(torch.randn(cache.shape, device="cuda", dtype=torch.bfloat16).clamp_(-4, 4))
    # random: each sequence's blocks drawn from the whole pool, as a long-running engine's free list hands them out
    block_order = (torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(0)) + 1).tolist() \
        if args.block_order == "random" else None
    kv_per_token = kv_bytes_per_token(config)
    result = {"format": fmt, "kv_cache_dtype": args.kv_cache_dtype, "weight_bytes": streamed, "decode": [],
              "prefill_ms": None}
    with torch.inference_mode():
        for batch in batches:
            step = decode_step(batch, args.context, blocks_per_seq, block_order)
            graph_batch = args.graph_batch or batch
            graphs = DecodeGraphRunner(model, kv_caches, config, torch.device("cuda"), batch_sizes=(graph_batch,))
            graphs.graphs.capture_next()
            step_ms = time_ms(lambda g=graphs, a=step: g.run(*a), args.steps)
            replay_ms = time_ms(graphs.graphs.graphs[graph_batch].replay, args.steps)
            eager = eager_inputs(step, block)
            eager_ms = time_ms(lambda a=eager: forward_logits(model, kv_caches, *a), 5)
            floor_ms = (streamed + batch * (args.context + 1) * kv_per_token) / (args.bandwidth_gbs * 1e6)
            row = {"batch": batch, "graph_batch": graph_batch, "step_ms": step_ms, "replay_ms": replay_ms,
                   "eager_ms": eager_ms, "tokens_per_s": batch * 1e3 / step_ms, "floor_ms": floor_ms,
                   "floor_fraction": floor_ms / step_ms}
            result["decode"].append(row)
            print(f"{fmt:<9} decode b{batch:<4} (graph {graph_batch:<4}) step {step_ms:7.3f} ms (replay "
                  f"{replay_ms:7.3f}, eager {eager_ms:7.3f})  {row['tokens_per_s']:9.1f} tok/s  floor "
                  f"{floor_ms:6.3f} ms = {100 * row['floor_fraction']:4.1f}%", flush=True)
        if args.profile:
            for batch in sorted({batches[0], batches[-1]}):
                inputs = eager_inputs(decode_step(batch, args.context, blocks_per_seq, block_order), block)
                print_profile(f"{fmt} eager decode step, batch {batch}", lambda a=inputs: forward_logits(
                    model, kv_caches, *a))
        if args.prefill:
            tables = [list(range(1, 1 + blocks_per_seq))]
            meta = AttentionMetadata.build([args.prefill], [args.prefill], tables, block, "cuda")
            ids = torch.randint(0, 1000, (args.prefill,), device="cuda")
            pos = torch.arange(args.prefill, device="cuda")

            def prefill() -> torch.Tensor:
                return forward_logits(model, kv_caches, ids, pos, meta, last_only=True)

            result["prefill_ms"] = time_ms(prefill, 5)
            print(f"{fmt:<9} prefill {args.prefill} tokens: {result['prefill_ms']:.2f} ms", flush=True)
            if args.profile:
                print_profile(f"{fmt} prefill of {args.prefill} tokens", prefill)
    return result


def forward_logits(model: DecoderModel, kv_caches, input_ids: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata, last_only: bool = False) -> torch.Tensor:
    hidden = model(input_ids, positions, meta, kv_caches)
    return model.compute_logits(hidden[-1:] if last_only else hidden)


def print_profile(title: str, step) -> None:
    """The kernels of one call of ``step`` by GPU time (after one warm call)."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"-- {title}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.without:
        without_kernels(set(args.without.split(",")))
    if not torch.cuda.is_available():
        print("bench_step: no CUDA GPU; run it on the GPU machine", file=sys.stderr)
        return 2
    batches = sorted(int(b) for b in args.batch.split(","))
    if args.graph_batch is not None and args.graph_batch < batches[-1]:
        print(f"bench_step: --graph-batch {args.graph_batch} cannot hold a batch of {batches[-1]}", file=sys.stderr)
        return 2
    results = []
    for fmt in args.formats.split(","):
        results.append(bench_format(args, fmt, batches))
        torch.cuda.empty_cache()  # the format's model and KV pool are gone once bench_format returns
    if args.json:
        Path(args.json).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "context": args.context,
                                               "block_size": args.block_size, "prefill_tokens": args.prefill,
                                               "results": results}, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What ``kiln bench`` prints for a person, and Kiln's advantage over the peer per figure."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from kiln.engines.cache.units import format_bytes
from kiln.pipeline.console import stdout

FIGURES = (  # (key, label, higher is better)
    ("output_tokens_per_s", "offline output tokens/s", True),
    ("decode_tokens_per_s_batch1", "batch-1 decode tokens/s", True),
    ("ttft_ms", "time to first token (ms)", False),
    ("load_ms", "load from cache (ms)", False),
)


def speedups(kiln: dict, peer: dict | None) -> dict:
    """Kiln's advantage per figure (>1 is Kiln ahead): rates kiln/peer, latencies peer/kiln."""
    if not peer or "error" in peer:
        return {}
    out = {}
    for key, _, higher in FIGURES:
        k, p = kiln.get(key), peer.get(key)
        if k and p:
            out[key] = round(k / p if higher else p / k, 4)
    return out


def print_report(report: dict) -> None:
    """A few aligned rows: Kiln, the peer, Kiln's advantage; then the floor line."""
    kiln, peer = report["kiln"], report["peer"]
    requests = ("batch-1 only (no offline run): one request at a time," if report["batch_1_only"]
                else str(report["prompts"]))
    stdout.print(f"[bold]kiln bench[/] {escape(report['target'])} on {escape(_machine(report))}: {requests} prompts of "
                 f"{report['input_len']} tokens, {report['output_len']} new tokens each", markup=True, highlight=False)
    stdout.print(f"engine: {kiln['quantization']}", highlight=False)
    print_runtime(report.get("runtime"))
    table = Table(box=None, header_style="bold")
    table.add_column("")
    table.add_column("kiln", justify="right")
    has_peer = peer is not None and "error" not in peer
    if has_peer:
        table.add_column(f"transformers ({peer['dtype']}, {peer['attn_implementation']})", justify="right")
        table.add_column("kiln advantage", justify="right")
    for key, label, _ in FIGURES:
        row = [label, _fmt(kiln.get(key))]
        if has_peer:
            ratio = report["speedups"].get(key)
            row += [_fmt(peer.get(key)), f"{ratio:.2f}x" if ratio else "-"]
        table.add_row(*row)
    stdout.print(table)
    floor = report["floor"]
    stdout.print(f"floor: batch-1 decode at {kiln['decode_tokens_per_s_batch1']:,.1f} tokens/s is "
                 f"{report['floor_fraction_batch1']:.1%} of {report['floor_tokens_per_s_batch1']:,.1f} tokens/s "
                 f"({floor['bytes_per_step'] / 1e6:,.1f} MB per step{_whose(floor)} at "
                 f"{floor['bandwidth_gbs']:,.1f} GB/s, {floor['bandwidth_source']})", highlight=False)
    if (pool := kiln.get("kv_pool")) is not None:
        memory = f", {format_bytes(pool['bytes'])}" if "bytes" in pool else ""
        if pool.get("ranks", 1) > 1:
            memory += f" over {pool['ranks']} ranks, {format_bytes(pool['bytes_per_rank'])} each"
        if "device_total_bytes" in pool:
            memory += (f" of {'rank 0' if pool.get('ranks', 1) > 1 else 'the'} device's "
                       f"{format_bytes(pool['device_total_bytes'])} ({format_bytes(pool['device_free_bytes'])} "
                       f"left free)")
        stdout.print(f"KV pool: {pool['tokens']:,} tokens{memory}; {pool['full_length_sequences']:,} sequences of "
                     f"max_seq_len at once for max_batch_size {pool['max_batch_size']:,}", highlight=False)
    if phases := kiln.get("load_phases_s"):
        parts = [f"{name.replace('_', ' ')} {seconds:.2f} s" for name, seconds in phases.items()]
        stdout.print(f"load: {kiln['load_ms'] / 1000:.2f} s, of which {', '.join(parts)}", highlight=False)
    if (graphs := kiln.get("cuda_graphs")) and graphs["captured"] and "decode_graphs" not in (phases or {}):
        stdout.print(f"CUDA graphs: {graphs['captured']} captured while idle after the load, in "
                     f"{kiln['warm_ms'] / 1000:.2f} s", highlight=False)
    if peer and "error" in peer:
        stdout.print(f"[yellow]peer transformers did not run[/]: {escape(peer['error'])}", markup=True,
                     highlight=False)
    elif peer and peer.get("note"):
        stdout.print(f"peer: {peer['note']}", highlight=False)
    stdout.print(f"engine {kiln['engine_key'][:12]} ({'cache hit' if kiln['cache_hit'] else 'built'}), "
                 f"config {report['config']}", highlight=False)


def print_runtime(runtime: dict | None) -> None:
    """The runtime options set away from their defaults (``provenance.runtime_record``), on one line; nothing at the
    defaults."""
    if runtime:
        stdout.print("runtime: " + ", ".join(f"{name} {value}" for name, value in runtime.items()), highlight=False)


def _machine(report: dict) -> str:
    """Where the run ran: the GPU or the CPU's torch threads, and the tensor-parallel ranks when there are several."""
    tp = report["tp_size"]
    if report["gpu"]:
        return f"{report['gpu']}, tp {tp}" if tp > 1 else report["gpu"]
    ranks = f"{tp} ranks x " if tp > 1 else ""
    return f"CPU, {ranks}{report['cpu_threads']} torch threads"


def _whose(floor: dict) -> str:
    """Whose reads a tensor-parallel engine's bytes per step are: every rank's on one memory, else one rank's."""
    if floor["tp_size"] == 1:
        return ""
    return f" of all {floor['ranks_counted']} ranks" if floor["ranks_counted"] > 1 else " per rank"


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def print_suite(report: dict) -> None:
    """One row per size: Kiln's offline tokens/s against the published figure, and what the engine did."""
    where = report["gpu"] or "CPU"
    stdout.print(f"[bold]kiln bench --suite {report['suite']}[/] {escape(report['target'])} on {escape(where)}",
                 markup=True, highlight=False)
    stdout.print(f"against: {report['source']}; requests per row: {report['counts']}", highlight=False)
    print_runtime(report["runtime"])
    table = Table(box=None, header_style="bold")
    for column in ("in/out", "requests", "kiln tok/s", "published tok/s", "kiln / published", "preemptions",
                   "KV pool seqs", "last batch p50"):
        table.add_column(column, justify="left" if column == "in/out" else "right")
    for row in report["rows"]:
        engine, pool = row["offline_engine"], row["kv_pool"]
        table.add_row(row["row"], f"{row['prompts']:,}", _fmt(row["kiln_tokens_per_s"]),
                      f"{row['published_tokens_per_s']:,.0f} ({row['published_by']})", f"{row['ratio']:.2f}x",
                      str(engine["preemptions"]), f"{pool['full_length_sequences']:,}/{pool['max_batch_size']:,}",
                      _fmt(engine["last_steps_batch_size_p50"]))
    stdout.print(table)

"""Runs scheduled steps on the model: flat batch metadata, forward, logits of the last tokens, sampling; a step is
launched on the device and collected once its tokens reach the host, so the engine can queue the next one between."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate
from pathlib import Path

import torch

from kiln.runtime.errors import InsufficientKVMemoryError, SamplingError
from kiln.runtime.native.attention_metadata import AttentionMetadata
from kiln.runtime.native.cuda_graphs import GraphSet
from kiln.runtime.native.decode_graphs import maybe_decode_graphs
from kiln.runtime.native.device_copy import device_tensor
from kiln.runtime.native.engine_format import EngineConfig
from kiln.runtime.native.grammar import Grammars
from kiln.runtime.native.kernel_choice import KernelChoice
from kiln.runtime.native.kv_cache import (
    GPU_MEMORY_UTILIZATION,
    allocate_kv_cache,
    default_kv_blocks,
    kv_bytes_per_block,
)
from kiln.runtime.native.logit_controls import UnseenTokens
from kiln.runtime.native.model.decoder import DecoderModel
from kiln.runtime.native.parallel.channel import StepChannel
from kiln.runtime.native.parallel.group import TensorParallelGroup
from kiln.runtime.native.parallel.sharding import rank_config
from kiln.runtime.native.parallel.step_batch import StepBatch
from kiln.runtime.native.prefill_graphs import maybe_prefill_graphs
from kiln.runtime.native.prompt_logprobs import (
    PromptLogprobs,
    PromptLogprobsCollector,
    logits_in_chunks,
    prompt_positions,
    wants_prompt_logprobs,
)
from kiln.runtime.native.sampler import Draw, Sampler
from kiln.runtime.native.scheduler import SchedulerOutput
from kiln.runtime.options import RuntimeOptions
from kiln.runtime.outputs import TokenLogprob
from kiln.runtime.sequence import Sequence
from kiln.runtime.stats import PhaseTimes


@dataclass
class LaunchedStep:
    """A step whose model run and sampling are queued on the device; ``ModelRunner.collect`` waits for its tokens.
    A step whose sampling waits for the host (``logits`` set, ``drawn`` None) is sampled by ``ModelRunner.sample``.
    """

    out: SchedulerOutput
    sample_seqs: list[Sequence]  # the sequences that get a token, in the order of ``drawn``'s rows
    drawn: Draw | None = None
    host_tokens: torch.Tensor | None = None  # the tokens' copy on the host, complete once ``ready`` has fired
    ready: torch.cuda.Event | None = None
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # of the sequences whose requests asked
    logits: torch.Tensor | None = None  # queued, not sampled yet: a structured output's mask needs the host

    @property
    def sampling_deferred(self) -> bool:
        return self.logits is not None

    @functools.cached_property
    def sample_rows(self) -> dict[Sequence, int]:
        """Each sequence that gets a token, and its row of ``drawn``."""
        return {seq: i for i, seq in enumerate(self.sample_seqs)}

    def unseen_tokens(self, seqs: list[Sequence]) -> UnseenTokens | None:
        """The rows of ``seqs`` that this step samples a token for, and those tokens, on the device: a step queued
        behind this one takes them as its input ids there, and its logit controls count them (None when this step
        samples none of them)."""
        row = self.sample_rows
        pairs = [(i, row[seq]) for i, seq in enumerate(seqs) if seq in row]
        if not pairs:
            return None
        index = device_tensor(pairs, torch.long, self.drawn.tokens.device)
        tokens = self.drawn.tokens[index[:, 1]].clamp_(min=0)  # a failed row's negative code (finished by then)
        return UnseenTokens([i for i, _ in pairs], index[:, 0], tokens)

    def logprobs(self, tokens: dict[Sequence, int | SamplingError]) -> dict[Sequence, TokenLogprob]:
        """The log probabilities of the collected ``tokens`` of the sequences whose requests asked for them."""
        if self.drawn is None or self.drawn.logprobs is None:
            return {}
        host = [token if isinstance(token := tokens[seq], int) else -1 for seq in self.sample_seqs]
        by_row = self.drawn.logprobs.on_host(host, self.sample_seqs)
        return {self.sample_seqs[row]: logprob for row, logprob in by_row.items()}


class ModelRunner:
    """Owns the model weights and the paged KV pool on one device, and executes scheduler outputs on them; the
    kernels, CUDA graphs and KV pool size follow ``options``. On a tensor-parallel engine it is rank ``tp.rank``'s
    shard; rank 0's hands each step to the other ranks through ``channel``, and every rank captures its graphs at
    load (together); on one GPU they are captured when first needed, or by ``capture_next_graph`` while idle."""

    def __init__(self, engine_dir: Path, config: EngineConfig, device: torch.device, options: RuntimeOptions,
                 grammars: Grammars | None = None, tp: TensorParallelGroup | None = None,
                 channel: StepChannel | None = None) -> None:
        self.device = device
        self.tp, self.channel = tp, channel
        captures_at_load = self._captures_at_load(options)
        self.block_size = config.plan.tokens_per_block
        self.load_times = PhaseTimes(functools.partial(torch.cuda.synchronize, device) if device.type == "cuda"
                                     else lambda: None)
        kernels = KernelChoice.from_options(options)
        with self.load_times.phase("weights"):
            self.model = DecoderModel.from_engine(Path(engine_dir), config, device, config.torch_dtype, kernels, tp)
        config = self.config = rank_config(config)  # the KV pool and the graphs have this rank's shapes
        with self.load_times.phase("kv_pool"):
            self._allocate_kv_pool(config, options)
        self.sampler = Sampler(config.architecture.eos_token_ids, grammars, kernels)
        graphs = options.captures_cuda_graphs
        self.decode_graphs = maybe_decode_graphs(self.model, self.kv_caches, config, device, graphs)
        self.prefill_graphs = maybe_prefill_graphs(self.model, self.kv_caches, config, device, graphs)
        for name, runner in (("decode_graphs", self.decode_graphs), ("prefill_graphs", self.prefill_graphs)):
            if captures_at_load and runner is not None:
                with self.load_times.phase(name):
                    runner.graphs.capture_all()

    def _captures_at_load(self, options: RuntimeOptions) -> bool:
        """Whether every CUDA graph is captured during the load (``RuntimeOptions.cuda_graph_capture``; always on a
        tensor-parallel engine, whose ranks capture together)."""
        return self.tp is not None or options.cuda_graph_capture == "at_load"

    def capture_next_graph(self) -> bool:
        """Capture one CUDA graph that is still pending (the decode buckets first, each kind largest first); False
        when none is. Only between steps, with none in flight: the graphs' static buffers are overwritten."""
        return any(graphs.capture_next() for graphs in self._graph_sets())

    def graph_stats(self) -> dict:
        """How many CUDA graphs are captured and pending, and the host seconds their captures took."""
        sets = self._graph_sets()
        return {"captured": sum(len(s.graphs) for s in sets), "pending": sum(len(s.pending) for s in sets),
                "capture_s": round(sum(s.capture_s for s in sets), 4)}

    def _graph_sets(self) -> list[GraphSet]:
        """The graph sets of the runners that capture (a runner made with ``capture=False`` runs eagerly)."""
        return [runner.graphs for runner in (self.decode_graphs, self.prefill_graphs)
                if runner is not None and runner.graphs is not None]

    def _allocate_kv_pool(self, config: EngineConfig, options: RuntimeOptions) -> None:
        self.num_kv_blocks = options.num_kv_blocks or default_kv_blocks(
            config, self.device, options.gpu_memory_utilization or GPU_MEMORY_UTILIZATION)
        if self.tp is not None:
            self.num_kv_blocks = self.tp.min_over_ranks(self.num_kv_blocks)
        min_blocks = config.plan.blocks_per_seq
        if self.num_kv_blocks < min_blocks:
            raise InsufficientKVMemoryError(
                f"KV pool of {self.num_kv_blocks} blocks cannot hold one sequence of max_seq_len "
                f"{config.plan.max_seq_len} ({min_blocks} blocks of {self.block_size} tokens): free memory, pass a "
                f"larger num_kv_blocks, or rebuild with a smaller max_seq_len")
        try:
            self.kv_caches = allocate_kv_cache(config, self.num_kv_blocks, self.device)
        except (RuntimeError, MemoryError) as e:  # torch.OutOfMemoryError is a RuntimeError, as is the CPU's
            gib = self.num_kv_blocks * kv_bytes_per_block(config) / 2**30
            raise InsufficientKVMemoryError(
                f"KV pool of {self.num_kv_blocks} blocks ({gib:.1f} GiB) could not be allocated on {self.device} "
                f"({str(e).splitlines()[0]}): pass a smaller num_kv_blocks or free memory") from None

    @torch.inference_mode()
    def launch(self, out: SchedulerOutput, after: LaunchedStep | None = None) -> LaunchedStep:
        """Queue the step's model run and sampling on the device and return without waiting for them.

        With ``after`` (a launched step not yet collected, ``Scheduler.schedule_ahead``), ``out`` follows it: the
        tokens ``after`` runs for a sequence are computed before ``out``'s, and a token it samples is the input id
        of that sequence's decode in ``out``, taken from the device."""
        seqs = list(out.scheduled)
        query_lens = list(out.scheduled.values())
        in_flight = after.out.scheduled if after is not None else {}
        sampled_before = after.sample_rows if after is not None else {}
        input_ids, positions, seq_lens, rows, starts = [], [], [], [], []
        for i, (seq, query_len) in enumerate(zip(seqs, query_lens, strict=True)):
            start = seq.num_computed_tokens + in_flight.get(seq, 0)
            starts.append(start)
            fed = seq in sampled_before  # its token is not on the host yet
            input_ids.extend([0] if fed else seq.token_ids[start:start + query_len])
            positions.extend(self.model.rotary.table_rows(start, query_len, seq.num_tokens + fed))
            seq_lens.append(start + query_len)
            if seq_lens[-1] == seq.num_tokens + fed:  # the step reaches its last token: it samples
                rows.append(i)
        unseen = after.unseen_tokens(seqs) if after is not None else None
        ends = list(accumulate(query_lens))
        prompt_rows = [i for i, seq in enumerate(seqs) if wants_prompt_logprobs(seq, starts[i])]
        spans = [(ends[i] - query_lens[i], prompt_positions(seqs[i], starts[i], query_lens[i])) for i in prompt_rows]
        collectors = [PromptLogprobsCollector(seqs[i], starts[i], count)
                      for i, (_, count) in zip(prompt_rows, spans, strict=True)]
        batch = StepBatch(input_ids, positions, query_lens, seq_lens, [seq.block_table for seq in seqs], rows,
                          unseen.rows if unseen is not None else [], spans)
        logits = self.execute(batch, (unseen.device_rows, unseen.tokens) if unseen is not None else None,
                              lambda span, chunk: collectors[span].add(chunk))
        found = [collector.result() for collector in collectors]
        sample_seqs = [seqs[i] for i in rows]
        step = LaunchedStep(out, sample_seqs, prompt_logprobs=found)
        if not rows:
            return step
        if any(seq.matcher is not None and seq in sampled_before for seq in sample_seqs):
            step.logits = logits  # its mask needs the token ``after`` samples: ``sample`` once the host has it
            return step
        controlled = after is not None and any(seq.params.controls_logits for seq in sample_seqs)
        self._draw(step, logits, after.unseen_tokens(sample_seqs) if controlled else None)
        return step

    def execute(self, batch: StepBatch, fed_ids: tuple[torch.Tensor, torch.Tensor] | None = None,
                take_prompt_logits: Callable[[int, torch.Tensor], None] | None = None) -> torch.Tensor | None:
        """Run the model on one step and return the logits of ``batch.sample_rows`` (None when there are none).
        ``fed_ids`` (rows, tokens; on the device) are the input ids of ``batch.fed_rows``; each prompt span's
        logits go to ``take_prompt_logits(span index, chunk)`` in chunks.

        On a tensor-parallel engine rank 0 first hands the batch and the fed tokens to the other ranks, which call
        this too (``parallel/worker.py``, with neither): every rank runs the same path, so their collectives meet."""
        if self.channel is not None:
            self.channel.send(batch.encode())
        if batch.fed_rows and self.tp is not None:
            if fed_ids is None:  # a worker: the rows from the batch, the tokens from rank 0
                fed_ids = (device_tensor(batch.fed_rows, torch.long, self.device),
                           torch.empty(len(batch.fed_rows), dtype=torch.long, device=self.device))
            self.tp.broadcast(fed_ids[1])
        rows, query_lens = batch.sample_rows, batch.query_lens
        graphs_fit = not batch.prompt_spans  # prompt log probabilities need every position's hidden state: eager
        if graphs_fit and self.decode_graphs is not None and self.decode_graphs.fits(query_lens):
            logits = self.decode_graphs.run(batch.input_ids, batch.positions, batch.seq_lens, batch.block_tables,
                                            fed_ids)  # a row a sequence
            return logits[rows] if len(rows) < len(query_lens) else logits
        if graphs_fit and fed_ids is None and self.prefill_graphs is not None and self.prefill_graphs.fits(query_lens):
            # the last token's logits
            return self.prefill_graphs.run(batch.input_ids, batch.positions, batch.seq_lens[0],
                                           batch.block_tables[0])
        meta = AttentionMetadata.build(query_lens, batch.seq_lens, batch.block_tables, self.block_size, self.device)
        ids = device_tensor(batch.input_ids, torch.long, self.device)
        if fed_ids is not None:
            ids.index_copy_(0, *fed_ids)
        hidden = self.model(ids, device_tensor(batch.positions, torch.long, self.device), meta, self.kv_caches)
        for span, (first, count) in enumerate(batch.prompt_spans):
            logits_in_chunks(hidden[first:first + count], self.model.compute_logits,
                             functools.partial(take_prompt_logits, span) if take_prompt_logits else lambda _: None)
        if not rows:
            return None
        ends = list(accumulate(query_lens))
        last_token_index = device_tensor([ends[i] - 1 for i in rows], torch.long, self.device)
        return self.model.compute_logits(hidden[last_token_index])

    @torch.inference_mode()
    def sample(self, step: LaunchedStep) -> None:
        """Queue the sampling of a step launched with its sampling deferred, now that the host holds every token
        before it (so its structured outputs' matchers and its logit controls are up to date)."""
        logits, step.logits = step.logits, None
        self._draw(step, logits, None)

    def _draw(self, step: LaunchedStep, logits: torch.Tensor, unseen: UnseenTokens | None) -> None:
        """Queue the step's sampling and the copy of its tokens to the host."""
        step.drawn = drawn = self.sampler.draw(logits, step.sample_seqs, unseen)
        if self.device.type != "cuda":
            step.host_tokens = drawn.tokens
            return
        step.host_tokens = torch.empty(drawn.tokens.shape, dtype=drawn.tokens.dtype, pin_memory=True)
        step.host_tokens.copy_(drawn.tokens, non_blocking=True)
        step.ready = torch.cuda.Event()
        step.ready.record()

    @staticmethod
    def collect(step: LaunchedStep) -> dict[Sequence, int | SamplingError]:
        """Wait for a launched step's tokens: the token of every sequence whose step reached its last token (a
        prefill chunk that stops short of the end of the prompt samples nothing), or the SamplingError of one that
        could not be sampled. The prompt log probabilities the step computed join their sequences."""
        for found in step.prompt_logprobs:
            found.append_to_sequence()
        if step.drawn is None:
            return {}
        if step.ready is not None:
            step.ready.synchronize()
        return dict(zip(step.sample_seqs, step.drawn.resolve(step.host_tokens.tolist()), strict=True))

"""In-flight batching: which sequences run in the next step, and for how many tokens each."""

from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kiln.runtime.limits import EngineLimits
from kiln.runtime.native.block_manager import BlockManager
from kiln.runtime.options import SchedulerPolicy
from kiln.runtime.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """Sequences of one step and the number of new tokens each runs (a prefill chunk, or 1 for a decode)."""

    scheduled: dict[Sequence, int] = field(default_factory=dict)
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    num_preempted: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.scheduled.values())

    def count_kinds(self, is_decode: Callable[[Sequence], bool]) -> None:
        """Set ``num_decode_seqs`` and ``num_prefill_seqs`` from ``scheduled``."""
        self.num_decode_seqs = sum(map(is_decode, self.scheduled))
        self.num_prefill_seqs = len(self.scheduled) - self.num_decode_seqs


class Scheduler:
    """First come, first served, under the engine's budget of `max_num_tokens` tokens and `max_batch_size` sequences
    per step (its limits: the build plan's).

    Each step schedules running decodes first, then running prefills, then admits waiting sequences in arrival
    order, chunking a prefill to whatever budget is left. When KV blocks run out, the most recently arrived running
    sequence is preempted by recompute: its blocks are freed and it goes back to the front of `waiting`. The oldest
    sequence is never a victim and every request was checked to fit the pool alone, so none starves. A sequence whose
    KV must be computed anew (``Sequence.recompute_due``: LongRoPE's switch to its long table) is requeued the same
    way, first in line, and readmitted in the same step where the budget allows.

    The ``policy`` decides what fits when a request is admitted: ``"max_utilization"`` its blocks for the tokens it
    runs now; ``"guaranteed_no_evict"`` also the blocks that every running request and it need to reach their
    ``max_tokens``, so blocks never run out and nothing is preempted.
    """

    def __init__(self, limits: EngineLimits, block_manager: BlockManager,
                 policy: SchedulerPolicy = "max_utilization") -> None:
        self.limits = limits
        self.block_manager = block_manager
        self.reserves_full_length = policy == "guaranteed_no_evict"
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.limits.check_request(seq.num_prompt_tokens, seq.params)  # each fits the pool alone
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.limits.max_num_tokens
        for seq in [seq for seq in self.running if seq.recompute_due()]:
            self._requeue(seq)
            seq.restart_kv()
        for seq in sorted(self.running, key=lambda s: not s.is_decode):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.append_slots(seq, num_new):
                victim = self.running[-1]
                budget += out.scheduled.pop(victim, 0)
                self.preempt(victim)
                out.num_preempted += 1
                if victim is seq:
                    break
            else:
                out.scheduled[seq] = num_new
                budget -= num_new
        if not out.num_preempted:
            self._admit(out, budget, len(self.running))
        out.count_kinds(lambda seq: seq.is_decode)
        return out

    def _admit(self, out: SchedulerOutput, budget: int, num_running: int) -> None:
        """Admit waiting sequences in arrival order into ``out`` while the token ``budget``, the sequence limit
        (``num_running`` are running) and the free blocks allow, the last one's prefill chunked to fit."""
        bm = self.block_manager
        reserved = sum(map(self._blocks_to_grow, self.running)) if self.reserves_full_length and self.waiting else 0
        while self.waiting and budget and num_running < self.limits.max_batch_size:
            seq = self.waiting[0]
            computed_blocks = bm.get_computed_blocks(seq)
            if self.reserves_full_length:
                shared = sum(1 for b in computed_blocks if bm.blocks[b].ref_count > 0)  # in use: taken from no one
                if bm.blocks_needed(self._full_length(seq)) - shared > bm.num_free_blocks - reserved:
                    break
            num_new = min(seq.num_tokens - len(computed_blocks) * bm.block_size, budget)
            if not bm.allocate(seq, computed_blocks, num_new):
                break
            reserved += self._blocks_to_grow(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, seq, key=lambda s: s.seq_id)
            out.scheduled[seq] = num_new
            budget -= num_new
            num_running += 1

    @staticmethod
    def _full_length(seq: Sequence) -> int:
        return seq.num_prompt_tokens + seq.params.max_tokens

    def _blocks_to_grow(self, seq: Sequence) -> int:
        """The blocks a running sequence still takes from the pool before it reaches its ``max_tokens``."""
        return max(0, self.block_manager.blocks_needed(self._full_length(seq)) - len(seq.block_table))

    def schedule_ahead(self, out: SchedulerOutput) -> SchedulerOutput | None:
        """The step after ``out``, a step launched but not collected, scheduled before its tokens are known.

        Each sequence that ``out`` samples is one token longer, a decode of that token, unless the token ends it by
        length; a prefill chunk continues; waiting requests are admitted into the rest of the budget and into the
        seats of the sequences that end (not yet into their blocks: those are freed once ``out`` is collected).
        Blocks for the tokens in flight and the new ones are taken now. None when ``out`` preempted, when a running
        sequence's blocks run short (that step would preempt: it waits for ``out``'s outcome), when a sequence's KV
        falls due for recompute, or when nothing would run."""
        if out.num_preempted:
            return None
        sampled = {seq for seq, num_new in out.scheduled.items() if seq.num_computed_tokens + num_new == seq.num_tokens}
        if any(seq.recompute_due(more_tokens=1) for seq in sampled):
            return None  # its KV is recomputed once the token is known
        ending = {seq for seq in sampled if seq.num_completion_tokens + 1 >= seq.params.max_tokens}
        going_on = [seq for seq in self.running if seq not in ending]

        def decodes_next(seq: Sequence) -> bool:
            return seq in sampled or seq.is_decode

        ahead = SchedulerOutput()
        budget = self.limits.max_num_tokens
        for seq in sorted(going_on, key=lambda s: not decodes_next(s)):  # decodes first
            if budget == 0:
                break
            in_flight = out.scheduled.get(seq, 0)
            num_new = min(seq.num_tokens + (seq in sampled) - seq.num_computed_tokens - in_flight, budget)
            if not self.block_manager.append_slots(seq, in_flight + num_new):
                return None
            ahead.scheduled[seq] = num_new
            budget -= num_new
        self._admit(ahead, budget, len(going_on))
        if not ahead.scheduled:
            return None
        ahead.count_kinds(decodes_next)
        return ahead

    def preempt(self, seq: Sequence) -> None:
        """Free the sequence's blocks and requeue it first in line; its tokens are recomputed when it is readmitted."""
        self._requeue(seq)
        seq.num_preemptions += 1
        self.num_preemptions += 1

    def _requeue(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def update_computed(self, out: SchedulerOutput) -> None:
        """Record that the step wrote KV for its scheduled tokens (of the sequences not finished since it was
        scheduled: a step scheduled ahead may outlive some)."""
        for seq, num_new in out.scheduled.items():
            if not seq.is_finished:
                seq.num_computed_tokens += num_new
                self.block_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Finish a waiting or running sequence ("stop", "length", "abort", "error") and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.finish(reason)

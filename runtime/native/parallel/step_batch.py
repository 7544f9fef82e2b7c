"""What every rank of a tensor-parallel engine needs to run one step of the model, and its bytes on the wire.

Rank 0 schedules and samples; the other ranks only run the model's forward with it, so that their collectives meet.
A ``StepBatch`` is the host data of one step (``ModelRunner.launch`` makes it), encoded as little-endian int64 values:
a header of counts, then each list, block tables as lengths then entries. No pickle crosses the wire.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln.runtime.errors import KilnError

STOP = b"stop"  # the message that ends a worker's loop
HEADER = 6  # sequences, tokens, sampled rows, fed rows, prompt spans, block-table entries


@dataclass
class StepBatch:
    """One step's model inputs: ``query_lens[i]`` new tokens of sequence i (``input_ids`` at ``positions``, context
    ``seq_lens[i]``, its blocks ``block_tables[i]``), the sequences whose last token's logits are computed
    (``sample_rows``), those whose input id comes from the device (``fed_rows``: a token rank 0 sampled in the step
    before, broadcast on the device), and the ``(first hidden row, rows)`` spans whose prompt logits are computed."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    fed_rows: list[int]
    prompt_spans: list[tuple[int, int]]

    def encode(self) -> bytes:
        """The batch as bytes (``decode`` reads them back)."""
        tables = [len(t) for t in self.block_tables]
        header = [len(self.query_lens), len(self.input_ids), len(self.sample_rows), len(self.fed_rows),
                  len(self.prompt_spans), sum(tables)]
        spans = [value for span in self.prompt_spans for value in span]
        values = [*header, *self.input_ids, *self.positions, *self.query_lens, *self.seq_lens, *tables,
                  *(b for t in self.block_tables for b in t), *self.sample_rows, *self.fed_rows, *spans]
        return np.asarray(values, dtype="<i8").tobytes()

    @classmethod
    def decode(cls, data: bytes) -> StepBatch:
        """The batch ``encode`` wrote; KilnError when the bytes are not one."""
        values = np.frombuffer(data, dtype="<i8")
        if len(data) % 8 or len(values) < HEADER:
            raise KilnError(f"tensor-parallel step message of {len(data)} bytes is not a step")
        seqs, tokens, sampled, fed, spans, entries = (int(v) for v in values[:HEADER])
        sizes = [tokens, tokens, seqs, seqs, seqs, entries, sampled, fed, 2 * spans]
        if len(values) != HEADER + sum(sizes):
            raise KilnError(f"tensor-parallel step message holds {len(values)} values, its header says "
                            f"{HEADER + sum(sizes)}")
        parts, at = [], HEADER
        for size in sizes:
            parts.append(values[at:at + size].tolist())
            at += size
        input_ids, positions, query_lens, seq_lens, lengths, flat, sample_rows, fed_rows, span_values = parts
        starts = np.cumsum([0, *lengths]).tolist()
        tables = [flat[starts[i]:starts[i + 1]] for i in range(seqs)]
        return cls(input_ids, positions, query_lens, seq_lens, tables, sample_rows, fed_rows,
                   list(zip(span_values[::2], span_values[1::2], strict=True)))

"""What a closed LLM keeps in place of its engine."""

from __future__ import annotations

import logging

from kiln.runtime.engine import Engine
from kiln.runtime.errors import EngineClosedError, KilnError
from kiln.runtime.outputs import RequestFailure, StreamDelta
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence

logger = logging.getLogger("kiln.runtime")


class ClosedEngine:
    """What a closed LLM keeps of its engine: its tokenizer, limits and last statistics (nothing running or waiting
    any more); nothing runs. The rest of ``Engine`` is here so that it is one, for code that holds an ``Engine``."""

    def __init__(self, engine: Engine) -> None:
        self.tokenizer, self.limits = engine.tokenizer, engine.limits
        try:
            stats = engine.stats_snapshot()
        except Exception as e:  # an engine in an error state: closing must still free it (no traceback kept, whose
            # frames would hold it)
            logger.warning("the closing engine's last statistics could not be read (%s: %s)", type(e).__name__, str(e))
            stats = {}
        self._stats = {**stats, **{gauge: 0 for gauge in ("num_running", "num_waiting") if gauge in stats}}

    def make_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Sequence:
        raise EngineClosedError("the LLM is closed: load it again")

    def add_request(self, seq: Sequence) -> None:
        raise EngineClosedError("the LLM is closed: load it again")

    def step(self) -> list[StreamDelta | RequestFailure]:
        return []

    def abort_request(self, request_id: str) -> StreamDelta | None:
        return None

    def has_unfinished(self) -> bool:
        return False

    def warm_up_step(self) -> bool:
        return False

    def failure(self) -> KilnError | None:
        return None

    def stats_snapshot(self) -> dict:
        return self._stats

    def close(self) -> None:
        pass

    def interrupt(self) -> bool:
        return False

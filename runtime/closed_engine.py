"""What a closed LLM keeps in place of its engine."""

from __future__ import annotations

import logging

from kiln.runtime.engine import Engine
from kiln.runtime.errors import EngineClosedError
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence

logger = logging.getLogger("kiln.runtime")


class ClosedEngine:
    """What a closed LLM keeps of its engine: its tokenizer, limits and last statistics (nothing running or waiting
    any more), and a refusal of new requests; nothing runs, so nothing else of ``Engine`` is asked of it."""

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
        """Refuse: a closed LLM takes no request."""
        raise EngineClosedError("the LLM is closed: load it again")

    def stats_snapshot(self) -> dict:
        """The engine's statistics as it closed."""
        return self._stats

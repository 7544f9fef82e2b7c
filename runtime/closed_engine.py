"""What a closed LLM keeps in place of its engine."""

from __future__ import annotations

from kiln.runtime.engine import Engine
from kiln.runtime.errors import EngineClosedError, KilnError
from kiln.runtime.outputs import RequestFailure, StreamDelta
from kiln.runtime.sampling_params import SamplingParams
from kiln.runtime.sequence import Sequence


class ClosedEngine:
    """What a closed LLM keeps of its engine: its tokenizer, limits and last statistics; nothing runs."""

    def __init__(self, engine: Engine) -> None:
        self.tokenizer, self.limits = engine.tokenizer, engine.limits
        self._stats = engine.stats_snapshot()

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

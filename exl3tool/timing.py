"""Seconds per stage of a warm (read, regularise, scale search, Viterbi, pack, publish...), for ``worker_stats``.

A ``StageTimer`` is called as a context manager around a stage: two ``perf_counter`` calls and a lock, so it can stay
on in every warm. With a CUDA ``device`` the stage ends with a synchronisation of the calling thread's current stream,
so GPU work is charged to the stage that queued it (the encoder already waits at the end of each of these stages to
read a scalar back, so this adds no wait of its own). Stages on different threads overlap: their sum is not the wall.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import ContextManager, Iterator, Optional

import torch

__all__ = ["StageTimer", "stage"]


class StageTimer:
    """Accumulated seconds and counts per stage name, from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds: dict[str, float] = defaultdict(float)
        self._counts: dict[str, int] = defaultdict(int)

    @contextmanager
    def __call__(self, name: str, device: Optional[torch.device] = None) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if device is not None and device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()
            self.add(name, time.perf_counter() - start)

    def add(self, name: str, seconds: float) -> None:
        with self._lock:
            self._seconds[name] += seconds
            self._counts[name] += 1

    def as_dict(self) -> dict[str, dict[str, float]]:
        """``{stage: {"seconds": s, "count": n}}``, stages in the order first seen."""
        with self._lock:
            return {k: {"seconds": round(v, 4), "count": self._counts[k]} for k, v in self._seconds.items()}


def stage(timer: Optional[StageTimer], name: str, device: Optional[torch.device] = None) -> ContextManager:
    """``timer(name, device)``, or a no-op without a timer."""
    return nullcontext() if timer is None else timer(name, device)

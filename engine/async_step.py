"""The device side of a step, run asynchronously: a queue that orders device work, and a handle on its result.

On CUDA, torch already queues kernels on a stream, so work is launched inline from the engine thread and only the
result is waited for: the sampled ids (and logprobs) are copied into pinned host memory with non_blocking copies,
an event is recorded after them, and `StepHandle.result()` waits on that event (vLLM v1's
AsyncGPUModelRunnerOutput). On CPU, torch ops run on the calling thread, so a dedicated thread plays the stream:
device work is submitted to it in order and runs while the engine thread schedules and prepares the next step
(torch releases the GIL inside its ops). Either way the queue is FIFO, which is what makes it safe for the host to
free, reuse and re-fill blocks and rows of a step still running: everything the next step does on the device runs
after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.sampler import SamplerOutput


@dataclass
class DeviceResult:
    """What a step's device work hands back: the sampler's tensors and whatever the host side needs with them."""

    sampled: SamplerOutput | None
    extra: dict[str, list[dict[int, float]]] | None = None  # prompt log-probabilities, already on the host


class DeviceQueue:
    """FIFO device work. `busy_seconds` sums the time device work took on CPU (the device thread's run time; 0 on
    CUDA, where work is only launched here): over a run's wall time, the share the device was kept busy."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.busy_seconds = 0.0  # written by the device thread only
        self._thread = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedq-device") if device.type == "cpu" else None
        )

    def submit(self, work: Callable[[], DeviceResult]) -> StepHandle:
        if self._thread is None:
            return StepHandle.from_cuda(_in_inference_mode(work), self.device)
        return StepHandle(self._thread.submit(self._timed, work))

    def _timed(self, work: Callable[[], DeviceResult]) -> DeviceResult:
        start = time.perf_counter()
        try:
            return _in_inference_mode(work)
        finally:
            self.busy_seconds += time.perf_counter() - start

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


def _in_inference_mode(work: Callable[[], DeviceResult]) -> DeviceResult:
    with torch.inference_mode():  # thread-local: the device thread enters it itself
        return work()


class StepHandle:
    """A step launched on the device; `result()` waits for it and returns host copies of its tensors."""

    def __init__(self, future: Future | None = None) -> None:
        self._future = future
        self._event: torch.cuda.Event | None = None
        self._host: DeviceResult | None = None

    @classmethod
    def from_cuda(cls, result: DeviceResult, device: torch.device) -> StepHandle:
        handle = cls()
        sampled = result.sampled
        if sampled is not None:
            sampled = SamplerOutput(
                _to_host(sampled.token_ids),
                *(
                    None if t is None else _to_host(t)
                    for t in (sampled.sampled_logprobs, sampled.top_logprobs, sampled.top_token_ids)
                ),
            )
        handle._host = DeviceResult(sampled, result.extra)
        event = torch.cuda.Event(blocking=True)  # a blocking event: the wait sleeps, not spins
        event.record(torch.cuda.current_stream(device))
        handle._event = event
        return handle

    def done(self) -> bool:
        if self._future is not None:
            return self._future.done()
        return self._cuda_event().query()

    def result(self) -> DeviceResult:
        """Wait for the step (re-raising what its device work raised)."""
        if self._future is not None:
            return self._future.result()
        self._cuda_event().synchronize()
        if self._host is None:
            raise RuntimeError("a CUDA step handle without its host copies")
        return self._host

    def _cuda_event(self) -> torch.cuda.Event:
        """The event of a handle made by from_cuda (a handle has a future or an event)."""
        if self._event is None:
            raise RuntimeError("a step handle with neither a future nor a CUDA event")
        return self._event


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Start the copy to host memory; the step's event says when it has landed."""
    return tensor.to("cpu", non_blocking=True)

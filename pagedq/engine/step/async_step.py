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

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pagedq.engine.sample.sampler import SamplerOutput


@dataclass
class DeviceResult:
    """What a step's device work hands back: the sampler's tensors and whatever the host side needs with them."""

    sampled: SamplerOutput | None
    extra: dict[str, list[dict[int, float]]] | None = None  # prompt log-probabilities, already on the host


class DeviceQueue:
    """FIFO device work. `busy_seconds` sums the time device work took on CPU (the device thread's run time; 0 on
    CUDA, where work is only launched here): over a run's wall time, the share the device was kept busy.

    Inline (CUDA): work runs on the calling thread, which only queues kernels. Work that `waits` for the host
    (a step whose sampling needs a structured-output mask the host fills during its forward) runs on a helper
    thread instead: it queues the forward, waits there for the mask, then queues the sampling, while the engine
    thread goes on. Whatever is submitted while such work is unfinished follows it on that thread, so the
    stream sees every step's kernels in launch order; once it has drained, work runs inline again.
    """

    def __init__(self, device: torch.device, inline: bool | None = None) -> None:
        self.device = device
        self.inline = device.type != "cpu" if inline is None else inline
        self.busy_seconds = 0.0  # written by the device thread only
        self._thread = None if self.inline else ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedq-device")
        self._waiting: ThreadPoolExecutor | None = None  # inline: the helper thread for work that waits
        self._num_waiting = 0  # work submitted to it and not yet queued on the device
        self._lock = threading.Lock()

    def submit(self, work: Callable[[], DeviceResult], waits: bool = False) -> StepHandle:
        if self._thread is not None:
            return StepHandle(self._thread.submit(self._timed, work))
        with self._lock:
            behind = waits or self._num_waiting > 0
            self._num_waiting += behind
        if not behind:
            return StepHandle.launched(_in_inference_mode(work), self.device)
        if self._waiting is None:
            self._waiting = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedq-device-wait")
        stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        return StepHandle(self._waiting.submit(self._launch_behind, work, stream), nested=True)

    def _launch_behind(self, work: Callable[[], DeviceResult], stream: torch.cuda.Stream | None) -> StepHandle:
        try:
            if stream is None:
                return StepHandle.launched(_in_inference_mode(work), self.device)
            with torch.cuda.device(self.device), torch.cuda.stream(stream):  # the submitter's device and stream
                return StepHandle.launched(_in_inference_mode(work), self.device)
        finally:
            with self._lock:
                self._num_waiting -= 1

    def _timed(self, work: Callable[[], DeviceResult]) -> DeviceResult:
        start = time.perf_counter()
        try:
            return _in_inference_mode(work)
        finally:
            self.busy_seconds += time.perf_counter() - start

    def close(self) -> None:
        for pool in (self._thread, self._waiting):
            if pool is not None:
                pool.shutdown(wait=True)


def _in_inference_mode(work: Callable[[], DeviceResult]) -> DeviceResult:
    with torch.inference_mode():  # thread-local: the device thread enters it itself
        return work()


class StepHandle:
    """A step launched on the device; `result()` waits for it and returns host copies of its tensors."""

    def __init__(self, future: Future | None = None, nested: bool = False) -> None:
        self._future = future
        self._nested = nested  # the future's result is the StepHandle of work launched on a helper thread
        self._event: torch.cuda.Event | None = None
        self._host: DeviceResult | None = None

    @classmethod
    def launched(cls, result: DeviceResult, device: torch.device) -> StepHandle:
        """Work that ran on the calling thread: on CUDA its kernels are queued (from_cuda); elsewhere it is done."""
        if device.type == "cuda":
            return cls.from_cuda(result, device)
        handle = cls()
        handle._host = result
        return handle

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
            return self._future.done() and (not self._nested or self._future.result().done())
        return self._host is not None if self._event is None else self._event.query()

    def result(self) -> DeviceResult:
        """Wait for the step (re-raising what its device work raised)."""
        if self._future is not None:
            outcome = self._future.result()
            return outcome.result() if self._nested else outcome
        if self._event is not None:
            self._event.synchronize()
        if self._host is None:
            raise RuntimeError("a step handle with neither a future nor its host copies")
        return self._host


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """Start the copy to host memory; the step's event says when it has landed."""
    return tensor.to("cpu", non_blocking=True)

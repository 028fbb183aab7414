"""Reward functions in subprocess workers.

Why processes, not threads: functions such as ``math_verify`` use
``signal.alarm``, which only works in a main thread, and a function stuck in
C code cannot be interrupted from a thread. Each worker is a ``spawn``-ed
process that resolves the reward specs itself (nothing unpicklable crosses
the pipe), runs every function in its own main thread on its shard of prompt
groups, and reports progress per function, so when it overruns
``trl.reward_timeout`` or dies the main process knows which function was
running. Such a worker is killed and replaced on the next call.

Protocol (parent -> worker): ``("score", Batch)`` | ``("stop",)``.
Worker -> parent: ``("ready",)`` | ``("fatal", exc)`` once at start, then per
batch ``("running", [i, ...])``, ``("result", i, Outcome)``, ``("done",)``.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import time
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo_core.contract.context import RunContext
from grpo_core.contract.errors import GrpoError, RewardError
from grpo_core.host.plugin_host import PluginHost
from grpo_core.scoring.reward_calls import (
    FIX_HINT,
    Batch,
    Outcome,
    describe_failure,
    run_functions,
)

if TYPE_CHECKING:
    from grpo_core.config.schema import GRPOConfig

START_TIMEOUT_S = 300.0  # resolving specs may load a reward model


def worker_main(conn: Connection, cfg: GRPOConfig, specs: list[str], names: list[str], allow: set[str] | None) -> None:
    """Entry point of one worker process."""
    try:
        host = PluginHost(allow=allow)
        context = RunContext(config=cfg, output_dir=Path(cfg.output_dir), log=lambda _msg: None)
        funcs = [host.load_reward(spec, context) for spec in specs]
    except BaseException as exc:  # report, never hang the parent
        try:
            conn.send(("fatal", exc if isinstance(exc, GrpoError) else RewardError(f"{type(exc).__name__}: {exc}")))
        except Exception:
            conn.send(("fatal", RewardError(f"{type(exc).__name__}: {exc}")))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message[0] != "score":
            return
        batch: Batch = message[1]
        run_functions(
            funcs,
            names,
            batch,
            on_start=lambda idx: conn.send(("running", idx)),
            on_result=lambda i, outcome: conn.send(("result", i, outcome)),
        )
        conn.send(("done",))


class _Worker:
    def __init__(self, ctx: Any, args: tuple[Any, ...]) -> None:
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=worker_main, args=(child, *args), daemon=True, name="grpo-reward-worker")
        self.process.start()
        child.close()

    def wait_ready(self) -> None:
        if not self.conn.poll(START_TIMEOUT_S):
            self.kill()
            raise RewardError(
                f"a reward worker did not start within {START_TIMEOUT_S:.0f}s (resolving trl.reward_funcs)."
            )
        try:
            message = self.conn.recv()
        except EOFError:
            code = self.process.exitcode
            self.kill()
            raise RewardError(f"a reward worker exited while starting (exit code {code}).") from None
        if message[0] == "fatal":
            self.kill()
            raise message[1]

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)
        self.conn.close()


def _crashed(worker: _Worker) -> str:
    """The problem text for a worker that died. Its sentinel and pipe report
    the death a moment before the process can be reaped, so wait for that:
    otherwise the exit code reads ``None``."""
    worker.process.join(timeout=5)
    return f"crashed: its reward worker process died (exit code {worker.process.exitcode})"


class _Job:
    """Progress of one shard on one worker."""

    def __init__(self, worker: _Worker, batch: Batch, count: int, timeout: float | None) -> None:
        self.worker = worker
        self.batch = batch
        self.outcomes: list[Outcome | None] = [None] * count
        self.running: list[int] = []
        self.timeout = timeout
        self.deadline = math.inf
        self.done = False

    def restart_clock(self) -> None:
        self.deadline = time.monotonic() + self.timeout if self.timeout is not None else math.inf

    def fail_pending(self, names: list[str], problem: str) -> None:
        """Running functions get ``problem``; ones that never started are
        reported as not run (their values are unknown, not wrong)."""
        for i, outcome in enumerate(self.outcomes):
            if outcome is None:
                text = problem if (i in self.running or not self.running) else "was not run (its worker was lost)"
                self.outcomes[i] = Outcome(None, describe_failure(names[i], text, self.batch))
        self.done = True


class WorkerPool:
    """``size`` reward workers, started lazily and replaced when lost."""

    def __init__(
        self,
        cfg: GRPOConfig,
        specs: list[str],
        names: list[str],
        allow: set[str] | None,
        size: int,
        timeout: float | None,
    ) -> None:
        self.size = size
        self.names = names
        self.timeout = timeout
        self._args = (cfg, specs, names, allow)
        self._ctx = mp.get_context("spawn")
        self._workers: list[_Worker | None] = [None] * size

    def _worker(self, i: int) -> _Worker:
        worker = self._workers[i]
        if worker is None or not worker.process.is_alive():
            if worker is not None:
                worker.kill()
            worker = _Worker(self._ctx, self._args)
            self._workers[i] = None
            worker.wait_ready()
            self._workers[i] = worker
        return worker

    def start(self) -> None:
        """Start every worker now (otherwise the first ``run`` does)."""
        for i in range(self.size):
            self._worker(i)

    def run(self, batches: list[Batch], step: int) -> list[list[Outcome]]:
        """Score ``batches[k]`` on worker ``k``; outcomes per batch, per function."""
        jobs: list[_Job] = []
        for k, batch in enumerate(batches):
            worker = self._worker(k)
            worker.conn.send(("score", batch))
            job = _Job(worker, batch, len(self.names), self.timeout)
            job.restart_clock()
            jobs.append(job)
        while not all(job.done for job in jobs):
            active = [job for job in jobs if not job.done]
            remaining = min(job.deadline for job in active) - time.monotonic()
            ready = wait(
                [job.worker.conn for job in active] + [job.worker.process.sentinel for job in active],
                timeout=None if remaining == math.inf else max(0.0, remaining),
            )
            for job in active:
                if job.worker.conn in ready:
                    self._drain(job)
                if not job.done and job.worker.process.sentinel in ready and not job.worker.conn.poll():
                    self._lost(job, _crashed(job.worker))
                if not job.done and time.monotonic() >= job.deadline:
                    self._lost(job, f"took longer than trl.reward_timeout = {self.timeout}s; its worker was killed")
        return [[o if o is not None else Outcome(None, FIX_HINT) for o in job.outcomes] for job in jobs]

    def _drain(self, job: _Job) -> None:
        while not job.done and job.worker.conn.poll():
            try:
                message = job.worker.conn.recv()
            except (EOFError, OSError):
                self._lost(job, _crashed(job.worker))
                return
            kind = message[0]
            if kind == "running":
                job.running = list(message[1])
                job.restart_clock()
            elif kind == "result":
                job.outcomes[message[1]] = message[2]
            elif kind == "done":
                job.done = True

    def _lost(self, job: _Job, problem: str) -> None:
        job.fail_pending(self.names, problem)
        for i, worker in enumerate(self._workers):
            if worker is job.worker:
                self._workers[i] = None
        job.worker.kill()

    def close(self) -> None:
        for i, worker in enumerate(self._workers):
            if worker is None:
                continue
            try:
                worker.conn.send(("stop",))
            except (OSError, BrokenPipeError):
                pass
            worker.process.join(timeout=5)
            worker.kill()
            self._workers[i] = None

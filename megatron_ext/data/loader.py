"""The planning data loader: global batches of whole documents, each planned one step ahead.

Per step it yields a ``Step``: the global batch (token arrays indexed by seq id, no padding), its
``StepPlan`` and a digest of the plan's decisions and the batch's identity.

Batches are ``GlobalBatches`` (``data/batches.py``): documents cut into pieces of at most
``max_seq_len`` (default: the longest sequence the cost model can place), shuffled per epoch by
the seed, the same for every planner.

Planning. A background process (``multiprocessing`` spawn context, ``plan_worker.py``; it imports
no torch) plans step k+1 while step k trains. When step k+1 is asked for, the loader waits at most
``deadline_s`` for its plan; if the plan is not there (slow solver, planner error, dead worker) it
computes a quick valid heuristic plan in the calling process (``fallback``, BatchAda by default:
milliseconds) and logs a warning. A step never waits on a solver beyond the deadline. The late
plan is discarded when it arrives, and a plan the worker has not started yet is skipped. The
worker dies with the process that started it (on Linux: with the thread that started it) and
leaves Ctrl-C to it.

Several ranks. ``sync="broadcast"``: only ``src_rank`` plans; every step its plan (JSON) is
broadcast to the group, then every rank checks the digest. ``sync="check"``: every rank plans
for itself and the digests are compared; this needs a planner whose answer does not depend on
timing -- ``background=False`` (fallbacks depend on timing) and a solver that does not stop at its
time limit (a time-limited MILP may stop at different incumbents on different ranks). A mismatch raises ``PlanMismatchError`` naming the ranks that differ.
torch.distributed is imported only by those functions, when called.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import multiprocessing as mp
import signal
import time
import weakref
from collections import Counter
from dataclasses import dataclass
from collections.abc import Iterator, Sequence

import numpy as np

from megatron_ext.cost import CostModel
from megatron_ext.data.batches import GlobalBatches
from megatron_ext.data.datasets import DataError, Documents
from megatron_ext.data.sharding import (IGNORE_INDEX, RankShard, ShardTokens, group_shards, num_loss_tokens,
                                        padded_buffer_length, rank_part, shard_bounds, shard_tokens)
from megatron_ext import errors
from megatron_ext.errors import InvalidPlanError, MegatronExtError
from megatron_ext.lifetime import blocked_in_children, main_module_hidden
from megatron_ext.plan.schema import StepPlan
from megatron_ext.planner import PLANNERS, PlannerOptions, make_plan
from megatron_ext.planner.api import planner_names

__all__ = ["PlanningDataLoader", "Step", "PlanMismatchError", "plan_digest", "check_plan_agreement",
           "broadcast_plan", "fallback_plan", "FALLBACK_LIMIT_S", "rank_part", "group_shards", "RankShard",
           "shard_tokens", "ShardTokens", "padded_buffer_length", "shard_bounds", "num_loss_tokens",
           "IGNORE_INDEX"]

logger = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a waiting step checks that the worker is alive


class PlanMismatchError(InvalidPlanError):
    """Ranks of one job hold different plans (or batches) for the same step."""


# ---- digests and agreement ------------------------------------------------------------------
_TIMING_KEYS = ("solve_time_s", "estimated_step_time_s", "lower_bound_step_time_s", "relaxed_bound_step_time_s",
                "estimated_time_s", "solver_status", "baselines", "planner")


def _decisions(obj):
    """The plan as data without timings and provenance (what must agree between ranks)."""
    if isinstance(obj, dict):
        return {k: _decisions(v) for k, v in obj.items() if k not in _TIMING_KEYS}
    if isinstance(obj, list):
        return [_decisions(v) for v in obj]
    return obj


def plan_digest(plan: StepPlan, samples: np.ndarray | None = None) -> str:
    """sha256 (hex) of the plan's decisions -- micro-batches (group ranks and seq_ids), pipelines,
    dropped ids, kind and GPU count; not timings or which planner made it -- and, if given, of the
    batch's samples ((doc, start, end) per seq id)."""
    payload = {"plan": _decisions(plan.to_dict())}
    if samples is not None:
        payload["samples"] = np.asarray(samples, dtype=np.int64).tolist()
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _describe_mismatch(digests: list[str], ranks: list[int]) -> str | None:
    """None if all digests agree, else which ranks hold which digest (relative to the first)."""
    if all(d == digests[0] for d in digests):
        return None
    by_digest: dict[str, list[int]] = {}
    for r, d in zip(ranks, digests):
        by_digest.setdefault(d, []).append(r)
    differ = [r for r, d in zip(ranks, digests) if d != digests[0]]
    parts = "; ".join(f"rank(s) {rs} have {d[:12]}" for d, rs in by_digest.items())
    return f"the step plan differs from rank {ranks[0]}'s on rank(s) {differ} ({parts})"


def check_plan_agreement(digest: str, group=None) -> None:
    """Gather every rank's digest over ``group`` (default: the world) and raise PlanMismatchError,
    on every rank alike, naming the ranks whose digest differs from the group's first rank.
    A no-op when torch.distributed is not initialized (a single process agrees with itself)."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return
    size = dist.get_world_size(group)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, digest, group=group)
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(size))
    msg = _describe_mismatch(gathered, list(ranks))
    if msg:
        raise PlanMismatchError(msg)


def broadcast_plan(plan: StepPlan | None, src: int = 0, group=None, source: str = "",
                   error: MegatronExtError | None = None) -> tuple[StepPlan, str]:
    """Send ``plan`` (given on rank ``src``, a global rank; ignored elsewhere) to every rank of
    ``group`` as JSON; returns (plan, source) on every rank. If ``src`` could not plan, it passes
    ``error`` instead and every rank raises it (same class and message), so all stop together."""
    import torch.distributed as dist
    if dist.get_rank() == src:
        obj = [(None, source, (type(error).__name__, str(error))) if error is not None else (plan.to_json(), source, None)]
    else:
        obj = [None]
    dist.broadcast_object_list(obj, src=src, group=group)
    text, source, failed = obj[0]
    if failed is not None:
        if error is not None:
            raise error
        raise getattr(errors, failed[0], MegatronExtError)(failed[1])
    return StepPlan.from_json(text), source


FALLBACK_LIMIT_S = 0.2  # a last resort's planning time (the step waits for it)


def fallback_plan(lengths, cost: CostModel, options: PlannerOptions, fallback: str = "batchada",
                  reason: str = "", last_resorts: tuple[str, ...] = ()) -> StepPlan:
    """A quick valid plan: ``fallback`` (then static Ulysses if that fails, then the
    ``last_resorts`` in turn, pipeline planners for a runtime that runs them: they slice what no
    SP group holds, and elastic_pp what no batch of whole sequences fits, at a time limit of
    ``FALLBACK_LIMIT_S``: its first candidate is built whatever that takes, 0.9 s for 8,192
    sequences on 8 stages), marked as a fallback in ``solver_status``."""
    # A pipeline runtime needs a pipeline plan: FlexSP-kind stand-ins only for FlexSP-kind fallbacks.
    flexsp_kind = fallback in planner_names("sp")
    names = [fallback] + ([n for n in ("batchada", "static_ulysses") if n != fallback] if flexsp_kind else [])
    hurried = dataclasses.replace(options, time_limit=min(options.time_limit, FALLBACK_LIMIT_S))
    last: Exception | None = None
    for name in names + [n for n in last_resorts if n not in names]:
        try:
            plan = make_plan(name, lengths, cost, options if name in names else hurried)
        except MegatronExtError as e:
            last = e
            continue
        plan.solver_status = f"fallback ({reason}): {plan.solver_status}" if reason else f"fallback: {plan.solver_status}"
        return plan
    raise last  # type: ignore[misc]


# ---- steps ----------------------------------------------------------------------------------
class BatchTokens(Sequence):
    """The tokens of a global batch's sequences (int64 arrays indexed by seq id), each read from
    the documents when first asked for: a rank reads only the sequences its shards hold (a
    pipeline's middle stages none of them), not the whole batch every step."""

    def __init__(self, documents: Documents, samples: np.ndarray):
        self.documents, self.samples = documents, samples
        self._read: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, sid):
        if isinstance(sid, slice):
            return [self[i] for i in range(*sid.indices(len(self)))]
        sid = int(sid)
        seq = self._read.get(sid)
        if seq is None:
            d, a, e = (int(x) for x in self.samples[sid])
            seq = self._read[sid] = np.array(self.documents.get(d, a, e - a), dtype=np.int64)
        return seq


@dataclass
class Step:
    """One training step's data and plan."""

    step: int
    plan: StepPlan
    batch: Sequence[np.ndarray]  # int64 tokens of each sequence, indexed by seq id (``BatchTokens``)
    lengths: np.ndarray  # tokens per sequence (what the plan was made for)
    samples: np.ndarray  # [n, 3]: (doc, start, end) of each sequence in the dataset
    digest: str  # plan_digest(plan, samples)
    plan_source: str  # "planner", "inline", "fallback" (prefixed "broadcast:" on receiving ranks)
    plan_wait_s: float  # how long the step waited for its plan

    def part(self, rank: int) -> list[RankShard | None]:
        """This rank's shard of each micro-batch (see ``sharding.rank_part``)."""
        return rank_part(self.plan, rank, self.lengths)

    @property
    def num_loss_tokens(self) -> int:
        return num_loss_tokens(self.lengths, self.plan.dropped_seq_ids)

    @property
    def trained_lengths(self) -> np.ndarray:
        """Lengths of the sequences the plan runs (all but the dropped ones), in seq-id order."""
        return np.delete(self.lengths, self.plan.dropped_seq_ids)


def _stop_worker(proc, tasks) -> None:
    try:
        tasks.put(None)
    except (OSError, ValueError):
        pass
    proc.join(timeout=2.0)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=2.0)


PLANNER_STARTUP_S = 60.0  # the first step's longest wait for the planner process to start


class PlanningDataLoader(GlobalBatches):
    """Global batches of variable-length documents with a plan per step (see the module doc).

    ``documents``: any ``Documents`` (an indexed dataset, a blend; ``source_sizes`` and
    ``weights``: a blend of sources, see ``GlobalBatches``). ``cost``: the cost model the
    planner uses. ``global_batch_size``: sequences per step. ``planner``: a name in
    ``megatron_ext.planner.PLANNERS``. ``num_steps``: stop after that many (None: endless), starting
    at ``start_step`` (resume). ``background=False`` plans inline in the caller with no deadline.
    ``deadline_s``: the longest a step waits for its background plan (default: the planner's
    time limit + 1 s). ``startup_timeout_s``: the first step's extra wait for the worker to start.
    ``worker_imports``: modules the worker imports first (extra planners register themselves on
    import). ``plan_delay_s``: the worker sleeps this long before each plan -- a slow solver, for
    tests and demos of the fallback. ``sync``, ``group``, ``src_rank``: several ranks, see above.
    """

    def __init__(self, documents: Documents, cost: CostModel, global_batch_size: int, *,
                 planner: str = "flexsp", options: PlannerOptions | None = None, seed: int = 0,
                 max_seq_len: int | None = None, num_steps: int | None = None, start_step: int = 0,
                 shuffle: bool = True, background: bool = True, deadline_s: float | None = None,
                 fallback: str = "batchada", baselines: tuple[str, ...] = (),
                 startup_timeout_s: float = PLANNER_STARTUP_S, worker_imports: tuple[str, ...] = (),
                 plan_delay_s: float = 0.0, sync: str | None = None, group=None, src_rank: int = 0,
                 source_sizes=None, weights=None):
        known = list(PLANNERS)
        if planner not in known and not worker_imports:
            raise DataError(f"unknown planner {planner!r}; choose one of {', '.join(known)}")
        if fallback not in known:
            raise DataError(f"unknown fallback planner {fallback!r}; choose one of {', '.join(known)}")
        here = [n for n in (planner, *baselines) if n in PLANNERS and PLANNERS[n].fn.__module__ == "__main__"]
        if background and here and not worker_imports:  # (the planner process does not import the script)
            raise DataError(f"planner {here[0]!r} is defined in the script being run, which the planner process "
                            f"does not import; define it in a module and name that module in worker_imports")
        if sync not in (None, "check", "broadcast"):
            raise DataError(f"sync must be None, 'check' or 'broadcast', got {sync!r}")
        if num_steps is not None and num_steps < 0 or start_step < 0:
            raise DataError("num_steps and start_step must be non-negative")
        self.documents = documents
        self.cost = cost
        self.planner = planner
        self.options = options or PlannerOptions()
        limit = cost.max_seq_len if self.options.max_seq_len is None else min(self.options.max_seq_len,
                                                                              cost.max_seq_len)
        super().__init__(documents.lengths, global_batch_size, limit if max_seq_len is None else max_seq_len,
                         seed, shuffle, source_sizes, weights)
        self.num_steps = num_steps
        self.start_step = int(start_step)
        self.background = background
        self.deadline_s = self.options.time_limit + 1.0 if deadline_s is None else float(deadline_s)
        self.fallback = fallback
        self.baselines = tuple(baselines)
        self.startup_timeout_s = float(startup_timeout_s)
        self.worker_imports = tuple(worker_imports)
        self.plan_delay_s = float(plan_delay_s)
        self.sync, self.group, self.src_rank = sync, group, src_rank

        self._proc = None
        self._ready = False
        self._startup_waited = False
        self._dead = False
        self._ticket = 0
        self._early: dict[int, tuple] = {}
        # How steps got their plans: "planner", "inline", "fallback", plus worker results that came
        # too late ("late_discarded") and tasks the worker skipped as stale ("skipped").
        self.stats: Counter[str] = Counter()

    # ---- the planner process ----------------------------------------------------------------
    @property
    def _plans_here(self) -> bool:
        if self.sync is None:
            return True
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise DataError(f"sync={self.sync!r} needs torch.distributed to be initialized first")
        return self.sync == "check" or dist.get_rank() == self.src_rank

    def _start_worker(self) -> None:
        from megatron_ext.data.plan_worker import worker_main
        ctx = mp.get_context("spawn")
        # Results come through a one-way pipe whose sending end only the worker holds: a worker that
        # dies, even halfway through a plan, ends the pipe (EOF) instead of leaving a read to block.
        # The worker, and the resource tracker multiprocessing starts for the queue's semaphores, never
        # get Slurm's SIGUSR1 (every process of the job step does) or SIGHUP: the tracker, killed,
        # would be replaced by one that knows none of the semaphores (a traceback for each).
        # It imports nothing of the training script (``main_module_hidden``): it stays torch-free.
        with blocked_in_children(signal.SIGUSR1, signal.SIGHUP), main_module_hidden():
            self._tasks, (self._results, sending) = ctx.Queue(), ctx.Pipe(duplex=False)
            # a task still queued when the worker stops is dropped: its feeder thread, blocked on a
            # full pipe (a task of a global batch of ~8,000 sequences or more), would hold the exit
            self._tasks.cancel_join_thread()
            self._floor = ctx.Value("q", 0)
            self._proc = ctx.Process(target=worker_main, name="megatron-ext-planner", daemon=True,
                                     args=(self.planner, self.cost, self.options, self.baselines, self._tasks,
                                           sending, self._floor, self.worker_imports, self.plan_delay_s))
            self._proc.start()
        sending.close()
        self._finalizer = weakref.finalize(self, _stop_worker, self._proc, self._tasks)

    def close(self) -> None:
        """Stop the planner process (also done at garbage collection and interpreter exit) and
        log how the steps got their plans."""
        if self._proc is not None:
            self._finalizer()
            while True:  # account for what the worker sent before it stopped
                try:
                    if not self._results.poll(0.1):
                        break
                    kind, ticket, _ = self._results.recv()
                except (OSError, EOFError):
                    break
                self._note(kind, ticket, None)
            self._results.close()
            self._proc = None
            self._ready = False
            if self.stats["fallback"]:
                logger.info("planning data loader: %d step(s) used the %s plan, %d the %s fallback plan; %d late "
                            "plan(s) discarded, %d stale plan(s) skipped", self.stats["planner"], self.planner,
                            self.stats["fallback"], self.fallback, self.stats["late_discarded"],
                            self.stats["skipped"])

    def _note(self, kind: str, ticket: int, want: int | None) -> None:
        if kind == "skipped":
            self.stats["skipped"] += 1
        elif kind in ("ok", "error") and (want is None or ticket < want):
            self.stats["late_discarded"] += 1

    def __enter__(self) -> "PlanningDataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _submit(self, lengths: np.ndarray) -> int | None:
        if self._dead:
            return None
        if self._proc is None:
            self._start_worker()
        t = self._ticket
        self._ticket += 1
        self._tasks.put((t, lengths))
        return t

    def _receive(self, until: float, want: int | None) -> tuple | None:
        """Handle worker messages until the result for ticket ``want`` (or, with None, the ready
        message) arrives or time ``until`` passes."""
        while True:
            if want is not None and want in self._early:
                return self._early.pop(want)
            left = until - time.monotonic()
            if left <= 0:
                return None
            try:
                if not self._results.poll(min(left, _POLL_S)):
                    continue
                kind, ticket, payload = self._results.recv()
            except (EOFError, OSError):  # the worker is gone (its end of the pipe closed)
                self._proc.join(1.0)
                self._dead = True
                logger.warning("the planner process exited (code %s); every further step uses the %s "
                               "fallback plan", self._proc.exitcode, self.fallback)
                return None
            if kind == "ready":
                self._ready = True
                if want is None:
                    return ("ready",)
            elif kind == "dead":
                self._dead = True
                logger.warning("the planner process failed to start (%s); every further step uses the %s "
                               "fallback plan", payload, self.fallback)
                return None
            elif want is not None and ticket == want:
                return kind, payload
            elif want is not None and ticket > want:
                self._early[ticket] = (kind, payload)
            else:
                self._note(kind, ticket, want)

    def _background_plan(self, step: int, ticket: int | None, lengths: np.ndarray) -> tuple[StepPlan, str]:
        reason = None
        if ticket is None:
            reason = "no planner process"
        else:
            self._floor.value = ticket
            if not self._ready and not self._startup_waited:  # (once: later steps wait their deadline only)
                self._startup_waited = True
                self._receive(time.monotonic() + self.startup_timeout_s, None)
                if not self._ready and not self._dead:
                    reason = f"the planner process did not start within {self.startup_timeout_s:.1f}s"
            if reason is None and not self._dead:
                got = self._receive(time.monotonic() + self.deadline_s, ticket)
                if got is not None and got[0] == "ok":
                    return got[1], "planner"
                if got is not None:
                    reason = f"the {self.planner} planner failed: {got[1]}"
                elif not self._dead:
                    reason = f"the {self.planner} plan was not ready within the {self.deadline_s:.2f}s deadline"
            if reason is None:
                reason = "the planner process is gone"
            self._floor.value = ticket + 1  # the worker skips this step's plan if it has not begun it
        start = time.perf_counter()
        short = ("late" if "deadline" in reason else "planner error" if "failed:" in reason
                 else "planner unavailable")
        try:
            # a runtime that runs pipelines (auto's, on one stage too) gets the pipeline planners
            # that slice last: batch 1F1B's whole sequences may not fit where its planner's slices
            # do (a run of the fallback planner itself keeps to it: its refusal stands)
            flexsp_kind = self.fallback in planner_names("sp")
            last_resorts = (() if self.planner == self.fallback else ("elastic_pp",) if not flexsp_kind
                            else ("seq1f1b", "elastic_pp") if self.planner == "auto" else ())
            plan = fallback_plan(lengths, self.cost, self.options, self.fallback, reason=short,
                                 last_resorts=last_resorts)
        except MegatronExtError as e:  # name both failures: the planner's is usually the one to fix
            if self.fallback == self.planner:
                raise
            raise type(e)(f"{reason}; the {self.fallback} fallback: {e}") from None
        logger.warning("step %d: %s; using the %s fallback plan (%.1f ms)", step, reason, plan.planner,
                       1e3 * (time.perf_counter() - start))
        return plan, "fallback"

    # ---- iteration --------------------------------------------------------------------------
    def __iter__(self) -> Iterator[Step]:
        end = None if self.num_steps is None else self.start_step + self.num_steps
        step = self.start_step
        if end is not None and step >= end:
            return
        plans_here = self._plans_here
        ticket = self._submit(self.batch_lengths(step)) if self.background and plans_here else None
        while end is None or step < end:
            samples = self.batch_samples(step)
            lengths = samples[:, 2] - samples[:, 1]
            t0 = time.perf_counter()
            plan, source, error = None, "", None
            if plans_here:
                try:
                    if self.background:
                        plan, source = self._background_plan(step, ticket, lengths)
                    else:
                        plan, source = make_plan(self.planner, lengths, self.cost, self.options, self.baselines), "inline"
                except MegatronExtError as e:  # e.g. not even the fallback fits: every rank must learn it
                    if self.sync != "broadcast":
                        raise
                    error = type(e)(f"step {step}: {e}")
            if self.background and plans_here and (end is None or step + 1 < end):
                ticket = self._submit(self.batch_lengths(step + 1))  # one step ahead
            if self.sync == "broadcast":
                plan, source = broadcast_plan(plan, self.src_rank, self.group, source, error)
                if not plans_here:
                    source = "broadcast:" + source
            wait = time.perf_counter() - t0
            self.stats[source.split(":")[-1]] += 1
            digest = plan_digest(plan, samples)
            if self.sync is not None:
                check_plan_agreement(digest, self.group)
            yield Step(step, plan, BatchTokens(self.documents, samples), lengths, samples, digest, source, wait)
            step += 1

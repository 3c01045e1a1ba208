"""Measure the cost model's coefficients on this hardware: the engine of ``megatron-ext profile``
(``commands/profile.py`` parses its options, starts the ranks, prints the coefficients and writes
the cost-model YAML).

Run under torchrun with one process per rank of the cluster (``measure``). Every rank
builds the model, then all ranks measure together, as in training (on a CPU box they share the
cores, and that contention is part of what the coefficients must capture). With CUDA (``--device
auto`` or ``cuda``) each rank runs on ``cuda:LOCAL_RANK`` over NCCL, the model is built there in
bf16 with the attention backend training will use, and device work is timed by CUDA events
(``DeviceClock``); on CPU over gloo in fp32, timed by the host clock:

- passes: forward+backward time of one sequence over a sweep of lengths, on every rank alone
  (degree 1) and on every aligned group of d ranks with Ulysses attention (each degree d);
  all fitted at once (``fit_profile``, non-negative least squares on relative error, which is
  what predictions are judged by) to the cost model's b1 + (a1 s^2 + a2 s) / d plus, for d > 1,
  tokens / bandwidth[d] + calls x latency[d]. These effective all-to-all figures are what the
  cost model gets: they include each all-to-all's wait for its slowest member, which on ranks
  that share cores costs far more than the raw collective;
- all-to-all, raw: for every degree d, every aligned group of d ranks runs all_to_all_single at
  once, over a sweep of sizes; latency and bandwidth per degree (reported for comparison);
- p2p: send/recv between rank pairs, bandwidth; and what a stage-to-stage handoff adds in a relay
  through all ranks, against the same compute with every rank busy (the wait for the receiver);
- activation memory per token: the bytes autograd saves for backward in a forward pass;
- parameters: counted.

``measure`` returns the fitted cost model with what it was fitted from (``Profile``); the command
writes it as a cost-model YAML that ``plan``, ``simulate`` and ``train`` accept via --cost-model.
"""
from __future__ import annotations

import dataclasses
import platform
import statistics

import numpy as np
import torch
import torch.distributed as dist

from megatron_ext.cost import CostModel
from megatron_ext.cost.model import a2a_mb_per_token
from megatron_ext.errors import ConfigError, MegatronExtError
from megatron_ext.spec import MB
from megatron_ext.runtime.compat import quiet_fallback_warnings

quiet_fallback_warnings()  # (the launcher imports this module too, through commands/profile.py)

from megatron_ext.runtime.attention import UlyssesAttention, UlyssesPackedSeqParams  # noqa: E402
from megatron_ext.runtime.pipeline_model import unwrap_model  # noqa: E402
from megatron_ext.runtime.timing import DeviceClock  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEAD_SHARE_CAP = 0.95  # the output layer's measured share of a2, at most (the layers do some per-token work)


@dataclasses.dataclass(frozen=True)
class RankSetup:
    """How this rank measures: its device (where the model and every tensor a collective touches
    live), the model's dtype, the attention backend asked for, and the clock of device work."""
    device: torch.device
    dtype_name: str
    attention_backend: str
    clock: DeviceClock

    @property
    def dtype(self) -> torch.dtype:
        return DTYPES[self.dtype_name]

    @property
    def device_name(self) -> str:
        if self.device.type == "cuda":
            return torch.cuda.get_device_name(self.device)
        return f"CPU ({platform.processor() or platform.machine()})"


def nonnegative_fit(cols: np.ndarray, y: np.ndarray, relative: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Least squares of y ~ cols @ coef with every coefficient >= 0 (scipy's NNLS), on relative
    error (rows weighted by 1 / y) unless ``relative`` is False. Returns (coef, residuals)."""
    from scipy.optimize import nnls

    cols = np.asarray(cols, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    w = 1.0 / np.maximum(np.abs(y), 1e-12) if relative else np.ones_like(y)
    weighted = cols * w[:, None]
    scale = np.maximum(np.abs(weighted).max(axis=0), 1e-300)  # columns span decades (s^2 against 1)
    coef, _ = nnls(weighted / scale, y * w)
    coef = coef / scale
    return coef, y - cols @ coef


def _time(fn, repeats: int, setup: RankSetup) -> float:
    """Median time (s) of fn's work on this rank's device over ranks in step: a barrier before
    each run."""
    times = []
    for _ in range(repeats + 1):  # the first run warms up
        dist.barrier()
        start = setup.clock.mark()
        fn()
        times.append(setup.clock.seconds(start, setup.clock.mark()))
    return statistics.median(times[1:])


def _build_model(spec, max_len: int, setup: RankSetup, ddp: bool = True):
    """The GPTModel `train` runs (without a recompute policy of the model's), built and initialised
    on this rank's device in its dtype."""
    from megatron_ext.runtime.pipeline_model import build_pipeline_model

    model, _ = build_pipeline_model(spec, spec.vocab_size, max_len, setup.attention_backend, ddp=ddp,
                                    use_cpu_initialization=setup.device.type == "cpu", params_dtype=setup.dtype,
                                    pipeline_dtype=setup.dtype, bf16=setup.dtype == torch.bfloat16)
    return model


def _measured_backend(model, setup: RankSetup) -> str:
    """The backend the model's core attention resolves to for queries like its own on this rank
    (what ``auto`` picks here): attention's one place that decides, asked."""
    attention = next(m for m in model.modules() if isinstance(m, UlyssesAttention))
    query = torch.empty(1, attention.num_heads, attention.head_dim, device=setup.device, dtype=setup.dtype)
    return attention._resolve_backend(query)


def _compute_sweep(model, lengths, vocab, repeats, tick, setup: RankSetup) -> list[float]:
    out = []
    for s in lengths:
        params = UlyssesPackedSeqParams.build([s], None, device=setup.device)
        tokens = torch.randint(0, vocab, (1, s), device=setup.device)

        def run():
            model.zero_grad()
            model(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params).sum().backward()

        out.append(_time(run, repeats, setup) * 1e3)
        tick(f"compute, {s} tokens")
    return out


def _head_ms(model, vocab: int, s: int, repeats: int, setup: RankSetup) -> float:
    """Forward+backward ms of what follows the layers (final norm, output layer, loss) for s tokens."""
    model = unwrap_model(model)
    hidden = torch.randn(s, 1, model.config.hidden_size, requires_grad=True, device=setup.device, dtype=setup.dtype)
    labels = torch.randint(0, vocab, (1, s), device=setup.device)

    def run():
        logits, _ = model.output_layer(model.decoder.final_layernorm(hidden))
        model.compute_language_model_loss(labels, logits).sum().backward()

    return _time(run, repeats, setup) * 1e3


def _saved_bytes_per_token(model, vocab: int, setup: RankSetup, s: int = 512) -> float:
    """Bytes autograd keeps for backward per token (the activation memory of training)."""
    params = UlyssesPackedSeqParams.build([s], None, device=setup.device)
    tokens = torch.randint(0, vocab, (1, s), device=setup.device)
    seen: dict[int, int] = {}

    def pack(t):
        if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params).sum()
    param_ptrs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    loss.backward()
    return sum(n for ptr, n in seen.items() if ptr not in param_ptrs) / s


def _ulysses_sweep(model, pool, degrees, lengths, vocab: int, repeats: int, tick,
                   setup: RankSetup) -> dict[int, list[float]]:
    """Per degree: ms of a real Ulysses forward+backward of one sequence per aligned group of d
    ranks (every group at once), for each length; a group lasts as long as its slowest rank."""
    world = dist.get_world_size()
    out = {}
    for d in degrees:
        me = pool.rank
        group = pool.get(tuple(range(me // d * d, me // d * d + d)))
        times = []
        for s in lengths:
            params = UlyssesPackedSeqParams.build([s], group, device=setup.device)
            tokens = params.shard(torch.randint(0, vocab, (s,), device=setup.device))[None]

            def run():
                model.zero_grad()
                model(tokens, params.position_ids[None], None, labels=tokens, packed_seq_params=params).sum().backward()

            times.append(_time(run, repeats, setup) * 1e3)
            tick(f"Ulysses degree {d}, {s} tokens")
        gathered = [None] * world
        dist.all_gather_object(gathered, times)
        per_group = np.array(gathered).reshape(world // d, d, len(lengths)).max(axis=1)
        out[d] = np.median(per_group, axis=0).tolist()
    return out


def fit_profile(model_spec, lengths, fwd_bwd_ms: dict[int, list[float]], raw: dict[int, dict]) -> dict:
    """One fit of every measured pass, degree 1 and the Ulysses degrees alike, on relative error:

        ms(d, s) = b1 + (a1 s^2 + a2 s) / d + [d > 1] (s x ms_per_token[d] + 8 L x latency[d])

    with every coefficient >= 0. ``fwd_bwd_ms[d]``: the passes of one sequence of each length at
    degree d. Returns a1, a2, b1, per degree the effective all-to-all bandwidth (GB/s; the raw
    figure where the excess does not grow with the tokens) and per-call latency (ms), and the
    residuals per degree. Fitting the degrees together keeps the compute terms that every degree
    shares from absorbing one sweep's noise."""
    s = np.asarray(lengths, dtype=np.float64)
    comm = sorted(d for d in fwd_bwd_ms if d > 1)
    rows, ys = [], []
    for d, ms in sorted(fwd_bwd_ms.items()):
        for x, y in zip(s, ms):
            row = [x * x / d, x / d, 1.0] + [0.0] * (2 * len(comm))
            if d > 1:
                j = comm.index(d)
                row[3 + 2 * j] = x
                row[4 + 2 * j] = 8 * model_spec.num_layers
            rows.append(row)
            ys.append(y)
    coef, resid = nonnegative_fit(np.array(rows), np.array(ys))
    if coef[0] <= 0 and coef[1] <= 0:
        # a cost model whose passes cost the same at any length cannot divide work (every planner
        # would put all tokens anywhere): say so rather than write it
        at = ", ".join(f"{t:.1f}" for t in fwd_bwd_ms[1])
        raise ConfigError(f"the passes took {at} ms at {', '.join(f'{int(x):,}' for x in s)} tokens: no time "
                          f"grows with the length, the fixed cost of a pass hides the work; profile longer "
                          f"--lengths (up to the longest sequence the model will train) or a larger model")
    per_token_mb = a2a_mb_per_token(model_spec)  # (the passes timed recompute nothing)
    out = {"a1": float(coef[0]), "a2": float(coef[1]), "b1": float(coef[2]), "a2a": {}, "residual_ms": {}}
    n = len(s)
    for i, d in enumerate(sorted(fwd_bwd_ms)):
        out["residual_ms"][d] = [round(float(r), 3) for r in resid[i * n:(i + 1) * n]]
    for j, d in enumerate(comm):
        ms_per_token, latency = coef[3 + 2 * j], coef[4 + 2 * j]
        bw = per_token_mb / d / ms_per_token if ms_per_token > 1e-12 else raw[d]["bandwidth_gbps"]
        out["a2a"][d] = {"bandwidth_gbps": float(bw), "latency_ms": float(latency)}
    out["rel_error"] = float(np.median(np.abs(resid) / np.asarray(ys)))
    return out


def _a2a_sweep(pool, world: int, repeats: int, tick, setup: RankSetup) -> dict[int, dict]:
    """Per degree: latency (ms) and bandwidth (MB per ms) of all_to_all_single, every group at once."""
    sizes_mb = [0.25, 1.0, 4.0]
    itemsize = setup.dtype.itemsize
    out = {}
    d = 2
    while d <= world:
        me = pool.rank
        block = tuple(range(me // d * d, me // d * d + d))
        group = pool.get(block)
        points = []
        for mb in sizes_mb:
            x = torch.zeros(int(mb * MB / itemsize), device=setup.device, dtype=setup.dtype)
            x = x[: len(x) // d * d]
            y = torch.empty_like(x)
            points.append((x.numel() * itemsize / MB,
                           _time(lambda: dist.all_to_all_single(y, x, group=group), repeats, setup)))
            tick(f"all-to-all, degree {d}, {mb:g} MB")
        out[d] = transfer_fit([p[0] for p in points], [p[1] for p in points])
        d *= 2
    return out


def transfer_fit(sizes_mb, seconds) -> dict:
    """Latency (ms) and bandwidth (MB per ms: spec.py, units) of transfers timed at ``sizes_mb``
    (ascending): a line through the times; where noise swamps its slope (the time barely grows,
    or falls, with the size), the largest transfer's own rate, latency included (a slope of ~0
    gave 1e9 GB/s: the collective priced as free)."""
    mbs, secs = np.asarray(sizes_mb, dtype=np.float64), np.asarray(seconds, dtype=np.float64)
    slope, intercept = np.polyfit(mbs, secs, 1)
    if slope <= 0.1 * secs[-1] / mbs[-1]:
        slope, intercept = secs[-1] / mbs[-1], 0.0
    return {"latency_ms": max(float(intercept), 0.0) * 1e3, "bandwidth_gbps": float(1e-3 / slope)}


def _activation_bytes(model) -> int:
    return next(model.parameters()).element_size()


def _p2p_bandwidth(world: int, repeats: int, setup: RankSetup) -> float | None:
    """Bandwidth (MB per ms: spec.py, units) of 8 MB send/recv between rank pairs (0<->1, 2<->3, ...), all pairs at once; None
    with one rank (no pair: the cluster file then states no figure)."""
    if world < 2:
        return None
    rank = dist.get_rank()
    peer = rank ^ 1
    if peer >= world:
        return 0.0
    x = torch.zeros(8 * MB // setup.dtype.itemsize, device=setup.device, dtype=setup.dtype)

    def run():
        ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.empty_like(x), peer)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()

    return 8 / (_time(run, repeats, setup) * 1e3)  # MB per ms, as the cost model divides by it


def _handoff_latency_ms(world: int, setup: RankSetup, hops: int = 20) -> float:
    """ms a stage-to-stage handoff adds, in place: a relay through every rank (rank r receives
    from r - 1, computes, sends to r + 1, ``hops`` times) against the same compute with every rank
    busy at once. On ranks that share cores this is mostly the wait for the receiver to run."""
    if world < 2:
        return 0.0
    rank = dist.get_rank()
    a = torch.randn(192, 192, device=setup.device, dtype=setup.dtype)
    msg = torch.zeros(64 * 1024 // setup.dtype.itemsize, device=setup.device, dtype=setup.dtype)

    def work():
        x = a
        for _ in range(12):
            x = torch.tanh(x @ a)

    alone = _time(work, 5, setup)
    out = []
    for _ in range(2):
        dist.barrier()
        start = setup.clock.mark()
        for _ in range(hops):
            if rank > 0:
                dist.recv(msg, rank - 1)
            work()
            if rank < world - 1:
                dist.send(msg, rank + 1)
        dist.barrier()
        out.append(setup.clock.seconds(start, setup.clock.mark()) / (hops + world - 1))
    return max(0.0, (min(out) - alone) * 1e3)


def _planned_step(cost: CostModel, n: int, max_len: int, *candidates) -> "Step":
    """A training-sized long-tailed batch of ``n`` random-token sequences and its plan, made on
    rank 0 by the first of ``candidates`` ((planner, options) pairs) that can plan it, and
    broadcast: the same ``Step`` on every rank (or the same error)."""
    from megatron_ext.data.lengths import sample_lengths
    from megatron_ext.data.loader import Step, broadcast_plan
    from megatron_ext.planner import make_plan

    lengths = sample_lengths("github", n, 0, max_len)
    rng = np.random.default_rng(0)
    batch = [rng.integers(0, cost.model.vocab_size, int(x)) for x in lengths]
    plan = error = None
    for planner, options in candidates if dist.get_rank() == 0 else ():
        try:
            plan, error = make_plan(planner, lengths, cost, options), None
            break
        except MegatronExtError as e:
            error = e
    plan, _ = broadcast_plan(plan, error=error)
    return Step(0, plan, batch, lengths, np.zeros((len(lengths), 3), dtype=np.int64), "", "profile", 0.0)


def _micro_batch_overhead_ms(cost: CostModel, pool, max_len: int, repeats: int,
                             setup: RankSetup) -> tuple[float, dict]:
    """ms a FlexSP micro-batch takes beyond the cost model, in place: a real FlexSP step on a
    long-tailed batch, with the DDP-wrapped model `train` runs, timed against the plan's estimate
    with ``cost`` (linear in the overhead: every micro-batch pays it once). A micro-batch ends
    with its slowest group, and on busy ranks the slowest runs longer than the expected time
    single passes measure."""
    from megatron_ext.runtime.step import forward_backward

    model = _build_model(cost.model, max_len, setup)
    step = _planned_step(cost, 16, max_len, ("flexsp", None))  # several micro-batches
    plan = step.plan

    def run():
        model.zero_grad_buffer()
        forward_backward(step, model, pool=pool, device=setup.device)

    measured = _time(run, repeats, setup) * 1e3
    predicted = plan.estimated_step_time_s * 1e3
    mbs = len(plan.micro_batches)
    return max(0.0, (measured - predicted) / mbs), {"flexsp_step_ms": round(measured, 1),
                                                    "flexsp_estimated_ms": round(predicted, 1),
                                                    "flexsp_micro_batches": mbs}


def _pipeline_op_overhead_ms(cost: CostModel, max_len: int, repeats: int, setup: RankSetup) -> tuple[float, dict]:
    """ms a pipeline stage's operation takes beyond the cost model, in place: a real elastic
    pipeline step (as many stages as the layers and ranks allow, one at least, SP = ranks / stages) on a
    long-tailed batch, timed, against the simulated step of the same plan with ``cost``; the
    per-operation overhead that makes them agree (bisection on the simulator). Leaves megatron's
    parallel state at that many stages."""
    from megatron.core import parallel_state

    from megatron_ext.planner.pp.pipeline import PipelineOptions
    from megatron_ext.runtime.step import forward_backward
    from megatron_ext.sim import simulate

    world, spec = dist.get_world_size(), cost.model
    # one stage where no more divide: its chunks are operations too
    stages = max((p for p in range(1, world + 1) if world % p == 0 and spec.num_layers % p == 0))
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(1, stages)
    model = _build_model(spec, max_len, setup)
    # on one stage, where elastic_pp runs the batch in a chunk or two, batch 1F1B's packs of the
    # longest sequence (its default; elastic_pp where they do not fit: it slices): a dozen at the
    # default lengths, four at 32K (packs of max_len made two on an H100, and the compute fit's
    # shortfall at 32K was written as the overhead: 7.4 ms an operation against 3.9 now)
    options = PipelineOptions(pp=stages, sp=world // stages, time_limit=5.0)
    packs = [("batch_1f1b", options)] if stages == 1 else []
    planned = _planned_step(cost, 24, max_len, *packs, ("elastic_pp", options))

    def step():
        model.zero_grad_buffer()
        forward_backward(planned, model, device=setup.device, cost=cost)  # (messages in the simulator's order)

    measured = _time(step, repeats, setup) * 1e3

    def simulated(overhead):
        c = CostModel(spec, dataclasses.replace(cost.cluster, pipeline_op_overhead_ms=overhead), cost.zero_stage)
        return simulate(planned.plan, planned.lengths, c, events=False).step_time_s * 1e3

    lo, hi = 0.0, 1.0
    if simulated(0.0) >= measured:
        hi = 0.0
    while hi and simulated(hi) < measured and hi < 1e4:
        lo, hi = hi, hi * 2
    for _ in range(20 if hi else 0):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if simulated(mid) < measured else (lo, mid)
    return hi, {"pipeline_stages": stages, "pipeline_step_ms": round(measured, 1),
                "pipeline_simulated_ms": round(simulated(0.0), 1),
                "pipeline_chunks": len(planned.plan.pipelines[0].chunks) if planned.plan.pipelines else 0}


@dataclasses.dataclass
class Profile:
    """What ``measure`` found: the fitted cost model (``cost``), the attention backend it was measured
    with, and what it was fitted from: ``fwd_bwd_ms`` (per degree, one pass of each length),
    ``fit`` (``fit_profile``), the raw all-to-all sweep, the all-to-all figures the cost model got
    (``a2a``: fitted where the heads allow the degree, else raw), the p2p handoff, and the real
    FlexSP and pipeline steps the overheads were measured on (``runs``)."""

    cost: CostModel
    attention: str
    lengths: list[int]
    fwd_bwd_ms: dict[int, list[float]]
    fit: dict
    raw_a2a: dict[int, dict]
    a2a: dict[int, dict]
    handoff_ms: float
    runs: dict


def measurements(world: int, spec, lengths: list[int]) -> int:
    """How many times ``measure`` calls its ``tick``: for a progress bar."""
    degrees = [d for d in (2**i for i in range(1, 12)) if d <= min(world, spec.max_sp_degree)]
    a2a_degrees = int(np.log2(world)) if world > 1 else 0  # _a2a_sweep: every power of two up to the ranks
    return len(lengths) + 3 * a2a_degrees + 4 + len(degrees) * len(lengths)


def measure(base: CostModel, lengths: list[int], repeats: int, setup: RankSetup, tick=lambda what: None) -> Profile:
    """Measure ``base``'s model on the run's ranks (collective: every rank calls it, the run's
    process group up), each point ``repeats`` times, and fit the cost model's coefficients (the
    module doc). ``tick(what)`` is called after each measurement (``measurements`` of them)."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_ext.runtime.compat import apply_cpu_compat
    from megatron_ext.runtime.groups import SPGroupPool

    world = dist.get_world_size()
    if base.num_gpus != world:
        raise ConfigError(f"cluster {base.cluster.name} has {base.num_gpus} GPUs, {world} ranks were launched")
    apply_cpu_compat()
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    pool = SPGroupPool()
    vocab = base.model.vocab_size
    model = _build_model(base.model, max(lengths), setup, ddp=False)
    attention = _measured_backend(model, setup)
    # every Ulysses degree the ranks and the model's heads allow (tiny's 4 KV heads stop at 4)
    degrees = [d for d in (2**i for i in range(1, 12)) if d <= min(world, base.model.max_sp_degree)]
    times_ms = _compute_sweep(model, lengths, vocab, repeats, tick, setup)
    gathered = [None] * world
    dist.all_gather_object(gathered, times_ms)
    per_length = np.median(np.array(gathered), axis=0)  # ranks ran concurrently; take the typical one
    fit_profile(base.model, lengths, {1: per_length.tolist()}, {})  # times that do not grow: refused now, not last
    act_mb = _saved_bytes_per_token(model, vocab, setup) / MB
    head_s = max(lengths)
    head = [None] * world
    dist.all_gather_object(head, _head_ms(model, vocab, head_s, repeats, setup))
    tick("activation memory, output layer")
    raw = _a2a_sweep(pool, world, repeats, tick, setup)
    spec = dataclasses.replace(base.model, vocab_size=vocab, activation_bytes=_activation_bytes(model))
    measured = {1: per_length.tolist(),
                **_ulysses_sweep(model, pool, degrees, lengths, vocab, repeats, tick, setup)}
    fit = fit_profile(spec, lengths, measured, raw)
    # all-to-all: fitted from the passes where the heads allow that degree, else the raw sweep's
    # b1, the fit's constant: the profiled passes gather no parameters (every rank holds the whole
    # model), so it is the launch constant (ModelSpec.launch_ms); cost/fixed.py adds the ZeRO
    # traffic of the stage the cost model is used at
    a1, a2, b1, a2a = fit["a1"], fit["a2"], fit["b1"], {**raw, **fit["a2a"]}
    # the output layer's share of the per-token work a2 (the last pipeline stage runs it alone),
    # timed at the longest length, where its fixed costs weigh least; a fit with no per-token work
    # (a2 = 0: launches hide it), or less than the output layer alone takes, says nothing of it,
    # and the FLOPs' share stands
    measured_share = float(max(0.0, np.median(head) / (a2 * head_s))) if a2 > 0 else None
    head_share = min(HEAD_SHARE_CAP, measured_share) if measured_share is not None and measured_share <= 1 else None
    p2p = _p2p_bandwidth(world, repeats, setup)
    handoff = [None] * world
    dist.all_gather_object(handoff, _handoff_latency_ms(world, setup))
    handoff_ms = float(np.median(handoff))
    tick("p2p")
    params_b = sum(p.numel() for p in model.parameters()) / 1e9
    del model  # its memory goes to the models of the real steps below
    fitted = CostModel(
        dataclasses.replace(spec, a1=a1, a2=a2, launch_ms=b1, act_mb_per_token=act_mb, head_time_share=head_share,
                            params_b=params_b),
        # (the overheads are measured below against this model without any: a cluster file
        # profiled before would otherwise have its old ones counted in the estimate they are fitted to)
        dataclasses.replace(base.cluster, p2p_bandwidth_gbps=p2p, p2p_latency_ms=handoff_ms,
                            a2a_bandwidth_gbps={d: v["bandwidth_gbps"] for d, v in a2a.items()},
                            a2a_latency_ms={d: v["latency_ms"] for d, v in a2a.items()},
                            micro_batch_overhead_ms=0.0, pipeline_op_overhead_ms=0.0),
        base.zero_stage)
    # the real steps run the model as built here, without a recompute policy of the model's
    # (the fitted a1 and a2 are those of passes without it, as the YAML's are): priced alike
    plain = fitted.with_recompute()
    mb_overhead, flexsp_run = _micro_batch_overhead_ms(plain, pool, max(lengths), repeats, setup)
    tick("a real FlexSP step")
    op_overhead, pipeline_run = _pipeline_op_overhead_ms(plain, max(lengths), repeats, setup)
    fitted = CostModel(fitted.model, dataclasses.replace(fitted.cluster, pipeline_op_overhead_ms=op_overhead,
                                                         micro_batch_overhead_ms=mb_overhead), base.zero_stage)
    tick("a real pipeline step")
    return Profile(fitted, attention, list(lengths), measured, fit, raw, a2a, handoff_ms,
                   {"output_layer_ms": round(float(np.median(head)), 3), "output_layer_share": None if measured_share is None else round(measured_share, 3),
                    **flexsp_run, **pipeline_run})

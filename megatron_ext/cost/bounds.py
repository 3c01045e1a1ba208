"""Lower bounds on the step time of a batch, for FlexSP-kind plans (with a barrier between
micro-batches or without), for any layout of SP groups, and for elastic pipelines on one layout.

The first two price a sequence of s tokens on a group of degree d as the cost model does:
t(s, d) = (a1 s^2 + a2 s) / d + s comm(d) (``CostModel.seq_time_ms``), plus lat(d), the group's
all-to-all latency, once per group and micro-batch; every micro-batch pays b1
(``micro_batch_fixed_ms``). They differ in which degrees a sequence may have:

- ``lower_bound_ms``: the degrees a Ulysses group can have (``CostModel.degrees``: powers of two,
  at most the GPU count and the head limit), so no FlexSP plan is faster.
- ``relaxed_bound_ms``: any number of GPUs from 1 to N, with the cost model's all-to-all figures
  at that span (the bandwidth and latency of the widest tabulated degree not above it); what a
  layout of groups unbounded by heads and powers of two (a hybrid of Ulysses and ring attention
  priced like Ulysses) could at best reach. Its degrees include the first bound's, so it is
  never above it.

The argument, for a plan of M micro-batches (memory forces M >= m, below). Micro-batch j lasts
b1 + span_j, where span_j >= max(P_j, W_j / N): P_j, the slowest of its sequences at its degree
(each runs on one group), and W_j, the GPU-ms of its sequences, each at least its cheapest
feasible g_k = min_d d t(s_k, d) (a group of degree d running for x ms holds d x GPU-ms, and a
micro-batch's groups hold at most N GPUs). So the step is at least m b1 + sum_j max(P_j, W_j/N).

- Memory: a micro-batch holds at most C = N x tokens per GPU tokens (a group of degree d holds
  floor(d x tokens per GPU)), so m = max(ceil(T / C), number of sequences over C / 2) for a batch
  of T tokens (two of those never share a micro-batch): at least m micro-batches, each paying b1
  (m may exceed ``CostModel.min_microbatches``, the paper's M_min, which counts tokens only).
- Critical path: let f_k be sequence k's fastest time at any feasible degree (with lat) and order
  the sequences longest first. The k longest fill at least n_k = max(ceil(T_k / C), their count
  over C / 2) micro-batches (T_k: their tokens), each of which has P_j >= min_{i<=k} f_i. So the
  j-th largest P_j is at least c_j = min_{i<=k_j} f_i, k_j the first k with n_k >= j.
- The longest sequence runs at some degree d: its micro-batch (call it 1) has P_1 >= a(d) =
  t(s_1, d) + lat(d), and the batch's GPU-ms are W(d) = W - g_1 + d a(d) (W: the sum of every
  g_k). The other micro-batches, the i-th largest of them at least c_(i+1), add A = sum_{j>=2} c_j.
- Micro-batch 1 holds W_1 between d a(d) and d a(d) + F GPU-ms, F the most the other sequences
  can add within its C - s_1 tokens (fractional knapsack by GPU-ms per token); the rest go to the
  others. Since sum max(x_j, y_j) >= max(sum x_j, sum y_j),
      step >= m b1 + min over d of  min over W_1 of  max(a(d), W_1 / N) + max(A, (W(d) - W_1) / N),
  a convex piecewise-linear function of W_1, so its minimum is at a kink or an end of the range.
  Every d the longest can run at is tried (the bound is the least over them), so no choice of a
  plan escapes it.

It is never below the FlexSP paper's bound, M_min b1 + W / N, nor below b1 plus the longest
sequence's fastest time: each refinement only raises it.

``barrier_free_bound_ms``: plans without a barrier between micro-batches (``StepPlan.barrier_free``),
where each set of GPUs runs its own passes back to back, so the micro-batch argument above does
not hold. Such a step is the last rank's finish plus the exposed gradient sync, and:
- the GPU set that runs the longest sequence is busy at least b1 + its fastest time at any allowed
  degree (with its group's latency): the critical path;
- a pass of degree d holding x <= cap(d) tokens takes d (b1 + lat(d)) GPU-ms whatever it runs, at
  least x d (b1 + lat(d)) / cap(d); so sequence k, run at degree d, brings d t(s_k, d) GPU-ms of
  its own plus at least s_k d (b1 + lat(d)) / cap(d) of its pass's fixed cost, and at least the
  least of that over the degrees that hold it. The N GPUs, between them, are busy that long.
So step >= max(critical path, sum_k of those GPU-ms / N) + step sync. Every FlexSP plan, with a
barrier or not, obeys both, so the bound is theirs too.

``pipeline_bound_ms``: elastic pipelines (and Seq1F1B, batch 1F1B) on one layout, P stages of SP
degree d, R replicas side by side (``PipelineCost``), however the sequences are cut, packed,
ordered and recomputed:
- Work: a sequence cut into pieces costs a1 s^2 + a2 s in all (the prefix terms telescope), and
  its all-to-alls s comm, so stage p of the replicas together computes compute_p(W, T) + T comm
  (W, T: the batch's work and tokens; compute_p, the stage's share with the output layer on the
  last), whatever the chunks; recompute only adds.
- Chunks: during a chunk's backward its full activations are back on the stage (recomputed
  layers re-run), so a chunk of t tokens needs t (act L_s + head) <= room on the last stage:
  at least c = ceil(T / t_max) chunks, each paying on every stage its fixed cost and two
  operation overheads (F). The R replicas share them: stage p's busiest replica works at least
  (compute_p + T comm + c F) / R, at least its share of the work plus one chunk.
- Sequences held together: a sequence runs on one replica, so of the k R + 1 longest some replica
  holds k + 1, and its stage works at least the k + 1 shortest of those (with the chunks their
  tokens force); k = 0 is the longest sequence alone.
- Recompute memory forces: a sequence of s tokens over a stage's cap (room / a, a = act L_s, plus
  the output layer's per token on the last stage) is cut into slices; during its last slice's
  backward (the first of its slices' backwards) every earlier slice is in flight, keeping its
  activations less what recomputed layers free (act - input a token and layer) and its cached
  K/V (kv L_s a token, kept under recompute). With the last slice at most the cap, s a +
  (s - cap) kv L_s - (act - input) X <= room, so at least X token-layers of its slices are
  recomputed on that stage. A token-layer recomputed costs a layer's forward share of the
  token's work (its attention growing with its place in the sequence) and half its all-to-all
  (``PipelineCost.recompute_ms``), so the least those X cost is every layer of the sequence's
  first X / L_s tokens.
- Fill and drain: stage p's first operation is a forward whose chunk has passed stages 0..p-1
  (each at least a forward's share of F, plus a handoff), and after its last, a backward, that
  chunk's backward still runs on stages p-1..0: p (F + 2 handoffs) outside stage p's work.
- The longest sequence's chain: cut into K slices (at least ceil(s / t_max)), on every stage its
  forwards run in order and its backwards in reverse (a later slice attends to the earlier ones'
  K/V). So, for the slice i with the most compute, this runs one after another: stage 0's
  forwards of slices 1..i, stages 1..P-2's forward of i, stage P-1's forwards of i..K and
  backwards of K..i, stages P-2..1's backward of i, stage 0's backwards of i..1. That is the
  sequence's whole work on one stage (C, on stage 0, which has no output layer), P - 1 more
  passes of slice i (at least C / K each), K + P - 1 fixed costs and 2 (P - 1) handoffs: at
  least C + min over K of ((P - 1) C / K + K F) + (P - 1) (F + 2 handoffs). Slicing finer
  shortens the passes the other stages wait for and adds fixed costs; a single sequence's plan
  comes within 1-2% of it.
So step >= max(max over p of (stage p's busiest replica + p (F + 2 handoffs)), the chain) + step
sync. It ignores bubbles memory forces (few chunks in flight) and the recompute of chunks that are
not slices, so it is loose where memory binds: a floor for what any pipeline plan could gain, not
an estimate.
"""
from __future__ import annotations

import math

import numpy as np


def lower_bound_ms(cost, lengths) -> float:
    """No FlexSP plan (Ulysses groups of the allowed degrees) runs the batch faster."""
    return _bound_ms(cost, lengths, np.asarray(cost.degrees, dtype=np.int64))


def relaxed_bound_ms(cost, lengths) -> float:
    """No plan whose sequences each run on any number of GPUs (the cost model's pricing) is faster."""
    return _bound_ms(cost, lengths, np.arange(1, cost.num_gpus + 1, dtype=np.int64))


def barrier_free_bound_ms(cost, lengths) -> float:
    """No FlexSP-kind plan, with or without a barrier between micro-batches, runs the batch faster
    (module docstring)."""
    s = np.asarray(lengths, dtype=np.float64)
    if not s.size:
        return 0.0
    degrees = np.asarray(cost.degrees, dtype=np.int64)
    table = _DegreeTable(cost, degrees)
    fixed = cost.micro_batch_fixed_ms + table.lat
    fits = s[:, None] <= table.capacity[None, :]
    if not fits[s.argmax()].any():
        return math.inf  # no group holds the longest: no plan runs the batch
    at = np.broadcast_to(np.arange(len(degrees)), fits.shape)
    t = table.times(s[:, None], at)
    path = float(np.where(fits, t + fixed, np.inf)[s.argmax()].min())
    gpu_ms = np.where(fits, degrees * t + s[:, None] * degrees * fixed / table.capacity, np.inf).min(axis=1)
    return max(path, float(gpu_ms.sum()) / cost.num_gpus) + cost.step_sync_ms


def pipeline_bound_ms(pc, lengths) -> float:
    """No pipeline plan on ``pc``'s layout (a ``PipelineCost``) runs the batch faster (module docstring)."""
    s = np.sort(np.asarray(lengths, dtype=np.float64))[::-1]  # longest first
    if not s.size:
        return 0.0
    c = pc.cost
    room, layers = pc.activation_room_mb, pc.layers_per_stage
    work = c.a1 * s * s + c.a2 * s  # whole-model one-GPU ms of each sequence, however it is cut
    fixed = pc.fixed_ms + 2 * c.cluster.pipeline_op_overhead_ms  # a chunk's, on one stage
    t_max = room / (pc.act_layer_mb * layers + float(pc.head_mb))  # (the last stage's cap)
    chunks = math.ceil(float(s.sum()) / t_max - 1e-9)
    handoffs = fixed + 2 * float(pc.p2p_ms(0)) if pc.pp > 1 else 0.0
    freed = pc.act_layer_mb - pc.input_layer_mb  # MB a recomputed layer frees of a token
    launch = float(pc.recompute_ms(0.0, 0.0, layers))  # (a chunk's, not a token's)
    busiest = 0.0
    # (stages before the last do the same work and wait p handoffs: of them, the last but one binds)
    for p in range(max(0, pc.pp - 2), pc.pp):
        whole = pc.act_layer_mb * layers + (float(pc.head_mb) if p == pc.pp - 1 else 0.0)
        rec = np.zeros_like(s)  # (none for a sequence that fits whole: the longest, first, may not)
        m = int(np.count_nonzero(s > room / whole)) if freed > 0 else 0
        if m:
            o = s[:m]
            first = np.minimum(o, np.maximum(0.0, o * whole + (o - room / whole) * pc.kv_layer_mb * layers - room)
                               / freed / layers)
            rec[:m] = pc.recompute_ms(c.a1 * first * first + c.a2 * first, first, layers) - launch
        each = pc.compute_ms(work, s, p) + s * pc.comm_ms_per_token + rec  # every sequence's work on the stage
        stage = float(each.sum())
        held = _held_together_ms(each, s, pc.replicas, t_max, fixed)
        busiest = max(busiest, max((stage + chunks * fixed) / pc.replicas, stage / pc.replicas + fixed, held)
                      + p * handoffs)
    return max(busiest, _slice_chain_ms(pc, float(s[0]), float(work[0]), t_max, fixed, handoffs)) + pc.step_sync_ms


def _held_together_ms(ms: np.ndarray, tokens: np.ndarray, replicas: int, t_max: float, fixed: float) -> float:
    """The least work some replica's stage holds (module docstring, "Sequences held together"):
    ``ms``, each sequence's work on the stage, longest first; the fixed costs of the chunks their
    tokens force."""
    e = np.concatenate([[0.0], np.cumsum(ms)])
    t = np.concatenate([[0.0], np.cumsum(tokens)])
    k = np.arange((len(tokens) - 1) // replicas + 1)
    top = k * replicas + 1  # the longest k R + 1 ...
    low = top - k - 1  # ... of which the shortest k + 1 start here
    return float(np.max(e[top] - e[low] + np.ceil((t[top] - t[low]) / t_max - 1e-9) * fixed))


def _slice_chain_ms(pc, tokens: float, work: float, t_max: float, fixed: float, handoffs: float) -> float:
    """The longest sequence's chain across the stages (module docstring), at the best K memory
    allows (at most one slice a token)."""
    if pc.pp == 1:
        return 0.0
    c = float(pc.compute_ms(work, tokens, 0)) + tokens * pc.comm_ms_per_token  # (stage 0: no output layer)
    least = max(1, math.ceil(tokens / t_max - 1e-9))
    best = math.sqrt((pc.pp - 1) * c / fixed) if fixed > 0 else tokens
    ks = {min(max(least, k), max(least, int(tokens))) for k in (math.floor(best), math.ceil(best))}
    return c + min((pc.pp - 1) * c / k + k * fixed for k in ks) + (pc.pp - 1) * handoffs


def cheapest_gpu_ms(cost, lengths) -> np.ndarray:
    """GPU-ms of each sequence at its cheapest allowed degree that holds it (without latency)."""
    s = np.asarray(lengths, dtype=np.float64)
    return _DegreeTable(cost, np.asarray(cost.degrees, dtype=np.int64)).cheapest_and_fastest(s)[0]


def _bound_ms(cost, lengths, degrees: np.ndarray) -> float:
    s = np.sort(np.asarray(lengths, dtype=np.float64))[::-1]  # longest first
    if not s.size:
        return 0.0
    n = cost.num_gpus
    table = _DegreeTable(cost, degrees)
    g, f = table.cheapest_and_fastest(s)
    # The critical path: c_j for the j-th micro-batch by its slowest sequence.
    cap = cost.tokens_per_gpu * n
    filled = np.maximum(np.ceil(np.cumsum(s) / cap - 1e-9), np.cumsum(s > cap / 2)).astype(np.int64)
    m = max(1, int(filled[-1]))
    reach = np.minimum.accumulate(f)
    first = np.searchsorted(filled, np.arange(2, m + 1), side="left")  # k_j (0-based) for j >= 2
    others_path = float(reach[first].sum())
    # The longest at each degree it fits: its time a(d) and GPU-ms d a(d).
    fits = np.flatnonzero(s[0] <= table.capacity)
    if not fits.size:
        return math.inf  # no group holds the longest: no plan runs the batch
    d = degrees[fits]
    a = table.times(s[0], fits) + table.lat[fits]
    work = float(g.sum()) - g[0] + d * a
    lo = d * a
    hi = lo + _most_gpu_ms(s[1:], g[1:], cap - s[0])
    # min over W_1 in [lo, hi] of max(a, W_1 / N) + max(A, (work - W_1) / N): at a kink or an end
    points = np.stack([lo, hi, np.clip(n * a, lo, hi), np.clip(work - n * others_path, lo, hi)])
    total = np.maximum(a, points / n) + np.maximum(others_path, (work - points) / n)
    return m * cost.micro_batch_fixed_ms + float(total.min())


def _most_gpu_ms(s: np.ndarray, g: np.ndarray, room: float) -> float:
    """Most GPU-ms sequences of lengths ``s`` and GPU-ms ``g`` can put in ``room`` tokens, taken
    fractionally, densest first (the fractional knapsack: no whole selection holds more)."""
    if not s.size or room <= 0:
        return 0.0
    order = np.argsort(-g / s, kind="stable")
    tokens, work = np.cumsum(s[order]), np.cumsum(g[order])
    k = int(np.searchsorted(tokens, room, side="right"))  # the first k fit whole
    whole = float(work[k - 1]) if k else 0.0
    if k == len(s):
        return whole
    return whole + (room - (tokens[k - 1] if k else 0.0)) * float(g[order[k]] / s[order[k]])


class _DegreeTable:
    """For a set of allowed degrees (ascending): each one's capacity in tokens, all-to-all ms per
    token and latency, from the cost model; and each sequence's cheapest GPU-ms and fastest time."""

    def __init__(self, cost, degrees: np.ndarray):
        self.cost = cost
        self.degrees = degrees
        self.capacity = np.array([cost.token_capacity(d) for d in degrees], dtype=np.float64)
        self.comm = np.array([cost.comm_ms_per_token(d) for d in degrees])
        self.lat = np.array([cost.a2a_latency_ms(d) for d in degrees])
        # the all-to-all figures a degree is priced at (bandwidth; none at degree 1), compared
        # exactly: comm x d, equal in exact arithmetic along a run, may differ in the last bit
        self.bandwidth = np.array([cost.cluster.a2a_bandwidth(d) if d > 1 else 0.0 for d in degrees])

    def times(self, s: float, at: np.ndarray) -> np.ndarray:
        """Time (ms, without latency) of sequences of ``s`` tokens at the degrees in positions ``at``."""
        return self.cost.seq_time_ms(s, 1) / self.degrees[at] + s * self.comm[at]

    def cheapest_and_fastest(self, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Each sequence's least GPU-ms (without latency) and least time (with it) over the
        allowed degrees that hold it, evaluated where those can be: the allowed degrees between
        two changes of the all-to-all figures form runs in which GPU-ms are the same (the least
        at the run's first degree that holds the sequence) and time falls (the least at its last)."""
        d = self.degrees
        changes = np.flatnonzero((np.diff(self.bandwidth) != 0) | (np.diff(self.lat) != 0)) + 1
        starts = np.concatenate([[0], changes])
        ends = np.concatenate([changes - 1, [len(d) - 1]])
        first_fit = np.searchsorted(self.capacity, s, side="left")  # position of the least degree that holds it
        cols = np.concatenate([np.maximum(starts[None, :], first_fit[:, None]), np.broadcast_to(ends, (len(s), len(ends)))],
                              axis=1)
        ok = (cols >= first_fit[:, None]) & (first_fit < len(d))[:, None]  # (inf where no degree holds it)
        cols = np.minimum(cols, len(d) - 1)
        t = self.times(s[:, None], cols)
        gpu_ms = np.where(ok, d[cols] * t, np.inf).min(axis=1)
        fastest = np.where(ok, t + self.lat[cols], np.inf).min(axis=1)
        return gpu_ms, fastest


__all__ = ["barrier_free_bound_ms", "cheapest_gpu_ms", "lower_bound_ms", "pipeline_bound_ms", "relaxed_bound_ms"]

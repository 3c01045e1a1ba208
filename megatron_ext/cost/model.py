"""The FlexSP cost model (PAPERS.md section 1): time and memory of Ulysses SP groups.

A group of degree d running sequences S costs, in milliseconds,
    b1 + r sum_s (a1 s^2 + a2 s) / d + [d > 1] (sum_s (V s / d) / bw[d] + (8 L + 4 n) lat[d])
(the all-to-alls carry Q, K, V and the attention's output forward and their gradients backward,
e-byte activations (the model's activation_bytes, 2 for bf16): V = (2 L + n) (2 h + 2 k) e / 2^20
MB a token, k the K/V width (KV heads x head dim: h without GQA), n the layers the model's
recompute runs forward again (``a2a_mb_per_token``); MB over GB/s is ms; lat[d]: the cluster's
latency, counted 8 a layer, the forward's half again per recomputed layer (as `profile` fits
it); r: the recompute's compute, cost/activations.py). b1, the fixed cost of a pass, is derived
(cost/fixed.py): the launch constant, plus under ZeRO-3 the parameter gathers of the whole model
over all GPUs. Its memory per GPU is sum_s s / d * act_mb_per_token + model states. A micro-batch
costs the max over its groups, a step the sum over its micro-batches plus, under ZeRO 0/1/2, what
the once-per-step gradient sync leaves exposed (``step_sync_ms``). Pure Python + numpy: no torch.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from megatron_ext.cost.activations import act_mb_per_token, recompute_time_factor
from megatron_ext.cost.bounds import barrier_free_bound_ms, cheapest_gpu_ms, lower_bound_ms, relaxed_bound_ms
from megatron_ext.cost.fixed import pass_fixed_ms, step_sync_ms
from megatron_ext.errors import ConfigError, InfeasibleError
from megatron_ext.spec import (MAX_MEMORY_GB, MB, ClusterSpec, ModelSpec, read_yaml, cluster_from_mapping,
                               is_power_of_two, load_cluster, load_model, model_from_mapping)

# Bytes a parameter of the model states, (weights, gradients, optimizer): mixed-precision Adam,
# bf16 weights and gradients, fp32 master weights and two moments, as the FlexSP paper counts them
# (16); Megatron's --bf16 accumulates gradients in fp32 (18); an fp32 run keeps no master copy (4,
# 4, 8). By ZeRO stage, what is sharded over the GPUs that hold the same parameters (the rest is
# replicated on each): ZeRO-1 the optimizer's bytes, ZeRO-2 the gradients too, ZeRO-3 everything.
MIXED_PRECISION_ADAM = (2, 2, 12)
ZERO_STAGES = (0, 1, 2, 3)


def a2a_mb_per_token(model: ModelSpec, recomputed: int = 0) -> float:
    """MB a token sends through the model's Ulysses all-to-alls, fwd and bwd: Q, K, V and the
    attention's output forward (2 h + 2 k values a layer, k the K/V width), their gradients
    backward, and the forward's again for each of ``recomputed`` layers."""
    kv = model.kv_heads * (model.hidden_size // model.num_attention_heads)
    return (2 * model.num_layers + recomputed) * (2 * model.hidden_size + 2 * kv) * model.activation_bytes / MB


def model_states_mb(params_b: float, zero_stage: int, shards: int, state_bytes=MIXED_PRECISION_ADAM) -> float:
    """MB per GPU of ``params_b`` billion parameters' model states under ``zero_stage``, the
    sharded part split over ``shards`` GPUs (a billion parameters' byte taken as 1024 MB, the
    paper's: spec.py, units)."""
    weights, grads, optimizer = state_bytes
    total = weights + grads + optimizer
    sharded = (0, optimizer, optimizer + grads, total)[zero_stage]
    return params_b * 1024 * (sharded / shards + total - sharded)


def check_presets_not_beside_file(model: str | None, cluster: str | None) -> None:
    """Refuse ``--model`` / ``--cluster`` given beside ``--cost-model``: the file holds its own
    model and cluster, so they would be dropped without a word."""
    given = [name for name, v in (("--model", model), ("--cluster", cluster)) if v is not None]
    if given:
        raise ConfigError(f"{' and '.join(given)} with --cost-model: the cost model holds its model and cluster; "
                          f"give one or the other")


@dataclass(frozen=True)
class CostModel:
    model: ModelSpec
    cluster: ClusterSpec
    zero_stage: int = 3
    # widest ring (context-parallel) degree a group may add beyond the heads' Ulysses limit
    # (``--max-ring``); 1: Ulysses only
    max_ring: int = 1
    state_bytes: tuple[int, int, int] = MIXED_PRECISION_ADAM  # (weights, gradients, optimizer) a parameter

    def __post_init__(self):
        z = self.zero_stage
        if not isinstance(z, int) or isinstance(z, bool) or z not in ZERO_STAGES:
            raise ConfigError(f"zero_stage must be one of 0, 1, 2, 3, got {self.zero_stage!r}")
        b = self.state_bytes
        if not (isinstance(b, tuple) and len(b) == 3 and all(isinstance(x, int) and x > 0 for x in b)):
            raise ConfigError(f"state_bytes must be the bytes a parameter of weights, gradients and optimizer "
                              f"states, e.g. {MIXED_PRECISION_ADAM}, got {b!r}")
        r = self.max_ring
        if not isinstance(r, int) or isinstance(r, bool) or not is_power_of_two(r):
            raise ConfigError(f"the ring degree limit must be a power of two (1: no ring), got {r!r}")

    def with_max_ring(self, max_ring: int) -> "CostModel":
        """The same model with groups of up to ``max_ring`` Ulysses subgroups in a ring."""
        return dataclasses.replace(self, max_ring=max_ring)

    @classmethod
    def from_presets(cls, model: str | ModelSpec, cluster: str | ClusterSpec, zero_stage: int = 3) -> "CostModel":
        return cls(load_model(model), load_cluster(cluster), zero_stage)

    @classmethod
    def from_yaml(cls, path: str | Path, zero_stage: int = 3) -> "CostModel":
        """A cost-model file: ``model`` and ``cluster`` (preset names, file paths, relative ones
        from the file's folder where a file is there, or inline mappings of their fields), optionally ``zero_stage`` (else the ``zero_stage`` given), and what ``megatron-ext profile``
        writes besides: ``device``, ``dtype`` and ``attention_backend`` (what it measured on) and
        the ``profile`` section (measurements and fit residuals); those are for people, not read here."""
        data = read_yaml(Path(path))
        unknown = {str(k) for k in data} - {"model", "cluster", "zero_stage", "device", "dtype", "attention_backend",
                                            "profile"}
        if unknown or "model" not in data or "cluster" not in data:
            raise ConfigError(f"{path}: a cost model needs 'model' and 'cluster' (and optionally 'zero_stage')"
                              + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else ""))
        model, cluster = data["model"], data["cluster"]
        for what, v in (("model", model), ("cluster", cluster)):
            if not isinstance(v, (str, dict)):
                raise ConfigError(f"{path}: '{what}' must be a preset name, a file path or a mapping of fields")
        model, cluster = (str(Path(path).parent / v) if isinstance(v, str) and (Path(path).parent / v).is_file()
                          and not Path(v).is_absolute() else v for v in (model, cluster))
        try:
            if isinstance(model, dict):
                model = model_from_mapping({"name": Path(path).stem, **model})
            if isinstance(cluster, dict):
                cluster = cluster_from_mapping({"name": Path(path).stem, **cluster})
            return cls.from_presets(model, cluster, data.get("zero_stage", zero_stage))
        except ConfigError as e:  # (its zero_stage, or an inline model or cluster: say which file)
            if str(path) in str(e):
                raise
            raise ConfigError(f"{path}: {e}") from None

    def with_recompute(self, recompute: str = "none", layers: int | None = None) -> "CostModel":
        """The same model with the recompute policy its runtime runs (``ModelSpec.recompute``,
        ``recompute_layers``; default none: a runtime that runs none of the model's own)."""
        return dataclasses.replace(self, model=dataclasses.replace(self.model, recompute=recompute,
                                                                   recompute_layers=layers))

    def with_memory(self, memory_mb: float) -> "CostModel":
        """The same model on GPUs with ``memory_mb`` usable each (``--memory-mb``: every planner,
        the simulator and the length limits then see one budget)."""
        if not (isinstance(memory_mb, (int, float)) and math.isfinite(memory_mb) and memory_mb > 0):
            raise ConfigError(f"the memory budget must be a positive number of MB, got {memory_mb!r}")
        if memory_mb > MAX_MEMORY_GB * 1024:
            raise ConfigError(f"the memory budget must be at most {MAX_MEMORY_GB * 1024:,} MB ({MAX_MEMORY_GB:,} GB), "
                              f"got {memory_mb:,.0f}")
        return dataclasses.replace(self, cluster=dataclasses.replace(self.cluster, memory_gb=memory_mb / 1024.0))

    @property
    def model_on_cluster(self) -> str:
        """What is planned, for headers: 'gpt-7b on a100-40g-8x8', or the one name a cost-model file
        gives its inline model and cluster alike (its own: 'my-cost', not 'my-cost on my-cost')."""
        model, cluster = self.model.name, self.cluster.name
        return model if model == cluster else f"{model} on {cluster}"

    # ---- memory -------------------------------------------------------------------------
    @property
    def num_gpus(self) -> int:
        return self.cluster.num_gpus

    @cached_property
    def model_states_mb(self) -> float:
        """params * ``state_bytes`` (16 bytes), the ZeRO-sharded part spread over all GPUs (MB per GPU)."""
        return model_states_mb(self.model.params_b, self.zero_stage, self.num_gpus, self.state_bytes)

    @cached_property
    def act_mb_per_token(self) -> float:
        """Activation memory per token on one GPU, MB: the model's measured figure, else derived
        from its shape and recompute policy (cost/activations.py)."""
        if self.model.act_mb_per_token is not None:
            return self.model.act_mb_per_token
        return act_mb_per_token(self.model)

    @cached_property
    def tokens_per_gpu(self) -> float:
        """Activation room of one GPU, in tokens (may be fractional)."""
        room = self.cluster.memory_mb - self.model_states_mb
        if room <= 0:
            raise InfeasibleError(
                f"model states of {self.model.name} ({self.model_states_mb:.0f} MB per GPU at ZeRO-{self.zero_stage}) "
                f"exceed the {self.cluster.memory_mb:.0f} MB usable on {self.cluster.name}")
        return room / self.act_mb_per_token

    def token_capacity(self, degree: int) -> int:
        """Most tokens a group of this degree can hold in one micro-batch (at most 2^53: memory that
        no batch runs short of, as an exact integer)."""
        return int(math.floor(min(self.tokens_per_gpu * degree + 1e-9, 2.0**53)))

    def group_memory_mb(self, tokens: float, degree: int) -> float:
        return tokens / degree * self.act_mb_per_token + self.model_states_mb

    # ---- degrees ------------------------------------------------------------------------
    @cached_property
    def degrees(self) -> tuple[int, ...]:
        """Degrees a group may have: powers of two up to the GPU count and the head limit times
        the ring limit (``max_ring``)."""
        top = min(self.num_gpus, self.model.max_sp_degree * self.max_ring)
        return tuple(2**i for i in range(int(math.log2(top)) + 1))

    @property
    def stage_degrees(self) -> tuple[int, ...]:
        """Degrees a pipeline stage's SP group may have: Ulysses only, no ring."""
        return tuple(d for d in self.degrees if self.ring_degree(d) == 1)

    def ulysses_degree(self, degree: int) -> int:
        """The Ulysses part of a degree-d group: all of it up to the head limit."""
        return min(degree, self.model.max_sp_degree)

    def ring_degree(self, degree: int) -> int:
        """The ring part of a degree-d group (1 up to the head limit): ``SPGroup.ring``."""
        return degree // self.ulysses_degree(degree)

    def check_degree(self, degree) -> None:
        """Refuse an SP degree no group can have, naming the ones it can."""
        if not isinstance(degree, int) or isinstance(degree, bool) or degree not in self.degrees:
            ring = f" times a ring of up to {self.max_ring}" if self.max_ring > 1 else ""
            raise ConfigError(f"SP degree {degree!r} is not allowed for {self.model.name} on {self.cluster.name}; "
                              f"allowed: {', '.join(map(str, self.degrees))} (powers of two up to the GPU count "
                              f"that divide the heads{ring})")

    @property
    def max_seq_len(self) -> int:
        """Longest sequence any group can hold."""
        return self.token_capacity(self.degrees[-1])

    def min_degree(self, seq_len: int) -> int:
        for d in self.degrees:
            if seq_len <= self.token_capacity(d):
                return d
        raise InfeasibleError(self._too_long(seq_len))

    def _too_long(self, seq_len: int) -> str:
        return (f"a sequence of {seq_len} tokens does not fit even at SP degree {self.degrees[-1]} "
                f"({self.model.name} on {self.cluster.name}: at most {self.max_seq_len} tokens); "
                f"drop or cut it, or use a larger cluster or a pipeline planner")  # (no flag: not every command has one)

    def check_lengths(self, lengths) -> None:
        arr = np.asarray(lengths)
        if arr.size and arr.max() > self.max_seq_len:
            raise InfeasibleError(self._too_long(int(arr.max())))

    # ---- time (ms) ----------------------------------------------------------------------
    @cached_property
    def a1(self) -> float:
        """ms per token^2 of a pass under the model's recompute policy (model.a1 without it)."""
        return self.model.a1 * recompute_time_factor(self.model)

    @cached_property
    def a2(self) -> float:
        """ms per token of a pass under the model's recompute policy (model.a2 without it)."""
        return self.model.a2 * recompute_time_factor(self.model)

    @cached_property
    def pass_fixed_ms(self) -> float:
        """The fixed cost of a FlexSP micro-batch (FlexSP's b1): a pass of the whole model, its
        parameters sharded over all GPUs (cost/fixed.py)."""
        return pass_fixed_ms(self.model, self.cluster, self.zero_stage, self.model.num_layers, range(self.num_gpus))

    @cached_property
    def step_sync_ms(self) -> float:
        """What a FlexSP step's gradient sync over all GPUs leaves exposed (ZeRO 0/1/2; 0 at 3)."""
        return 0.0 if self.zero_stage == 3 else step_sync_ms(self.model, self.cluster, range(self.num_gpus))

    def comm_ms_per_token(self, degree: int) -> float:
        """All-to-all ms per token of a degree-d group: each GPU sends its 1/d of the tokens
        through the group's Ulysses part (the ring part adds ``ring_ms``)."""
        u = self.ulysses_degree(degree)
        if u == 1:
            return 0.0
        mb = a2a_mb_per_token(self.model, recomputed=self.model.recomputed_layers)
        return mb / degree / self.cluster.a2a_bandwidth(u)

    def a2a_latency_ms(self, degree: int, layers: int | None = None) -> float:
        """Latency of a degree-d group's all-to-alls over ``layers`` layers (default: all), 8 a
        layer (forward and backward; the forward's 4 again per layer the model's recompute runs
        again), plus its ring's p2p calls."""
        u, r = self.ulysses_degree(degree), self.ring_degree(degree)
        m = self.model
        layers = m.num_layers if layers is None else layers
        calls = (8 + 4 * m.recomputed_layers / m.num_layers) * layers
        a2a = calls * self.cluster.a2a_latency(u) if u > 1 else 0.0
        return a2a + 3 * (r - 1) * layers * self.cluster.p2p_latency_ms

    def ring_ms(self, seq_len, degree: int):
        """What a degree-d group's ring leaves exposed per sequence (0 without a ring): K/V blocks
        pass r - 1 times around the ring forward, K/V and their gradients r - 1 times each backward
        (3 (r - 1) transfers of s / r tokens of this GPU's K/V heads per layer), overlapped with the
        attention work a1 s^2 / d that each step runs on the block in hand."""
        s = np.asarray(seq_len, dtype=np.float64)
        u, r = self.ulysses_degree(degree), self.ring_degree(degree)
        if r == 1:
            return np.zeros_like(s)
        m = self.model
        kv_mb_per_token = 2 * m.kv_heads * (m.hidden_size // m.num_attention_heads) * m.activation_bytes / MB / u
        # a group is an aligned block of ranks, its ring u GPUs apart: the ring crosses nodes once the
        # group spans several, each crossing hop carrying a Ulysses part's sends over the node's NICs
        # (a whole node's where the part fills it); the slowest hop sets each ring step
        gpn = self.cluster.gpus_per_node
        rate = self.cluster.pair_mb_per_ms(degree > gpn, min(u, gpn))
        p2p = 3 * (r - 1) * m.num_layers * (s / r) * kv_mb_per_token / rate
        return np.maximum(0.0, p2p - self.a1 * s * s / degree)

    @property
    def micro_batch_fixed_ms(self) -> float:
        """What every FlexSP micro-batch pays whatever it runs: the pass's fixed cost (b1) and the
        measured overhead."""
        return self.pass_fixed_ms + self.cluster.micro_batch_overhead_ms

    def group_fixed_ms(self, degree: int) -> float:
        """What a group pays per micro-batch whatever it runs: the micro-batch's fixed cost and
        the group's all-to-all latency."""
        return self.micro_batch_fixed_ms + self.a2a_latency_ms(degree)

    def seq_time_ms(self, seq_len, degree: int):
        """Time of sequence(s) in a degree-d group, without the per-group b1 (array-friendly)."""
        s = np.asarray(seq_len, dtype=np.float64)
        return (self.a1 * s * s + self.a2 * s) / degree + s * self.comm_ms_per_token(degree) + self.ring_ms(s, degree)

    def group_time_ms(self, lengths, degree: int) -> float:
        return self.group_fixed_ms(degree) + float(np.sum(self.seq_time_ms(lengths, degree)))

    def cheapest_gpu_ms(self, lengths) -> np.ndarray:
        """GPU-milliseconds of each sequence at its cheapest feasible degree (for lower bounds)."""
        return cheapest_gpu_ms(self, lengths)

    def compute_floor_ms(self, lengths) -> float:
        """The batch's compute spread perfectly over every GPU, and nothing else: no all-to-all, no
        per-pass fixed cost, no idle time, memory ignored. No plan of any kind (FlexSP, pipelines,
        any layout) takes less on this cost model, so ``t / floor`` bounds any planner's speedup
        over a plan that takes ``t``."""
        return float(np.sum(self.seq_time_ms(lengths, 1))) / self.num_gpus

    def min_microbatches(self, lengths) -> int:
        total = float(np.sum(lengths))
        return max(1, math.ceil(total / (self.tokens_per_gpu * self.num_gpus) - 1e-9))

    def lower_bound_ms(self, lengths) -> float:
        """No FlexSP plan runs the batch faster: work spread perfectly at each sequence's cheapest
        degree, the micro-batches memory forces, each paying its fixed cost, and the critical
        path of the longest sequences (cost/bounds.py has the argument)."""
        return lower_bound_ms(self, lengths)

    def relaxed_bound_ms(self, lengths) -> float:
        """The same bound when a sequence may run on any number of GPUs, neither a power of two
        nor limited by the heads: what no layout of groups priced by this model beats."""
        return relaxed_bound_ms(self, lengths)

    def barrier_free_bound_ms(self, lengths) -> float:
        """No FlexSP-kind plan, even one without a barrier between micro-batches (each set of GPUs
        running its passes back to back), runs the batch faster: the critical path of the longest
        sequence, or the GPU-ms of the work and of the passes memory forces spread over every GPU,
        then the exposed gradient sync (cost/bounds.py has the argument)."""
        return barrier_free_bound_ms(self, lengths)

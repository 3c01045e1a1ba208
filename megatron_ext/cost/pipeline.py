"""Cost model of a pipeline stage (InfiniPipe, PAPERS.md section 2, Eq. 1-11), built on CostModel.

A pipeline has ``pp`` stages of ``L_s = L / pp`` layers each; every stage is one Ulysses group of
``sp`` GPUs; the cluster runs GPUs / (pp x sp) replicas of it side by side (``replicas``). The
whole-model FlexSP coefficients (a1, a2: fwd+bwd, ms, with the model's recompute:
CostModel.a1/a2) are spread evenly over the layers, so a stage does ``L_s / L`` of them. For one chunk on one stage (milliseconds):

    work    = sum over pieces of  a1 ((C + s)^2 - C^2) + a2 s       (C: prefix already processed)
    compute = (L_s / L * attention + share_p * a2 tokens) / sp      (attention = work - a2 tokens)
    a2a     = L_s / L * tokens * comm_ms_per_token(sp)            (4 all-to-alls per layer, fwd+bwd)
    fixed   = b1_scale * pass_fixed(stage) + 8 L_s lat[sp]        (cost/fixed.py; 2 beta(d_s) 2 L / d_p)
    stage   = compute + a2a + fixed;  forward = stage / 3,  backward = 2 stage / 3

The output layer's matmuls (ModelSpec.head_share of the per-token work, h x vocab) run on
the last stage only: share_p = (1 - head) / pp, plus head on the last stage. The planner's own
searches use the average stage (share 1 / pp); the simulator times every stage with its own.
Each forward and backward also pays the cluster's ``pipeline_op_overhead_ms`` (measured by
`profile` from a real pipeline step; what the runtime adds per operation beyond the passes).
The 1/3 : 2/3 split of forward and backward is the usual FLOP ratio (the backward computes the
gradients of both the input and the weights); recomputing ``r`` layers costs ``r / L_s`` of the
forward. p2p between stages: ``tokens * hidden * e bytes`` (e: the model's activation_bytes),
split over the stage's sp ranks, each to its peer on the next stage, over the link between them
(``PipelineCost._handoff``: NVLink or a measured pair rate inside a node, the node's NICs
between nodes), plus a latency per handoff. Ranks are laid out as Megatron's (pipeline
outermost): a stage's GPUs are consecutive, sp ranks per replica.

``b1_scale`` (default 1): a what-if multiplier of the fixed cost a chunk pays on one stage.
That cost is derived (cost/fixed.py), not a share of FlexSP's b1: the launch constant's share of
the stage's layers, plus under ZeRO-3 the gathers of the stage's own parameters (``params_b /
pp``, sharded over the stage's SP group, inside one node: NVLink) and its last reduce-scatter;
under ZeRO 0/1/2 no chunk gathers anything, and the step pays once what the gradient sync of the
stage's parameters over the GPUs holding them (its SP ranks in every replica) leaves exposed
(``step_sync_ms``, the slowest stage's).

Memory per GPU of a stage, MB:
- model states of the fullest stage (``stage_params_b``: its layers' share of params_b and, on
  the first and last stage, a vocabulary table), ZeRO-sharded at the CostModel's ZeRO
  stage: ZeRO-3 over the stage's sp ranks (not over the replicas: a stage gathers its
  parameters every pass, inside its node, which is what the per-chunk fixed cost assumes);
  ZeRO 1/2 over every GPU holding the stage (sp ranks x replicas: the distributed optimizer's
  data-parallel group, which gathers only once per step);
- per in-flight chunk: ``tokens * act_layer * L_s``, plus on the last stage what the output
  layer and loss keep, ``tokens * (vocab * 4 + 2 * hidden * e) bytes / sp`` (fp32 logits, the
  inputs of the final norm and of the output layer). act_mb_per_token is the whole model's
  figure, head included, so act_layer = (act_mb_per_token - head) / L / sp;
- pieces of split sequences: the prefix cache keeps a copy of the K/V of every piece but the
  last (``2 * kv_heads * head_dim * e`` bytes per token and layer), which later slices attend
  to, so it stays, checkpointed or not, until the sequence's first slice has run backward; a
  slice [C, C + s) attends to the K/V it concatenates (C + s tokens), which autograd keeps as
  the cached parts, not as a copy (runtime/saved.py): the concatenation lives inside one
  layer's attention, forward and backward, a transient like that attention's workspace or the
  MLP's intermediate, left to the headroom between a card and its usable memory;
- recomputing a layer of a chunk keeps only its input (``hidden * e`` bytes per token) and the
  cached K/V;
- while a split sequence runs backward, the gradient of its prefix K/V (same size as the K/V of
  the tokens before the current slice) waits for the earlier slices' backward.
Pure Python + numpy.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from megatron_ext.cost.activations import head_bytes_per_token
from megatron_ext.cost.bounds import pipeline_bound_ms
from megatron_ext.cost.fixed import pass_fixed_ms, step_sync_ms
from megatron_ext.cost.model import CostModel, model_states_mb
from megatron_ext.errors import ConfigError, InfeasibleError
from megatron_ext.spec import MB

FWD_FRACTION = 1.0 / 3.0  # forward share of a fwd+bwd pass (and so the cost of a recomputation)


# a what-if multiple of the derived fixed cost past which step times lose their precision
MAX_B1_SCALE = 1e3


@dataclass(frozen=True)
class PipelineCost:
    """Time and memory of chunks on the stages of a ``pp``-stage pipeline of SP degree ``sp``."""

    cost: CostModel
    pp: int
    sp: int
    b1_scale: float = 1.0
    memory_mb: float | None = None  # usable per GPU; default: the cluster's

    def __post_init__(self):
        m, c = self.cost.model, self.cost.cluster
        if not isinstance(self.pp, int) or isinstance(self.pp, bool) or self.pp < 1:
            raise ConfigError(f"pipeline degree must be a positive integer, got {self.pp!r}")
        if m.num_layers % self.pp:
            fits = [d for d in range(1, m.num_layers + 1) if m.num_layers % d == 0 and c.num_gpus % d == 0]
            raise ConfigError(f"pipeline degree {self.pp} does not divide the {m.num_layers} layers of {m.name}; "
                              f"on {c.name} ({c.num_gpus} GPUs) choose one of {', '.join(map(str, fits))}")
        self.cost.check_degree(self.sp)
        if self.sp not in self.cost.stage_degrees:  # (a stage's SP group is Ulysses only, over its heads)
            raise ConfigError(f"SP degree {self.sp} of a pipeline stage is past {m.name}'s Ulysses limit "
                              f"({self.cost.ulysses_degree(self.sp)}: its heads); a stage runs Ulysses only, no ring")
        if not (m.a1 > 0 or m.a2 > 0):  # (a model to be profiled may say so; a pipeline cannot be cut by it)
            raise ConfigError(f"model {m.name}: a1 and a2 are both 0, so a pass takes as long for any number of "
                              f"tokens and no chunking is better than another; measure them with `megatron-ext "
                              f"profile` (at --lengths long enough for the time to grow)")
        if c.num_gpus % (self.pp * self.sp):
            raise ConfigError(f"pp {self.pp} x sp {self.sp} = {self.pp * self.sp} GPUs does not divide the "
                              f"{c.num_gpus} GPUs of {c.name} (a layout runs as GPUs / (pp x sp) replicas side by side)")
        if not (isinstance(self.b1_scale, (int, float)) and 0 <= self.b1_scale <= MAX_B1_SCALE):
            raise ConfigError(f"b1_scale (--b1-scale) must be from 0 to {MAX_B1_SCALE:g}, got {self.b1_scale!r}")
        head = head_bytes_per_token(m) / MB
        if self.cost.act_mb_per_token <= head:  # (the layers would keep nothing: no chunk size is better)
            raise ConfigError(f"model {m.name}: act_mb_per_token {self.cost.act_mb_per_token:g} MB is no more than "
                              f"what its output layer alone keeps per token ({head:.4g} MB: fp32 logits of "
                              f"{m.vocab_size:,} words and two inputs of {m.hidden_size:,}); it counts every layer's "
                              f"activations and the output layer's (leave it out to derive it from the shape)")
        if self.memory_mb is not None and not (isinstance(self.memory_mb, (int, float))
                                               and math.isfinite(self.memory_mb) and self.memory_mb > 0):
            raise ConfigError(f"memory budget must be a positive number of MB, got {self.memory_mb!r}")
        if self.activation_room_mb <= 0:
            raise InfeasibleError(
                f"the memory budget of {self.budget_mb:.0f} MB per GPU is below the model states of a stage "
                f"({self.model_states_mb:.0f} MB: {self.stage_params_b:.2f}B parameters of {m.name} at ZeRO-"
                f"{self.cost.zero_stage} over {self.sp} GPUs); use more stages, a larger SP degree or more memory")

    # ---- shape --------------------------------------------------------------------------
    @property
    def replicas(self) -> int:
        """Data-parallel copies of the pipeline, side by side (each runs its share of the batch)."""
        return self.cost.num_gpus // (self.pp * self.sp)

    @property
    def layers_per_stage(self) -> int:
        return self.cost.model.num_layers // self.pp

    @property
    def stage_share(self) -> float:
        """Fraction of the whole model's layers on one stage."""
        return 1.0 / self.pp

    # ---- time (ms) ----------------------------------------------------------------------
    def piece_work(self, s, prefix=0):
        """Whole-model, one-GPU fwd+bwd ms of tokens [C, C+s) of a sequence (without b1)."""
        s = np.asarray(s, dtype=np.float64)
        c = np.asarray(prefix, dtype=np.float64)
        a1, a2 = self.cost.a1, self.cost.a2
        return a1 * ((c + s) ** 2 - c * c) + a2 * s

    @cached_property
    def comm_ms_per_token(self) -> float:
        """All-to-all ms per token for the stage's layers (fwd+bwd)."""
        return self.cost.comm_ms_per_token(self.sp) * self.stage_share

    @property
    def stage_width(self) -> int:
        """GPUs holding one stage: its sp ranks in every replica."""
        return self.sp * self.replicas

    def stage_ranks(self, stage: int = 0, replica: int = 0) -> range:
        """The GPUs of one stage of one replica, in Megatron's rank order (pipeline outermost: a
        stage's ``stage_width`` ranks are consecutive, each replica's sp of them in turn; rank r of
        a stage hands its activations to rank r + stage_width)."""
        first = stage * self.stage_width + replica * self.sp
        return range(first, first + self.sp)

    @cached_property
    def pass_fixed_ms(self) -> float:
        """Fixed cost of a chunk's fwd+bwd pass on one stage (cost/fixed.py): the launch share of
        its layers and, under ZeRO-3, the gathers of its parameters over the stage's group."""
        c = self.cost
        return pass_fixed_ms(c.model, c.cluster, c.zero_stage, self.layers_per_stage, self.stage_ranks())

    @cached_property
    def fixed_ms(self) -> float:
        """Per-chunk fixed cost on one stage (fwd+bwd): the pass's fixed cost (times the what-if
        ``b1_scale``) and the stage's all-to-all latency."""
        return self.pass_fixed_ms * self.b1_scale + self.cost.a2a_latency_ms(self.sp, self.layers_per_stage)

    @cached_property
    def step_sync_ms(self) -> float:
        """What the once-per-step gradient sync leaves exposed, the slowest stage's (cost/fixed.py):
        ZeRO 0/1/2, each stage's layers over the GPUs holding them (its sp ranks in every replica);
        ZeRO-3 (a stage sharded over its own sp ranks, reduced per pass), each GPU's shard over its
        peers in the other replicas (none without replicas)."""
        c = self.cost
        # (the layers' even share: what a sync leaves exposed is about one layer's, and a stage's
        # vocabulary table is reduced with the rest, hidden behind its backward)
        stage_model = dataclasses.replace(c.model, params_b=c.model.params_b / self.pp,
                                          num_layers=self.layers_per_stage, act_mb_per_token=c.act_mb_per_token)
        # (a stage's ``stage_width`` ranks are consecutive, each replica's sp in turn: ``stage_ranks``)
        w = self.stage_width
        if c.zero_stage == 3:  # (each replica's first rank of the stage, and so on)
            shard = dataclasses.replace(stage_model, params_b=stage_model.params_b / self.sp)
            return max(step_sync_ms(shard, c.cluster, range(p * w, (p + 1) * w, self.sp)) for p in range(self.pp))
        return max(step_sync_ms(stage_model, c.cluster, range(p * w, (p + 1) * w)) for p in range(self.pp))

    def lower_bound_ms(self, lengths) -> float:
        """No pipeline plan on this layout runs the batch faster: each stage's work, the chunks
        memory forces (each paying the fixed cost), the fill and drain, the exposed sync
        (cost/bounds.py has the argument)."""
        return pipeline_bound_ms(self, lengths)

    def linear_share(self, stage: int | None = None, head: bool = True) -> float:
        """Share of the model's per-token (a2) work a stage does: None, the average stage;
        ``head=False``, its layers alone."""
        if stage is None and head:
            return self.stage_share
        h = self.cost.model.head_share
        return (1.0 - h) * self.stage_share + (h if head and stage == self.pp - 1 else 0.0)

    def compute_ms(self, work, tokens, stage: int | None = None, head: bool = True):
        """Fwd+bwd compute ms of a chunk on one stage (None: the average stage), from its
        whole-model work and token count: no all-to-all, no fixed cost."""
        linear = self.cost.a2 * np.asarray(tokens, dtype=np.float64)
        attention = np.asarray(work, dtype=np.float64) - linear
        return (attention * self.stage_share + linear * self.linear_share(stage, head)) / self.sp

    def stage_ms(self, work, tokens, stage: int | None = None, head: bool = True):
        """Fwd+bwd ms of a chunk on one stage (None: the average stage): its compute, all-to-alls
        and fixed cost."""
        tokens = np.asarray(tokens, dtype=np.float64)
        return self.compute_ms(work, tokens, stage, head) + tokens * self.comm_ms_per_token + self.fixed_ms

    def fwd_ms(self, work, tokens, stage: int | None = None):
        return FWD_FRACTION * self.stage_ms(work, tokens, stage) + self.cost.cluster.pipeline_op_overhead_ms

    def bwd_ms(self, work, tokens, stage: int | None = None):
        return (1.0 - FWD_FRACTION) * self.stage_ms(work, tokens, stage) + self.cost.cluster.pipeline_op_overhead_ms

    def recompute_ms(self, work, tokens, layers):
        """Re-running the forward of ``layers`` of the stage's layers for a chunk (the output
        layer is never recomputed): a layer's forward compute and launches (a third of its pass's)
        and its forward all-to-alls (half of its pass's, calls too: the backward's carry the
        gradients); no parameter gather (under ZeRO-3 the backward's, just before, serves it)."""
        a2a = np.asarray(tokens, dtype=np.float64) * self.comm_ms_per_token + self.cost.a2a_latency_ms(
            self.sp, self.layers_per_stage)
        launch = self.b1_scale * self.cost.model.launch_ms * self.stage_share
        per_layer = (FWD_FRACTION * (self.compute_ms(work, tokens, head=False) + launch) + 0.5 * a2a) \
            / self.layers_per_stage
        return per_layer * np.asarray(layers, dtype=np.float64)

    @cached_property
    def _handoff(self) -> tuple[float, float]:
        """(ms per MB of a chunk's activations, ms per handoff) from one stage to the next, the mean
        over the pipeline's P - 1 handoffs (a chunk's fill or drain crosses each once). Each of the
        stage's sp ranks sends its 1 / sp of the chunk to its peer on the next stage, at the rate
        ``ClusterSpec.pair_mb_per_ms`` gives: inside a node, the measured pair rate or NVLink;
        across nodes, the node's NICs shared by the node's GPUs that send across at once (every GPU
        of the node when a stage fills nodes; a stage's ranks when nodes hold several stages, and
        then only every few handoffs cross). A handoff's latency: the links' call latency, or where
        the cluster's p2p was measured, ``p2p_latency_ms`` (`profile` times a handoff in place)."""
        c = self.cost.cluster
        if self.pp < 2:
            return 0.0, 0.0
        w, gpn = self.stage_width, c.gpus_per_node
        per_mb, per_handoff = [], []
        for p in range(1, self.pp):  # the handoff from stage p - 1 to stage p
            senders = np.arange((p - 1) * w, p * w)
            across = senders // gpn != (senders + w) // gpn
            sharing = int(np.bincount(senders[across] // gpn).max()) if across.any() else 1
            per_mb.append(1.0 / (self.sp * c.pair_mb_per_ms(bool(across.any()), sharing)))
            per_handoff.append(c.inter_node_latency if across.any() else c.intra_node_latency)
        return float(np.mean(per_mb)), c.p2p_latency_ms + (0.0 if c.p2p_bandwidth_gbps else float(np.mean(per_handoff)))

    def p2p_ms(self, tokens):
        """Sending a chunk's activations (or their gradients) to the next (previous) stage
        (``_handoff``)."""
        m = self.cost.model
        per_mb, latency = self._handoff
        return np.asarray(tokens, dtype=np.float64) * m.hidden_size * m.activation_bytes / MB * per_mb + latency

    # ---- time along a sequence (for balanced slicing) -----------------------------------
    @cached_property
    def _quad(self) -> tuple[float, float]:
        """T(x) = alpha x^2 + beta x: stage ms (without the fixed cost) of a sequence's first x tokens."""
        alpha = self.cost.a1 * self.stage_share / self.sp
        beta = self.cost.a2 * self.stage_share / self.sp + self.comm_ms_per_token
        return alpha, beta

    def prefix_ms(self, x):
        """Stage ms (no fixed cost) of the first x tokens of a sequence."""
        alpha, beta = self._quad
        x = np.asarray(x, dtype=np.float64)
        return alpha * x * x + beta * x

    def prefix_tokens(self, t):
        """Inverse of prefix_ms: how many leading tokens cost t ms."""
        alpha, beta = self._quad
        t = np.asarray(t, dtype=np.float64)
        if alpha <= 0:
            return t / beta
        return (-beta + np.sqrt(beta * beta + 4 * alpha * t)) / (2 * alpha)

    # ---- memory (MB per GPU of a stage) -------------------------------------------------
    @property
    def budget_mb(self) -> float:
        return float(self.memory_mb) if self.memory_mb is not None else self.cost.cluster.memory_mb

    @cached_property
    def stage_params_b(self) -> float:
        """Billions of parameters of the fullest stage: its share of the layers', and a vocabulary
        table (V x h) that the first stage (the embedding) and the last (the output layer, or its
        copy of tied embeddings) hold besides; the layers' taken as the rest of ``params_b`` less
        one table (tied; with untied ones, a table's share too many: on the safe side). One stage:
        the whole model."""
        m = self.cost.model
        if self.pp == 1:
            return m.params_b
        vocab = m.vocab_size * m.hidden_size / 1e9
        return max(0.0, m.params_b - vocab) / self.pp + vocab

    @cached_property
    def model_states_mb(self) -> float:
        over = self.sp if self.cost.zero_stage == 3 else self.sp * self.replicas
        return model_states_mb(self.stage_params_b, self.cost.zero_stage, over, self.cost.state_bytes)

    @cached_property
    def activation_room_mb(self) -> float:
        return self.budget_mb - self.model_states_mb

    @cached_property
    def act_layer_mb(self) -> float:
        """Stored activations per token per layer on one GPU (the head's are the last stage's)."""
        m = self.cost.model
        return max(0.0, self.cost.act_mb_per_token - self.head_mb * self.sp) / m.num_layers / self.sp

    @cached_property
    def input_layer_mb(self) -> float:
        """A checkpointed layer keeps its input: hidden * activation_bytes per token."""
        m = self.cost.model
        return m.hidden_size * m.activation_bytes / MB / self.sp

    @cached_property
    def kv_layer_mb(self) -> float:
        """K and V of one token in one layer, on one GPU."""
        m = self.cost.model
        head_dim = m.hidden_size / m.num_attention_heads
        return 2 * m.kv_heads * head_dim * m.activation_bytes / MB / self.sp

    @cached_property
    def head_mb(self) -> float:
        """What the output layer and the loss keep per token on one GPU (last stage): fp32
        logits and the inputs of the final norm and of the output layer."""
        return head_bytes_per_token(self.cost.model) / MB / self.sp

    def chunk_memory(self, tokens, cached_tokens, last_stage: bool):
        """(I, F): memory a chunk holds between its forward and backward with no recompute, and
        what each recomputed layer saves of it. Beyond the layers' activations: the prefix cache's
        copy of the K/V of pieces whose sequence continues in a later chunk (``cached_tokens``;
        kept under recompute too, and after the chunk's backward until the sequence's first
        slice's: sim/engine.py). A slice's prefix K/V is that cache's, not a copy (module doc)."""
        tokens = np.asarray(tokens, dtype=np.float64)
        cached_tokens = np.asarray(cached_tokens, dtype=np.float64)
        L_s = self.layers_per_stage
        full = (tokens * self.act_layer_mb + cached_tokens * self.kv_layer_mb) * L_s \
            + (tokens * self.head_mb if last_stage else 0.0)
        save = np.maximum(0.0, tokens * (self.act_layer_mb - self.input_layer_mb))
        return full, save

    def dkv_mb(self, tokens):
        """Gradient buffer of the prefix K/V of a split sequence, for ``tokens`` prefix tokens."""
        return np.asarray(tokens, dtype=np.float64) * self.kv_layer_mb * self.layers_per_stage


def default_layout(cost: CostModel) -> tuple[int, int]:
    """(pp, sp) when none is given: Ulysses inside a node (up to the head limit), stages across
    (as many as divide the layers: the rest of the GPUs run replicas of the pipeline); on one node
    (where that would be a single stage), the fewest stages >= 2 that divide the layers and leave
    an allowed SP degree."""
    sp = min(cost.cluster.gpus_per_node, cost.stage_degrees[-1])
    across = cost.num_gpus // sp
    pp = max(p for p in range(1, across + 1) if across % p == 0 and cost.model.num_layers % p == 0)
    if across == 1:
        L, n = cost.model.num_layers, cost.num_gpus
        pp = next((p for p in range(2, n + 1) if L % p == 0 and n % p == 0 and n // p in cost.stage_degrees), 1)
        sp = n // pp
    return pp, sp


__all__ = ["FWD_FRACTION", "MAX_B1_SCALE", "PipelineCost", "default_layout"]

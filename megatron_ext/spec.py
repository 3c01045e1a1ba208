"""ModelSpec and ClusterSpec: plain dataclasses loaded from YAML presets or user files.

A preset is a name resolved in ``megatron_ext/presets/models`` or ``megatron_ext/presets/clusters``
(package data, so a wheel install has them too); anything containing a path separator or ending in
``.yaml``/``.yml`` is read as a file. A cluster family file named like ``h100-80g-8xN.yaml`` serves
every ``h100-80g-8x<nodes>`` name.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import yaml

from megatron_ext.errors import ConfigError
from megatron_ext.files import TooBigError, read_text

# MEGATRON_EXT_CONFIGS names another directory holding models/ and clusters/ presets
PRESET_DIR = Path(os.environ.get("MEGATRON_EXT_CONFIGS", Path(__file__).resolve().parent / "presets"))


# Units. Memory and message sizes: MB of 2**20 bytes (a cluster's memory_gb: GB of 1024 MB).
# Model states follow the FlexSP paper's accounting, params_b x 16 x 1024 MB (a billion
# parameters' 16 bytes taken as 16 GB), on which its published memory figures and worked example
# rest (a cost model's ``state_bytes`` may count other than 16 bytes a parameter). All-to-all and
# p2p tables (``a2a_bandwidth_gbps``, ``p2p_bandwidth_gbps``): MB per ms, as
# the paper's code divides MB by them ("GB/s": 1000 MB a second) and ``profile`` fits them. Link
# figures for ZeRO collectives (``intra_node_bandwidth_gbps``, ``inter_node_bandwidth_gbps``):
# GB/s of 1e9 bytes, as NCCL bus bandwidths are quoted (cost/fixed.py).
MB = 2**20
GBPS_IN_MB_PER_MS = 1e6 / MB  # a link figure of 1 GB/s (1e9 bytes a second) in MB per ms
MAX_GPUS = 2**20  # a cluster past this many GPUs is a typo (its batches would not fit in memory here)
MAX_MEMORY_GB = 10_000  # a GPU's memory past this (10 TB) is a typo: its documents would be cut at trillions of tokens
# a sequence longer than this is a typo (the longest documents are millions of tokens); with at most
# 2^20 of them in a batch its tokens stay far inside int64 (9e18 + 9e18 wrapped to a negative sum)
MAX_LENGTH = 2**40


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class ModelSpec:
    """A transformer and its profiled FlexSP cost coefficients (whole model, fwd+bwd, ms).

    The fixed cost of a pass (FlexSP's b1) is not a field: cost/fixed.py derives it from the
    parameter traffic of the ZeRO stage in use, the links it crosses and ``launch_ms``."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    params_b: float  # parameters, billions
    a1: float  # ms per token^2 (attention)
    a2: float  # ms per token (linear layers)
    # ms per fwd+bwd pass over the whole model that is neither compute nor parameter traffic:
    # kernel launches and per-layer synchronisation (a pipeline stage pays its layers' share)
    launch_ms: float = 0.0
    # activation memory per token on one GPU, MB (2^20 bytes); None: from the shape and the
    # recompute policy (cost/activations.py); a number: measured (what `profile` writes)
    act_mb_per_token: float | None = None
    # activation recomputation the runtime applies to every pass (for every planner alike):
    # "none", or "full" (Megatron's --recompute-granularity full --recompute-method block):
    # ``recompute_layers`` layers (None: all) keep only their input and run their forward twice
    recompute: str = "none"
    recompute_layers: int | None = None
    dropout: bool = True  # dropout after attention and MLP (GPT: 1-byte masks kept; LLaMA: none)
    num_query_groups: int | None = None  # KV heads (GQA); None means multi-head
    ffn_hidden_size: int | None = None
    vocab_size: int = 50257
    activation_bytes: int = 2  # bytes per activation element sent or kept (bf16: 2; the fp32 CPU runtime: 4)
    swiglu: bool = False  # gated MLP (three FFN matrices, LLaMA) rather than two (GPT)
    head_time_share: float | None = None  # measured share of a2 in the output layer and loss (None: from FLOPs)

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def recomputed_layers(self) -> int:
        """Layers whose forward runs twice (activation recomputation of the whole layer)."""
        if self.recompute != "full":
            return 0
        return self.num_layers if self.recompute_layers is None else min(self.recompute_layers, self.num_layers)

    @property
    def head_share(self) -> float:
        """Share of the model's per-token (a2) work in the output layer and loss, which only the
        last pipeline stage does; the rest is spread evenly over the layers. Measured by
        `profile` (head_time_share), else the output layer's share of the matmul FLOPs."""
        if self.head_time_share is not None:
            return self.head_time_share
        h = self.hidden_size
        kv = self.kv_heads * (h // self.num_attention_heads)
        ffn = self.ffn_hidden_size or 4 * h
        layer = h * (h + 2 * kv) + h * h + (3 if self.swiglu else 2) * h * ffn
        head = h * self.vocab_size
        return head / (self.num_layers * layer + head)

    @cached_property  # (asked for every group of every plan checked: 87,000 times for 32,768 sequences)
    def max_sp_degree(self) -> int:
        """Largest Ulysses degree: heads and KV heads must divide by it."""
        d = 1
        while self.num_attention_heads % (2 * d) == 0 and self.kv_heads % (2 * d) == 0:
            d *= 2
        return d


@dataclass(frozen=True)
class ClusterSpec:
    """GPUs, their usable memory, the all-to-all bandwidth of a group of each degree and the
    links the collectives of ZeRO and of gradient sync cross (cost/fixed.py)."""

    name: str
    num_nodes: int
    gpus_per_node: int
    memory_gb: float  # usable per GPU
    a2a_bandwidth_gbps: dict[int, float] = field(default_factory=dict)
    # MB per ms one GPU gets sending to another GPU of its node while every pair sends at once
    # (what `profile` measures on rank pairs): pipeline handoffs and rings inside a node use it
    # where given, else NVLink; across nodes, the links below (``pair_mb_per_ms``)
    p2p_bandwidth_gbps: float | None = None
    # ms per all_to_all call by degree, on top of bytes / bandwidth (what `profile` measures; the
    # published GPU tables have none, and their large messages make it negligible)
    a2a_latency_ms: dict[int, float] = field(default_factory=dict)
    # ms a stage-to-stage handoff adds on top of bytes / bandwidth (what `profile` measures)
    p2p_latency_ms: float = 0.0
    # ms every forward or backward of a pipeline stage takes beyond the model's estimate (what
    # `profile` measures running a real pipeline; 0 in the published GPU presets)
    pipeline_op_overhead_ms: float = 0.0
    # ms a FlexSP micro-batch takes beyond the model's estimate (what `profile` measures running
    # a real FlexSP step: a micro-batch ends with its slowest group; 0 in the published GPU presets)
    micro_batch_overhead_ms: float = 0.0
    # Links for the ring collectives of ZeRO parameter gathers and gradient reductions (NCCL bus
    # bandwidth, GB/s, for large messages): per GPU inside a node (NVLink), per node between
    # nodes (all its NICs together); and the ms one such collective call costs however small.
    # None: from the all-to-all table (inside a node: the widest degree a node holds; between
    # nodes: the cluster-wide degree's figure times the GPUs of a node) and its latencies.
    intra_node_bandwidth_gbps: float | None = None
    inter_node_bandwidth_gbps: float | None = None
    intra_node_latency_ms: float | None = None
    inter_node_latency_ms: float | None = None

    @property
    def num_gpus(self) -> int:
        return self.num_nodes * self.gpus_per_node

    @property
    def memory_mb(self) -> float:
        return self.memory_gb * 1024.0

    def a2a_bandwidth(self, degree: int) -> float:
        """GB/s of a degree-d all-to-all; beyond the table, the widest tabulated degree's figure.
        Degree 1 is unbounded: nothing crosses a link (a one-GPU machine needs no table)."""
        if degree <= 1:
            return math.inf
        known = [d for d in self.a2a_bandwidth_gbps if d <= degree]
        if not known:
            raise ConfigError(f"cluster {self.name!r}: no all-to-all bandwidth for degree {degree}")
        return self.a2a_bandwidth_gbps[max(known)]

    @property
    def intra_node_gbps(self) -> float:
        """Bus bandwidth of a collective inside a node, GB/s per GPU."""
        if self.intra_node_bandwidth_gbps is not None:
            return float(self.intra_node_bandwidth_gbps)
        return self.a2a_bandwidth(min(self.gpus_per_node, self.num_gpus)) / GBPS_IN_MB_PER_MS  # (MB/ms -> GB/s)

    @property
    def inter_node_gbps(self) -> float:
        """Bandwidth a node's NICs give a collective spanning nodes, GB/s per node."""
        if self.inter_node_bandwidth_gbps is not None:
            return float(self.inter_node_bandwidth_gbps)
        return self.a2a_bandwidth(self.num_gpus) * self.gpus_per_node / GBPS_IN_MB_PER_MS  # (MB/ms -> GB/s)

    @property
    def intra_node_latency(self) -> float:
        """ms per collective call inside a node."""
        if self.intra_node_latency_ms is not None:
            return float(self.intra_node_latency_ms)
        return self.a2a_latency(max(2, min(self.gpus_per_node, self.num_gpus)))

    @property
    def inter_node_latency(self) -> float:
        """ms per collective call spanning nodes."""
        if self.inter_node_latency_ms is not None:
            return float(self.inter_node_latency_ms)
        return self.a2a_latency(max(2, self.num_gpus))

    def pair_mb_per_ms(self, across_nodes: bool, sharing: int = 1) -> float:
        """MB per ms one GPU gets sending to another while every GPU of its node sends too
        (pipeline handoffs, rings): inside a node, the measured ``p2p_bandwidth_gbps`` (`profile`
        times pairs of one node) or else NVLink (``intra_node_gbps``); across nodes, the node's
        NICs (``inter_node_gbps``) shared by the ``sharing`` GPUs of the node sending across, at
        most the rate inside a node."""
        inside = float(self.p2p_bandwidth_gbps) if self.p2p_bandwidth_gbps else self.intra_node_gbps * GBPS_IN_MB_PER_MS
        if not across_nodes:
            return inside
        return min(inside, self.inter_node_gbps / sharing * GBPS_IN_MB_PER_MS)  # (no faster than inside a node)

    def a2a_latency(self, degree: int) -> float:
        """ms per all_to_all call of a degree-d group (the widest tabulated degree's beyond the table)."""
        known = [d for d in self.a2a_latency_ms if d <= degree]
        return float(self.a2a_latency_ms[max(known)]) if known else 0.0


def _check(cond: bool, what: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{what}: {msg}")


def _build(cls, data: dict, what: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{what}: expected a mapping of fields, got {type(data).__name__}")
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(str(k) for k in data if k not in names)  # (a key may be a number: `1: 2`)
    _check(not unknown, what, f"unknown field(s) {', '.join(unknown)}; known: {', '.join(names)}")
    missing = sorted(n for n, f in names.items() if n not in data and f.default is dataclasses.MISSING
                     and f.default_factory is dataclasses.MISSING)
    _check(not missing, what, f"missing field(s) {', '.join(missing)}")
    try:
        return cls(**data)
    except TypeError as e:  # pragma: no cover - guarded by the checks above
        raise ConfigError(f"{what}: {e}") from None


class _YamlLoader(yaml.SafeLoader):
    """Safe YAML, reading exponents without a dot (``a1: 5e-6``) as numbers, as YAML 1.2 does
    (PyYAML's 1.1 rules read them as strings), and refusing a key given twice (PyYAML keeps the
    last without a word) and aliases (``*name``: a spec needs none, and nested ones expand to
    billions of values)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(None, None, f"*{event.anchor}: aliases are not read here", event.start_mark)
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)):  # (an unhashable key: PyYAML's own error)
                if key in seen:
                    raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice", key_node.start_mark)
                seen.add(key)
        return super().construct_mapping(node, deep)


_YamlLoader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                  list("-+0123456789"))


def read_yaml(path: Path) -> dict:
    try:
        data = yaml.load(read_text(path, 2**24), Loader=_YamlLoader)
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not UTF-8 text (a YAML file was expected)") from None
    except TooBigError as e:
        raise ConfigError(f"{path}: too big to be a model, cluster or cost-model YAML ({e})") from None
    except ValueError:  # (what else yaml's int() refuses: over 4,300 digits)
        raise ConfigError(f"{path}: holds a number of over 4,300 digits") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a YAML mapping")
    return data


def _looks_like_path(ref: str) -> bool:
    return os.sep in ref or ref.endswith((".yaml", ".yml"))


def _presets(kind: str) -> list[str]:
    return sorted(p.stem for p in (PRESET_DIR / kind).glob("*.yaml"))


def is_int(v) -> bool:
    """An int, not a bool (YAML's true and false are not counts)."""
    return isinstance(v, int) and not isinstance(v, bool)


def is_number(v) -> bool:
    """A finite int or float (YAML's .inf and .nan are floats; true and false are not numbers)."""
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _check_count(v, what: str, name: str) -> None:
    _check(is_int(v) and v > 0, what, f"{name} must be a positive integer, got {v!r}")


# Past these a spec's times overflow or lose all precision (a2a_latency_ms: 1e300, a1: 1e307), so
# no plan could be compared with another: no real model or machine comes near them.
_LARGEST = 1e9
_SLOWEST_GBPS = 1e-3  # 1 Mbit/s


def _check_number(v, what: str, name: str, positive: bool) -> None:
    ok = is_number(v) and (v > 0 if positive else v >= 0)
    _check(ok, what, f"{name} must be a {'positive' if positive else 'non-negative'} finite number, got {v!r}")
    _check(v <= _LARGEST, what, f"{name} must be at most {_LARGEST:g}, got {v!r}")
    if "gbps" in name:
        _check(v >= _SLOWEST_GBPS, what, f"{name} must be at least {_SLOWEST_GBPS:g} GB/s, got {v!r}")


def _check_name(name, kind: str) -> None:
    _check(isinstance(name, str) and 0 < len(name) <= 100, f"{kind} name", f"must be a string of 1-100 characters, "
           f"got {str(name)[:60]!r}")


def validate_model(m: ModelSpec) -> ModelSpec:
    _check_name(m.name, "model")
    what = f"model {m.name!r}"
    for f in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size"):
        _check_count(getattr(m, f), what, f)
    for f in ("num_query_groups", "ffn_hidden_size"):
        if getattr(m, f) is not None:
            _check_count(getattr(m, f), what, f)
    for f in ("params_b", "a1", "a2", "launch_ms"):
        _check_number(getattr(m, f), what, f, positive=False)
    _check(m.a1 > 0 or m.a2 > 0, what, "a1 and a2 are both 0: a pass would take no time (measure them with "
           "`megatron-ext profile`)")
    if m.act_mb_per_token is not None:
        _check_number(m.act_mb_per_token, what, "act_mb_per_token", positive=True)
    _check(m.recompute in ("none", "full"), what, f"recompute must be 'none' or 'full', got {m.recompute!r}")
    if m.recompute_layers is not None:
        _check(is_int(m.recompute_layers) and 0 <= m.recompute_layers <= m.num_layers, what,
               f"recompute_layers must be an integer in 0..{m.num_layers}, got {m.recompute_layers!r}")
        _check(m.recompute == "full", what, f"recompute_layers ({m.recompute_layers}) applies with recompute: full, "
               f"not {m.recompute!r}")
    _check(isinstance(m.dropout, bool), what, f"dropout must be true or false, got {m.dropout!r}")
    _check(m.num_attention_heads % m.kv_heads == 0, what, "num_attention_heads must divide by num_query_groups")
    _check(m.hidden_size % m.num_attention_heads == 0, what,
           f"hidden_size {m.hidden_size} must divide by num_attention_heads {m.num_attention_heads} (the head size)")
    _check(is_int(m.activation_bytes) and m.activation_bytes in (1, 2, 4, 8), what,
           f"activation_bytes must be 1, 2, 4 or 8, got {m.activation_bytes!r}")
    _check(isinstance(m.swiglu, bool), what, f"swiglu must be true or false, got {m.swiglu!r}")
    _check(m.head_time_share is None or (is_number(m.head_time_share) and 0 <= m.head_time_share < 1),
           what, f"head_time_share must be in [0, 1), got {m.head_time_share!r}")
    return m


def validate_cluster(c: ClusterSpec) -> ClusterSpec:
    _check_name(c.name, "cluster")
    what = f"cluster {c.name!r}"
    for name in ("gpus_per_node", "num_nodes"):  # (1.0 or "1" was "not a power of two")
        _check_count(getattr(c, name), what, name)
    _check(is_int(c.gpus_per_node) and is_power_of_two(c.gpus_per_node), what,
           f"gpus_per_node must be a power of two, got {c.gpus_per_node!r}")
    _check(is_int(c.num_nodes) and is_power_of_two(c.num_nodes), what,
           f"the GPU count must be a power of two times the node size; num_nodes={c.num_nodes!r} "
           f"is not a power of two")
    _check(c.gpus_per_node * c.num_nodes <= MAX_GPUS, what,
           f"{c.gpus_per_node * c.num_nodes:,} GPUs is over the {MAX_GPUS:,} this models")
    _check_number(c.memory_gb, what, "memory_gb", positive=True)
    _check(c.memory_gb <= MAX_MEMORY_GB, what, f"memory_gb must be at most {MAX_MEMORY_GB:,}, got {c.memory_gb!r}")
    if c.p2p_bandwidth_gbps is not None:
        _check_number(c.p2p_bandwidth_gbps, what, "p2p_bandwidth_gbps", positive=True)
    for name in ("p2p_latency_ms", "pipeline_op_overhead_ms", "micro_batch_overhead_ms"):
        _check_number(getattr(c, name), what, name, positive=False)
    for name in ("intra_node_bandwidth_gbps", "inter_node_bandwidth_gbps", "intra_node_latency_ms",
                 "inter_node_latency_ms"):
        if getattr(c, name) is not None:
            _check_number(getattr(c, name), what, name, positive=name.endswith("gbps"))
    bw = c.a2a_bandwidth_gbps
    for name, table, positive in (("a2a_bandwidth_gbps", bw, True), ("a2a_latency_ms", c.a2a_latency_ms, False)):
        _check(isinstance(table, dict), what, f"{name} must map degree -> number")
        for d, v in table.items():
            _check(is_int(d) and is_power_of_two(d) and d >= 2, what,
                   f"{name} key {d!r} is not a power-of-two degree >= 2")
            _check_number(v, what, f"{name}[{d}]", positive)
    if c.num_gpus > 1:
        _check(any(d <= 2 for d in bw), what, "a2a_bandwidth_gbps needs an entry for degree 2")
    return c


_FAMILY = re.compile(r"^(?P<base>.+-\d+x)(?P<nodes>\d+)$")


def _read_ref(kind: str, ref: str) -> dict:
    """The fields of a preset (``presets/<kind>/<ref>.yaml``, or a family file ``<base>N.yaml``
    serving ``<base><nodes>``) or of a YAML file path, with its name."""
    if _looks_like_path(ref):
        data = read_yaml(Path(ref))
        data.setdefault("name", Path(ref).stem)
        return data
    path = PRESET_DIR / kind / f"{ref}.yaml"
    fam = _FAMILY.match(ref)
    if ref.endswith("xN") and path.exists():  # (its num_nodes would be taken without a word)
        raise ConfigError(f"{ref} names a family of {kind}: give the node count, e.g. {ref[:-1]}4")
    if path.exists():
        data = read_yaml(path)
    elif fam and (PRESET_DIR / kind / f"{fam['base']}N.yaml").exists():
        data = read_yaml(PRESET_DIR / kind / f"{fam['base']}N.yaml")
        data["num_nodes"] = int(fam["nodes"])
    else:
        family = "; a name ending in N stands for any node count, e.g. h100-80g-8x4" if kind == "clusters" else ""
        raise ConfigError(f"unknown {kind[:-1]} preset {ref!r}; presets: {', '.join(_presets(kind))} "
                          f"(or a YAML file path{family})")
    data["name"] = ref
    return data


def load_model(ref: str | ModelSpec) -> ModelSpec:
    return validate_model(ref) if isinstance(ref, ModelSpec) else model_from_mapping(_read_ref("models", ref))


def model_from_mapping(data: dict) -> ModelSpec:
    if isinstance(data, dict) and "b1" in data:
        raise ConfigError(f"model {data.get('name')!r}: b1 is no longer a model field: the fixed cost of a pass is "
                          f"derived from the ZeRO stage's parameter traffic and the links (cost/fixed.py); give what "
                          f"is neither compute nor traffic as launch_ms (what `megatron-ext profile` fits)")
    return validate_model(_build(ModelSpec, data, f"model {data.get('name')!r}"))


def load_cluster(ref: str | ClusterSpec) -> ClusterSpec:
    return validate_cluster(ref) if isinstance(ref, ClusterSpec) else cluster_from_mapping(_read_ref("clusters", ref))


def cluster_from_mapping(data: dict) -> ClusterSpec:
    data = dict(data)
    for name in ("a2a_bandwidth_gbps", "a2a_latency_ms"):
        if isinstance(data.get(name), dict):
            keys = list(data[name])
            try:
                ints = [int(k) for k in keys]
            except (TypeError, ValueError):
                ints = []
            if len(ints) != len(keys) or any(i != k for i, k in zip(ints, keys) if not isinstance(k, str)):
                raise ConfigError(f"cluster {data['name']!r}: {name} keys must be integer degrees, got "
                                  f"{', '.join(map(repr, keys))}")
            if len(set(ints)) != len(ints):  # ("2" and 2: the later one would win without a word)
                raise ConfigError(f"cluster {data['name']!r}: {name} gives a degree twice "
                                  f"({', '.join(map(repr, keys))})")
            data[name] = dict(zip(ints, data[name].values()))
    return validate_cluster(_build(ClusterSpec, data, f"cluster {data.get('name')!r}"))

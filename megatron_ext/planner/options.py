"""``PlannerOptions``: what ``make_plan`` and the FlexSP-kind planners are told (pipeline planners
read the fields they share with ``pp.pipeline.PipelineOptions`` from it)."""
from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass


@dataclass(frozen=True)
class PlannerOptions:
    time_limit: float = 1.0  # seconds the solver may spend on a step
    static_degree: int | None = None  # static_ulysses: the fixed degree (default: the largest)
    drop_over_max: bool = False  # drop (and report) sequences no group can hold, instead of failing
    max_seq_len: int | None = None  # longest sequence to plan (default and cap: the longest a group can hold)
    num_buckets: int = 16  # sequence-blaster buckets per micro-batch
    extra_microbatches: int = 4  # try M_min .. M_min + this many micro-batches
    search_budget: int = 48  # part solves the flexsp cut search may make: bounds work deterministically
    pp: int | None = None  # pipeline planners: stages (default: one per node that divides the layers)
    sp: int | None = None  # pipeline planners: Ulysses degree inside a stage (default: GPUs / pp)
    recompute: str = "ilp"  # elastic_pp: per-chunk recompute "ilp" | "greedy", or "auto" (none if it fits, else full)
    flexsp: bool = True  # auto: FlexSP among the candidates whatever pp / sp pin (False: a run cut into stages)

    def __post_init__(self):
        check_whole_numbers(self, ("num_buckets", "search_budget"))
        check_whole_numbers(self, ("extra_microbatches",), least=0)


def check_whole_numbers(options, names, least: int = 1) -> None:
    """Refuse option fields that are not whole numbers of at least ``least`` (ConfigError)."""
    from megatron_ext.errors import ConfigError

    for name in names:
        value = getattr(options, name)
        if not (isinstance(value, numbers.Integral) and value >= least):
            raise ConfigError(f"{name.replace('_', ' ')} must be a whole number of at least {least}, got {value!r}")


def options_as(cls, options):
    """``options`` as dataclass ``cls`` (PlannerOptions, PipelineOptions): itself, the defaults
    for None, or the fields of ``cls`` that another options object has."""
    if options is None:
        return cls()
    if isinstance(options, cls):
        return options
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: getattr(options, k) for k in fields if hasattr(options, k)})


def planner_options(options) -> PlannerOptions:
    return options_as(PlannerOptions, options)


__all__ = ["PlannerOptions", "check_whole_numbers", "options_as", "planner_options"]

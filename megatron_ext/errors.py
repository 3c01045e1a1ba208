"""Errors a user can act on. The CLI prints them as one line and exits non-zero."""


class MegatronExtError(Exception):
    """Base class: bad input or an impossible request, explained in the message."""


class ConfigError(MegatronExtError):
    """A preset, YAML file or option is unknown or malformed."""


class LengthsError(MegatronExtError):
    """A lengths file or batch is empty or malformed."""


class InfeasibleError(MegatronExtError):
    """No plan can hold the batch (e.g. a sequence over memory even at the largest degree)."""


class OutOfTimeError(MegatronExtError):
    """A planner told to keep to its time limit (another plan stands) cannot finish within it."""


class InvalidPlanError(MegatronExtError):
    """A StepPlan breaks an invariant (coverage, group alignment, memory)."""


class DivergedError(MegatronExtError):
    """A training step's loss or gradient norm is not finite: the run stops there, unsaved."""


class SaveError(MegatronExtError):
    """A checkpoint could not be written (a full disk, a read-only folder): the newest one stays."""

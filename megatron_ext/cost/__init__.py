from megatron_ext.cost.model import CostModel

__all__ = ["CostModel"]

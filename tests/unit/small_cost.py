"""The fixed small model and 4-GPU cluster the unit tests compute by hand against."""
from pathlib import Path

from megatron_ext.cost import CostModel

FIXTURES = Path(__file__).parent / "fixtures"
SMALL_MODEL = str(FIXTURES / "small-model.yaml")
SMALL_CLUSTER = str(FIXTURES / "small-cluster.yaml")


def small_cost() -> CostModel:
    return CostModel.from_presets(SMALL_MODEL, SMALL_CLUSTER)

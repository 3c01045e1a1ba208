"""Output files are written whole or not at all (``files.replacing``)."""
import pytest

from megatron_ext.files import replacing
from megatron_ext.sim.trace import write_trace


def test_a_write_that_fails_leaves_the_old_file_and_nothing_else(tmp_path):
    out = tmp_path / "plan.json"
    out.write_text("old")
    with pytest.raises(TypeError):
        write_trace(str(out), {"traceEvents": [object()]})  # fails part-way through the JSON
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]
    write_trace(str(out), {"traceEvents": []})
    assert out.read_text() == '{"traceEvents": []}' and len(list(tmp_path.iterdir())) == 1


def test_the_temporary_path_keeps_the_suffix_beside_the_file(tmp_path):
    with replacing(tmp_path / "fig.png") as tmp:
        assert tmp.parent == tmp_path and tmp.suffix == ".png" and tmp.name.startswith(".fig.png.")
        tmp.write_bytes(b"png")
    assert (tmp_path / "fig.png").read_bytes() == b"png"

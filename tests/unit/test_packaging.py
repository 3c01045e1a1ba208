"""A wheel install (not editable, the repo checkout out of reach) has the presets and plans a batch."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What setup.py reads to build the wheel; copied so the build's build/ and *.egg-info stay out of
# the checkout.
BUILD_INPUTS = ("setup.py", "README.md", "megatron_ext")

PROBE = """
import json
import megatron_ext, megatron_ext.spec as spec
print(json.dumps({"package": megatron_ext.__file__,
                  "models": spec._presets("models"), "clusters": spec._presets("clusters"),
                  "gpt-7b layers": spec.load_model("gpt-7b").num_layers,
                  "a100-40g-8x8 gpus": spec.load_cluster("a100-40g-8x8").num_gpus}))
"""


def run(cmd, **kw):
    r = subprocess.run(cmd, capture_output=True, text=True, **kw)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} failed:\n{r.stdout}\n{r.stderr}"
    return r.stdout


def test_wheel_install_has_presets_and_plans(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(ROOT / name, src / name)
    # Offline: no build isolation (setuptools is already here: torch requires it) and no index.
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    run(pip + ["wheel", "--no-deps", "--no-build-isolation", "--no-index", str(src), "-w", str(tmp_path / "wheel")])
    (wheel,) = (tmp_path / "wheel").glob("megatron_ext-*.whl")
    site = tmp_path / "site"
    run(pip + ["install", "--no-deps", "--no-index", "--target", str(site), str(wheel)])

    # From outside the checkout with only the installed copy on the path: the checkout's editable
    # install (a finder appended to sys.meta_path) comes after PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_EXT_CONFIGS"}
    env["PYTHONPATH"] = str(site)
    cwd = tmp_path / "elsewhere"
    cwd.mkdir()
    probe = json.loads(run([sys.executable, "-c", PROBE], env=env, cwd=cwd))
    assert Path(probe["package"]).resolve().is_relative_to(site.resolve())
    presets = ROOT / "megatron_ext" / "presets"
    assert probe["models"] == sorted(p.stem for p in (presets / "models").glob("*.yaml"))
    assert probe["clusters"] == sorted(p.stem for p in (presets / "clusters").glob("*.yaml"))
    assert probe["gpt-7b layers"] == 32 and probe["a100-40g-8x8 gpus"] == 64

    plan = json.loads(run([sys.executable, "-m", "megatron_ext.commands.cli", "plan", "--dist", "wikipedia",
                           "--model", "gpt-7b", "--cluster", "a100-40g-8x8", "--json", "--no-baselines"],
                          env=env, cwd=cwd))
    assert plan["num_gpus"] == 64 and plan["micro_batches"]

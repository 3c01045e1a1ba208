"""patches/ and scripts/ without a Megatron-LM checkout: the patch series is well formed, and
scripts/apply_patches.sh applies it to a stand-in checkout built from the patches' own context
(applies, is idempotent, checks, reverses, refuses conflicts and other versions); every script is
`bash -n` clean and its --dry-run prints the commands it would run."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PATCHES = ROOT / "patches/core_v0.16.1"
SCRIPTS = sorted([ROOT / "scripts/apply_patches.sh", ROOT / "scripts/run_local.sh", ROOT / "scripts/gpu_smoke.sh",
                  *(ROOT / "scripts/slurm").glob("*.sh"), *(ROOT / "scripts/slurm").glob("*.sbatch")])
TOUCHED = {"pretrain_gpt.py", "megatron/training/training.py", "megatron/training/arguments.py"}
HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


def series() -> list[str]:
    return [line.strip() for line in (PATCHES / "series").read_text().splitlines()
            if line.strip() and not line.startswith("#")]


def parse_patch(path: Path) -> dict[str, list[list[str]]]:
    """{file: [hunk lines]} of a unified diff; checks the headers and hunk sizes on the way."""
    files: dict[str, list[list[str]]] = {}
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("--- a/"):
            i += 1
            continue
        old, new = lines[i][6:].split("\t")[0], lines[i + 1]
        assert new.startswith("+++ b/") and new[6:].split("\t")[0] == old, (path.name, lines[i:i + 2])
        hunks = files.setdefault(old, [])
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = HUNK.match(lines[i])
            assert m, (path.name, lines[i])
            n_old, n_new = int(m[2] or 1), int(m[4] or 1)
            body = []
            i += 1
            while i < len(lines) and lines[i][:1] in (" ", "-", "+", "\\") and not lines[i].startswith("--- a/"):
                body.append(lines[i])
                i += 1
            assert sum(ln[:1] in " -" for ln in body) == n_old, (path.name, "old line count")
            assert sum(ln[:1] in " +" for ln in body) == n_new, (path.name, "new line count")
            hunks.append(body)
    return files


def test_series_is_well_formed():
    names = series()
    assert names and len(set(names)) == len(names)
    assert sorted(p.name for p in PATCHES.glob("*.patch")) == sorted(names)
    touched = set()
    for name in names:
        text = (PATCHES / name).read_text()
        assert not text.startswith("---"), f"{name}: starts without a description"
        files = parse_patch(PATCHES / name)
        assert files, f"{name}: no file diffs"
        touched.update(files)
        for hunks in files.values():
            for body in hunks:
                added = [ln for ln in body if ln.startswith("+")]
                assert added and any("megatron_ext" in ln for ln in added), f"{name}: a hunk without a marker"
                assert all(len(ln) <= 121 for ln in added), f"{name}: an overlong added line"
                assert all("\t" not in ln for ln in added), f"{name}: a tab"
    assert touched == TOUCHED


def test_patches_are_small():
    added = sum(ln.startswith("+") and not ln.startswith("+++")
                for name in series() for ln in (PATCHES / name).read_text().splitlines())
    assert added <= 20


def stand_in_checkout(root: Path, version=(0, 16, 1)) -> Path:
    """A directory holding what the patches change: each file is its hunks' context (the
    pre-image) separated by filler, plus megatron/core/package_info.py."""
    contents: dict[str, list[str]] = {}
    for name in series():
        for file, hunks in parse_patch(PATCHES / name).items():
            out = contents.setdefault(file, [f"# stand-in for {file}"] + ["pass"] * 3)
            for body in hunks:
                out += [ln[1:] for ln in body if ln[:1] in " -"] + ["pass"] * 7
    for file, lines in contents.items():
        (root / file).parent.mkdir(parents=True, exist_ok=True)
        (root / file).write_text("\n".join(lines) + "\n")
    info = root / "megatron/core/package_info.py"
    info.parent.mkdir(parents=True, exist_ok=True)
    info.write_text(f"MAJOR = {version[0]}\nMINOR = {version[1]}\nPATCH = {version[2]}\nPRE_RELEASE = ''\n")
    return root


def run(*args, cwd=ROOT, env=None) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          env=dict(os.environ, **(env or {})), timeout=120)


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in root.rglob("*") if p.is_file()}


needs_patch = pytest.mark.skipif(shutil.which("patch") is None, reason="needs the patch program")


@needs_patch
def test_apply_is_idempotent_and_reversible(tmp_path):
    mlm = stand_in_checkout(tmp_path)
    pristine = snapshot(mlm)
    script = ROOT / "scripts/apply_patches.sh"
    r = run(script, "--check", mlm)
    assert r.returncode == 1 and r.stdout.count(": not applied") == len(series())
    r = run(script, mlm)
    assert r.returncode == 0, r.stderr
    assert f"applied {len(series())} of {len(series())} patches" in r.stdout
    patched = snapshot(mlm)
    assert "wrap_pretrain_gpt" in patched["pretrain_gpt.py"]
    assert "get_forward_backward_func', get_forward_backward_func)()" in patched["megatron/training/training.py"]
    assert not list(mlm.rglob("*.orig")) and not list(mlm.rglob("*.rej"))
    r = run(script, mlm)  # second run
    assert r.returncode == 0 and r.stdout.count(": already applied") == len(series())
    assert "all 3 patches already applied" in r.stdout
    assert snapshot(mlm) == patched
    assert run(script, "--check", mlm).returncode == 0
    r = run(script, "--reverse", mlm)
    assert r.returncode == 0 and r.stdout.count(": reversed") == len(series())
    assert snapshot(mlm) == pristine


@needs_patch
def test_apply_finishes_a_partly_patched_checkout(tmp_path):
    mlm = stand_in_checkout(tmp_path)
    first = series()[0]
    subprocess.run(["patch", "-d", str(mlm), "-p1", "-s", "-f"], stdin=(PATCHES / first).open(), check=True)
    r = run(ROOT / "scripts/apply_patches.sh", mlm)
    assert r.returncode == 0
    assert f"{first}: already applied" in r.stdout and f"applied {len(series()) - 1} of" in r.stdout


@needs_patch
def test_a_conflict_is_explained_and_changes_nothing(tmp_path):
    mlm = stand_in_checkout(tmp_path)
    training = mlm / "megatron/training/training.py"
    training.write_text(training.read_text().replace("forward_backward_func = get_forward_backward_func()",
                                                     "forward_backward_func = my_own_func()"))
    before = snapshot(mlm)
    r = run(ROOT / "scripts/apply_patches.sh", mlm)
    assert r.returncode == 1
    assert "0002-training-forward-backward-func-hook.patch does not apply" in r.stderr
    assert "nothing was changed" in r.stderr and "FAILED" in r.stderr
    assert snapshot(mlm) == before
    r = run(ROOT / "scripts/apply_patches.sh", "--check", mlm)
    assert r.returncode == 1 and "does not apply (conflict)" in r.stdout


def test_other_versions_and_directories_are_refused(tmp_path):
    mlm = stand_in_checkout(tmp_path / "old", version=(0, 15, 0))
    r = run(ROOT / "scripts/apply_patches.sh", mlm)
    assert r.returncode == 2 and "core 0.15.0" in r.stderr and "core_v0.16.1" in r.stderr
    r = run(ROOT / "scripts/apply_patches.sh", tmp_path)
    assert r.returncode == 2 and "not a Megatron-LM checkout" in r.stderr
    r = run(ROOT / "scripts/apply_patches.sh")
    assert r.returncode == 2 and "MEGATRON_DIR" in r.stderr


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse(script):
    r = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_run_local_dry_run(tmp_path):
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--nproc", "4", "--megatron", tmp_path, "--",
            "--train-iters", "3", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    check, cmd = r.stdout.strip().splitlines()
    assert check.endswith(f"apply_patches.sh --check {tmp_path}")
    assert "-m torch.distributed.run --standalone --nproc-per-node=4 -m megatron_ext.megatron.launch" in cmd
    assert f"{tmp_path}/pretrain_gpt.py --num-layers 2" in cmd
    assert "--flexsp" in cmd and "--mock-data" in cmd and "--train-iters 3" in cmd
    assert f"--cost-model {ROOT}/configs/megatron/cost/tiny-cpu4.yaml" in cmd
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--", "--data-path", "/data/x")
    assert "--mock-data" not in r.stdout and "--data-path /data/x" in r.stdout
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--nproc", "3")
    assert r.returncode == 2 and "no cost model for 3 ranks" in r.stderr


def test_run_local_dry_run_with_elastic_pipelines(tmp_path):
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--nproc", "4", "--pp", "2", "--megatron", tmp_path, "--",
            "--flexsp-planner", "batchada", "--train-iters", "3")
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip().splitlines()[-1].split()
    assert "--flexsp" not in cmd and "--flexsp-planner" not in cmd and "batchada" not in cmd
    assert cmd[-6:-2] == ["--elastic-pp", "--pipeline-model-parallel-size", "2", "--mock-data"]
    assert cmd[-2:] == ["--cost-model", f"{ROOT}/configs/megatron/cost/tiny-cpu4.yaml"]
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--pp", "two")
    assert r.returncode == 2 and "--pp must be a positive integer" in r.stderr


def test_run_local_refuses_an_unpatched_checkout(tmp_path):
    r = run(ROOT / "scripts/run_local.sh", "--megatron", tmp_path, env={"PYTHON": "false"})
    assert r.returncode == 2 and "not a Megatron-LM checkout" in r.stderr


def sbatch_dry_run(mode: str, *args, env=None):
    return run(ROOT / f"scripts/slurm/{mode}.sbatch", "--dry-run", *args,
               env={k: v for k, v in {"SLURM_NNODES": "", **(env or {})}.items()})


def test_flexsp_sbatch_dry_run():
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args", "h100-80g-8x4", "--", "--mock-data",
                       env={"MEGATRON_LM_DIR": "/opt/Megatron-LM", "NCCL_SOCKET_IFNAME": "ib0"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "# flexsp: gpt-7b on h100-80g-8x4 (4 nodes x 8 GPUs)" in out
    for line in ("export NCCL_DEBUG=WARN", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                 "export CUDA_DEVICE_MAX_CONNECTIONS=1", "export NCCL_SOCKET_IFNAME=ib0"):
        assert line in out
    cmd = out.strip().splitlines()[-1]
    assert cmd.startswith("srun --nodes=4 --ntasks-per-node=1 ")
    assert "-m torch.distributed.run --nnodes=4 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=" in cmd
    assert "-m megatron_ext.megatron.launch /opt/Megatron-LM/pretrain_gpt.py --num-layers 32" in cmd
    assert cmd.count("--flexsp") == 1 and "--cost-model gpt-7b:h100-80g-8x4:1" in cmd
    assert "--distributed-backend nccl" in cmd and cmd.endswith("--distributed-backend nccl")
    assert "--mock-data" in cmd


def test_elastic_pp_sbatch_dry_run():
    r = sbatch_dry_run("elastic_pp", "configs/megatron/llama-7b.args", "a800-80g-8x4")
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip().splitlines()[-1]
    assert "--elastic-pp" in cmd and "--flexsp" not in cmd and "--plan-ahead 1" in cmd
    assert cmd.split().count("--pipeline-model-parallel-size") == 2 and cmd.endswith("--distributed-backend nccl")
    assert "--pipeline-model-parallel-size 4" in cmd and "--cost-model llama-7b:a800-80g-8x4:1" in cmd
    # the command validates: 4 stages of 8 GPUs, the cost model spanning all 32
    from megatron_ext.megatron.arguments import validate_args
    from test_megatron_arguments import megatron_like_parser

    args, _ = megatron_like_parser().parse_known_args(cmd.split("pretrain_gpt.py", 1)[1].split() + ["--mock-data"])
    v = validate_args(args, world_size=32)
    assert v.enabled and v.data_parallel_size == 8


def test_sbatch_refuses_an_allocation_that_is_not_the_cluster():
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args", "h100-80g-8x4", env={"SLURM_NNODES": "2"})
    assert r.returncode == 2 and "is not the cluster h100-80g-8x4" in r.stderr
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args")
    assert r.returncode == 2 and "MODEL_ARGS CLUSTER" in r.stderr


def test_sbatch_headers():
    for mode in ("flexsp", "elastic_pp"):
        text = (ROOT / f"scripts/slurm/{mode}.sbatch").read_text()
        directives = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
        assert "#SBATCH --ntasks-per-node=1" in directives and any("--gpus-per-node" in d for d in directives)
        body = text.split("\n")
        first_code = next(i for i, ln in enumerate(body) if ln.strip() and not ln.startswith("#"))
        assert all(i < first_code for i, ln in enumerate(body) if ln.startswith("#SBATCH"))


def test_gpu_smoke_refuses_without_cuda():
    import sys

    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the smoke test would run")
    done = subprocess.run(["bash", str(ROOT / "scripts/gpu_smoke.sh"), "--python", sys.executable],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "no CUDA GPU here" in done.stderr, done.stderr

"""patches/ and scripts/ without a Megatron-LM checkout: the patch series is well formed, and
scripts/apply_patches.sh applies it to a stand-in checkout built from the patches' own context
(applies, is idempotent, checks, reverses, refuses conflicts and other versions); every script is
`bash -n` clean and its --dry-run prints the commands it would run."""
from __future__ import annotations

import os
import re
import shlex
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
    assert "-m megatron_ext.runtime.supervisor --standalone --nproc-per-node=4 -m megatron_ext.megatron.launch" in cmd
    assert f"{tmp_path}/pretrain_gpt.py --num-layers 2" in cmd
    assert "--flexsp" in cmd and "--mock-data" in cmd and "--train-iters 3" in cmd
    assert f"--cost-model {ROOT}/configs/megatron/cost/tiny-cpu4.yaml" in cmd
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--", "--data-path", "/data/x")
    assert "--mock-data" not in r.stdout and "--data-path /data/x" in r.stdout
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--", "--train-data-path", "/data/x")  # (any data option)
    assert r.returncode == 0 and "--mock-data" not in r.stdout
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--args", str(tmp_path / "missing.args"))
    assert r.returncode == 2 and r.stdout == "" and f"no argument file {tmp_path}/missing.args" in r.stderr
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--nproc", "3")
    assert r.returncode == 2 and "no cost model for 3 ranks" in r.stderr
    # FlexSP's groups span the data-parallel ranks: 4 ranks of tensor-parallel size 2 are 2 of them
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--nproc", "4", "--", "--tensor-model-parallel-size", "2")
    assert r.returncode == 0 and f"--cost-model {ROOT}/configs/megatron/cost/tiny-cpu2.yaml" in r.stdout
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--", "--cost-model=configs/megatron/cost/tiny-cpu2.yaml")
    assert f"--cost-model={ROOT}/configs/megatron/cost/tiny-cpu2.yaml" in r.stdout  # (from any directory)
    for flag in ("--nproc", "--args", "--pp", "--megatron"):
        r = run(ROOT / "scripts/run_local.sh", "--dry-run", flag)
        assert r.returncode == 2 and r.stderr == f"run_local.sh: {flag} needs a value\n", r.stderr


def test_run_local_dry_run_with_elastic_pipelines(tmp_path):
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--nproc", "4", "--pp", "2", "--megatron", tmp_path, "--",
            "--flexsp-planner", "batchada", "--flexsp-max-ring", "2", "--train-iters", "3")
    assert r.returncode == 0, r.stderr
    cmd = r.stdout.strip().splitlines()[-1].split()
    assert "--flexsp" not in cmd and "--flexsp-planner" not in cmd and "batchada" not in cmd
    assert "--flexsp-max-ring" not in cmd
    assert cmd[-6:-2] == ["--elastic-pp", "--pipeline-model-parallel-size", "2", "--mock-data"]
    assert cmd[-2:] == ["--cost-model", f"{ROOT}/configs/megatron/cost/tiny-cpu4.yaml"]
    r = run(ROOT / "scripts/run_local.sh", "--dry-run", "--pp", "two")
    assert r.returncode == 2 and "--pp must be a positive integer" in r.stderr


def test_run_local_refuses_an_unpatched_checkout(tmp_path):
    r = run(ROOT / "scripts/run_local.sh", "--megatron", tmp_path, env={"PYTHON": "false"})
    assert r.returncode == 2 and "not a Megatron-LM checkout" in r.stderr


# What the sbatch scripts read from the environment, blank (unset for them) unless a test sets it.
SLURM_ENV = ("SLURM_NNODES", "SLURM_GPUS_ON_NODE", "SLURM_SUBMIT_DIR", "SLURM_JOB_NAME", "SLURM_JOB_ID",
             "SLURM_RESTART_COUNT", "SLURM_CPUS_PER_TASK",
             "SLURM_JOB_NODELIST", "GPUS_PER_NODE", "CONTAINER_IMAGE", "CONTAINER_MOUNTS", "MEGATRON_EXT_DIR")


def sbatch_dry_run(mode: str, *args, env=None, cwd=ROOT):
    return run(ROOT / f"scripts/slurm/{mode}.sbatch", "--dry-run", *args, cwd=cwd,
               env={**dict.fromkeys(SLURM_ENV, ""), **(env or {})})


def srun_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("srun "))


def test_flexsp_sbatch_dry_run():
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args", "h100-80g-8x4", "--", "--mock-data",
                       env={"MEGATRON_LM_DIR": "/opt/Megatron-LM", "NCCL_SOCKET_IFNAME": "ib0"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "# flexsp: gpt-7b on h100-80g-8x4 (4 nodes x 8 GPUs)" in out
    for line in ("export NCCL_DEBUG=WARN", "export TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                 "export CUDA_DEVICE_MAX_CONNECTIONS=1", "export NCCL_SOCKET_IFNAME=ib0", f"export PYTHONPATH={ROOT}"):
        assert line in out
    cmd = srun_line(out)
    assert cmd.startswith("srun --nodes=4 --ntasks-per-node=1 ")
    assert "-m torch.distributed.run --nnodes=4 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=" in cmd
    assert "-m megatron_ext.megatron.launch /opt/Megatron-LM/pretrain_gpt.py --num-layers 32" in cmd
    assert cmd.count("--flexsp") == 1 and "--cost-model gpt-7b:h100-80g-8x4:1" in cmd
    assert "--distributed-backend nccl" in cmd and "--mock-data" in cmd
    assert "--container-image" not in cmd


def test_sbatch_saves_before_the_time_limit_and_resumes(tmp_path):
    """The ranks get Megatron's exit signal (torchrun starts with it ignored), checkpoints go to
    the submit directory and are loaded back from there, unless the arguments say otherwise."""
    env = {"SLURM_SUBMIT_DIR": "/elsewhere", "SLURM_JOB_NAME": "run7", "MEGATRON_LM_DIR": "/opt/Megatron-LM",
           "MEGATRON_EXT_DIR": str(ROOT)}
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args", "h100-80g-8x4", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(srun_line(r.stdout))
    ckpt = str(tmp_path / "checkpoints/run7")
    assert cmd[-9:] == ["--save", ckpt, "--load", ckpt, "--save-interval", "1000", "--exit-signal-handler",
                         "--exit-signal", "SIGUSR1"]
    wrapper = cmd.index("bash")
    assert cmd[wrapper + 1:wrapper + 4] == ["-c", 'trap "" "$0" && exec "$@"', "SIGUSR1"]
    assert cmd[wrapper + 5:wrapper + 7] == ["-m", "torch.distributed.run"]
    assert f"# in {tmp_path}: checkpoints {ckpt}; 300 s before the time limit" in r.stdout
    assert "\ncd " not in r.stdout  # it runs where it was submitted, not in megatron_ext's checkout

    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args", "h100-80g-8x4", "--", "--save", "ckpt",
                       "--save-interval", "50", "--exit-signal", "SIGUSR2", env=env, cwd=tmp_path)
    cmd = shlex.split(srun_line(r.stdout))
    assert cmd.count("--save") == 1 and cmd[cmd.index("--load") + 1] == "ckpt"
    assert cmd.count("--save-interval") == 1 and cmd.count("--exit-signal") == 1
    assert cmd[cmd.index("bash") + 3] == "SIGUSR2"
    # torchrun handles SIGTERM and SIGINT itself: it would stop the ranks before they save
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args", "h100-80g-8x4", "--", "--exit-signal", "SIGTERM",
                       env=env, cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == "" and "--exit-signal SIGTERM: use SIGUSR1 or SIGUSR2" in r.stderr
    # a job's checkpoints are its own (a requeued job keeps its id), and srun gets sbatch's CPUs a task
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args", "h100-80g-8x4",
                       env={**env, "SLURM_JOB_ID": "812", "SLURM_CPUS_PER_TASK": "64"}, cwd=tmp_path)
    cmd = shlex.split(srun_line(r.stdout))
    assert cmd[cmd.index("--save") + 1] == str(tmp_path / "checkpoints/run7-812")
    assert cmd[:4] == ["srun", "--nodes=4", "--ntasks-per-node=1", "--cpus-per-task=64"]
    # a job begun from another's --load goes on, once requeued, from its own saves
    own = tmp_path / "checkpoints/run7-812"
    for restarts, saved, load in (("0", True, "old"), ("1", False, "old"), ("1", True, str(own))):
        if saved:
            own.mkdir(parents=True, exist_ok=True)
            (own / "latest_checkpointed_iteration.txt").write_text("100\n")
        r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args", "h100-80g-8x4", "--", "--load", "old",
                           env={**env, "SLURM_JOB_ID": "812", "SLURM_RESTART_COUNT": restarts}, cwd=tmp_path)
        cmd = shlex.split(srun_line(r.stdout))
        assert cmd.count("--load") == (2 if restarts == "1" and saved else 1)
        assert cmd[len(cmd) - cmd[::-1].index("--load")] == load, (restarts, saved)  # (the last one counts)
        if (own / "latest_checkpointed_iteration.txt").exists():
            (own / "latest_checkpointed_iteration.txt").unlink()


def test_sbatch_container_image(tmp_path):
    """The job's directory (sbatch --chdir's, not SLURM_SUBMIT_DIR) is mounted and worked in; the
    batch host needs no Python environment for a cluster preset (its name says its shape)."""
    env = {"SLURM_SUBMIT_DIR": "/runs/a", "MEGATRON_LM_DIR": "/opt/Megatron-LM", "MEGATRON_EXT_DIR": str(ROOT),
           "PYTHON": "false"}
    r = sbatch_dry_run("flexsp", "--container-image", "nvcr.io/nvidia/pytorch:25.01-py3",
                       "configs/megatron/gpt-7b.args", "h100-80g-8x4", env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    cmd = shlex.split(srun_line(r.stdout))
    at = cmd.index("--kill-on-bad-exit=1") + 1
    assert cmd[at:at + 4] == ["--container-image=nvcr.io/nvidia/pytorch:25.01-py3",
                              f"--container-mounts={tmp_path}:{tmp_path},{ROOT}:{ROOT},/opt/Megatron-LM:/opt/Megatron-LM",
                              f"--container-workdir={tmp_path}", "bash"]
    assert cmd[cmd.index("torch.distributed.run") - 2] == "python3"  # the image's interpreter
    r = sbatch_dry_run("elastic_pp", "configs/megatron/llama-7b.args", "a800-80g-8x4",
                       env={**env, "CONTAINER_IMAGE": "img.sqsh", "CONTAINER_MOUNTS": "/data:/data"}, cwd=tmp_path)
    cmd = shlex.split(srun_line(r.stdout))
    assert "--container-image=img.sqsh" in cmd
    assert any(a.startswith("--container-mounts=") and a.endswith(",/data:/data") for a in cmd)
    r = sbatch_dry_run("flexsp", "--container-image")
    assert r.returncode == 2 and "--container-image needs an image" in r.stderr


def test_elastic_pp_sbatch_dry_run():
    r = sbatch_dry_run("elastic_pp", "configs/megatron/llama-7b.args", "a800-80g-8x4")
    assert r.returncode == 0, r.stderr
    cmd = srun_line(r.stdout)
    assert "--elastic-pp" in cmd and "--flexsp" not in cmd and "--plan-ahead 1" in cmd
    assert cmd.split().count("--pipeline-model-parallel-size") == 2 and "--distributed-backend nccl" in cmd
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
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args", "h100-80g-8x4",
                       env={"SLURM_NNODES": "4", "SLURM_GPUS_ON_NODE": "4"})
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1
    assert "the allocation (4 nodes x 4 GPUs) is not the cluster h100-80g-8x4 (4 x 8): sbatch --nodes=4 " \
           "--gpus-per-node=8" in r.stderr
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args")
    assert r.returncode == 2 and "MODEL_ARGS CLUSTER" in r.stderr
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7B.args", "h100-80g-8x4")  # (a misspelt file was ignored)
    assert r.returncode == 2 and r.stdout == "" and "no argument file" in r.stderr and "gpt-7B.args" in r.stderr
    r = sbatch_dry_run("flexsp", "configs/megatron/gpt-7b.args", "h100-80g")
    assert r.returncode == 2 and r.stderr.startswith("flexsp.sbatch: unknown cluster preset 'h100-80g'")
    assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


def test_sbatch_headers():
    for mode in ("flexsp", "elastic_pp"):
        text = (ROOT / f"scripts/slurm/{mode}.sbatch").read_text()
        directives = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
        assert "#SBATCH --ntasks-per-node=1" in directives and any("--gpus-per-node" in d for d in directives)
        # requeued after saving before the time limit, its log appended to (same job id, same file)
        for line in ("#SBATCH --requeue", "#SBATCH --signal=B:USR1@300", "#SBATCH --open-mode=append"):
            assert line in directives
        body = text.split("\n")
        first_code = next(i for i, ln in enumerate(body) if ln.strip() and not ln.startswith("#"))
        assert all(i < first_code for i, ln in enumerate(body) if ln.startswith("#SBATCH"))


FAKE_SLURM = {  # stand-ins for Slurm's commands, logging to $FAKE_LOG
    "srun": 'echo "srun $$" >> "$FAKE_LOG"\n'
            'trap \'echo "ranks saved" >> "$FAKE_LOG"; exit 0\' USR1\n'  # Megatron's handler: save, exit
            'for _ in $(seq "$FAKE_SRUN_TICKS"); do sleep 0.1; done\nexit "$FAKE_SRUN_STATUS"\n',
    "scancel": 'echo "scancel $*" >> "$FAKE_LOG"\nkill -USR1 "$(awk \'/^srun/ {print $2}\' "$FAKE_LOG")"\n',
    "scontrol": 'if [[ $1 == show ]]; then echo node1; else echo "scontrol $*" >> "$FAKE_LOG"; fi\n',
}


@needs_patch
@pytest.mark.parametrize("stopped", [True, False])
def test_sbatch_passes_the_signal_on_and_requeues(tmp_path, stopped):
    """Not a dry run, with stand-ins for srun, scancel and scontrol: SIGUSR1 to the batch script
    reaches the ranks (scancel) and, once they exit cleanly, requeues the job; a run that ends on
    its own (here failing) is not requeued."""
    import signal
    import time

    mlm = stand_in_checkout(tmp_path / "mlm")
    assert run(ROOT / "scripts/apply_patches.sh", mlm).returncode == 0
    fake = tmp_path / "bin"
    fake.mkdir()
    for name, body in FAKE_SLURM.items():
        (fake / name).write_text("#!/bin/bash\n" + body)
        (fake / name).chmod(0o755)
    log = tmp_path / "slurm.log"
    env = {**os.environ, **dict.fromkeys(SLURM_ENV, ""), "PATH": f"{fake}:{os.environ['PATH']}",
           "FAKE_LOG": str(log), "MEGATRON_LM_DIR": str(mlm), "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node1",
           "SLURM_SUBMIT_DIR": str(tmp_path), "FAKE_SRUN_STATUS": "3", "FAKE_SRUN_TICKS": "100" if stopped else "1",
           "MEGATRON_EXT_DIR": str(ROOT),
           "CHECK_ARGS": "0"}  # (the stand-in checkout has no Megatron-LM to check the arguments with)
    proc = subprocess.Popen(["bash", str(ROOT / "scripts/slurm/flexsp.sbatch"), "configs/megatron/gpt-7b.args",
                             "h100-80g-8x4"], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    if stopped:
        deadline = time.monotonic() + 60
        while not (log.exists() and "srun" in log.read_text()):
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGUSR1)  # what #SBATCH --signal=B:USR1@300 sends
    out, err = proc.communicate(timeout=60)
    lines = log.read_text().splitlines()
    if stopped:
        assert proc.returncode == 0, err
        assert lines[1:] == ["scancel --signal=SIGUSR1 42", "ranks saved", "scontrol requeue 42"]
        assert f"saved a checkpoint in {tmp_path}/checkpoints/megatron-ext-flexsp-42 before the time limit" in out
    else:
        assert proc.returncode == 3 and len(lines) == 1 and lines[0].startswith("srun ")


def test_gpu_smoke_refuses_without_cuda():
    import sys

    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the smoke test would run")
    done = subprocess.run(["bash", str(ROOT / "scripts/gpu_smoke.sh"), "--python", sys.executable],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "no CUDA GPU here" in done.stderr, done.stderr

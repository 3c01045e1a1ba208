"""Megatron-LM's own pretrain_gpt.py, patched, training with --flexsp and --elastic-pp on 2-4 CPU
ranks (gloo).

Needs a Megatron-LM checkout at tag core_v0.16.1: set MEGATRON_LM_DIR to it (skipped otherwise).
The checkout is not modified: the tests copy its Python sources twice into a temporary
directory, one copy patched with scripts/apply_patches.sh and one unpatched, and run both through
``megatron_ext.megatron.launch`` under torchrun.

- --flexsp with --mock-data, and with a weighted blend of real indexed datasets (.bin/.idx
  written with megatron_ext.data.datasets.write_indexed_dataset) as its train split and a
  validation split of its own, trains: losses are finite and fall, every step is planned and
  holds the blend's documents, the planner log has one record per step;
- --elastic-pp with 2 pipeline stages of SP degree 2 (4 ranks, through run_local.sh --pp 2)
  trains on mock data with sequences cut into slices, and evaluates;
- a --flexsp run resumed on another GPU count, where it would cut documents otherwise, is refused;
- a --flexsp run resumed from its checkpoint (--load) reports the uninterrupted run's training
  and validation losses (validation goes on where it stopped);
- the patched script with --flexsp, on a cost model that makes it mix SP degrees 1 and 2 in a
  step, reports the same loss and grad norm at the first iterations
  as the *unpatched* script with static settings (Megatron's GPT dataset, data parallelism,
  --micro-batch-size 1) on the same data and seed (``equivalence_runs``, below): the same token
  sequences in every global batch, per-document attention and loss in both; and so does
  --elastic-pp against the unpatched script's 1F1B pipeline with the same pipeline size
  (``elastic_equivalence_runs``), one pipeline of SP 2 and, with --elastic-pp-sp 1, 2 pipeline
  replicas of SP 1;
- conflicts stop at argument parsing with their one-line explanation ``megatron-ext: error: ...``;
  through run_local.sh before any rank starts, that line last, status 2.

``python tests/e2e/test_megatron_lm.py`` runs the equivalence measurement and prints its table.
"""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MEGATRON_LM_DIR = os.environ.get("MEGATRON_LM_DIR")
COST_2 = str(ROOT / "configs/megatron/cost/tiny-cpu2.yaml")
COST_4 = str(ROOT / "configs/megatron/cost/tiny-cpu4.yaml")

pytestmark = pytest.mark.skipif(not MEGATRON_LM_DIR,
                                reason="set MEGATRON_LM_DIR to a Megatron-LM checkout at tag core_v0.16.1")
# what megatron/training imports beyond megatron-core (setup.py's megatron-lm extra)
MISSING = [m for m in ("six", "regex", "pydantic", "pybind11") if importlib.util.find_spec(m) is None]


@pytest.fixture(autouse=True, scope="module")
def megatron_lm_requirements():
    if MISSING:  # (one line each, not a rank's traceback from deep inside the launch)
        pytest.fail(f"Megatron-LM's training needs {', '.join(MISSING)}: pip install -e '.[megatron-lm]'",
                    pytrace=False)

VOCAB = 2047  # NullTokenizer: ids 0..2046, <eod> = 2047
# The tiny model of megatron_ext/presets/models/tiny.yaml, fp32, no dropout (dropout masks depend
# on the layout).
MODEL_ARGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
              "--num-query-groups", "4", "--ffn-hidden-size", "256", "--position-embedding-type", "rope",
              "--hidden-dropout", "0", "--attention-dropout", "0", "--tokenizer-type", "NullTokenizer",
              "--vocab-size", str(VOCAB), "--micro-batch-size", "1", "--lr", "1e-3", "--lr-decay-style", "constant",
              "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--split", "100,0,0",
              "--seed", "1234"]

ITERATION = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+) \|.*?grad norm: ([0-9.]+) \|")


# ---- the checkouts ---------------------------------------------------------------------------------
def _copy_sources(src: Path, dst: Path) -> None:
    """What pretrain_gpt.py needs: the megatron package and the three top-level modules."""
    dst.mkdir(parents=True)
    for name in ("pretrain_gpt.py", "gpt_builders.py", "model_provider.py"):
        shutil.copy2(src / name, dst / name)
    shutil.copytree(src / "megatron", dst / "megatron", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))


def prepare_checkouts(src: Path, work: Path) -> tuple[Path, Path]:
    """(unpatched, patched) copies of the checkout's sources, whatever state the checkout is in."""
    script = ROOT / "scripts/apply_patches.sh"
    unpatched, patched = work / "unpatched", work / "patched"
    for dst in (unpatched, patched):
        _copy_sources(src, dst)
    subprocess.run(["bash", str(script), "--reverse", str(unpatched)], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["bash", str(script), str(patched)], check=True, stdout=subprocess.DEVNULL)
    return unpatched, patched


@pytest.fixture(scope="module")
def checkouts(tmp_path_factory):
    return prepare_checkouts(Path(MEGATRON_LM_DIR), tmp_path_factory.mktemp("megatron-lm"))


# ---- running pretrain_gpt.py -----------------------------------------------------------------------
def run_pretrain(checkout: Path, args: list[str], nproc: int = 2, timeout: float = 900.0) -> dict:
    """torchrun NPROC ranks of megatron_ext.megatron.launch CHECKOUT/pretrain_gpt.py ARGS; returns
    {"returncode", "output", "iterations": {i: (loss, grad_norm)}}."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "megatron_ext.megatron.launch", str(checkout / "pretrain_gpt.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", MEGATRON_EXT_DEVICE_CHECK="1")
    proc = subprocess.run(cmd, env=env, cwd=checkout, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    iterations = {int(m[1]): (float(m[2]), float(m[3])) for m in ITERATION.finditer(proc.stdout)}
    return {"returncode": proc.returncode, "output": proc.stdout, "iterations": iterations}


def _ok(run: dict, iters: int) -> dict:
    assert run["returncode"] == 0, run["output"][-6000:]
    assert sorted(run["iterations"]) == list(range(1, iters + 1)), run["output"][-6000:]
    return run["iterations"]


def _random_docs(n: int, seed: int, lo: int, hi: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    docs = []
    for length in rng.integers(lo, hi, n):
        d = rng.integers(0, VOCAB, int(length))
        d[-1] = VOCAB  # <eod>
        docs.append(d)
    return docs


# ---- the equivalence data ----------------------------------------------------------------------
def equivalence_data(work: Path, seq_len: int, per_sample: int, num_samples: int, seed: int = 7):
    """Documents for both runs. Megatron's GPT dataset cuts a token stream into samples of
    ``seq_len`` tokens; here every indexed "document" of the static run is exactly one sample made
    of ``per_sample`` real documents, each ending in <eod>, so with --reset-attention-mask
    --reset-position-ids --eod-mask-loss each real document is attended to and scored on its own:
    the same function FlexSP computes on the real documents as separate sequences.
    Returns (static prefix, the real documents of each static sample)."""
    from megatron_ext.data.datasets import write_indexed_dataset

    rng = np.random.default_rng(seed)
    samples, parts = [], []
    for _ in range(num_samples):
        cuts = np.sort(rng.choice(np.arange(16, seq_len - 15), per_sample - 1, replace=False))
        lengths = np.diff(np.concatenate([[0], cuts, [seq_len]]))
        docs = []
        for n in lengths:
            d = rng.integers(0, VOCAB, int(n))
            d[-1] = VOCAB
            docs.append(d)
        parts.append(docs)
        samples.append(np.concatenate(docs))
    prefix = write_indexed_dataset(work / "static", samples)
    return prefix, parts


def static_sample_order(cache_dir: Path, num: int) -> list[int]:
    """Which static document each of the first ``num`` training samples of Megatron's GPT dataset
    is, read from the index files it cached (document, sample and shuffle index)."""
    def one(affix):
        found = glob.glob(str(cache_dir / f"*-GPTDataset-train-{affix}.npy"))
        assert len(found) == 1, (affix, found)
        return np.load(found[0], allow_pickle=True)

    doc_index, sample_index, shuffle_index = one("document_index"), one("sample_index"), one("shuffle_index")
    order = []
    for j in range(num):
        pos, offset = sample_index[shuffle_index[j]]
        assert offset == 0, "a static sample does not start at a document boundary"
        order.append(int(doc_index[pos]))
    return order


def planned_dataset(work: Path, parts, order: list[int], batch: int, per_sample: int, seed: int, seq_len: int) -> str:
    """The real documents, placed so that the planned runs' step k (``batch * per_sample``
    documents) holds exactly the documents of the static run's step k (``batch`` samples): the
    planning data loader's batches depend on the data, seed, batch size and length cap only."""
    from megatron_ext.data.datasets import InMemoryDocuments, write_indexed_dataset
    from megatron_ext.data.loader import PlanningDataLoader
    from megatron_ext.megatron.cost import load_cost_model

    docs = [d for sample in parts for d in sample]
    n = len(docs)
    cost = load_cost_model(COST_2, zero_stage=0)  # the planned runs' stage: plain DDP (no --use-distributed-optimizer)
    probe = PlanningDataLoader(InMemoryDocuments([np.zeros(2, np.int64)] * n), cost, batch * per_sample, seed=seed,
                               max_seq_len=seq_len, background=False)
    slots: list = [None] * n
    used = set()
    for k in range(len(order) // batch):
        wanted = [d for s in order[k * batch:(k + 1) * batch] for d in parts[s]]
        assert not used.intersection(order[k * batch:(k + 1) * batch]), "a static sample repeats"
        used.update(order[k * batch:(k + 1) * batch])
        for slot, d in zip(probe.batch_sample_ids(k), wanted):
            slots[int(slot)] = d
    rest = iter(d for s in range(len(parts)) if s not in used for d in parts[s])
    slots = [s if s is not None else next(rest) for s in slots]
    return write_indexed_dataset(work / "planned", slots)


def mixed_degree_cost_model(work: Path, tokens_at_degree_1: int = 470) -> str:
    """tiny-cpu2.yaml with memory for ``tokens_at_degree_1`` tokens of activations a rank beside
    plain DDP's model states: the equivalence data's documents (up to 496 tokens) longer than that
    need a group of degree 2, shorter ones fit at degree 1, so the planner mixes degrees in a step.
    (tiny-cpu2.yaml itself holds about 1,700 tokens a rank: every such document, and whole steps,
    at degree 1.)"""
    import yaml

    from megatron_ext.megatron.cost import load_cost_model

    cost = load_cost_model(COST_2, zero_stage=0)
    spec = yaml.safe_load(Path(COST_2).read_text())
    spec["cluster"]["memory_gb"] = (cost.model_states_mb + tokens_at_degree_1 * cost.model.act_mb_per_token) / 1024
    path = work / f"tiny-cpu2-{tokens_at_degree_1}-tokens.yaml"
    path.write_text(yaml.safe_dump(spec))
    assert load_cost_model(str(path), zero_stage=0).token_capacity(1) == tokens_at_degree_1
    return str(path)


def static_and_planned(unpatched: Path, work: Path, iters: int, batch: int, per_sample: int, seq_len: int,
                       seed: int, static_extra: tuple = (), nproc: int = 2):
    """The equivalence data, the unpatched static run on it (``static_extra`` added) and the
    planned runs' dataset. Returns (static args, planned args without a mode flag, static
    iterations)."""
    work.mkdir(parents=True, exist_ok=True)
    prefix, parts = equivalence_data(work, seq_len, per_sample, iters * batch + 8)
    common = MODEL_ARGS + ["--seq-length", str(seq_len), "--max-position-embeddings", str(seq_len),
                           "--train-iters", str(iters), "--calculate-per-token-loss", "--use-cpu-initialization"]
    cache = work / "cache"
    static_args = common + ["--global-batch-size", str(batch), "--data-path", prefix, "--data-cache-path", str(cache),
                            "--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"]
    static = _ok(run_pretrain(unpatched, static_args + list(static_extra), nproc=nproc), iters)
    order = static_sample_order(cache, iters * batch)
    planned = planned_dataset(work, parts, order, batch, per_sample, seed, seq_len)
    return static_args, common + ["--global-batch-size", str(batch * per_sample), "--data-path", planned], static


def equivalence_runs(unpatched: Path, patched: Path, work: Path, iters: int = 3, batch: int = 4,
                     per_sample: int = 2, seq_len: int = 512, seed: int = 1234, tp2: bool = True) -> dict:
    """Runs on the same token sequences: the unpatched script (static: GPT dataset, plain data
    parallelism on 2 ranks), the patched one with --flexsp (planner flexsp, on a cost model whose
    memory makes it mix SP degrees 1 and 2: ``mixed_degree_cost_model``), with --flexsp
    --flexsp-planner static_ulysses --flexsp-static-degree 2 (every sequence split over both
    ranks), with --flexsp --flexsp-planner auto (FlexSP or one-stage pipeline replicas per step)
    and, with ``tp2``, the unpatched and the --flexsp runs again on 4 ranks with
    --tensor-model-parallel-size 2. All
    initialize on the CPU (--use-cpu-initialization), so TP ranks hold slices of the same weights.
    Returns {"iterations": {name: {iteration: (loss, grad norm)}}, "reference": {name: the static
    run it must match}, "plans": [flexsp records]}."""
    static_args, planned, static = static_and_planned(unpatched, work, iters, batch, per_sample, seq_len, seed)
    out = {"static (unpatched)": static}
    flex_common = planned + ["--flexsp", "--cost-model", mixed_degree_cost_model(work)]
    flex = run_pretrain(patched, flex_common + ["--planner-log", str(work / "plans.jsonl")])
    out["flexsp (patched)"] = _ok(flex, iters)
    ulysses = run_pretrain(patched, flex_common + ["--flexsp-planner", "static_ulysses", "--flexsp-static-degree", "2"])
    out["static Ulysses SP=2 (patched)"] = _ok(ulysses, iters)
    auto = run_pretrain(patched, flex_common + ["--flexsp-planner", "auto", "--planner-log", str(work / "auto.jsonl")])
    out["flexsp auto (patched)"] = _ok(auto, iters)
    # barrier-free timelines, degree-2 groups as Ulysses 1 x ring 2 (K/V passed between the ranks)
    # (memory for 250 tokens a rank: the longer documents need a group of 2)
    ring = run_pretrain(patched, planned + ["--flexsp", "--cost-model", mixed_degree_cost_model(work, 250),
                                            "--flexsp-planner", "timelines", "--flexsp-max-sp-size", "1",
                                            "--flexsp-max-ring", "2", "--planner-log", str(work / "ring.jsonl")])
    out["timelines, ring 2 (patched)"] = _ok(ring, iters)
    reference = {name: "static (unpatched)" for name in out}
    if tp2:  # Megatron initializes TP=2 weights differently from TP=1: compare with its own TP=2 run
        tp_args = ["--tensor-model-parallel-size", "2"]
        out["static TP=2 (unpatched)"] = _ok(run_pretrain(unpatched, static_args + tp_args, nproc=4), iters)
        out["flexsp TP=2 (patched)"] = _ok(run_pretrain(patched, flex_common + tp_args, nproc=4), iters)
        reference["static TP=2 (unpatched)"] = reference["flexsp TP=2 (patched)"] = "static TP=2 (unpatched)"
    plans = [json.loads(line) for line in (work / "plans.jsonl").read_text().splitlines()]
    auto_plans = [json.loads(line) for line in (work / "auto.jsonl").read_text().splitlines()]
    ring_plans = [json.loads(line) for line in (work / "ring.jsonl").read_text().splitlines()]
    return {"iterations": out, "reference": reference, "plans": plans, "auto_plans": auto_plans,
            "ring_plans": ring_plans}


ELASTIC_SP2, ELASTIC_REPLICAS = "elastic-pp PP=2 SP=2 (patched)", "elastic-pp PP=2 2 replicas x SP=1 (patched)"
ELASTIC_AUTO = "elastic-pp PP=2 SP auto (patched)"


def elastic_equivalence_runs(unpatched: Path, patched: Path, work: Path, iters: int = 3, batch: int = 4,
                             per_sample: int = 1, seq_len: int = 2048, seed: int = 1234) -> dict:
    """Runs on the same token sequences, 4 ranks, --pipeline-model-parallel-size 2 in all (Megatron
    seeds each stage's weights by its pipeline rank, so a pipeline has its own static reference):
    the unpatched script's 1F1B over micro-batches of one sample with data parallelism 2, the
    patched one with --elastic-pp, each stage's 2 ranks one Ulysses group, with --elastic-pp
    --elastic-pp-sp 1, 2 pipeline replicas of SP 1 side by side, each on its share of the
    documents, and with --elastic-pp-sp auto, either per step. Documents of ``seq_len`` tokens (one a sample), long enough for the planner to cut
    them into slices. Same result shape as ``equivalence_runs``; "plans" maps each elastic run to its
    planner-log records."""
    pp = ["--pipeline-model-parallel-size", "2"]
    _, planned, static = static_and_planned(unpatched, work, iters, batch, per_sample, seq_len, seed, tuple(pp),
                                            nproc=4)
    out, plans = {"static PP=2 (unpatched)": static}, {}
    for name, extra in ((ELASTIC_SP2, []), (ELASTIC_REPLICAS, ["--elastic-pp-sp", "1"]),
                        (ELASTIC_AUTO, ["--elastic-pp-sp", "auto"])):
        log = work / f"plans-{len(plans)}.jsonl"
        run = run_pretrain(patched, planned + pp + ["--elastic-pp", "--cost-model", COST_4, "--planner-log", str(log),
                                                    *extra], nproc=4)
        out[name] = _ok(run, iters)
        plans[name] = [json.loads(line) for line in log.read_text().splitlines()]
    return {"iterations": out, "reference": {name: "static PP=2 (unpatched)" for name in out}, "plans": plans}


def assert_same_as_reference(result: dict) -> None:
    runs = result["iterations"]
    for name, its in runs.items():
        static = runs[result["reference"][name]]
        for i, (loss, grad) in its.items():
            assert loss == pytest.approx(static[i][0], rel=2e-5), (name, i, its, static)
            assert grad == pytest.approx(static[i][1], abs=2e-3), (name, i, its, static)


def _load_checkpoint(save_dir: Path, iteration: int) -> dict:
    """Rank 0's state of a --ckpt-format torch checkpoint (it holds the run's args and FLOPs count)."""
    import torch

    return torch.load(save_dir / f"iter_{iteration:07d}" / "mp_rank_00" / "model_optim_rng.pt", map_location="cpu",
                      weights_only=False)


def megatron_flops(checkout: Path, args, batches: list) -> list[float]:
    """Megatron's own num_floating_point_operations for each batch of document lengths (each
    document a sample of its length), run in a process of its own on the checkout's sources."""
    import pickle
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "in.pkl"
        data.write_bytes(pickle.dumps((args, [[int(s) for s in b] for b in batches])))
        code = ("import copy, pickle, sys\n"
                "from megatron_ext.megatron.launch import prepare_cpu\n"
                "prepare_cpu()\n"
                "from megatron.training.training import num_floating_point_operations as count\n"
                "args, batches = pickle.loads(open(sys.argv[1], 'rb').read())\n"
                "out = []\n"
                "for lengths in batches:\n"
                "    total = 0.0\n"
                "    for s in lengths:\n"
                "        one = copy.copy(args)\n"
                "        one.seq_length = s\n"
                "        total += count(one, 1)\n"
                "    out.append(total)\n"
                "print(repr(out))\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(checkout), str(ROOT)]), PYTHONWARNINGS="ignore")
        proc = subprocess.run([sys.executable, "-c", code, str(data)], env=env, cwd=checkout, capture_output=True,
                              text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [float(x) for x in proc.stdout.strip().splitlines()[-1].strip("[]").split(",")]


# ---- tests -----------------------------------------------------------------------------------------
def _check_planner_trace(path, iterations: int) -> None:
    """--planner-trace: every training iteration, planned (process 1) and measured (process 2) on
    the same tracks, each measured slice one the plan has (a recompute is timed in its backward)."""
    events = json.loads(path.read_text())["traceEvents"]
    assert sorted(e["name"] for e in events if e["ph"] == "i") == [f"step {k}" for k in range(1, iterations + 1)]
    tracks = {pid: {e["tid"] for e in events if e["ph"] == "M" and e["pid"] == pid and e["name"] == "thread_name"}
              for pid in (1, 2)}
    assert tracks[1] and tracks[1] == tracks[2]
    planned = {(e["tid"], e["name"]) for e in events if e["ph"] == "X" and e["pid"] == 1}
    measured = {(e["tid"], e["name"]) for e in events if e["ph"] == "X" and e["pid"] == 2}
    assert measured and measured <= planned


def _assert_at_uniform_floor(its: dict) -> None:
    """Mock data is uniform random tokens: nothing to learn, so every iteration's loss sits at the
    entropy of the uniform distribution over the padded vocabulary, ln(2048), from the first step on
    (whether one step's loss is below another's is chance; the exactness tests above compare losses
    and gradients). A loss summed instead of averaged over tokens or ranks, or logits over the
    wrong vocabulary, move it away."""
    floor = np.log(-(-(VOCAB + 1) // 128) * 128)
    assert all(abs(loss - floor) < 0.1 for loss, _ in its.values()), (floor, its)


def test_flexsp_trains_on_mock_data(checkouts, tmp_path):
    _, patched = checkouts
    log = tmp_path / "plans.jsonl"
    run = run_pretrain(patched, MODEL_ARGS + [
        "--seq-length", "1024", "--max-position-embeddings", "1024", "--global-batch-size", "8",
        "--train-iters", "4", "--mock-data", "--flexsp", "--cost-model", COST_2, "--planner-log", str(log),
        "--planner-trace", str(tmp_path / "trace.json"),
        "--attention-dropout", "0.1"])  # (Megatron-LM's default: each SP rank draws its own masks)
    its = _ok(run, 4)
    _check_planner_trace(tmp_path / "trace.json", 4)
    assert all(np.isfinite(loss) and loss > 0 for loss, _ in its.values())
    _assert_at_uniform_floor(its)
    assert "flexsp iteration        1 | plan" in run["output"]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert all(r["plan"]["kind"] == "flexsp" and r["step_time_s"] > 0 for r in records)
    assert any(len(g["ranks"]) > 1 for r in records for mb in r["plan"]["micro_batches"] for g in mb["groups"])
    assert any(r["plan_source"] == "planner" for r in records)
    # `megatron-ext report` reads the planner log: the cost model's error over the run
    from megatron_ext.commands.report import fidelity, load_run, report_table

    f = fidelity(load_run(log))
    assert f["steps"] == 3 and f["micro_batch_median_abs_error"] is not None and f["layouts"]
    assert report_table(load_run(log)).startswith(f"{records[0]['planner']}: 3 steps (the first is left out)")


def test_flexsp_trains_on_a_blend_of_indexed_datasets_with_4_ranks(checkouts, tmp_path):
    """A weighted blend as the train split (--train-data-path 0.25 LONG 0.75 SHORT) and a
    validation split of its own (--valid-data-path SHORT): each step holds the documents
    GlobalBatches gives, a quarter of them from LONG; validation runs planned steps."""
    from megatron_ext.data.batches import GlobalBatches
    from megatron_ext.data.datasets import IndexedDocuments, write_indexed_dataset

    _, patched = checkouts
    long = write_indexed_dataset(tmp_path / "long", _random_docs(60, 3, 1200, 1900))
    short = write_indexed_dataset(tmp_path / "short", _random_docs(300, 4, 8, 400))
    i = MODEL_ARGS.index("--split")
    no_split = MODEL_ARGS[:i] + MODEL_ARGS[i + 2:]  # per-split paths take no --split (as in Megatron)
    run = run_pretrain(patched, no_split + [
        "--seq-length", "2048", "--max-position-embeddings", "2048", "--global-batch-size", "16",
        "--train-iters", "3", "--train-data-path", "0.25", long, "0.75", short, "--valid-data-path", short,
        "--eval-iters", "1", "--eval-interval", "3", "--flexsp", "--cost-model", COST_4,
        "--save", str(tmp_path / "ckpt"), "--save-interval", "3", "--ckpt-format", "torch"], nproc=4)
    its = _ok(run, 3)
    assert all(np.isfinite(loss) for loss, _ in its.values())
    degrees = set(re.findall(r"groups \(degree x count\) ([0-9x ]+) \|", run["output"]))
    assert degrees, run["output"][-3000:]
    assert f"660 documents (train 0.25 x {long} + 0.75 x {short}, valid {short}), split [360, 300, 0]" \
        in run["output"], run["output"][-3000:]
    assert "validation loss at iteration 3" in run["output"], run["output"][-3000:]
    ref = GlobalBatches(np.concatenate([IndexedDocuments(long).lengths, IndexedDocuments(short).lengths]), 16,
                        2048, 1234, source_sizes=[60, 300], weights=[0.25, 0.75])
    tokens = [int(t) for t in re.findall(r"16 seqs (\d+) tokens", run["output"])]
    assert tokens == [int(ref.batch_lengths(k).sum()) for k in range(3)], run["output"][-3000:]
    # Megatron's FLOPs count (its TFLOP/s/GPU line; checkpoints) is that of the documents each step
    # trained, each at its own length, not of 16 samples of --seq-length tokens
    saved = _load_checkpoint(tmp_path / "ckpt", 3)
    batches = [ref.batch_lengths(k) for k in range(3)]
    expected = megatron_flops(checkouts[0], saved["args"], batches)
    assert saved["num_floating_point_operations_so_far"] == pytest.approx(sum(expected), rel=1e-12)
    assert megatron_flops(checkouts[0], saved["args"], [[2048] * 16])[0] > 3 * max(expected)


VALIDATION = re.compile(r"validation loss at iteration (\d+)( on validation set)? \| lm loss value: ([0-9.Ee+-]+)")


def test_flexsp_resumes_training_and_validation_where_they_stopped(checkouts, tmp_path):
    """A run resumed from its iteration-2 checkpoint (torch_dist, Megatron's default format) reports
    the uninterrupted run's losses, validation included: Megatron counts the validation batches
    run (consumed_valid_samples, in the checkpoint) and the planned validation goes on from there,
    rather than scoring its first batches again."""
    _, patched = checkouts
    save = tmp_path / "ckpt"
    args = MODEL_ARGS + ["--seq-length", "1024", "--max-position-embeddings", "1024", "--global-batch-size", "8",
                         "--train-iters", "4", "--mock-data", "--flexsp", "--cost-model", COST_2, "--split", "90,10,0",
                         "--eval-iters", "1", "--eval-interval", "2"]
    whole = run_pretrain(patched, args + ["--save", str(save), "--save-interval", "2"])
    its = _ok(whole, 4)
    resumed = run_pretrain(patched, args + ["--load", str(save), "--ckpt-step", "2"])
    assert resumed["returncode"] == 0, resumed["output"][-6000:]
    assert sorted(resumed["iterations"]) == [3, 4], resumed["output"][-6000:]
    # (Megatron logs the first iteration after --load without resetting its loss sum, so its line at
    # iteration 4 averages iterations 3 and 4: only iteration 3 compares.)
    assert resumed["iterations"][3][0] == pytest.approx(its[3][0], rel=1e-6)
    # at iteration 4 (every 2) and after training: validation batches 1 and 2, in both runs
    validation = {run: [(int(m[1]), bool(m[2]), float(m[3])) for m in VALIDATION.finditer(out["output"])]
                  for run, out in (("whole", whole), ("resumed", resumed))}
    assert [v[:2] for v in validation["whole"]] == [(2, False), (4, False), (4, True)], validation
    assert [v[:2] for v in validation["resumed"]] == [(4, False), (4, True)], validation
    for (_, _, loss), (_, _, expected) in zip(validation["resumed"], validation["whole"][1:]):
        assert loss == pytest.approx(expected, rel=1e-6), validation


def test_flexsp_refuses_to_resume_cutting_documents_otherwise(checkouts, tmp_path):
    """Documents are cut at the longest sequence the run plans: --seq-length 8192 capped at what
    the largest SP group holds, on 2 ranks less than on 4. Resumed on 4 ranks, the run would cut
    (and so draw) other batches: it is refused in one line, naming both cuts."""
    _, patched = checkouts
    save = tmp_path / "ckpt"
    args = MODEL_ARGS + ["--seq-length", "8192", "--max-position-embeddings", "8192", "--global-batch-size", "8",
                         "--mock-data", "--flexsp", "--split", "100,0,0", "--eval-iters", "0", "--train-iters", "2"]
    # (stopped and saved after iteration 1, as a preempted run is)
    _ok(run_pretrain(patched, args + ["--cost-model", COST_2, "--save", str(save), "--save-interval", "1000",
                                      "--exit-interval", "1"]), 1)
    resumed = run_pretrain(patched, args + ["--cost-model", COST_4, "--load", str(save)], nproc=4)
    assert resumed["returncode"] != 0
    said = re.search(r"megatron-ext: error: --flexsp: the checkpoint's run cut documents into samples of at most "
                     r"([\d,]+) tokens, this one would cut them at ([\d,]+)", resumed["output"])
    assert said and int(said[1].replace(",", "")) < int(said[2].replace(",", "")) <= 8192, resumed["output"][-3000:]


def test_flexsp_auto_slices_what_no_group_holds(checkouts, tmp_path):
    """--flexsp-planner auto: documents longer than any FlexSP group of the 2 ranks holds (3,462
    tokens on tiny-cpu2 with plain DDP, ZeRO-0) train, as one-stage pipeline replicas that cut them
    into slices."""
    from megatron_ext.data.datasets import write_indexed_dataset

    _, patched = checkouts
    log = tmp_path / "plans.jsonl"
    prefix = write_indexed_dataset(tmp_path / "docs", _random_docs(200, 5, 4500, 6000))
    run = run_pretrain(patched, MODEL_ARGS + [
        "--seq-length", "6144", "--max-position-embeddings", "6144", "--global-batch-size", "4",
        "--train-iters", "2", "--data-path", prefix, "--flexsp", "--flexsp-planner", "auto", "--cost-model", COST_2,
        "--planner-log", str(log)])
    its = _ok(run, 2)
    assert all(np.isfinite(loss) and loss > 0 for loss, _ in its.values())
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["kind"], r["plan_source"]) for r in records] == [("elastic_pp", "planner")] * 2, records
    assert all(sum(p["sliced_chunks"] for p in r["pipelines"]) > 0 for r in records), records


def test_flexsp_matches_unpatched_static_settings(checkouts, tmp_path):
    unpatched, patched = checkouts
    result = equivalence_runs(unpatched, patched, tmp_path)
    assert_same_as_reference(result)
    # The flexsp run really was planned per step, and some step's groups had different SP degrees.
    assert all(r["plan_source"].endswith("planner") for r in result["plans"])
    assert any(len(r["groups_by_degree"]) > 1 for r in result["plans"]), [r["groups_by_degree"]
                                                                          for r in result["plans"]]
    # --flexsp-planner auto ran each step as the kind it planned (FlexSP, or one-stage pipeline replicas)
    for r in result["auto_plans"]:
        assert r["plan"]["kind"] == r["kind"] and r["kind"] in ("flexsp", "elastic_pp"), r
        if r["kind"] == "elastic_pp":
            assert {p["stages"] for p in r["pipelines"]} == {1} and r["replicas"] * r["pipelines"][0]["sp_degree"] == 2
    # the timelines run's plans were barrier-free, and some group ran as a ring
    assert all(r["plan"]["barrier_free"] for r in result["ring_plans"])
    assert any(g["ring"] == 2 for r in result["ring_plans"] for mb in r["plan"]["micro_batches"] for g in mb["groups"])


@pytest.fixture(scope="module")
def elastic_equivalence(checkouts, tmp_path_factory):
    unpatched, patched = checkouts  # 4 ranks on few cores: 2 iterations suffice
    return elastic_equivalence_runs(unpatched, patched, tmp_path_factory.mktemp("elastic"), iters=2)


def _assert_elastic_run_matches(result: dict, name: str) -> list[dict]:
    """``name``'s losses and grad norms are the static pipeline's, every step came from the
    planner; returns its planner-log records."""
    assert_same_as_reference({"iterations": {k: result["iterations"][k] for k in (name, "static PP=2 (unpatched)")},
                              "reference": result["reference"]})
    plans = result["plans"][name]
    assert [r["iteration"] for r in plans] == [1, 2]
    assert all(r["kind"] == "elastic_pp" and r["plan_source"].endswith("planner") for r in plans)
    return plans


def test_elastic_pp_matches_unpatched_static_pipeline(elastic_equivalence):
    plans = _assert_elastic_run_matches(elastic_equivalence, ELASTIC_SP2)
    assert all(r["replicas"] == 1 and {p["sp_degree"] for p in r["pipelines"]} == {2} for r in plans)
    assert any(p["sliced_chunks"] for r in plans for p in r["pipelines"]), "no step cut a sequence into slices"


def test_elastic_pp_replicas_match_unpatched_static_pipeline(elastic_equivalence):
    """--elastic-pp-sp 1: each stage's 2 data-parallel ranks run 2 pipeline replicas of SP 1, each
    its share of the documents; Megatron's loss and gradient reductions over the data-parallel
    ranks make them one step."""
    plans = _assert_elastic_run_matches(elastic_equivalence, ELASTIC_REPLICAS)
    for r in plans:
        assert r["replicas"] == 2 and {p["replica"] for p in r["pipelines"]} == {0, 1}, r["pipelines"]
        assert {(p["stages"], p["sp_degree"]) for p in r["pipelines"]} == {(2, 1)}


def test_elastic_pp_sp_auto_matches_unpatched_static_pipeline(elastic_equivalence):
    """--elastic-pp-sp auto: each step one pipeline of SP 2 or 2 replicas of SP 1, whichever the
    planner finds faster; the same loss and grad norm either way."""
    plans = _assert_elastic_run_matches(elastic_equivalence, ELASTIC_AUTO)
    for r in plans:
        layout = {(p["stages"], p["sp_degree"]) for p in r["pipelines"]}
        assert layout in ({(2, 2)}, {(2, 1)}) and r["replicas"] == 2 // r["pipelines"][0]["sp_degree"], r


def test_elastic_pp_trains_on_mock_data_with_4_ranks(checkouts, tmp_path):
    """Through run_local.sh --pp 2: 2 stages of SP degree 2, per-chunk recompute planned, a
    validation split evaluated through the elastic runtime's forward-only programs."""
    _, patched = checkouts
    log = tmp_path / "plans.jsonl"
    proc = subprocess.run(["bash", str(ROOT / "scripts/run_local.sh"), "--megatron", str(patched), "--nproc", "4",
                           "--pp", "2", "--", "--seq-length", "2048", "--max-position-embeddings", "2048",
                           "--train-iters", "4", "--hidden-dropout", "0", "--attention-dropout", "0",
                           "--eval-iters", "1", "--eval-interval", "2", "--split", "90,10,0", "--adaptive-recompute",
                           "--planner-log", str(log), "--planner-trace", str(tmp_path / "trace.json")],
                          capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore"))
    its = {int(m[1]): (float(m[2]), float(m[3])) for m in ITERATION.finditer(proc.stdout)}
    assert proc.returncode == 0 and sorted(its) == [1, 2, 3, 4], (proc.stdout + proc.stderr)[-6000:]
    _check_planner_trace(tmp_path / "trace.json", 4)
    assert all(np.isfinite(loss) and loss > 0 and np.isfinite(grad) for loss, grad in its.values())
    _assert_at_uniform_floor(its)
    assert "elastic-pp iteration        1 | plan elastic_pp" in proc.stdout
    assert "x 2 stages x SP 2 | chunks" in proc.stdout
    validation = re.findall(r"validation loss at iteration 4 \| lm loss value: ([0-9.Ee+-]+)", proc.stdout)
    assert validation and np.isfinite(float(validation[0])), proc.stdout[-3000:]
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    assert all(r["plan"]["kind"] == "elastic_pp" and r["plan_source"].endswith("planner") for r in records)
    assert any(p["sliced_chunks"] for r in records for p in r["pipelines"]), "no step cut a sequence into slices"
    assert all(len(r["measured_stage_busy_s"]) == 2 and min(r["measured_stage_busy_s"]) > 0 for r in records)


def test_run_local_script_trains(checkouts):
    _, patched = checkouts
    proc = subprocess.run(["bash", str(ROOT / "scripts/run_local.sh"), "--megatron", str(patched), "--",
                           "--train-iters", "2"], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore"))
    its = {int(m[1]): float(m[2]) for m in ITERATION.finditer(proc.stdout)}
    assert proc.returncode == 0 and sorted(its) == [1, 2], (proc.stdout + proc.stderr)[-5000:]
    assert "flexsp iteration        2 | plan" in proc.stdout


def test_unpatched_checkout_without_flexsp_flags_still_rejects_them(checkouts):
    unpatched, _ = checkouts
    run = run_pretrain(unpatched, MODEL_ARGS + ["--seq-length", "64", "--max-position-embeddings", "64",
                                                "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
                                                "--flexsp"], nproc=1, timeout=300)
    assert run["returncode"] != 0 and "unrecognized arguments: --flexsp" in run["output"]


@pytest.mark.parametrize("extra, line", [
    (["--global-batch-size", "7"], "megatron-ext: error: --global-batch-size 7 is not a multiple of the data-parallel "
                                   "size 2 (world 2 / (TP 1 x PP 1 x CP 1)) x --micro-batch-size 1"),
    # Megatron's own validate_args too: its assert, where it gives no message
    (["--fp16", "--bf16"], "megatron-ext: error: Megatron refuses the arguments: assert not args.bf16 (arguments.py:"),
])
def test_run_local_ends_with_our_one_line_error(checkouts, extra, line):
    """run_local.sh checks the arguments before torchrun starts ranks: a conflict is one line
    ``megatron-ext: error: ...``, the last of the output, and status 2."""
    _, patched = checkouts
    proc = subprocess.run(["bash", str(ROOT / "scripts/run_local.sh"), "--megatron", str(patched), "--", *extra],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHON=sys.executable, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 2, (proc.stdout + proc.stderr)[-3000:]
    assert proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr[-3000:]
    assert proc.stdout == ""  # no rank started


def test_check_args_validates_as_the_ranks_do(checkouts):
    """--check-args runs Megatron's validate_args under the CPU ranks' patches (tensor parallelism
    asks the device's architecture: it was refused as "Torch not compiled with CUDA"), and any of
    its refusals, not only asserts, is one line with status 2."""
    _, patched = checkouts

    def check(world: int, *extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "megatron_ext.megatron.launch", "--check-args", str(world),
                               str(patched / "pretrain_gpt.py"), *MODEL_ARGS, "--seq-length", "64",
                               "--max-position-embeddings", "64", "--global-batch-size", "4", "--train-iters", "1",
                               "--mock-data", "--flexsp", *extra], capture_output=True, text=True, timeout=300)

    ok = check(4, "--tensor-model-parallel-size", "2", "--cost-model", COST_2)
    assert ok.returncode == 0 and ok.stderr == "", ok.stderr[-3000:]
    refused = check(2, "--cost-model", COST_2, "--non-persistent-ckpt-type", "local")
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr[-3000:]
    assert refused.stderr.startswith("megatron-ext: error: Megatron refuses the arguments: nvidia_resiliency_ext")


@pytest.mark.parametrize("extra, message", [
    (["--context-parallel-size", "2"], "replaces context parallelism"),
    (["--global-batch-size", "3"], "--global-batch-size 3 is not a multiple of the data-parallel size 2"),
    (["--elastic-pp", "--pipeline-model-parallel-size", "2", "--cost-model", COST_4], "describes 4 GPUs"),
    (["--elastic-pp", "--pipeline-model-parallel-size", "2", "--elastic-pp-sp", "2", "--cost-model", COST_2],
     "--elastic-pp-sp 2 must divide a stage's 1 data-parallel ranks"),
])
def test_conflicts_stop_at_parsing(checkouts, extra, message):
    _, patched = checkouts
    flags = ["--flexsp", "--cost-model", COST_2] if "--elastic-pp" not in extra else []
    run = run_pretrain(patched, MODEL_ARGS + ["--seq-length", "64", "--max-position-embeddings", "64",
                                              "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
                                              *flags, *extra], nproc=2, timeout=300)
    assert run["returncode"] != 0
    line = next((x for x in run["output"].splitlines() if message in x), "")
    assert line.startswith("megatron-ext: error: "), run["output"][-3000:]
    assert "Traceback" not in run["output"].split(message)[0][-2000:]


def main() -> int:
    """Run the equivalence measurement and print its table (MEGATRON_LM_DIR must be set)."""
    import tempfile

    if not MEGATRON_LM_DIR:
        print("set MEGATRON_LM_DIR to a Megatron-LM checkout at core_v0.16.1", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="mx-megatron-eq-"))
    unpatched, patched = prepare_checkouts(Path(MEGATRON_LM_DIR), work / "src")
    iters = int(os.environ.get("ITERS", "3"))
    flexsp = equivalence_runs(unpatched, patched, work / "runs", iters=iters)
    elastic = elastic_equivalence_runs(unpatched, patched, work / "elastic", iters=iters)
    for result in (flexsp, elastic):
        runs = result["iterations"]
        for ref in dict.fromkeys(result["reference"].values()):
            names = [n for n in runs if result["reference"][n] == ref]
            print(f"{'iteration':>9}  " + "  ".join(f"{n:>32}" for n in names))
            for i in sorted(runs[names[0]]):
                print(f"{i:>9}  " + "  ".join(f"{'loss %.6E grad %.3f' % runs[n][i]:>32}" for n in names))
            print()
    for r in flexsp["plans"]:
        print(f"flexsp plan, iteration {r['iteration']}: {r['micro_batches']} micro-batches, groups by degree "
              f"{r['groups_by_degree']}, {r['sequences']} sequences, {r['tokens']} tokens ({r['plan_source']})")
    for name, records in elastic["plans"].items():
        for r in records:
            p = r["pipelines"]
            print(f"{name} plan, iteration {r['iteration']}: {len(p)} pipeline(s) over {r['replicas']} replica(s), "
                  f"{r['micro_batches']} chunks ({sum(x['sliced_chunks'] for x in p)} with slices), {r['sequences']} "
                  f"sequences, {r['tokens']} tokens ({r['plan_source']})")
    print(f"(work files in {work})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

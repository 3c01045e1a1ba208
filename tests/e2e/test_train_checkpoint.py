"""`megatron-ext train --save / --load` end to end on 4 CPU ranks: a run of 2 steps that saves,
resumed by a run to step 4, trains steps 2 and 3 exactly as one uninterrupted run of 4 steps does
(same loss and grad norm), for FlexSP and for a 2-stage elastic pipeline. A resume that lost the
optimizer's moments, the weights or the data position would show in those numbers."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CLI = [sys.executable, "-m", "megatron_ext.commands.cli", "train"]
ARGS = ["--global-batch", "6", "--max-seq-len", "1024", "--seed", "7", "--json"]
LAYOUTS = {"flexsp": [], "elastic_pp": ["--planner", "elastic_pp", "--pp", "2"]}


def _train(*argv: str) -> tuple[list[dict], str]:
    # the ranks under NCCL's rules (runtime/device.py), as in test_train_cli.py
    done = subprocess.run([*CLI, *ARGS, *argv], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, MEGATRON_EXT_DEVICE_CHECK="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")], done.stderr


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A layout's runs (``runs``), trained once in the module, when first asked for: a test of one
    layout's checkpoint does not train the other."""
    done = {}

    def of(name: str) -> dict:
        if name not in done:
            layout = LAYOUTS[name]
            ckpt = tmp_path_factory.mktemp(f"ckpt-{name}")
            run_dir = ckpt / "records"
            whole, _ = _train("--steps", "4", *layout)
            first, first_log = _train("--steps", "2", "--save", str(ckpt), "--save-interval", "1", "--run-dir",
                                      str(run_dir), *layout)
            rest, rest_log = _train("--steps", "4", "--load", str(ckpt), "--save", str(ckpt), "--run-dir",
                                    str(run_dir), *layout)
            done[name] = {"whole": whole, "first": first, "rest": rest, "first_log": first_log, "rest_log": rest_log,
                          "ckpt": ckpt, "layout": layout, "run_dir": run_dir}
        return done[name]

    return of


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, trained):
    return trained(request.param)


def test_resumed_run_continues_where_the_saved_one_stopped(runs):
    whole, first, rest = runs["whole"], runs["first"], runs["rest"]
    assert [r["step"] for r in whole] == [0, 1, 2, 3]
    assert [r["step"] for r in first] == [0, 1] and [r["step"] for r in rest] == [2, 3]
    for x, y in zip(first + rest, whole):
        assert x["tokens"] == y["tokens"], (x, y)  # the same batches: nothing repeated or skipped
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-6), (x["step"], x["loss"], y["loss"])
        assert x["grad_norm"] == pytest.approx(y["grad_norm"], rel=1e-6), (x["step"], x["grad_norm"], y["grad_norm"])


def test_a_resumed_run_adds_its_records_to_the_run_dir(runs):
    lines = (runs["run_dir"] / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]  # (the resumed run wrote over 0 and 1)


def test_checkpoints_are_saved_every_interval_and_at_the_end(runs):
    ckpt = runs["ckpt"]
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001", "iter_0000002", "iter_0000004"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    run = json.loads((ckpt / "iter_0000004" / "megatron_ext.json").read_text())
    assert run["pp"] == (2 if runs["layout"] else 1) and run["ranks"] == 4 and run["seed"] == 7
    assert not list(ckpt.glob(".iter_*"))  # written under a hidden name, renamed once whole
    assert run["files"][".metadata"] > 0 and any(name.endswith(".distcp") for name in run["files"])
    assert f"saved step 2 to {ckpt / 'iter_0000002'}" in runs["first_log"]
    assert f"resumed from {ckpt / 'iter_0000002'} at step 2" in runs["rest_log"]


def test_a_checkpoint_of_another_layout_or_run_is_refused(runs):
    from megatron_ext.cost import CostModel
    from megatron_ext.errors import ConfigError
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args

    ckpt = str(runs["ckpt"])
    other = [] if runs["layout"] else LAYOUTS["elastic_pp"]
    saved_pp = 2 if runs["layout"] else 1
    cost = CostModel.from_presets("tiny", "cpu-4")
    for argv, match in (
            (other, f"--load {ckpt}: its step-4 checkpoint was saved by a run with --pp {saved_pp}, this run has "
                    f"{3 - saved_pp}"),
            ([*runs["layout"], "--seed", "8"], "saved by a run with --seed 7, this run has 8"),
            ([*runs["layout"], "--lr", "0.01"], "saved by a run with --lr 0.003, this run has 0.01")):
        args = build_parser().parse_args([*ARGS, "--load", ckpt, *argv])
        with pytest.raises(ConfigError, match=match):
            check_args(args, cost, 4)


def test_a_checkpoint_of_another_sampling_rule_is_refused(runs, tmp_path):
    """A checkpoint of a version that cut documents into samples otherwise (its step k drew other
    batches) is not resumed as if it were this one's."""
    import shutil

    from megatron_ext.cost import CostModel
    from megatron_ext.errors import ConfigError
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args

    copy = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], copy)
    run_file = copy / "iter_0000004" / "megatron_ext.json"
    saved = json.loads(run_file.read_text())
    del saved["sample_rule"]
    run_file.write_text(json.dumps(saved))
    args = build_parser().parse_args([*ARGS, *runs["layout"], "--load", str(copy)])
    with pytest.raises(ConfigError, match="saved by a run with documents cut into samples as not given, this run has "
                                          "pieces of max_seq_len, under 2 tokens left out"):
        check_args(args, CostModel.from_presets("tiny", "cpu-4"), 4)


def test_a_checkpoint_missing_or_cutting_a_file_is_refused_before_launching(runs, tmp_path):
    import shutil

    from megatron_ext.cost import CostModel
    from megatron_ext.errors import ConfigError
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args

    copy = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], copy)
    shard = sorted((copy / "iter_0000004").glob("*.distcp"))[-1]
    args = build_parser().parse_args([*ARGS, *runs["layout"], "--load", str(copy)])
    cost = CostModel.from_presets("tiny", "cpu-4")
    with shard.open("r+b") as f:
        f.truncate(shard.stat().st_size - 1)
    cut = rf"iter_0000004 is damaged: {shard.name} has [\d,]+ bytes, [\d,]+ were saved"
    with pytest.raises(ConfigError, match=cut):
        check_args(args, cost, 4)
    shard.unlink()
    with pytest.raises(ConfigError, match=rf"iter_0000004 is damaged: {shard.name} is missing; resume from another"):
        check_args(args, cost, 4)


def test_a_checkpoint_damaged_in_place_is_refused_before_launching(runs, tmp_path):
    """Bytes changed in a shard, its size kept (one byte changed: a loss off in its seventh digit;
    more: NaN steps, saved as the newest checkpoint): its CRC-32 differs from the one saved."""
    import shutil

    from megatron_ext.cost import CostModel
    from megatron_ext.errors import ConfigError
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args

    copy = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], copy)
    shard = sorted((copy / "iter_0000004").glob("*.distcp"))[-1]
    args = build_parser().parse_args([*ARGS, *runs["layout"], "--load", str(copy)])
    check_args(args, CostModel.from_presets("tiny", "cpu-4"), 4)  # (as saved: resumes)
    with shard.open("r+b") as f:
        f.seek(shard.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ConfigError, match=rf"iter_0000004 is damaged: {shard.name} does not hold the bytes that were "
                                          rf"saved \(its CRC-32 differs\); resume from another"):
        check_args(args, CostModel.from_presets("tiny", "cpu-4"), 4)
    # the ranks, started after the launcher's check, read no checkpoint bytes again (sizes only)
    check_args(args, CostModel.from_presets("tiny", "cpu-4"), 4, read_checkpoint=False)


def test_a_checkpoint_resumes_on_its_data_wherever_it_lies_and_on_no_other(runs):
    """The data is named by content (documents, tokens, the CRC-32 of their lengths), checked by
    the ranks once they read it: the default corpus given by its path resumes; other data is
    refused (its path text, compared before, let a replaced corpus through)."""
    from megatron_ext.data.corpus import stdlib_corpus
    from megatron_ext.errors import ConfigError
    from megatron_ext.runtime.checkpoint import check_resumed_data
    from megatron_ext.runtime.train import open_training_data

    import dataclasses

    data = open_training_data([stdlib_corpus()], None)
    check_resumed_data(str(runs["ckpt"]), data)
    docs = type("Docs", (), {"lengths": data.documents.lengths[::-1].copy()})()  # (the same lengths in another order)
    with pytest.raises(ConfigError, match=r"saved by a run on other data \(\d+ documents, \d+ tokens, lengths "
                                          r"CRC-32 [0-9a-f]{8}\), this run's --data holds"):
        check_resumed_data(str(runs["ckpt"]), dataclasses.replace(data, documents=docs))
    # the same documents blended at weights draw other batches (a blend's weights were not compared)
    n = len(data.documents.lengths)
    blend = dataclasses.replace(data, source_sizes=[n // 2, n - n // 2], weights=[0.3, 0.7])
    with pytest.raises(ConfigError, match=rf"saved by a run on another blend of its data \(unweighted\), this "
                                          rf"run's --data holds {n // 2} \+ {n - n // 2} documents at weights 0.3 : 0.7"):
        check_resumed_data(str(runs["ckpt"]), blend)
    # a checkpoint saved before blends were compared resumes on any blend of its documents
    import shutil

    old = runs["ckpt"].parent / f"{runs['ckpt'].name}-before-blends"
    shutil.copytree(runs["ckpt"], old, dirs_exist_ok=True)
    run_file = old / "iter_0000004" / "megatron_ext.json"
    run_file.write_text(json.dumps({k: v for k, v in json.loads(run_file.read_text()).items() if k != "blend"}))
    check_resumed_data(str(old), blend)
    # the same lengths, tokenized otherwise (every token id moved by one)
    original = data.documents
    moved = type("Moved", (), {"lengths": original.lengths, "__len__": lambda self: len(original),
                               "get": lambda self, i: (original.get(i) + 1) % 128})()
    with pytest.raises(ConfigError, match=r"saved by a run on other tokens in documents of the same lengths "
                                          r"\(tokens of 64 documents, CRC-32 [0-9a-f]{8}\)"):
        check_resumed_data(str(runs["ckpt"]), dataclasses.replace(data, documents=moved))


def test_blend_fingerprints_of_huge_weights_differ():
    """Weights are normalized by the largest first: their sum overflowed to inf, and every blend of
    huge weights read "0 : 0" (two that draw other batches resumed one another)."""
    import types

    from megatron_ext.runtime.checkpoint import blend_fingerprint

    a, b = (blend_fingerprint(types.SimpleNamespace(weights=w, source_sizes=[5, 5]))
            for w in ([1.5e308, 1e308], [1.7e308, 2e307]))
    assert a == "5 + 5 documents at weights 0.6 : 0.4" and b != a


def test_load_and_save_of_one_directory_start_fresh_before_its_first_save(tmp_path):
    """A job requeued with one command line (--load DIR --save DIR) starts fresh while DIR holds
    nothing yet, as Megatron-LM does; a --load of another, empty directory is still refused."""
    from argparse import Namespace

    from megatron_ext.runtime.checkpoint import resume_from

    assert resume_from(Namespace(load=str(tmp_path / "new"), save=str(tmp_path / "new"))) is None
    assert resume_from(Namespace(load=str(tmp_path), save=str(tmp_path) + "/.")) is None
    assert resume_from(Namespace(load=str(tmp_path), save=None)) == str(tmp_path)
    (tmp_path / "iter_0000002").mkdir()  # (something saved, or half-saved: not a fresh start)
    assert resume_from(Namespace(load=str(tmp_path), save=str(tmp_path))) == str(tmp_path)
    assert resume_from(Namespace(load=None, save=str(tmp_path))) is None


def test_a_resave_killed_between_its_renames_loses_neither_copy(runs, tmp_path):
    """A save of step 4 again, killed after it set the first save aside and before it named its
    own: the tracker names a missing folder; the check before launching puts the first one back,
    and the next save clears the second's leftovers."""
    import shutil

    from megatron_ext.cost import CostModel
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args

    copy = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], copy)
    (copy / "iter_0000004").rename(copy / ".iter_0000004.replaced")
    shutil.copytree(copy / ".iter_0000004.replaced", copy / ".iter_0000004.saving")
    args = build_parser().parse_args([*ARGS, *runs["layout"], "--load", str(copy)])
    check_args(args, CostModel.from_presets("tiny", "cpu-4"), 4)
    assert (copy / "iter_0000004" / "megatron_ext.json").is_file()
    assert not (copy / ".iter_0000004.replaced").exists()


def test_a_first_save_killed_before_its_tracker_resumes_from_the_newest_whole_folder(runs, tmp_path):
    """Killed between a first save's rename and its tracker (or folders copied without it): the
    newest complete folder is the checkpoint, not "holds no checkpoint" until someone writes one."""
    import shutil

    from megatron_ext.cost import CostModel
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.checkpoint import latest_checkpoint
    from megatron_ext.runtime.train import check_args

    copy = tmp_path / "ckpt"
    for name in ("iter_0000001", "iter_0000002"):
        shutil.copytree(runs["ckpt"] / name, copy / name)
    shutil.copytree(runs["ckpt"] / "iter_0000004", copy / "iter_0000004")
    (copy / "iter_0000004" / "megatron_ext.json").unlink()  # (never whole: its run file is written last)
    assert latest_checkpoint(str(copy)) == (2, copy / "iter_0000002")
    check_args(build_parser().parse_args([*ARGS, *runs["layout"], "--load", str(copy), "--save", str(copy)]),
               CostModel.from_presets("tiny", "cpu-4"), 4)


def test_a_save_directory_of_a_checkpoint_not_resumed_is_refused(runs, tmp_path):
    """Its saves would take the tracker from that checkpoint: a later --load would find it gone."""
    import shutil

    from megatron_ext.cost import CostModel
    from megatron_ext.errors import ConfigError
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args

    cost, ckpt, other = CostModel.from_presets("tiny", "cpu-4"), runs["ckpt"], tmp_path / "other"
    shutil.copytree(ckpt / "iter_0000001", other / "iter_0000001")  # (a complete folder, no tracker)
    for save, load in ((ckpt, None), (other, ckpt)):
        argv = [*ARGS, *runs["layout"], "--save", str(save)] + (["--load", str(load)] if load else [])
        with pytest.raises(ConfigError, match=f"--save {save} holds a checkpoint this run does not resume"):
            check_args(build_parser().parse_args(argv), cost, 4)
    for save in (ckpt, tmp_path / "new"):  # resuming it, or saving to a folder of none
        check_args(build_parser().parse_args([*ARGS, *runs["layout"], "--load", str(ckpt), "--save", str(save)]),
                   cost, 4)


def test_a_save_that_fails_is_one_line_naming_the_newest_checkpoint(runs, tmp_path):
    """A save that cannot be written (here: files capped at 256 KB, the ranks' shards are ~0.5 MB;
    a full disk alike) ends the run with one line, status 2, and the checkpoint before it stays
    the newest. (It printed a traceback from every rank and blamed a rank.)"""
    import resource
    import shutil

    def capped_files():
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    copy = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], copy)
    done = subprocess.run([*CLI, *ARGS, *runs["layout"], "--steps", "5", "--load", str(copy), "--save", str(copy)],
                          capture_output=True, text=True, timeout=300, preexec_fn=capped_files)
    assert done.returncode == 2, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("megatron-ext:")]
    assert len(said) == 1 and said[0].startswith(f"megatron-ext: error: cannot save step 5 to {copy}: "), \
        done.stderr[-3000:]
    assert said[0].endswith(f"; the newest checkpoint stays {copy / 'iter_0000004'}"), said
    assert "Traceback" not in done.stderr and (copy / "latest_checkpointed_iteration.txt").read_text().strip() == "4"


def test_a_write_torch_fails_is_a_save_failure_and_a_broken_collective_is_not(tmp_path):
    """torch.save reports a full disk as a RuntimeError (megatron-core's common.pt, rank 0's first
    write); gloo a dead peer as a RuntimeError too, which the launcher reports by rank."""
    from megatron_ext.runtime.checkpoint import RUN_FILE, TRACKER_FILE, save_failure

    (tmp_path / "iter_0000004").mkdir()  # (what names the newest checkpoint: the tracker and its run file)
    (tmp_path / "iter_0000004" / RUN_FILE).write_text("{}\n")
    (tmp_path / TRACKER_FILE).write_text("4\n")
    full = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    failed = save_failure(full, str(tmp_path), 5)
    assert str(failed) == (f"cannot save step 5 to {tmp_path}: RuntimeError: [enforce fail at inline_container.cc:672]"
                           f" . unexpected pos 704 vs 598; the newest checkpoint stays {tmp_path / 'iter_0000004'}")
    assert save_failure(RuntimeError("Connection closed by peer [127.0.0.1]:1234"), str(tmp_path), 5) is None
    assert "no checkpoint was saved before it" in str(save_failure(OSError(28, "No space left on device"), "/nonexistent", 1))


def test_a_checkpoint_the_ranks_cannot_read_is_a_one_line_error(trained, tmp_path):
    import shutil

    runs = trained("flexsp")  # (one layout is enough: the load is the same)
    copy = tmp_path / "ckpt"
    shutil.copytree(runs["ckpt"], copy)
    metadata = copy / "iter_0000004" / ".metadata"
    data = bytearray(metadata.read_bytes())
    data[8:40] = b"x" * 32  # the size the checkpoint lists, but not a pickle
    metadata.write_bytes(bytes(data))
    run_file = copy / "iter_0000004" / "megatron_ext.json"  # (a checkpoint of before CRCs: sizes only)
    run_file.write_text(json.dumps({k: v for k, v in json.loads(run_file.read_text()).items() if k != "crc32"}))
    done = subprocess.run([*CLI, *ARGS, "--steps", "5", "--load", str(copy)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 2 and done.stdout == "", done.stderr[-3000:]
    assert done.stderr.startswith(f"megatron-ext: error: --load {copy}: {copy / 'iter_0000004'} could not be "
                                  f"loaded (") and done.stderr.count("\n") == 1, done.stderr[-3000:]


@pytest.mark.parametrize("argv, message", [
    (["--load", "{tmp}/missing"], "--load {tmp}/missing: no such directory"),
    (["--load", "{tmp}"], "--load {tmp} holds no checkpoint (no latest_checkpointed_iteration.txt"),
    (["--save", "{tmp}", "--save-interval", "0"], "--save-interval must be at least 1, got 0"),
    (["--save-interval", "2"], "--save-interval applies to --save"),
    (["--load", "{tmp}/damaged"], "--load {tmp}/damaged: {tmp}/damaged/iter_0000004/megatron_ext.json is damaged"),
    (["--load", "{tmp}/listed"], "--load {tmp}/listed: {tmp}/listed/iter_0000004/megatron_ext.json is damaged "
                                 "(not a JSON object)"),
    (["--load", "{tmp}/binary"], "--load {tmp}/binary: latest_checkpointed_iteration.txt should hold a step count"),
])
def test_bad_checkpoint_options_are_refused_before_launching(tmp_path, argv, message):
    from megatron_ext.cost import CostModel
    from megatron_ext.errors import ConfigError
    from megatron_ext.commands.train import build_parser
    from megatron_ext.runtime.train import check_args

    for name, tracker, run_file in (("damaged", b"4\n", b"not json{"), ("listed", b"4\n", b"[1, 2]"),
                                    ("binary", b"\xff\xfe4", b"{}")):
        (tmp_path / name / "iter_0000004").mkdir(parents=True)
        (tmp_path / name / "latest_checkpointed_iteration.txt").write_bytes(tracker)
        (tmp_path / name / "iter_0000004" / "megatron_ext.json").write_bytes(run_file)

    args = build_parser().parse_args([*ARGS, *(a.format(tmp=tmp_path) for a in argv)])
    with pytest.raises(ConfigError) as refused:
        check_args(args, CostModel.from_presets("tiny", "cpu-4"), 4)
    assert str(refused.value).startswith(message.format(tmp=tmp_path))


def test_a_missing_checkpoint_is_a_one_line_error(tmp_path):
    done = subprocess.run([*CLI, *ARGS, "--steps", "1", "--load", str(tmp_path)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"megatron-ext: error: --load {tmp_path} holds no checkpoint (no " \
                          f"latest_checkpointed_iteration.txt; `train --save {tmp_path}` writes one)\n"


def test_a_step_whose_loss_is_not_finite_stops_the_run_unsaved(tmp_path):
    """A learning rate of 1e30 makes step 1's loss NaN: the run stops there in one line (status 2),
    and the checkpoint of step 0 stays the newest (a NaN one would be resumed as if good)."""
    done = subprocess.run([*CLI, *ARGS, "--steps", "4", "--lr", "1e30", "--save", str(tmp_path), "--save-interval",
                           "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.splitlines()[-1] == (f"megatron-ext: error: step 1: loss nan, grad norm nan; the run stops here, "
                                            f"unsaved (the newest checkpoint stays in {tmp_path})"), done.stderr[-3000:]
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "1"
    assert not (tmp_path / "iter_0000002").exists()

"""examples/train_gpt.py runs, its loss falls, and its memory table follows the ZeRO formula.

The in-process test calls the example's ``main(argv)`` on a 2-rank ``local_mesh``; the torchrun test
launches it as the README does (2 processes, gloo) and reads its ``--json-out``. Both use a tiny model
and a 1 MiB slice of the corpus so that each takes a few seconds. The loss-curve PNG is asserted where the
two ways of running it are (``--plot``); the other tests pass ``--plot ''``.
"""

import importlib.util
import json
import math
import re
import os

import pytest

from fzero.data import load_corpus
from launch import torchrun

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "train_gpt.py")
TINY = ["--layers", "2", "--width", "32", "--heads", "2", "--seq", "32", "--batch-size", "8",
        "--steps", "40", "--lr", "1e-2", "--warmup", "5", "--log-every", "10", "--eval-batches", "4", "--plot", ""]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def load_example():
    spec = importlib.util.spec_from_file_location("train_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory):
    # A 1 MiB file, not the 8 MiB default corpus: the tests are about the example, not the data.
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(load_corpus(max_bytes=1 << 20).numpy().tobytes())
    return str(path)


def check_png(path):
    with open(path, "rb") as f:
        png = f.read()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000, path


def check_result(result, *, stages, world):
    losses = result["losses"]
    assert result["steps"] == len(losses) == 40
    # Byte-level loss starts near ln(256) = 5.5; 40 steps of a tiny model reach the unigram level (~3.5).
    assert sum(losses[-3:]) / 3 < losses[0] - 1.0, losses
    assert result["val_loss"] < losses[0] - 1.0
    assert result["tokens_per_s"] > 0
    mem = result["memory"]
    assert len(mem["ranks"]) == world
    for row in mem["ranks"]:
        for key in ("params", "grads", "optimizer", "total"):
            # Measured from the state, padded to a multiple of the world size: a few percent over Ψ at most.
            assert mem["formula"][key] <= row[key] <= mem["formula"][key] * 1.03, (key, row, mem["formula"])
    # What each stage divides by the world size (fp32 AdamW: params 4, grads 4, optimizer 8 bytes each).
    row = mem["ranks"][0]
    for key, bytes_per_param, sharded_from in (("params", 4, 3), ("grads", 4, 2), ("optimizer", 8, 1)):
        expected = result["num_params"] * bytes_per_param / (world if stages >= sharded_from else 1)
        assert row[key] == pytest.approx(expected, rel=0.03), (key, stages)


@pytest.mark.parametrize("stages", [2, 0, 1, 3])
def test_example_trains_on_local_mesh(corpus_file, tmp_path, capsys, stages):
    out, png = tmp_path / "result.json", tmp_path / "loss.png"
    result = load_example().main([*TINY, "--mesh", "local", "--ranks", "2", "--stages", str(stages),
                                  "--data", corpus_file, "--json-out", str(out), "--plot", str(png)])
    check_result(result, stages=stages, world=2)
    assert result["plot"] == str(png)
    check_png(png)
    assert json.loads(out.read_text())["losses"] == result["losses"]
    printed = capsys.readouterr().out
    assert "ZeRO formula" in printed and "val loss" in printed and "tokens/s" in printed and f"loss curve: {png}" in printed


@pytest.mark.torchrun
def test_example_under_torchrun_stage2(corpus_file, tmp_path):
    out, png = tmp_path / "result.json", tmp_path / "loss.png"
    # launched as every torchrun test is (tests/launch.py: its one retry is for the known stage-2 C++ abort only)
    proc = torchrun([EXAMPLE, *TINY, "--stages", "2", "--data", corpus_file, "--json-out", str(out), "--plot", str(png)])
    result = json.loads(out.read_text())
    assert result["mesh"] == "dist"
    check_result(result, stages=2, world=2)
    assert proc.stdout.count("ZeRO formula") == 1  # rank 0 prints, rank 1 does not
    check_png(png)  # rank 0 draws it


def test_example_options_remat_precision_accum_clip(corpus_file, tmp_path, capsys):
    """--remat changes memory, not the numbers; bf16 with accumulation and clipping still learns."""
    base = [*TINY, "--mesh", "local", "--ranks", "2", "--stages", "2", "--data", corpus_file, "--steps", "8"]
    plain = load_example().main(base)
    remat = load_example().main([*base, "--remat"])
    assert remat["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    mixed = load_example().main([*base, "--precision", "bf16", "--grad-accum", "2", "--clip", "1.0",
                                 "--schedule", "warmup-decay", "--steps", "20"])
    assert sum(mixed["losses"][-3:]) / 3 < mixed["losses"][0] - 0.5
    # --curriculum: each step's sequences cut to DeepSpeed's fixed_linear length, growing to --seq (32 here)
    grown = load_example().main([*base, "--steps", "6", "--curriculum", "8:4"])
    assert grown["seq_lengths"] == [8, 16, 24, 32, 32, 32]
    assert all(math.isfinite(x) for x in grown["losses"])
    # --layer-drop: blocks skipped as the draw says (evaluation runs them all); it still learns
    dropped = load_example().main([*base, "--steps", "6", "--layer-drop", "0.5:0.5"])
    assert 0 < dropped["blocks_run"] < 6 * 2 and all(math.isfinite(x) for x in dropped["losses"])
    # at stage 3 --remat recomputes each unit (compile(remat=True), as at every stage): the same numbers again
    s3 = [*TINY, "--mesh", "local", "--ranks", "2", "--stages", "3", "--data", corpus_file, "--steps", "4"]
    assert load_example().main([*s3, "--remat"])["losses"] == pytest.approx(load_example().main(s3)["losses"], rel=1e-5)
    # --layer-drop with --remat: the blocks that run are recomputed, the skipped ones are not called at all
    both = load_example().main([*base, "--steps", "6", "--layer-drop", "0.5:0.5", "--remat"])
    assert both["losses"] == pytest.approx(dropped["losses"], rel=1e-5)


def test_example_saves_and_resumes_exactly(corpus_file, tmp_path):
    base = [*TINY, "--mesh", "local", "--ranks", "2", "--data", corpus_file, "--schedule", "constant",
            "--ckpt-dir", str(tmp_path / "ckpt")]
    straight = load_example().main([*base, "--stages", "3", "--steps", "6"])
    first = load_example().main([*base, "--stages", "3", "--steps", "3", "--save-every", "3"])
    # resumed on a different stage: the checkpoint reshards; the losses continue as if never stopped
    resumed = load_example().main([*base, "--stages", "1", "--steps", "6", "--resume"])
    assert first["losses"] == straight["losses"][:3]
    assert resumed["losses"] == pytest.approx(straight["losses"][3:], rel=1e-5)


@pytest.mark.parametrize("flags, match", [
    (["--json-out", "{missing}/result.json"], r"--json-out .*: the directory .*missing does not exist; create it first"),
    (["--plot", "{missing}/loss.png"], r"--plot .*: the directory .*missing does not exist; create it first"),
    (["--grad-accum", "3"], r"--batch-size 8 \(sequences per rank per step\) does not split into --grad-accum 3 equal "
                            r"micro-batches; pass a --batch-size that is a multiple of 3"),
    (["--schedule", "warmup-decay", "--warmup", "0"], r"--schedule warmup-decay needs at least one warm-up step .* "
                                                      r"pass --warmup >= 1 and --steps >= 2, or --schedule cosine"),
], ids=["json-out-dir", "plot-dir", "grad-accum", "warmup-decay"])
def test_example_refuses_by_flag_before_training_what_would_fail_later(corpus_file, tmp_path, capsys, flags, match):
    """An output directory that does not exist (written after the last step: the run's numbers were lost at the end,
    FileNotFoundError), a batch that does not split into the micro-batches and a warm-up-less WarmupDecayLR (fzero's
    errors named the batch leaf and warmup_num_steps, not the flags) are refused as the flags the user typed."""
    flags = [f.format(missing=tmp_path / "missing") for f in flags]
    with pytest.raises(SystemExit):
        load_example().main([*TINY, "--mesh", "local", "--ranks", "2", "--data", corpus_file, *flags])
    assert re.search(match, capsys.readouterr().err)


def test_example_resume_with_no_steps_left_says_so(corpus_file, tmp_path):
    """--resume from a checkpoint saved at --steps trains nothing: a message naming --steps (was an IndexError on
    the empty loss list after the last step)."""
    base = [*TINY, "--mesh", "local", "--ranks", "2", "--data", corpus_file, "--steps", "2", "--eval-batches", "1",
            "--ckpt-dir", str(tmp_path / "ckpt")]
    load_example().main([*base, "--save-every", "2"])
    with pytest.raises(SystemExit, match=r"--resume: the newest checkpoint in .*ckpt was saved after step 2, and "
                                         r"--steps 2 ends there; nothing is left to train. Pass --steps above 2"):
        load_example().main([*base, "--resume"])


def test_example_json_out_is_strict_json_without_validation(corpus_file, tmp_path):
    """--eval-batches 0 makes val_loss NaN: --json-out writes it as null (was the bare token NaN, which is not JSON:
    jq and JavaScript's JSON.parse refuse the file)."""
    out = tmp_path / "result.json"
    load_example().main([*TINY, "--mesh", "local", "--ranks", "2", "--data", corpus_file, "--steps", "2",
                         "--eval-batches", "0", "--json-out", str(out)])

    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    result = json.loads(out.read_text(), parse_constant=refuse)
    assert result["val_loss"] is None and result["evals"] == [{"step": 2, "val_loss": None}] and len(result["losses"]) == 2

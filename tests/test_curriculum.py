"""Curriculum learning by sequence length (DeepSpeed's "curriculum_learning" block): fzero.data.Curriculum."""

import pytest
import torch

import fzero
from fzero.data import Curriculum
from fzero.testing import assert_trees_equal
from problems import gpt_problem

SCHEDULES = {
    "fixed_linear": {"total_curriculum_step": 37, "difficulty_step": 8},
    "fixed_root": {"total_curriculum_step": 37, "difficulty_step": 8, "root_degree": 2},
    "fixed_discrete": {"difficulty": [8, 24, 40, 64], "max_step": [5, 9, 20]},
}


@pytest.mark.parametrize("min_difficulty", [8, 12])
@pytest.mark.parametrize("schedule_type", list(SCHEDULES))
def test_the_schedules_equal_deepspeeds_step_by_step(schedule_type, min_difficulty):
    scheduler = pytest.importorskip("deepspeed.runtime.data_pipeline.curriculum_scheduler")
    block = {"curriculum_type": "seqlen", "min_difficulty": min_difficulty, "max_difficulty": 64,
             "schedule_type": schedule_type, "schedule_config": SCHEDULES[schedule_type]}
    theirs = scheduler.CurriculumScheduler(block)
    ours = Curriculum.from_deepspeed(block)
    # DeepSpeed's engine asks for global_steps + 1 before each step's forward; ours takes the steps taken
    got = [ours.difficulty(k) for k in range(60)]
    want = [theirs.update_difficulty(k + 1) for k in range(60)]
    assert got == want
    assert got[0] < 64 and got[-1] == 64  # it grows, and ends at the max


def test_fixed_discrete_holds_the_first_difficulty_at_the_max_as_deepspeed_does():
    """DeepSpeed updates the difficulty only while it is below max_difficulty: a fixed_discrete list that goes past the
    max (or a min equal to the max) stays where DeepSpeed stays. fzero went on to 64 tokens with max_difficulty 32."""
    import random

    scheduler = pytest.importorskip("deepspeed.runtime.data_pipeline.curriculum_scheduler")
    cases = [([16, 32, 64], [2, 4], 8, 32), ([40, 50, 54], [21, 27], 6, 6)]
    rng = random.Random(0)
    for _ in range(300):
        k = rng.randint(1, 4)
        low = rng.randint(1, 40)
        cases.append((sorted(rng.randint(1, 80) for _ in range(k + 1)), sorted(rng.sample(range(1, 30), k)), low,
                      rng.randint(low, 80)))
    for difficulty, max_step, low, high in cases:
        block = {"curriculum_type": "seqlen", "min_difficulty": low, "max_difficulty": high,
                 "schedule_type": "fixed_discrete", "schedule_config": {"difficulty": difficulty, "max_step": max_step}}
        theirs = scheduler.CurriculumScheduler(block)
        ours = Curriculum.from_deepspeed(block)
        assert [ours.difficulty(t) for t in range(40)] == [theirs.update_difficulty(t + 1) for t in range(40)], block
    assert Curriculum.from_deepspeed({"min_difficulty": 8, "max_difficulty": 32, "schedule_type": "fixed_discrete",
                                      "schedule_config": {"difficulty": [16, 32, 64], "max_step": [2, 4]}}).difficulty(10) == 32


def test_apply_cuts_the_sequence_dimension_of_every_tensor():
    c = Curriculum(min_difficulty=4, max_difficulty=16, schedule_type="fixed_linear", total_curriculum_step=4, difficulty_step=4)
    batch = {"x": torch.arange(32).reshape(2, 16), "y": torch.arange(32).reshape(2, 16) + 1, "n": 3,
             "mask": [torch.ones(2, 16)], "ids": torch.arange(2)}
    first = c.apply(batch, 0)
    assert first["x"].shape == (2, 4) and torch.equal(first["y"], batch["y"][:, :4]) and first["mask"][0].shape == (2, 4)
    assert first["n"] == 3 and first["ids"] is batch["ids"]  # a 1-D tensor has no sequence dimension
    assert c.apply(batch, 10)["x"] is batch["x"]  # at the max: as it was


def test_a_left_padded_batch_is_refused_a_right_padded_one_is_cut():
    # the curriculum keeps the first positions (DeepSpeed's too): a left-padded short row would keep only its padding
    c = Curriculum(min_difficulty=4, max_difficulty=16, schedule_type="fixed_linear", total_curriculum_step=4, difficulty_step=4)
    right = torch.ones(2, 16, dtype=torch.long)
    right[1, 10:] = 0
    batch = {"input_ids": torch.arange(32).reshape(2, 16), "attention_mask": right}
    assert c.apply(batch, 0)["attention_mask"].shape == (2, 4)
    left = right.flip(1)
    with pytest.raises(ValueError, match=r"Curriculum.apply: the batch is left-padded \(attention_mask row 1 starts with padding\)"):
        c.apply({**batch, "attention_mask": left}, 0)
    assert c.apply({**batch, "attention_mask": left}, 10)["attention_mask"] is left  # at the max nothing is cut


def test_a_gpt_trains_on_the_curriculum_at_every_stage_as_on_the_cut_batches():
    # the loop applies the curriculum; each stage trains on it, and equals stage 0 (bitwise on one rank of a local mesh)
    c = Curriculum(min_difficulty=4, max_difficulty=16, schedule_type="fixed_linear", total_curriculum_step=3, difficulty_step=4)
    results = {}
    for stages in (0, 1, 2, 3):
        prob = gpt_problem(steps=3)
        step = fzero.compile(prob.loss_fn, optimizer=fzero.optim.adamw(1e-2), stages=stages, mesh=fzero.local_mesh(1))
        state = step.init(fzero.params_of(prob.model))
        lengths, losses = [], []
        for b in prob.batches:
            cut = c.apply(b, state.step_count)
            lengths.append(cut["x"].shape[1])
            state, m = step(state, cut)
            losses.append(m["loss"])
        results[stages] = (step.gather(state), losses)
        assert lengths == [c.difficulty(k) for k in range(3)] and lengths[0] < lengths[-1]
    for stages in (1, 2, 3):
        assert_trees_equal(results[stages][0], results[0][0])
        assert results[stages][1] == results[0][1]


def test_the_config_block_is_read_and_bad_settings_are_named():
    block = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 64,
             "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 10, "difficulty_step": 8}}
    settings = fzero.config.from_deepspeed({"curriculum_learning": block})
    assert settings.curriculum == Curriculum.from_deepspeed({k: v for k, v in block.items() if k != "enabled"})
    assert "curriculum" in str(settings)
    assert fzero.config.from_deepspeed({"curriculum_learning": {**block, "enabled": False}}).curriculum is None
    with pytest.raises(ValueError, match=r"unknown key 'curriculum_learning\.schedule_config\.total_step'"):
        fzero.config.from_deepspeed({"curriculum_learning": {**block, "schedule_config": {"total_step": 10, "difficulty_step": 8}}})
    with pytest.raises(ValueError, match=r"fzero\.config\.from_deepspeed: curriculum_learning: schedule_type 'fixed_root' needs "
                                         r"schedule_config keys \['root_degree'\]"):
        fzero.config.from_deepspeed({"curriculum_learning": {**block, "schedule_type": "fixed_root"}})
    with pytest.raises(NotImplementedError, match=r"curriculum_type='vocabularyrarity'.*'seqlen'"):
        fzero.config.from_deepspeed({"curriculum_learning": {**block, "curriculum_type": "vocabularyrarity"}})
    with pytest.raises(ValueError, match=r"fzero\.data\.Curriculum: fixed_discrete needs non-decreasing difficulties \[8, 4\]"):
        Curriculum(min_difficulty=4, max_difficulty=8, schedule_type="fixed_discrete", difficulties=(8, 4), max_steps=(3,))
    with pytest.raises(ValueError, match=r"fzero\.data\.Curriculum: min_difficulty=0; it must be a positive int"):
        Curriculum(min_difficulty=0, max_difficulty=8, total_curriculum_step=3)
    with pytest.raises(ValueError, match=r"schedule_type='custom'; use one of"):
        Curriculum(min_difficulty=1, max_difficulty=8, schedule_type="custom")


def test_discrete_difficulties_as_a_range_or_numpy_ints_are_the_list():
    """A range or numpy ints for difficulties and max_steps were taken as the list before they were checked, and
    refused as "must be a list" after: they are the same schedule as the list."""
    np = pytest.importorskip("numpy")
    made = Curriculum(min_difficulty=8, max_difficulty=32, schedule_type="fixed_discrete", difficulties=range(8, 40, 8),
                      max_steps=[np.int64(2), np.int64(4), np.int64(6)])
    listed = Curriculum(min_difficulty=8, max_difficulty=32, schedule_type="fixed_discrete", difficulties=[8, 16, 24, 32],
                        max_steps=[2, 4, 6])
    assert made == listed and [made.difficulty(s) for s in range(8)] == [listed.difficulty(s) for s in range(8)]


def test_discrete_difficulties_dim_and_step_that_make_no_curriculum_are_named():
    """A difficulty of 0 cut every batch to no tokens, silently; 8.5 failed deep in ``narrow``; an int for the list and
    a step of None were raw TypeErrors; dim=-1 would cut a (batch,) label tensor as if it were the sequence."""
    discrete = {"min_difficulty": 8, "max_difficulty": 64, "schedule_type": "fixed_discrete"}
    block = {"enabled": True, **discrete, "schedule_config": {"difficulty": [0, 64], "max_step": [5]}}
    with pytest.raises(ValueError, match=r"from_deepspeed: curriculum_learning: difficulties=\[0, 64\] holds 0; each must be a positive int"):
        fzero.config.from_deepspeed({"curriculum_learning": block})
    with pytest.raises(ValueError, match=r"difficulties=8; it must be a list of sequence lengths"):
        Curriculum.from_deepspeed({**discrete, "schedule_config": {"difficulty": 8, "max_step": 5}})
    with pytest.raises(ValueError, match=r"Curriculum: difficulties=\[8.5, 64\] holds 8.5"):
        Curriculum(**discrete, difficulties=(8.5, 64), max_steps=(2,))
    with pytest.raises(ValueError, match=r"Curriculum: max_steps=\[-1\] holds -1"):
        Curriculum(**discrete, difficulties=(8, 64), max_steps=(-1,))
    with pytest.raises(ValueError, match=r"Curriculum: dim=-1; it must be an int >= 0"):
        Curriculum(min_difficulty=4, max_difficulty=16, total_curriculum_step=4, dim=-1)
    c = Curriculum(min_difficulty=4, max_difficulty=16, total_curriculum_step=4)
    with pytest.raises(TypeError, match=r"Curriculum: step=None; pass the optimizer steps taken so far"):
        c.apply({"x": torch.zeros(2, 16)}, None)
    with pytest.raises(TypeError, match=r"Curriculum.from_deepspeed: block must be the \"curriculum_learning\" dict"):
        Curriculum.from_deepspeed([block])


def test_a_config_that_enables_curriculum_or_layer_drop_is_refused_by_compile_unless_read_first(tmp_path):
    """DeepSpeed's engine applies curriculum_learning and progressive_layer_drop itself (curriculum_seqlen and pld_theta
    into the model's forward). compile(config=path) used to train on full sequences and every layer without a word:
    the blocks live in Settings, for the loop, and compile never handed them back. Refused by name with the recipe; the
    Settings read first are taken, and the loop cuts the batches as the error says."""
    import json

    block = {"enabled": True, "curriculum_type": "seqlen", "min_difficulty": 8, "max_difficulty": 16,
             "schedule_type": "fixed_linear", "schedule_config": {"total_curriculum_step": 2, "difficulty_step": 8}}
    prob = gpt_problem(steps=2)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"curriculum_learning": block}))
    with pytest.raises(ValueError, match=r"fzero\.compile: the config enables blocks that the training loop applies.*"
                                         r"curriculum_learning: cut each batch in the loop, step\(state, settings\.curriculum"
                                         r"\.apply\(batch, state\.step_count\)\).*settings = fzero\.config\.from_deepspeed"):
        fzero.compile(prob.loss_fn, config=str(path))
    with pytest.raises(ValueError, match=r"progressive_layer_drop: pass the step's draw to the model in loss_fn"):
        fzero.compile(prob.loss_fn, config={"progressive_layer_drop": {"enabled": True, "theta": 0.5, "gamma": 0.001}})
    fzero.compile(prob.loss_fn, config={"curriculum_learning": {**block, "enabled": False}})  # disabled: nothing to apply
    settings = fzero.config.from_deepspeed(str(path), world_size=1)
    step = fzero.compile(prob.loss_fn, config=settings)
    state = step.init(fzero.params_of(prob.model))
    for b in prob.batches:
        state, _ = step(state, settings.curriculum.apply(b, state.step_count))
    assert settings.curriculum.difficulty(0) == 8 and prob.batches[0]["x"].shape[1] == 16

"""The stage rules (``fzero/_rules.py``) and the one ZeRO model-state formula that compile, the config reader,
the estimator and ``fzero.memory`` share."""

from __future__ import annotations

import itertools

import pytest

import fzero
from fzero.config import from_deepspeed
from fzero.estimate import CHOICES
from fzero.memory import zero_model_state_bytes
from fzero import _rules
from problems import mlp_problem


def test_valid_combinations_are_the_ones_the_estimator_lists():
    assert _rules.combinations() == (
        (0, None, False), (1, None, False), (1, "cpu", False), (1, "nvme", False), (2, None, False), (2, "cpu", False),
        (2, "nvme", False), (3, None, False), (3, "cpu", False), (3, "cpu", True), (3, "nvme", False), (3, "nvme", True),
    )
    assert CHOICES == _rules.combinations()


def test_valid_is_check_offload_as_a_predicate():
    for stage, offload, params in itertools.product(range(5), (None, "cpu", "disk"), (False, True)):
        if stage not in _rules.STAGES:
            assert not _rules.valid(stage, offload, params)
            continue
        try:
            _rules.check_offload(stage, offload, params, api="test")
            raised = False
        except ValueError:
            raised = True
        assert _rules.valid(stage, offload, params) is not raised, (stage, offload, params)


@pytest.mark.parametrize("stage", [4, -1, True, "1", 1.0])
def test_check_stage_names_the_api_and_value(stage):
    with pytest.raises(ValueError, match=rf"api: stages must be 0, 1, 2 or 3 \(the ZeRO stage\), got {stage!r}"):
        _rules.check_stage(stage, api="api")


@pytest.mark.parametrize("stage, names, match", [
    (1, ["units"], r"^fzero.compile: units only apply at stages=2 or 3 \(units by module\), but stages=1. Drop units, or use stages=2 or 3.$"),
    (2, ["prefetch"], r"^fzero.compile: prefetch only applies at stages=3 \(sharded params\), but stages=2. Drop prefetch"),
    (0, ["offload"], r"offload needs stages >= 1 \(each rank offloads its shard of the optimizer state\), but stages=0"),
    (3, ["unit_elements"], r"unit_elements only applies at stages=0 or 1 .* but stages=3.* pass units=\('blocks.0', ...\)"),
    (0, ["units", "prefetch"], r"units only apply at stages=2 or 3 .* prefetch only applies at stages=3 .*but stages=0"),
])
def test_check_settings_names_the_setting_the_stage_and_the_fix(stage, names, match):
    with pytest.raises(ValueError, match=match):
        _rules.check_settings(stage, names, api="fzero.compile")


def test_settings_accepted_at_their_stages_pass():
    for setting, rule in _rules.SETTINGS.items():
        for stage in _rules.STAGES:
            assert _rules.accepts(setting, stage) == (stage in rule.stages)
            if stage in rule.stages:
                _rules.check_settings(stage, [setting], api="test")
    assert _rules.accepts("donate", 0)  # a setting without a stage rule applies everywhere


@pytest.mark.parametrize("args, match", [
    ((0, "cpu", False), r"^est: offload needs stages >= 1 .* but stages=0"),
    ((2, "cpu", True), r"^est: offload_params=True needs stages=3 \(param shards exist only at stage 3\), but stages=2"),
    ((3, None, True), r"^est: offload_params=True needs offload='cpu' or 'disk' .* but offload=None"),
])
def test_check_offload(args, match):
    with pytest.raises(ValueError, match=match):
        _rules.check_offload(*args, api="est")


def test_disk_offload_needs_donate():
    _rules.check_disk_donate("cpu", False, api="fzero.offload")
    _rules.check_disk_donate("disk", True, api="fzero.offload")
    with pytest.raises(ValueError, match=r"fzero.offload: offload='nvme' .* \(donate=False\). Build the step with donate=True"):
        _rules.check_disk_donate("nvme", False, api="fzero.offload")


def test_config_reader_states_offload_rules_by_its_keys():
    with pytest.raises(ValueError, match=r"zero_optimization.offload_optimizer needs zero_optimization.stage >= 1 .*"
                                         r"but zero_optimization.stage=0. Drop zero_optimization.offload_optimizer"):
        from_deepspeed({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ValueError, match=r"zero_optimization.stage must be 0, 1, 2 or 3 \(the ZeRO stage\), got 4"):
        from_deepspeed({"zero_optimization": {"stage": 4}})


def test_config_maps_unit_elements_only_where_it_applies():
    s = from_deepspeed({"zero_optimization": {"stage": 1, "reduce_bucket_size": 1000}})
    assert [("unit_elements" in s.compile_kwargs(stage)) for stage in _rules.STAGES] == [True, True, False, False]


@pytest.mark.parametrize("stages", [2, 3])
def test_compile_refuses_unit_elements_where_units_are_modules(stages):
    with pytest.raises(ValueError, match=r"fzero.compile: unit_elements only applies at stages=0 or 1 .* pass units="):
        fzero.compile(mlp_problem(steps=1).loss_fn, stages=stages, unit_elements=4096)


@pytest.mark.parametrize("precision, p, k", [("fp32", 4, 8), ("bf16", 2, 12)])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_one_formula_for_the_estimator_and_fzero_memory(stage, precision, p, k):
    formula = zero_model_state_bytes(7_500_000_000, stage=stage, world_size=64, param_bytes=p, grad_bytes=p, optimizer_bytes=k)
    est = fzero.estimate_memory(7.5e9, stages=stage, world_size=64, precision=precision)
    assert (est.device.params, est.device.grads, est.device.optimizer) == pytest.approx(
        (formula["params"], formula["grads"], formula["optimizer"]), rel=1e-12)
    assert est.model_states == pytest.approx(formula["total"], rel=1e-12)


def test_formula_checks_its_arguments():
    with pytest.raises(ValueError, match=r"fzero.memory.zero_model_state_bytes: stage must be 0, 1, 2 or 3"):
        zero_model_state_bytes(10, stage=4, world_size=1)
    with pytest.raises(ValueError, match=r"fzero.memory.zero_model_state_bytes: world_size must be >= 1"):
        zero_model_state_bytes(10, stage=1, world_size=0)

"""DeepSpeed's learning-rate schedulers as pure functions of the step count.

fzero evaluates a schedule at k = the number of optimizer steps already taken (0 at the first step). DeepSpeed's
engine calls ``optimizer.step()`` and then ``lr_scheduler.step()``, so the lr of its k-th step is the one its
scheduler holds after k calls to ``step()`` (the constructor's at k = 0). The formula tests below always run;
``test_equals_deepspeed`` drives DeepSpeed's own classes, when DeepSpeed is installed, and asserts equality bit
for bit at every step.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch

import fzero
import fzero.optim as fo


def values(schedule, steps):
    return [schedule(k) for k in steps]


# -- formulas at chosen steps ---------------------------------------------------------------------------------


def test_warmup_lr_log():
    s = fo.warmup_lr(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=10)  # warmup_type="log" by default
    assert s(0) == 0.0 and s(1) == 0.0  # constructor, then log(1) = 0 at the first scheduler step
    assert s(2) == pytest.approx(math.log(2) / math.log(10))
    assert s(10) == pytest.approx(1.0)
    assert s(11) == 1.0 and s(10_000) == 1.0
    assert all(isinstance(v, float) for v in values(s, range(12)))


def test_warmup_lr_linear():
    s = fo.warmup_lr(warmup_min_lr=0.2, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    assert values(s, [0, 1]) == [0.2, 0.2]
    assert s(2) == pytest.approx(0.2 + 0.8 / 4)
    assert s(4) == pytest.approx(0.2 + 0.8 * 3 / 4)  # (k - 1) / W: the max is reached one step after W
    assert values(s, [5, 99]) == [1.0, 1.0]
    # DeepSpeed warms up over at least 2 steps
    one = fo.warmup_lr(warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=1, warmup_type="linear")
    assert values(one, [0, 1, 2, 3]) == [0.0, 0.0, 0.5, 1.0]


def test_warmup_decay_lr():
    s = fo.warmup_decay_lr(total_num_steps=10, warmup_min_lr=0.0, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    assert s(3) == pytest.approx(0.5)
    assert s(5) == 1.0  # last_batch_iteration 4 = W: (10 - 4) / (10 - 4)
    assert s(8) == pytest.approx(0.5)  # (10 - 7) / 6
    assert values(s, [11, 12, 100]) == [0.0, 0.0, 0.0]
    # decays towards 0, not towards warmup_min_lr
    lo = fo.warmup_decay_lr(total_num_steps=10, warmup_min_lr=0.5, warmup_max_lr=1.0, warmup_num_steps=4, warmup_type="linear")
    assert lo(0) == 0.5 and lo(8) == pytest.approx(0.75) and lo(11) == 0.5


def test_warmup_cosine_lr():
    s = fo.warmup_cosine_lr(base_lr=2.0, total_num_steps=10, warmup_min_ratio=0.5, warmup_num_steps=4,
                            cos_min_ratio=0.1, warmup_type="linear")
    assert s(0) == 0.0  # DeepSpeed's constructor sets 0, not warmup_min_ratio * base_lr
    assert s(1) == pytest.approx(1.0)
    assert s(3) == pytest.approx(2.0 * (0.5 + 0.5 * 2 / 4))
    assert s(5) == pytest.approx(2.0 * (0.1 + 0.9 * (1 + math.cos(math.pi / 6)) / 2))
    assert s(10) == pytest.approx(0.2) and s(50) == pytest.approx(0.2)
    log = fo.warmup_cosine_lr(base_lr=1.0, total_num_steps=100, warmup_num_steps=10)
    assert log(2) == pytest.approx(math.log(2) / math.log(10)) and log(10) == pytest.approx(1.0)
    assert log(100) == pytest.approx(1e-4)  # cos_min_ratio's default


def test_lr_range_test():
    s = fo.lr_range_test(lr_range_test_min_lr=0.01, lr_range_test_step_size=10, lr_range_test_step_rate=2.0)
    assert s(0) == 0.01 and s(5) == pytest.approx(0.02) and s(25) == pytest.approx(0.06)
    stairs = fo.lr_range_test(lr_range_test_min_lr=0.01, lr_range_test_step_size=10, lr_range_test_step_rate=2.0,
                              lr_range_test_staircase=True)
    assert values(stairs, [0, 5, 9]) == [0.01] * 3
    assert stairs(10) == pytest.approx(0.03) and stairs(25) == pytest.approx(0.05)


def test_one_cycle_lr_and_momentum():
    s = fo.one_cycle(cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_second_step_size=6,
                     decay_lr_rate=0.5, decay_step_size=2, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.01)
    assert isinstance(s, fo.OneCycleSchedule) and callable(s.momentum)
    assert s(0) == 0.1 and s(2) == pytest.approx(0.55) and s(4) == pytest.approx(1.0)
    assert s(7) == pytest.approx(0.55)  # halfway down the 6-step second half
    assert s(10) == pytest.approx(0.1)  # end of the cycle
    assert s(14) == pytest.approx(0.1 / (1 + 0.5 * 4 / 2))  # decay: 4 steps past the cycle
    m = s.momentum
    assert m(0) == 0.8  # DeepSpeed's constructor sets cycle_min_mom; the cycle formula would give 0.9
    assert m(1) == pytest.approx(0.9 - 0.1 / 4) and m(4) == pytest.approx(0.8) and m(10) == pytest.approx(0.9)
    assert m(14) == pytest.approx(0.9 * (1 + 0.01 * 4 / 2))
    # an optimizer takes it as its learning rate (it is a Schedule), and the step reports it
    assert fo.adamw(s).learning_rate is s


def test_one_cycle_without_decay_stays_at_the_ends():
    s = fo.one_cycle(cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=3)
    assert s(6) == pytest.approx(0.1) and values(s, [7, 100]) == [0.1, 0.1]
    assert values(s.momentum, [7, 100]) == [0.9, 0.9]
    assert fo.one_cycle(cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_momentum=False).momentum is None


def test_one_cycle_stairs():
    s = fo.one_cycle(cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=4, cycle_second_step_size=6,
                     cycle_first_stair_count=2)  # the second half takes the first's stair count
    assert values(s, [0, 1]) == [0.1, 0.1]
    assert s(2) == pytest.approx(0.55) and s(3) == pytest.approx(0.55) and s(4) == pytest.approx(1.0)
    assert s(5) == pytest.approx(0.55)  # (10 - 5) * 2 / 6 = 1.67 stairs: floor 1 of 2
    assert s.momentum(2) == pytest.approx(0.85)


# -- input validation -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "call, exc, match",
    [
        (lambda: fo.warmup_lr(warmup_type="cosine"), ValueError,
         r"fzero\.optim\.warmup_lr: warmup_type must be 'log' or 'linear', got 'cosine'\..* Pass warmup_type="),
        (lambda: fo.warmup_lr(warmup_num_steps=0), ValueError, r"fzero\.optim\.warmup_lr: warmup_num_steps must be an int >= 1, got 0"),
        (lambda: fo.warmup_lr(warmup_num_steps=10.0), TypeError, r"warmup_lr: warmup_num_steps must be an int >= 1, got float 10\.0"),
        (lambda: fo.warmup_lr(warmup_max_lr=-1.0), ValueError, r"fzero\.optim\.warmup_lr: warmup_max_lr must be in \[0\.0, inf\], got -1\.0\. Learning rates are >= 0"),
        (lambda: fo.warmup_lr(0.0), TypeError, r"positional"),  # settings are keyword-only, as in a DeepSpeed config
        (lambda: fo.warmup_decay_lr(total_num_steps=5, warmup_num_steps=10), ValueError,
         r"fzero\.optim\.warmup_decay_lr: total_num_steps counts from step 0 and includes the warmup, so it must be >= "
         r"warmup_num_steps; got total_num_steps=5, warmup_num_steps=10\..* E\.g\. warmup_num_steps=1000"),
        (lambda: fo.warmup_decay_lr(total_num_steps=0), ValueError, r"warmup_decay_lr: total_num_steps must be an int >= 1, got 0"),
        (lambda: fo.warmup_cosine_lr(base_lr=1e-3, total_num_steps=100, warmup_num_steps=10, cos_min_ratio=1.5), ValueError,
         r"fzero\.optim\.warmup_cosine_lr: cos_min_ratio must be in \[0\.0, 1\.0\], got 1\.5\. It is a fraction of base_lr"),
        (lambda: fo.warmup_cosine_lr(base_lr="1e-3", total_num_steps=100), TypeError, r"warmup_cosine_lr: base_lr must be a float .* got str '1e-3'"),
        (lambda: fo.warmup_cosine_lr(base_lr=1e-3, total_num_steps=100, warmup_num_steps=10, warmup_type="Log"), ValueError,
         r"warmup_cosine_lr: warmup_type must be 'log' or 'linear', got 'Log'"),
        (lambda: fo.one_cycle(cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_first_step_size=0), ValueError,
         r"fzero\.optim\.one_cycle: cycle_first_step_size must be an int >= 1, got 0"),
        (lambda: fo.one_cycle(cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_second_step_size=-1), ValueError,
         r"one_cycle: cycle_second_step_size must be an int >= 0, got -1"),
        (lambda: fo.one_cycle(cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_max_mom=1.0), ValueError,
         r"fzero\.optim\.one_cycle: cycle_max_mom must be in \[0\.0, 1\.0\), got 1\.0\. Typical: 0\.95"),
        (lambda: fo.one_cycle(cycle_min_lr=0.1, cycle_max_lr=1.0, cycle_momentum="yes"), TypeError,
         r"one_cycle: cycle_momentum must be a bool, got str 'yes'"),
        (lambda: fo.one_cycle(cycle_min_lr=-0.1, cycle_max_lr=1.0), ValueError, r"one_cycle: cycle_min_lr must be in \[0\.0, inf\], got -0\.1"),
        (lambda: fo.lr_range_test(lr_range_test_step_size=2.5), TypeError,
         r"fzero\.optim\.lr_range_test: lr_range_test_step_size must be an int >= 1, got float 2\.5"),
        (lambda: fo.lr_range_test(lr_range_test_staircase=1), TypeError, r"lr_range_test: lr_range_test_staircase must be a bool, got int 1"),
        (lambda: fo.warmup_lr()(-1), ValueError, r"fzero\.optim\.warmup_lr: the step count must be >= 0, got -1\. Schedules count steps already taken, from 0"),
        (lambda: fo.one_cycle(cycle_min_lr=0.1, cycle_max_lr=1.0).momentum(-2), ValueError, r"one_cycle: the step count must be >= 0, got -2"),
    ],
)
def test_errors_name_the_function_the_value_and_the_fix(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


# -- against DeepSpeed's own scheduler classes (when DeepSpeed is installed) -------------------------------------------

CASES = {
    "warmup_log": ("WarmupLR", dict(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=7, warmup_type="log")),
    "warmup_linear": ("WarmupLR", dict(warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=7, warmup_type="linear")),
    "warmup_one_step": ("WarmupLR", dict(warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=1, warmup_type="linear")),
    "decay_log": ("WarmupDecayLR", dict(total_num_steps=30, warmup_min_lr=0.001, warmup_max_lr=0.1, warmup_num_steps=6, warmup_type="log")),
    "decay_linear": ("WarmupDecayLR", dict(total_num_steps=30, warmup_min_lr=0.0, warmup_max_lr=0.1, warmup_num_steps=6, warmup_type="linear")),
    "cosine_log": ("WarmupCosineLR", dict(total_num_steps=30, warmup_min_ratio=0.1, warmup_num_steps=6, cos_min_ratio=0.01, warmup_type="log")),
    "cosine_linear": ("WarmupCosineLR", dict(total_num_steps=30, warmup_min_ratio=0.0, warmup_num_steps=6, cos_min_ratio=0.0001, warmup_type="linear")),
    "one_cycle": ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, decay_lr_rate=0.3, cycle_first_step_size=5,
                                   cycle_second_step_size=7, decay_step_size=3, cycle_min_mom=0.85, cycle_max_mom=0.95,
                                   decay_mom_rate=0.01)),
    "one_cycle_stairs": ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=6, cycle_second_step_size=9,
                                          cycle_first_stair_count=3, cycle_second_stair_count=2)),
    "one_cycle_no_decay": ("OneCycle", dict(cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4)),
    "range_continuous": ("LRRangeTest", dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=3, lr_range_test_step_rate=0.5)),
    "range_staircase": ("LRRangeTest", dict(lr_range_test_min_lr=0.001, lr_range_test_step_size=3, lr_range_test_step_rate=0.5,
                                            lr_range_test_staircase=True)),
}
FZERO = {"WarmupLR": fo.warmup_lr, "WarmupDecayLR": fo.warmup_decay_lr, "WarmupCosineLR": fo.warmup_cosine_lr,
         "OneCycle": fo.one_cycle, "LRRangeTest": fo.lr_range_test}
BASE_LR = 0.05  # the optimizer's lr: WarmupCosineLR scales it (fzero: base_lr)
STEPS = 45  # past every warmup, cycle and decay above


@pytest.mark.parametrize("case", list(CASES))
def test_equals_deepspeed(case):
    lr_schedules = pytest.importorskip("deepspeed.runtime.lr_schedules")
    name, kwargs = CASES[case]
    param = torch.zeros(1, requires_grad=True)
    # OneCycle cycles momentum only for optimizers with betas; others need just an lr.
    optimizer = torch.optim.Adam([param], lr=BASE_LR) if name == "OneCycle" else torch.optim.SGD([param], lr=BASE_LR)
    scheduler = getattr(lr_schedules, name)(optimizer, **kwargs)
    ours = FZERO[name](**kwargs, **({"base_lr": BASE_LR} if name == "WarmupCosineLR" else {}))
    for k in range(STEPS):
        group = optimizer.param_groups[0]  # what DeepSpeed's k-th optimizer.step() reads
        assert ours(k) == group["lr"], f"{case}: lr at step {k}"
        if name == "OneCycle":
            assert ours.momentum(k) == group["betas"][0], f"{case}: momentum at step {k}"
            assert group["betas"][1] == 0.99  # DeepSpeed's fixed second beta (fzero leaves b2 alone)
        scheduler.step()  # after optimizer.step(), as DeepSpeed's engine does


@pytest.mark.parametrize("stages", [0, 3])
def test_an_lr_the_loop_sets_between_steps_is_the_one_applied_and_reported(stages):
    """docs/migrating.md: a schedule is called on the host at every step, so one that reads a value the loop sets
    (ReduceLROnPlateau's way, torch's param_group["lr"] = x) applies that value: SGD moves each param by lr * grad."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    lr = {"now": 0.1}
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), optimizer=fzero.optim.sgd(lambda t: lr["now"]),
                         stages=stages, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    x = torch.randn(4, 4)
    moved = []
    for value in (0.1, 0.0, 0.05):
        lr["now"] = value
        before = {k: t.clone() for k, t in step.gather(state).items()}
        state, m = step(state, x)
        assert m["lr"] == value
        moved.append(max(float((step.gather(state)[k] - before[k]).abs().max()) for k in before))
    assert moved[0] > 0 and moved[1] == 0.0 and moved[2] > 0


@pytest.mark.parametrize("stages, ranks, offload", [(0, 1, None), (0, 2, None), (2, 2, None), (3, 2, "cpu"), (1, 2, "nvme")])
def test_a_schedule_is_called_once_per_step_and_the_lr_reported_is_the_lr_applied(stages, ranks, offload, tmp_path):
    """Found by a sweep of habits: a schedule with Python state (a closure that counts its calls, as a LambdaLR user
    writes one) was called twice per step on one rank (once for metrics["lr"] and its check, once by the update) and
    four times on a local_mesh(2), in the order the rank threads ran: metrics["lr"] said 5e-3 where 2.5e-3 was applied,
    and at stage 0 the two ranks applied different rates, so their replicas drifted apart (1e-3 after one SGD step),
    silently. Now a step calls each schedule once for all its ranks and readers, and the update applies what
    metrics["lr"] reports: SGD moves each param by exactly lr * grad."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    calls = []

    def halving(t):  # a schedule that counts its own calls
        calls.append(t)
        return 0.1 * 0.5 ** len(calls)

    if offload == "nvme":
        offload = fzero.DiskOffload(tmp_path)
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), optimizer=fzero.optim.sgd(halving),
                         stages=stages, mesh=fzero.local_mesh(ranks), offload=offload)
    state = step.init(fzero.params_of(model))
    x = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(1))
    for k, b in enumerate(x):
        before = step.gather(state)
        ref = copy.deepcopy(model)
        ref.load_state_dict(before)
        ref(b).pow(2).mean().backward()
        state, m = step(state, b)
        assert calls == list(range(k + 1))  # once per step, with the steps already taken
        assert m["lr"] == 0.1 * 0.5 ** (k + 1)
        after = step.gather(state)
        for name, p in ref.named_parameters():
            torch.testing.assert_close(after[name], before[name] - m["lr"] * p.grad, rtol=0, atol=1e-7)
        if ranks > 1 and stages == 0:  # the replicas are one model
            for name, t in state.states[0].params.items():
                assert torch.equal(t, state.states[1].params[name])


def test_a_bound_method_schedule_of_two_groups_is_called_once_per_step():
    """Found in review: a schedule known by id() was called once per step as a function but twice as a bound method
    given to two groups (``sgd(s.lr)`` twice: two bound-method objects of one method), so a schedule object that
    counts its calls counted two per step."""
    class Counting:
        def __init__(self):
            self.calls = []

        def lr(self, t):
            self.calls.append(t)
            return 0.1

    s = Counting()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    opt = fo.multi_transform({"a": fo.sgd(s.lr), "b": fo.sgd(s.lr)},
                             lambda params: {k: "a" if k.startswith("0") else "b" for k in params})
    step = fzero.compile(lambda p, b: fzero.apply(model, p, b).pow(2).mean(), optimizer=opt, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(model))
    for _ in range(2):
        state, _ = step(state, torch.randn(4, 4))
    assert s.calls == [0, 1]

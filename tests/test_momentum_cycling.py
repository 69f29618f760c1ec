"""OneCycle's momentum cycling: Adam's b1 as a schedule equals torch's Adam with betas rewritten per step
(what DeepSpeed's OneCycle scheduler does to the param groups)."""

import pytest
import torch

import fzero
from fzero.testing import assert_trees_equal


@pytest.mark.parametrize("fused", [True, False])
def test_adamw_b1_schedule_equals_torch_with_cycled_betas(fused):
    sched = fzero.optim.one_cycle(cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=3,
                                  cycle_min_mom=0.8, cycle_max_mom=0.95)
    assert len({sched.momentum(k) for k in range(8)}) > 3  # it does cycle
    gen = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(37, generator=gen), "b": torch.randn(5, 3, generator=gen)}
    grads = [{k: torch.randn(v.shape, generator=gen) for k, v in params.items()} for _ in range(8)]

    ref = {k: v.clone() for k, v in params.items()}
    opt = torch.optim.AdamW(list(ref.values()), lr=sched(0), betas=(sched.momentum(0), 0.999), weight_decay=0.01, fused=fused)
    mine = fzero.optim.adamw(sched, b1=sched.momentum, weight_decay=0.01)
    if not fused:
        mine = mine._replace(fused=None)  # the pure update path
    ours = {k: v.clone() for k, v in params.items()}
    state = mine.init(ours)
    for k, g in enumerate(grads):
        for group in opt.param_groups:
            group["lr"], group["betas"] = sched(k), (sched.momentum(k), 0.999)
        for p, gp in zip(ref.values(), g.values()):
            p.grad = gp.clone()
        opt.step()
        state = fzero.optim.apply_inplace(mine, g, state, ours)
        if fused:
            assert_trees_equal(ours, ref)
        else:
            torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)

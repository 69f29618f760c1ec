"""The pure train step: state, one rank's program, the gradient and the update."""

# What other packages use of this one (they import it from here, never from a private module):
from fzero.step._context import (
    as_in_forward,
    buffers_for_run,
    call_module,
    cast_floating,
    current_buffers,
    current_compute_dtype,
    current_scope,
    current_writes,
    live_buffers,
    module_for_thread,
    recompute_scope,
    recording,
    replaying,
    Snapshots,
)
from fzero.step._module import apply, apply_dict
from fzero.step._params import buffers_of, free_frozen, frozen_of, module_device, params_of, replace_params
from fzero.step._parts import GradsAllReduce, OnDevice, OptStateReplicated, View
from fzero.step._protocols import GradsPart, OffloadPolicy, OptStatePart, ParamsPart, UnitSettings
from fzero.step._pool import (
    alloc_memory,
    can_move,
    forget,
    free_memory,
    give,
    move_into,
    Pool,
    take,
)
from fzero.step._update import DynamicLossScale, MAX_LOSS_SCALE, policy, Precision, StaticLossScale
from fzero.step._state import group_labels, keeps_groups_shared, moved_params, shares_group_state, is_busy, is_donated, made_by, RankStates, TrainState, whole_frozen
from fzero.layout import has_grad_hooks
from fzero.step._module_refusals import check_no_grad_hooks, check_trainable_set, trainable_changes
from fzero.step._refusals import check_export_model
from fzero.step._hints import DATA_WRITE, PARAM_WRITE_FIX
from fzero.step._batch import batch_rows, per_row_items, record_list, rows_listed
from fzero.step._step import Step
from fzero.step._train_step import as_step, check_details, train_step
from fzero.step._update import apply_update, MasterState, ZeroGradientWarning
from fzero.step import _context as usage  # the usage record (which params the gradients used), by namespace

"""How a params pytree maps to flat unit buffers, shards and per-parameter segments."""

# What other packages use of this one (they import it from here, never from a private module):
from fzero.layout._empty import empty_params, META_BUFFER_FIX
from fzero.layout._modules import Binding, bound, check_no_meta, clone_structure, freed, named_tensors, walk, Writes, HeldStreams, RANDOM_STREAMS
from fzero.layout._modules import compiled_in_place, compiled_wrapper, has_grad_hooks, same_values, value_changes
from fzero.layout._layout import (
    build_frozen,
    build_layout,
    frozen_key,
    frozen_regions,
    frozen_views,
    DEFAULT_UNIT_ELEMENTS,
    device_of,
    DEVICE_TYPES,
    Layout,
    pack_frozen,
    LayoutSegments,
    ROOT,
    SHARD_ALIGN,
    Slot,
    split_sizes,
    Unit,
    units_by_size,
)
from fzero.layout._units import by_container_child, by_prefixes, check_units_exist, units_of
from fzero.layout import _tree as pytrees

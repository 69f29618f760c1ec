"""``fzero.checkpoint.from_deepspeed``: a run started under DeepSpeed ZeRO goes on under fzero, optimizer state and all.

DeepSpeed's ``engine.save_checkpoint(save_dir)`` writes ``save_dir/latest`` (the tag, e.g. ``global_step500``) and
``save_dir/<tag>/`` with one model-states file (stages 1-2: ``mp_rank_00_model_states.pt``; stage 3: one per rank,
``zero_pp_rank_<r>_mp_rank_00_model_states.pt``) and one optimizer-states file per data-parallel rank
(``zero_pp_rank_<r>_mp_rank_00_optim_states.pt``; ``bf16_`` in front for its bf16 optimizer). The model-states file
names the trainable parameters in order (``param_shapes``, one dict per parameter group) and holds the buffers; each
optimizer-states file holds that rank's partition of the fp32 masters and of the base optimizer's state (Adam's
``exp_avg``, ``exp_avg_sq`` and ``step``), flat, one tensor per parameter group (stages 1-2) or per sub-group (stage 3).

How a parameter's elements are found (as DeepSpeed's own ``zero_to_fp32.py`` reassembles the masters):

- stages 1-2: a group's parameters lie one after another (plus DeepSpeed's per-parameter alignment padding, where it
  records one) in one flat buffer, cut into the ranks' partitions in rank order; padding is at the end of the last;
- stage 3: every parameter is cut alone into ``ceil(numel / N)`` elements per rank, and rank r's partitions of all
  parameters lie one after another across its sub-groups; a parameter is rank 0's piece, then rank 1's, ..., cut
  to its size.

The same walk reads ``exp_avg`` and ``exp_avg_sq``, which have the masters' layout. The state is then laid out for
``like`` (any stage, world size, mesh and precision policy) through the per-parameter entries ``fzero.checkpoint.load``
fills (``fzero.checkpoint._state``), each rank reading only the pieces it will hold.

Reading is safe: files are opened with ``torch.load(weights_only=True, mmap=True)``. DeepSpeed pickles four of its
own classes into them (its loss scalers, ``ZeroStageEnum``, ``fragment_address``); each is read as an inert stand-in
that keeps the pickled attributes and runs nothing, so DeepSpeed need not be installed and no code in the files runs.
"""

from __future__ import annotations

import dataclasses
import glob
import math
import os
import re
from typing import Any

import torch

from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._files import HF_WEIGHTS, TORCH_OPTIMIZERS, fzero_names
from fzero.checkpoint._load import _target
from fzero.checkpoint._state import dests, entries, held, with_saved_buffers
from fzero.step import RankStates, TrainState

API = "fzero.checkpoint.from_deepspeed"

# -- reading DeepSpeed's files without DeepSpeed ------------------------------------------------------------------------


class _Stub:
    """A DeepSpeed object as its file describes it: the constructor's arguments (an enum's value) and the attributes
    (``__dict__``) it was pickled with. Nothing of DeepSpeed runs."""

    ds_name = ""

    def __init__(self, *args: Any) -> None:
        self.args = args

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})

    def __repr__(self) -> str:
        return f"<{self.ds_name} {getattr(self, 'args', None) or self.__dict__}>"  # unpickled: no __init__, no args


_DS_CLASSES = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)
_STUBS = [(type(name.rsplit(".", 1)[1], (_Stub,), {"ds_name": name}), name) for name in _DS_CLASSES]


def _read(path: str) -> Any:
    try:
        with torch.serialization.safe_globals(_STUBS):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - named with the file, and what to do
        raise CheckpointError(
            f"{API}: cannot read {path} ({type(e).__name__}: {str(e).splitlines()[0][:300]}). fzero reads DeepSpeed's "
            f"files with torch.load(weights_only=True), allowing only tensors, plain containers and DeepSpeed's "
            f"{', '.join(n.rsplit('.', 1)[1] for n in _DS_CLASSES)} as inert stand-ins; a file holding other objects (a "
            f"client_state with your own classes, a DeepSpeed version that pickles more) is refused rather than run. "
            f"Save without them, or convert the checkpoint with DeepSpeed's zero_to_fp32.py (weights only)."
        ) from None


def find_tag_folder(path: str | os.PathLike, tag: str | None) -> str:
    """The ``global_step*`` folder: ``path/<tag>``, ``path/<the tag in path/latest>``, or ``path`` itself."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{API}: path must be the save_dir given to engine.save_checkpoint (a str or os.PathLike), got "
                        f"{type(path).__name__}.")
    if tag is not None and not isinstance(tag, str):
        raise TypeError(f"{API}: tag={tag!r}; it is a folder name in the save_dir, a str such as 'global_step{tag}'.")
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{API}: {path!r} is not a directory; pass the save_dir given to engine.save_checkpoint, "
                                f"or one of its global_step* folders.")
    if tag is None and glob.glob(os.path.join(path, "*_optim_states.pt")):
        return path
    _refuse_other_formats(path)
    if tag is None:
        latest = os.path.join(path, "latest")
        if not os.path.isfile(latest):
            raise FileNotFoundError(
                f"{API}: {path!r} holds no DeepSpeed optimizer states (*_optim_states.pt) and no 'latest' file naming a "
                f"tag. Pass the save_dir of engine.save_checkpoint, one of its global_step* folders, or tag='global_stepN'."
            )
        with open(latest) as f:
            tag = f.read().strip()
        if not tag:
            raise CheckpointError(f"{API}: {latest} is empty (a save interrupted while writing it?); pass tag='global_stepN' "
                                  f"naming one of the folders in {path!r}.")
    folder = os.path.join(path, tag)
    if not tag or not os.path.isdir(folder):
        raise FileNotFoundError(f"{API}: the tag {tag!r} has no folder in {path!r}.")
    _refuse_other_formats(folder)
    return folder


def _refuse_other_formats(path: str) -> None:
    """DeepSpeed's other outputs, named: a universal checkpoint (``ds_to_universal.py``: one folder per parameter under
    ``zero/``) and the weights-only files of ``zero_to_fp32.py``."""
    if os.path.isdir(os.path.join(path, "zero")) and not glob.glob(os.path.join(path, "*_optim_states.pt")):
        raise NotImplementedError(
            f"{API}: {path!r} is a DeepSpeed universal checkpoint (ds_to_universal.py: a zero/<param>/ folder per "
            f"parameter), which fzero does not read. Pass the global_stepN folder it was converted from (fzero reshards "
            f"that to any stage and world size itself)."
        )
    names = set(os.listdir(path))
    if fzero_names(names):
        raise CheckpointError(f"{API}: {path!r} is an fzero checkpoint (fzero.checkpoint.save), not DeepSpeed's: resume it "
                              f"with fzero.checkpoint.load(path, step).")
    weights = [f for f in HF_WEIGHTS if f in names]
    if weights and not glob.glob(os.path.join(path, "*_model_states.pt")):
        torch_optimizer = [f for f in TORCH_OPTIMIZERS if f in names]
        raise CheckpointError(  # a Trainer's checkpoint-N has a torch optimizer's state beside them, which fzero does not read
            f"{API}: {path!r} holds weights only ({weights[0]}: zero_to_fp32.py's output, or save_pretrained's), no DeepSpeed "
            f"optimizer state to resume"
            + (f" (its {torch_optimizer[0]} is a torch optimizer's, a Hugging Face Trainer's or Accelerate's, which fzero "
               f"does not read: the optimizer starts afresh)" if torch_optimizer else "")
            + ". Load them into the model (model.load_state_dict / from_pretrained) and start with "
            "step.init(fzero.params_of(model)), or pass the DeepSpeed checkpoint they were converted from."
        )


# -- where each parameter's elements are ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Piece:
    rank: int
    group: int
    start: int
    stop: int


class DeepSpeedCheckpoint:
    """The trainable parameters of one DeepSpeed ZeRO checkpoint folder, each readable whole: fp32 master,
    ``exp_avg``, ``exp_avg_sq``; its step counts and buffers."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        model_files = sorted(glob.glob(os.path.join(folder, "*model_states.pt")), key=_rank_of)
        optim_files = sorted(glob.glob(os.path.join(folder, "*_optim_states.pt")), key=_rank_of)
        if not model_files or not optim_files:
            raise CheckpointError(
                f"{API}: {folder} lacks DeepSpeed's model-states or optimizer-states files (*_model_states.pt, "
                f"*_optim_states.pt); it is not a ZeRO checkpoint of engine.save_checkpoint (a ZeRO stage 0 run keeps its "
                f"optimizer in the model-states file: load the weights into the model and start the optimizer afresh)."
            )
        self.model_files = model_files
        self.model = _read(model_files[0])
        for key in ("param_shapes", "buffer_names", "module"):
            if key not in self.model:
                raise CheckpointError(f"{API}: {model_files[0]} has no {key!r}: not a DeepSpeed model-states file.")
        self.optim = [_read(f)["optimizer_state_dict"] for f in optim_files]
        first = self.optim[0]
        stage = first.get("zero_stage")
        self.stage = int(stage.args[0]) if isinstance(stage, _Stub) and stage.args else (1 if stage is None else int(stage))
        counts = first.get("partition_count")
        counts = counts if isinstance(counts, (list, tuple)) else [counts]
        if len(set(counts)) != 1:
            raise NotImplementedError(
                f"{API}: {folder}'s parameter groups are partitioned over different numbers of ranks ({list(counts)}), "
                f"as DeepSpeed's mixture-of-experts groups are; fzero shards every parameter over one mesh."
            )
        self.world = int(counts[0])
        if self.world != len(optim_files):
            raise CheckpointError(
                f"{API}: {folder} was saved by {self.world} ranks but holds {len(optim_files)} optimizer-states files; a "
                f"rank's file is missing (or another run's is mixed in)."
            )
        if self.stage == 3 and first.get("ds_zero_partition_groups"):
            raise NotImplementedError(f"{API}: {folder} uses ZeRO-3 partition groups (hpZ / MiCS); fzero reads checkpoints "
                                      f"partitioned over all data-parallel ranks only.")
        self.groups = [dict(g) for g in self.model["param_shapes"]]
        self.shapes = {n: tuple(s) for g in self.groups for n, s in g.items()}
        self._pieces = self._stage3_pieces() if self.stage == 3 else self._stage12_pieces()

    # the per-rank flat tensors: masters, and the base optimizer's state in their layout
    def _base_state(self, rank: int) -> dict[int, dict[str, Any]]:
        o = self.optim[rank]
        base = o.get("base_optimizer_state", o.get("optimizer_state_dict"))
        if not isinstance(base, dict) or "state" not in base:
            raise CheckpointError(f"{API}: rank {rank}'s optimizer-states file in {self.folder} has no base optimizer state.")
        return base["state"]

    def _not_stepped(self) -> bool:
        """No rank's optimizer has stepped yet: an fp16 run saved while every step so far overflowed (and was skipped).
        Adam's state is then made at its first step: moments 0, count 0."""
        return all(not self._base_state(r) for r in range(self.world))

    def flat(self, kind: str, rank: int, group: int) -> torch.Tensor:
        if kind == "fp32":
            o = self.optim[rank]
            flats = o.get("single_partition_of_fp32_groups") if self.stage < 3 else o.get("fp32_flat_groups")
            return flats[group].reshape(-1)
        state = self._base_state(rank).get(group, {})
        if kind in ("exp_avg", "exp_avg_sq") and self._not_stepped():
            return torch.zeros_like(self.flat("fp32", rank, group))
        if kind not in state:
            have = sorted({k for s in self._base_state(rank).values() for k in s})
            raise NotImplementedError(
                f"{API}: the optimizer in {self.folder} keeps {have}, not Adam's {kind!r}; fzero resumes Adam and AdamW "
                f"states (torch.optim.Adam/AdamW, DeepSpeed's FusedAdam and DeepSpeedCPUAdam)."
            )
        return state[kind].reshape(-1)

    def _stage12_pieces(self) -> dict[str, list[_Piece]]:
        pads = self.optim[0].get("param_alignment_paddings")
        flats = self.optim[0].get("single_partition_of_fp32_groups") or ()
        if len(self.groups) != len(flats):
            raise CheckpointError(f"{API}: {self.folder}'s model-states file has {len(self.groups)} parameter groups, its "
                                  f"optimizer-states files {len(flats)}: the files do not belong together (another run's, "
                                  f"or another model's, are mixed in).")
        out = {}
        for g, shapes in enumerate(self.groups):
            lengths = [self.flat("fp32", r, g).numel() for r in range(self.world)]
            starts = [sum(lengths[:r]) for r in range(self.world)]
            pad = pads[g] if pads and g < len(pads) and pads[g] else [0] * len(shapes)
            need = sum(math.prod(x) for x in shapes.values()) + sum(pad)
            # DeepSpeed pads a group's flat buffer to a multiple of 2 x ranks (its NCCL alignment), at the end
            if len(pad) != len(shapes) or not sum(lengths) - 2 * self.world < need <= sum(lengths):
                raise CheckpointError(
                    f"{API}: in {self.folder}, parameter group {g}'s {len(shapes)} parameters (model-states file) need "
                    f"{need} elements, and its optimizer-states files hold {sum(lengths)} ({len(pad)} parameters): the "
                    f"files do not belong together (another run's, or another model's, are mixed in)."
                )
            at = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = math.prod(shape)
                out[name] = [_Piece(r, g, max(at, s) - s, min(at + n, s + length) - s)
                             for r, (s, length) in enumerate(zip(starts, lengths)) if max(at, s) < min(at + n, s + length)]
                at += n + pad[i]
        return out

    def _stage3_pieces(self) -> dict[str, list[_Piece]]:
        sizes = [self.flat("fp32", 0, i).numel() for i in range(len(self.optim[0]["fp32_flat_groups"]))]
        bounds = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        out, at = {}, 0
        for name, shape in self.shapes.items():
            n = math.prod(shape)
            part = math.ceil(n / self.world)
            pieces, left = [], n
            for r in range(self.world):  # rank r's [at, at + part) of its stream, over its sub-groups, cut to n in all
                take = min(part, left)
                a, b = at, at + take
                for i in range(len(sizes)):
                    lo, hi = max(a, bounds[i]), min(b, bounds[i + 1])
                    if lo < hi:
                        pieces.append(_Piece(r, i, lo - bounds[i], hi - bounds[i]))
                left -= take
            out[name] = pieces
            at += part
        if at > bounds[-1]:
            raise CheckpointError(f"{API}: {self.folder}'s parameters need {at} elements per rank, its files hold "
                                  f"{bounds[-1]}: the model-states file does not match the optimizer-states files.")
        return out

    def full(self, kind: str, name: str) -> torch.Tensor:
        """Parameter ``name``'s ``kind`` ("fp32", "exp_avg", "exp_avg_sq"), flat, fp32."""
        parts = [self.flat(kind, p.rank, p.group)[p.start:p.stop] for p in self._pieces[name]]
        return torch.cat(parts).float() if len(parts) != 1 else parts[0].float()

    def adam_step(self) -> int:
        """The base optimizer's step count (every parameter group's, which must agree)."""
        steps = set()
        for r in range(self.world):
            for s in self._base_state(r).values():
                if "step" in s:
                    steps.add(int(s["step"]))
        if not steps and self._not_stepped():
            return 0
        if len(steps) != 1:
            raise CheckpointError(f"{API}: the Adam step counts in {self.folder} differ between groups or ranks ({sorted(steps)}).")
        return steps.pop()

    def frozen(self) -> dict[str, torch.Tensor]:
        """The parameters the optimizer does not hold (``requires_grad=False``), whole, by name. Stages 2-3 save them
        apart (``frozen_param_fragments``: the whole tensor at stage 2, each rank's partition in its own model-states
        file at stage 3); stage 1 only in the module's state dict, beside the trainable ones, the tied aliases
        (``shared_params``) and the buffers."""
        shapes = self.model.get("frozen_param_shapes")
        if shapes:
            if self.stage == 3:
                parts = [self.model["frozen_param_fragments"]] + [_read(f)["frozen_param_fragments"] for f in self.model_files[1:]]
                return {n: torch.cat([p[n].reshape(-1) for p in parts])[:math.prod(s)].reshape(tuple(s)).clone()
                        for n, s in shapes.items()}
            return {n: self.model["frozen_param_fragments"][n].reshape(tuple(s)).clone() for n, s in shapes.items()}
        if self.stage == 3:
            return {}  # saved with exclude_frozen_parameters=True (or none frozen): the module holds placeholders only
        skip = set(self.shapes) | set(self.model["buffer_names"]) | set(self.model.get("shared_params") or ())
        return {k: v.clone() for k, v in self.model["module"].items() if k not in skip and isinstance(v, torch.Tensor)}

    def buffers(self) -> dict[str, torch.Tensor]:
        names = set(self.model["buffer_names"])
        return {k: v.clone() for k, v in self.model["module"].items() if k in names}


def _rank_of(path: str) -> int:
    found = re.search(r"rank_(\d+)_", os.path.basename(path))
    return int(found.group(1)) if found else 0


# -- the fzero state -----------------------------------------------------------------------------------------------


def from_deepspeed(path: str | os.PathLike, like: Any, *, tag: str | None = None, model: Any = None) -> TrainState | RankStates:
    """The state of a DeepSpeed ZeRO checkpoint (stage 1, 2 or 3, any world size; ``engine.save_checkpoint``), laid
    out for ``like``: the ``Step`` to go on with (its stage, mesh and precision; the params are rebuilt from
    DeepSpeed's names and shapes, in DeepSpeed's order), or a state from its ``init`` (``step.init(fzero.params_of(
    model))``: the model's order and names, checked against the checkpoint's).

    ``path``: the ``save_dir`` given to ``save_checkpoint`` (its ``latest`` tag, or ``tag=``), or a ``global_step*``
    folder. The fp32 masters (the params in the step's compute dtype are their cast), Adam's moments and step count,
    the step and the buffers come from the checkpoint. The optimizer must be Adam or AdamW on both sides (its
    hyper-parameters are the step's), and the step count is the optimizer's: steps DeepSpeed skipped for an fp16
    overflow are not counted, as fzero does not count them. An fp16 run's dynamic loss scale resumes whole (the scale,
    the clean steps since the last overflow and the hysteresis left); a run without one leaves the step's own initial
    loss scale. Under torchrun every rank calls it; each reads the pieces it holds. DeepSpeed need not be installed.

    ``model``: the module the step runs, to put the checkpoint's frozen parameters (``requires_grad=False``, which
    DeepSpeed saves with the module and fzero reads from the module) into, by name, strict. A checkpoint that holds
    frozen parameters is refused without it: the run would resume on whatever values the module was built with.
    With ``like=step`` the params are rebuilt on the kind of device ``model`` is on (a CUDA model: this process's
    current CUDA device); without ``model``, on the host (DeepSpeed's checkpoint does not say where it ran): pass
    ``like=step.init(params)`` to choose.
    """
    folder = find_tag_folder(path, tag)
    ds = DeepSpeedCheckpoint(folder)
    _load_frozen(ds, model, folder)
    info = {"params_tree": "dict", "params": [{"name": n, "shape": list(s)} for n, s in ds.shapes.items()],
            "packing_order": list(ds.shapes), "master": True}
    if model is not None:  # like=step rebuilds the params where the model computes (DeepSpeed does not record it)
        info["device"] = next((t.device.type for t in [*model.parameters(), *model.buffers()] if not t.is_meta), "cpu")
    target = _target(like, info, folder, API)
    states, _distributed = held(target, API)
    buffers = ds.buffers()
    states = [with_saved_buffers(s, {"buffers": [{"name": k, "shape": list(v.shape), "dtype": str(v.dtype).removeprefix("torch.")}
                                                 for k, v in buffers.items()]}) for s in states]
    _check_names(ds, states[0], folder)
    step = ds.adam_step()
    first = entries(states[0], api=API)
    kinds = _kinds(first, folder)  # every rank state holds the same entries
    scale = _loss_scale(ds, states[0])
    info.update({"loss_scale": list(scale) or None, "opt": [{"key": k} for k in first.tensors if k.startswith("opt/")],
                 "buffers": [{"name": k} for k in buffers]})
    for state in states:
        current: tuple[str, str, torch.Tensor] | None = None
        for d in dests(state, entries(state, api=API), info):
            prefix, _, name = d.fqn.rpartition("/")  # "<entry>/<param>" (an entry may hold a "/": "opt/0.mu")
            if prefix in kinds or prefix in ("master", "params"):
                kind = kinds.get(prefix, "fp32")
                if current is None or current[:2] != (kind, name):  # one param's pieces are asked for together
                    current = (kind, name, ds.full(kind, name))
                data = current[2][d.offset[0]: d.offset[0] + d.shape[0]]
            else:
                data = _tensor_value(d.fqn, ds, step, buffers, scale, folder)
            _put(d, data)
    return RankStates(tuple(states)) if isinstance(target, RankStates) else states[0]


def _kinds(e: Any, folder: str) -> dict[str, str]:
    """The state's per-parameter optimizer entries as DeepSpeed's: Adam's first and second moments."""
    kinds = {}
    for key in e.per_param:
        if not key.startswith("opt/"):
            continue
        field = key.rpartition(".")[2]
        if field not in ("mu", "nu"):
            raise NotImplementedError(
                f"{API}: the step's optimizer keeps {key!r} per parameter, which a DeepSpeed Adam state does not hold; "
                f"resume with fzero.optim.adam or fzero.optim.adamw (what the DeepSpeed run used)."
            )
        kinds[key] = "exp_avg" if field == "mu" else "exp_avg_sq"
    if sorted(kinds.values()) != ["exp_avg", "exp_avg_sq"]:
        raise NotImplementedError(f"{API}: the step's optimizer is not Adam or AdamW (its state: {sorted(e.per_param)}); "
                                  f"the checkpoint in {folder} holds Adam's moments. Resume with fzero.optim.adam(w).")
    return kinds


def _check_names(ds: DeepSpeedCheckpoint, state: TrainState, folder: str) -> None:
    mine = {s.path: tuple(s.shape) for u in state.meta.layout.units for s in u.slots}
    problems = []
    if set(mine) - set(ds.shapes):
        problems.append(f"missing from the checkpoint: {sorted(set(mine) - set(ds.shapes))[:5]}")
    if set(ds.shapes) - set(mine):
        problems.append(f"not in the state: {sorted(set(ds.shapes) - set(mine))[:5]}")
    problems += [f"{n}: DeepSpeed {list(ds.shapes[n])}, state {list(mine[n])}" for n in sorted(set(mine) & set(ds.shapes))
                 if mine[n] != ds.shapes[n]][:5]
    if problems:
        raise CheckpointError(
            f"{API}: the DeepSpeed checkpoint {folder} does not hold this model's trainable parameters ({'; '.join(problems)}). "
            f"Build like from the model the run trained (step.init(fzero.params_of(model))), with the same parameters "
            f"trainable (DeepSpeed saves frozen parameters apart; fzero.params_of leaves them out too)."
        )


def _loss_scale(ds: DeepSpeedCheckpoint, state: TrainState) -> dict[str, torch.Tensor]:
    """The loss-scale fields the checkpoint gives: from DeepSpeed's scaler where its run was fp16. The fields it does
    not give keep the target's own (``like``'s values, or a fresh init's: ``fzero.checkpoint._load._target``).

    DeepSpeed's ``DynamicLossScaler`` (0.19) counts iterations (``cur_iter``, skipped ones too) and remembers the last
    overflow; at the next update the clean steps since it are ``cur_iter - last_overflow_iter - 1``, fzero's
    ``good_steps`` (``fzero.step._update.next_loss_scale``). An fp32 or bf16 run pickles a ``LossScaler`` of scale 1
    too, which is no loss scale to resume an fp16 step with."""
    if state.loss_scale is None:
        return {}
    scaler = ds.optim[0].get("loss_scaler")
    out: dict[str, torch.Tensor] = {}
    fp16 = ((ds.model.get("ds_config") or {}).get("fp16") or {}).get("enabled") is True
    if isinstance(scaler, _Stub) and "cur_scale" in scaler.__dict__ and (scaler.ds_name.endswith(".DynamicLossScaler") or fp16):
        out["scale"] = torch.tensor(float(scaler.cur_scale), dtype=torch.float32)
        d = scaler.__dict__
        if scaler.ds_name.endswith(".DynamicLossScaler") and all(k in d for k in ("cur_iter", "last_overflow_iter", "cur_hysteresis")):
            out["good_steps"] = torch.tensor(int(d["cur_iter"]) - int(d["last_overflow_iter"]) - 1, dtype=torch.int64)
            out["hysteresis"] = torch.tensor(int(d["cur_hysteresis"]), dtype=torch.int64)
    return out


def _load_frozen(ds: DeepSpeedCheckpoint, model: Any, folder: str) -> None:
    """The checkpoint's frozen parameters into ``model``'s (``fzero.checkpoint._frozen``'s rules: same names, shapes)."""
    from fzero.checkpoint._frozen import frozen_of

    saved = {n: t for n, t in ds.frozen().items() if t.numel() > 0}
    if model is None:
        if saved:
            names = list(saved)
            raise CheckpointError(
                f"{API}: {folder} holds the frozen parameters {names[:4]}{' ...' if len(names) > 4 else ''} (requires_grad=False, "
                f"saved by DeepSpeed with the module); pass the model, from_deepspeed(path, like=..., model=model), so that "
                f"they go into it: fzero reads frozen parameters from the module, and without them the run would resume on "
                f"whatever values the module was built with."
            )
        return
    have = {n: p for n, p in frozen_of(model, api=API).items() if p.numel() > 0}
    missing, extra = sorted(set(saved) - set(have)), sorted(set(have) - set(saved))
    if missing or extra:
        raise CheckpointError(
            f"{API}: the frozen parameters of {type(model).__name__} are not those {folder} holds: "
            + "; ".join(x for x in (f"saved frozen but not frozen in the model: {missing[:4]}" if missing else "",
                                    f"frozen in the model but not in the checkpoint: {extra[:4]}" if extra else "") if x)
            + ". Build the model (and freeze it) as the DeepSpeed run did (a checkpoint saved with "
              "exclude_frozen_parameters=True holds none: load it without model= and give the module those values)."
        )
    bad = [n for n in saved if tuple(saved[n].shape) != tuple(have[n].shape)]
    if bad:
        raise CheckpointError(f"{API}: frozen parameter {bad[0]!r} has shape {list(saved[bad[0]].shape)} in {folder} but "
                              f"{list(have[bad[0]].shape)} in {type(model).__name__}: another configuration of the model.")
    with torch.no_grad():
        for n, t in saved.items():
            have[n].copy_(t)


def _tensor_value(key: str, ds: DeepSpeedCheckpoint, step: int, buffers: dict, scale: dict, folder: str) -> torch.Tensor:
    if key == "step" or key.endswith(".count"):  # the step, Adam's count and a schedule's: the optimizer steps taken
        return torch.tensor(step)
    if key.endswith(".skipped"):  # per-parameter skipped steps: DeepSpeed steps every trainable parameter
        return torch.tensor(0.0)
    if key.startswith("buffers/"):
        return buffers[key.removeprefix("buffers/")]
    if key.startswith("loss_scale/") and key.removeprefix("loss_scale/") in scale:
        return scale[key.removeprefix("loss_scale/")]
    raise NotImplementedError(f"{API}: the step's state holds {key!r}, which the DeepSpeed checkpoint {folder} has no "
                              f"counterpart for.")


def _put(d: Any, data: torch.Tensor) -> None:
    if d.view is not None:
        with torch.no_grad():
            d.view.copy_(data.reshape(d.view.shape) if data.numel() == d.view.numel() else data.expand_as(d.view))
    else:
        d.write(0, data)

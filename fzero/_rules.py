"""The ZeRO stage rules, written once: which stage shards what, which settings each stage accepts, and which
(stage, offload, offload_params) combinations exist. Pure data and small pure functions (no torch); the errors
name the API, the offending value and the fix. ``fzero.compile``, the config reader (``fzero.config``), the
estimator (``fzero.estimate``) and the memory formula read the rules from here.

Data:

* ``STAGES = (0, 1, 2, 3)``; ``STAGE_NAMES[stage]``: "stage 1 (ZeRO-1)", ... for messages.
* ``SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}``: the first stage at which each model state is
  sharded 1/N (the ZeRO paper); ``sharded(what, stage)`` reads it.
* ``SETTINGS[name] = Rule(stages, why, fix)``: the stages that accept a stage-bound setting:
  ``unit_elements`` 0-1 (flat buffers by size; at 2-3 units are modules), ``units`` 2-3, ``prefetch``
  3, ``jit`` and ``bucket_elements`` 2-3, ``offload`` 1-3, ``offload_params`` 3. Settings not listed apply at
  every stage.
* ``OFFLOADS = (None, "cpu", "nvme")``: the offload choices ``combinations()`` enumerates ("disk" is "nvme").

Functions (``api``: the public name that reports, e.g. "fzero.compile"; ``stage_key``: how that API spells
the stage in its messages, "stages" for the keyword, "zero_optimization.stage" in a DeepSpeed config):

* ``check_stage(stage, *, api, stage_key="stages") -> int``: an int 0-3, else ``ValueError``.
* ``accepts(setting, stage) -> bool``: the setting applies at that stage.
* ``check_settings(stage, names, *, api, stage_key="stages")``: ``ValueError`` naming every setting in
  ``names`` (as the API spells them, e.g. ``{"prefetch": "prefetch"}`` or ``["units"]``) that the stage does
  not accept, and the fix.
* ``check_offload(stage, offload, offload_params=False, *, api, stage_key="stages", offload_key="offload",
  params_key="offload_params=True")``: the offload rules (offload needs stages >= 1; offload params need
  stage 3 and an offload), ``ValueError`` otherwise. ``offload`` is None or a kind ("cpu", "disk", "nvme").
* ``valid(stage, offload, offload_params) -> bool``: the same rules as a predicate.
* ``combinations(offloads=OFFLOADS)``: every valid ``(stage, offload, offload_params)``, in stage order.
* ``check_disk_donate(where, donate, *, api)``: disk offload updates its files in place, so it needs
  ``donate=True``; ``ValueError`` otherwise.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "stage 0 (replicated, like DDP)", 1: "stage 1 (ZeRO-1)", 2: "stage 2 (ZeRO-2)", 3: "stage 3 (ZeRO-3)"}
SHARDED_FROM = {"optimizer": 1, "grads": 2, "params": 3}
OFFLOADS = (None, "cpu", "nvme")


class Rule(NamedTuple):
    stages: tuple[int, ...]  # the stages that accept the setting
    why: str  # what the setting acts on, said in the error
    fix: str = ""  # said after "Drop it, or use <stages>." when there is more to say


SETTINGS: dict[str, Rule] = {
    "unit_elements": Rule((0, 1), "the size of the flat buffers of stages 0-1",
                          "At stages 2-3 units are modules: pass units=('blocks.0', ...) (module paths; default, each "
                          "child of a ModuleList/Sequential)."),
    "units": Rule((2, 3), "units by module"),
    "bucket_elements": Rule((2, 3), "buckets of module units reduced together",
                            "At stages 0-1 units are already buckets by size: pass unit_elements=... instead."),
    "prefetch": Rule((3,), "sharded params"),
    "jit": Rule((2, 3), "units by module (each unit's forward is compiled)",
                "At stages 0-1 there are no module units yet: compile the model yourself (torch.compile on each block)."),
    "offload": Rule((1, 2, 3), "each rank offloads its shard of the optimizer state"),
    "offload_params": Rule((3,), "param shards exist only at stage 3"),
}
_NEEDS = ("offload", "offload_params")  # said "X needs stages=..." (a feature); the others "X only applies at ..."


def sharded(what: str, stage: int) -> bool:
    """Whether ``what`` ("optimizer", "grads" or "params") is sharded 1/N at ``stage``."""
    return stage >= SHARDED_FROM[what]


def check_stage(stage: object, *, api: str, stage_key: str = "stages") -> int:
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in STAGES:
        raise ValueError(f"{api}: {stage_key} must be 0, 1, 2 or 3 (the ZeRO stage), got {stage!r}.")
    return stage


def accepts(setting: str, stage: int) -> bool:
    rule = SETTINGS.get(setting)
    return rule is None or stage in rule.stages


def _stages_text(stages: tuple[int, ...], key: str) -> str:
    if len(stages) > 2 and stages == tuple(range(stages[0], STAGES[-1] + 1)):
        return f"{key} >= {stages[0]}"
    return f"{key}=" + " or ".join(str(s) for s in stages)


def _plural(spelled: str) -> bool:  # "units only apply", "jit, units only apply", "prefetch only applies"
    return "/" in spelled or ", " in spelled or spelled == "units"


def _violation(setting: str, spelled: str, stage: int, api: str, stage_key: str) -> str:
    rule = SETTINGS[setting]
    if setting in _NEEDS:
        verb = "need" if _plural(spelled) else "needs"
    else:
        verb = "only apply at" if _plural(spelled) else "only applies at"
    where = _stages_text(rule.stages, stage_key)
    return (f"{api}: {spelled} {verb} {where} ({rule.why}), but {stage_key}={stage}. Drop {spelled.split('=')[0]}, "
            f"or use {where}." + (f" {rule.fix}" if rule.fix else ""))


def check_settings(stage: int, names: Iterable[str] | Mapping[str, str], *, api: str, stage_key: str = "stages") -> None:
    """``names``: the stage-bound settings given (setting -> how ``api`` spells it, or just the settings).
    Settings under one rule are named in one sentence ("a, b only apply at stages=...")."""
    spelled = dict(names) if isinstance(names, Mapping) else {n: n for n in names}
    by_rule: dict[Rule, list[str]] = {}
    for s in spelled:
        if not accepts(s, stage):
            by_rule.setdefault(SETTINGS[s], []).append(s)
    if by_rule:
        raise ValueError(" ".join(
            _violation(bad[0], ", ".join(spelled[s] for s in bad), stage, api, stage_key) for bad in by_rule.values()
        ).replace(f" {api}: ", " "))


def _offload_violation(stage: int, offload: str | None, offload_params: bool) -> str | None:
    """The first offload rule that (stage, offload, offload_params) breaks: its setting, or "params_need_offload"."""
    if offload is not None and not accepts("offload", stage):
        return "offload"
    if offload_params and offload is None:
        return "params_need_offload"
    if offload_params and not accepts("offload_params", stage):
        return "offload_params"
    return None


def check_offload(stage: int, offload: str | None, offload_params: bool = False, *, api: str, stage_key: str = "stages",
                  offload_key: str = "offload", params_key: str = "offload_params=True") -> None:
    broken = _offload_violation(stage, offload, offload_params)
    if broken == "params_need_offload":
        need = "need" if _plural(params_key) else "needs"
        raise ValueError(f"{api}: {params_key} {need} {offload_key}='cpu' or 'disk' (they go where the optimizer state "
                         f"goes), but {offload_key}=None. Set {offload_key}, or drop {params_key.split('=')[0]}.")
    if broken is not None:
        spelled = offload_key if broken == "offload" else params_key
        raise ValueError(_violation(broken, spelled, stage, api, stage_key))


def valid(stage: int, offload: str | None, offload_params: bool) -> bool:
    return stage in STAGES and _offload_violation(stage, offload, offload_params) is None


def combinations(offloads: tuple[str | None, ...] = OFFLOADS) -> tuple[tuple[int, str | None, bool], ...]:
    """Every valid (stage, offload, offload_params), stage by stage, offloads in the order given."""
    return tuple((s, o, p) for s in STAGES for o in offloads for p in (False, True) if valid(s, o, p))


def check_disk_donate(where: str, donate: bool, *, api: str) -> None:
    if where in ("disk", "nvme") and not donate:
        raise ValueError(f"{api}: offload={where!r} keeps the optimizer state in files that each step updates, so an old "
                         f"state cannot be kept (donate=False). Build the step with donate=True.")

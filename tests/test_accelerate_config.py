"""fzero.config.from_accelerate: the DeepSpeed section of an Accelerate config file (what `accelerate config` writes)
as fzero settings, equal to the DeepSpeed config it stands for."""

import json
import os
import shutil

import pytest

import fzero
from fzero.config import from_accelerate, from_deepspeed

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")
HF_ARGS = dict(learning_rate=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, warmup_steps=10,
               clip_grad_norm=1.0, batch_size=4, grad_accum=2, hidden_size=64)

ZERO2 = """compute_environment: LOCAL_MACHINE
debug: false
deepspeed_config:
  gradient_accumulation_steps: 4
  gradient_clipping: 0.5
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
downcast_bf16: 'no'
machine_rank: 0
main_training_function: main
mixed_precision: fp16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
use_cpu: false
"""

ZERO3 = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 1
  offload_optimizer_device: cpu
  offload_param_device: cpu
  zero3_init_flag: true
  zero3_save_16bit_model: true
  zero_stage: 3
distributed_type: DEEPSPEED
mixed_precision: bf16
num_machines: 1
num_processes: 4
"""

WITH_FILE = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  deepspeed_config_file: hf_zero3_offload_auto.json
  zero3_init_flag: true
distributed_type: DEEPSPEED
mixed_precision: bf16
num_machines: 1
num_processes: 2
"""


def _write(tmp_path, text, name="default_config.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_the_plugins_fields_are_the_deepspeed_keys_they_stand_for(tmp_path):
    got = from_accelerate(_write(tmp_path, ZERO2), batch_size=3)
    want = from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
                           "gradient_accumulation_steps": 4, "gradient_clipping": 0.5, "fp16": {"enabled": True},
                           "train_micro_batch_size_per_gpu": 3}, world_size=2)
    assert got.compile_kwargs() == want.compile_kwargs() and got.world_size == 2
    assert (got.stages, got.offload, got.offload_params, got.grad_accum, got.clip_grad_norm) == (2, "cpu", False, 4, 0.5)
    assert (got.micro_batch_size, got.train_batch_size) == (3, 24)  # the loader's batch size, as prepare() fills it
    assert any("rdzv_backend" in n and "torchrun" in n for n in got.notes)  # the launcher's settings, listed
    assert got.source.endswith("default_config.yaml")


def test_zero3_with_cpu_offload_and_the_init_flag(tmp_path):
    got = from_accelerate(_write(tmp_path, ZERO3))
    assert (got.stages, got.offload, got.offload_params, got.world_size) == (3, "cpu", True, 4)
    assert str(got.precision.compute) == "torch.bfloat16"
    assert any(n.startswith("zero3_init_flag=True") and "fzero.empty_params()" in n for n in got.notes)
    assert any(n.startswith("zero3_save_16bit_model=True") for n in got.notes)
    step = fzero.compile(lambda p, b: p["w"].sum(), **got.compile_kwargs())  # what fzero.compile takes
    assert (step.stage, step.grad_accum) == (3, 1)


def test_a_deepspeed_config_file_is_read_with_the_launchers_precision(tmp_path):
    shutil.copy(os.path.join(CONFIGS, "hf_zero3_offload_auto.json"), tmp_path / "hf_zero3_offload_auto.json")
    got = from_accelerate(_write(tmp_path, WITH_FILE), **HF_ARGS)
    want = from_deepspeed(os.path.join(CONFIGS, "hf_zero3_offload_auto.json"), **HF_ARGS, precision="bf16", world_size=2)
    assert got.compile_kwargs().keys() == want.compile_kwargs().keys()
    assert (got.stages, got.offload, got.precision) == (want.stages, want.offload, want.precision)


def test_what_cannot_map_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"distributed_type is 'MULTI_GPU', not 'DEEPSPEED'.*compile\(stages=0\)"):
        from_accelerate({"distributed_type": "MULTI_GPU"})
    with pytest.raises(ValueError, match=r"unknown deepspeed_config keys \['zero_stag'\]"):
        from_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stag": 3}})
    with pytest.raises(ValueError, match=r"deepspeed_config_file is given beside \['zero_stage'\]"):
        from_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": "x.json",
                                                                               "zero_stage": 3}})
    with pytest.raises(ValueError, match=r"mixed_precision='fp8'"):
        from_accelerate({"distributed_type": "DEEPSPEED", "mixed_precision": "fp8", "deepspeed_config": {"zero_stage": 1}})
    with pytest.raises(FileNotFoundError, match=r"no Accelerate config file at"):
        from_accelerate(str(tmp_path / "missing.yaml"))



def test_a_plugin_field_that_does_not_cast_is_named_and_a_null_clipping_is_deepspeeds_default():
    """Accelerate's plugin casts the launcher's strings back (float() for gradient_clipping): a value that cast refuses
    was a bare "could not convert string to float" from fzero; it names the field now. A null gradient_clipping reaches
    DeepSpeed as "auto", which Accelerate fills with 1.0 (it was refused as from_deepspeed's "got null")."""
    def read(**section):
        return from_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": section})

    with pytest.raises(ValueError, match=r"^fzero.config.from_accelerate: deepspeed_config.gradient_clipping must be a "
                                         r"number or \"auto\", got 'none' \(0 leaves it to DeepSpeed's default"):
        read(gradient_clipping="none")
    with pytest.raises(ValueError, match=r"deepspeed_config.gradient_clipping must be a number or \"auto\", got True"):
        read(gradient_clipping=True)
    with pytest.raises(ValueError, match=r"deepspeed_config.zero_stage must be an integer or \"auto\", got 'two'\.$"):
        read(zero_stage="two")
    got = read(gradient_clipping=None)
    assert got.clip_grad_norm == 1.0
    assert any(n.startswith("gradient_clipping=None") and "default (1.0)" in n for n in got.notes)
    assert read(gradient_clipping="0.5", zero_stage="3").clip_grad_norm == 0.5  # strings that cast, as the plugin's


def test_gradient_clipping_auto_is_what_accelerates_prepare_fills(tmp_path):
    """gradient_clipping: "auto" (a plugin field, or in the deepspeed_config_file) is 1.0 under Accelerate: prepare()
    fills it so, whatever max_norm the loop gives accelerator.clip_grad_norm_ (which does not clip under DeepSpeed). It
    was refused, asking for clip_grad_norm=, where a loop's own max_norm would then clip unlike Accelerate's run."""
    plugin = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 2, "gradient_clipping": "auto"}}
    assert from_accelerate(plugin).clip_grad_norm == 1.0
    assert from_accelerate(plugin, clip_grad_norm=0.5).clip_grad_norm == 0.5  # a choice given wins
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": "auto",
                                "train_micro_batch_size_per_gpu": 2}))
    filed = {"distributed_type": "DEEPSPEED", "deepspeed_config": {"deepspeed_config_file": str(path)}}
    assert from_accelerate(filed).clip_grad_norm == 1.0

LAUNCHED = """compute_environment: LOCAL_MACHINE
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.0
  offload_optimizer_device: none
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 2
distributed_type: DEEPSPEED
mixed_precision: 'no'
num_machines: 1
num_processes: 2
use_cpu: true
"""


@pytest.mark.torchrun
def test_accelerate_launch_runs_an_fzero_script_with_the_same_config(tmp_path, one_thread):
    """``accelerate launch --config_file`` of an Accelerate DeepSpeed config (ZeRO-2, 2 processes, accumulation 2,
    clipping 1.0) starts an fzero script as torchrun would: two ranks under fzero.dist_mesh(), which read their
    settings from the same file, and whose params equal the same step on local_mesh(2), bit for bit."""
    pytest.importorskip("deepspeed", reason="accelerate launch imports DeepSpeed for a config with a DeepSpeed plugin")
    import subprocess
    import sys

    import torch

    pytest.importorskip("accelerate", reason="accelerate is a test dependency: pip install -e '.[test]'")
    from problems import B1, B2, EPS, LR, WD, gpt_problem

    from fzero.testing import assert_trees_equal

    cfg = _write(tmp_path, LAUNCHED)
    out = tmp_path / "run.pt"
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu", "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", cfg, os.path.join(here, "accelerate_worker.py"),
           "--config", cfg, "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = torch.load(out, weights_only=True)
    assert (got["world"], got["stage"], got["grad_accum"], got["clip"]) == (2, 2, 2, 1.0)
    prob = gpt_problem(steps=3)
    step = fzero.compile(prob.loss_fn, config=from_accelerate(cfg, batch_size=2), mesh=fzero.local_mesh(2),
                         optimizer=fzero.optim.adamw(LR, b1=B1, b2=B2, eps=EPS, weight_decay=WD))
    state = step.init(fzero.params_of(prob.model))
    for k, b in enumerate(prob.batches):
        state, _ = step(state, b)
        assert_trees_equal(got["history"][k], step.gather(state))


def test_what_accelerate_fills_in_is_filled_in_alike(tmp_path):
    """Where the yaml leaves something to Accelerate, the settings are what Accelerate's DeepSpeedPlugin makes of it
    (found against accelerate 1.15): no zero_stage is ZeRO-2; num_processes already counts every machine's processes;
    gradient_clipping 0.0 is left out of the DeepSpeed config, so DeepSpeed clips at its default 1.0; and a
    deepspeed_config_file without a block for mixed_precision's dtype gets {"enabled": true} (it trained in fp32)."""
    fields = {"distributed_type": "DEEPSPEED", "num_machines": 2, "num_processes": 16,
              "deepspeed_config": {"gradient_accumulation_steps": 1, "gradient_clipping": 0.0}}
    got = from_accelerate(fields)
    assert (got.stages, got.world_size, got.clip_grad_norm) == (2, 16, 1.0)
    assert any(n.startswith("gradient_clipping=0.0") and "default (1.0)" in n for n in got.notes)
    file = tmp_path / "ds.json"
    file.write_text('{"zero_optimization": {"stage": 1}, "train_micro_batch_size_per_gpu": 2}')
    for mixed, dtype in (("bf16", "torch.bfloat16"), ("fp16", "torch.float16"), ("no", "torch.float32")):
        got = from_accelerate({"distributed_type": "DEEPSPEED", "mixed_precision": mixed, "num_processes": 2,
                               "deepspeed_config": {"deepspeed_config_file": str(file)}})
        assert str(got.precision.compute) == dtype, mixed


def test_an_unknown_top_level_key_is_refused_as_accelerate_launch_refuses_it():
    """accelerate launch refuses a config file with a top-level key its ClusterConfig does not have ("had unknown
    keys"). fzero listed any such key as a launcher setting with no effect, so the typo mixed_precison: bf16 trained in
    fp32 here, silently, where Accelerate would not start (found against accelerate 1.15)."""
    with pytest.raises(ValueError, match=r"^fzero.config.from_accelerate: unknown top-level keys in the Accelerate config: "
                                         r"'mixed_precison' \(did you mean 'mixed_precision'\?\)\. accelerate launch refuses"):
        from_accelerate({"distributed_type": "DEEPSPEED", "mixed_precison": "bf16", "deepspeed_config": {"zero_stage": 3}})
    # every key accelerate 1.15's ClusterConfig has is still accepted, listed in the notes
    got = from_accelerate({"distributed_type": "DEEPSPEED", "deepspeed_config": {"zero_stage": 1}, "tpu_zone": None,
                           "enable_cpu_affinity": False, "parallelism_config": None, "gpu_ids": "all"})
    assert any("enable_cpu_affinity" in n and "gpu_ids" in n for n in got.notes)


def test_the_old_fp16_key_and_a_null_mixed_precision_read_as_accelerate_reads_them():
    """Accelerate's reader turns an old-format ``fp16: true`` (no mixed_precision) into mixed_precision fp16, and takes a
    null mixed_precision as 'no' (BaseConfig.process_config, accelerate 1.15): fzero trained the first in fp32, silently,
    and refused the second."""
    got = from_accelerate({"distributed_type": "DEEPSPEED", "fp16": True, "deepspeed_config": {"zero_stage": 2}})
    assert str(got.precision.compute) == "torch.float16" and got.precision.loss_scale is not None
    got = from_accelerate({"distributed_type": "DEEPSPEED", "mixed_precision": None, "deepspeed_config": {"zero_stage": 2}})
    assert str(got.precision.compute) == "torch.float32"
    got = from_accelerate({"distributed_type": "DEEPSPEED", "mixed_precision": "bf16", "fp16": True,
                           "deepspeed_config": {"zero_stage": 2}})  # mixed_precision wins, as Accelerate's reader has it
    assert str(got.precision.compute) == "torch.bfloat16"
    # found in review: a null mixed_precision beside fp16: true is None to the reader (it reads fp16 only where
    # mixed_precision is absent) and 'no' to accelerate launch: fp32, where fzero took fp16
    got = from_accelerate({"distributed_type": "DEEPSPEED", "mixed_precision": None, "fp16": True,
                           "deepspeed_config": {"zero_stage": 2}})
    assert str(got.precision.compute) == "torch.float32"


def test_gradient_accumulation_knows_the_loaders_batch_size_so_a_short_last_batch_is_refused():
    """At the end of an epoch that does not divide by gradient_accumulation_steps, Accelerate's accumulate() steps on the
    micro-batches left, each weighted 1/gradient_accumulation_steps (measured with accelerate 1.15 + DeepSpeed 0.19 on 2
    CPU ranks, ZeRO-2, accumulation 2: its last step's gradient norm was half fzero's, the params 4e-4 apart). fzero took
    those rows as a whole step (split into 2 micro-batches of half the rows, full weight), silently. Now the plugin's
    batch sizes are "auto" as DeepSpeedPlugin writes them, filled from batch_size= (the loader's, as prepare() fills them),
    required with accumulation, and the step refuses the short batch by name."""
    import torch

    cfg = {"distributed_type": "DEEPSPEED", "num_processes": 2,
           "deepspeed_config": {"zero_stage": 2, "gradient_accumulation_steps": 2}}
    with pytest.raises(ValueError, match=r"^fzero.config.from_accelerate: gradient_accumulation_steps=2 needs batch_size=, "
                                         r"the per-process batch_size of the DataLoader.*weighted 1/2.*drop_last=True"):
        from_accelerate(cfg)
    settings = from_accelerate(cfg, batch_size=2)
    assert (settings.micro_batch_size, settings.grad_accum, settings.train_batch_size) == (2, 2, 8)
    assert any(path == "train_micro_batch_size_per_gpu" and value == 2 for path, value, _ in settings.resolved)
    step = fzero.compile(lambda p, b: ((p["w"] * b["x"]).sum(-1) ** 2).mean(), config=settings, mesh=fzero.local_mesh(2),
                         optimizer=fzero.optim.sgd(0.1))
    state = step.init({"w": torch.ones(3)})
    state, _ = step(state, {"x": torch.randn(8, 3)})  # 2 rows x 2 micro-batches x 2 ranks
    with pytest.raises(ValueError, match=r"make 8 rows for the global batch of local_mesh\(2\).*If it is the short last batch of "
                                         r"an epoch, drop it.*under Accelerate, accumulate\(\) steps on the fewer than 2 "
                                         r"micro-batches left"):
        step(state, {"x": torch.randn(4, 3)})
    # without accumulation a short last batch is the mean over its rows on both sides: no batch_size= needed
    assert from_accelerate({**cfg, "deepspeed_config": {"zero_stage": 2}}).micro_batch_size is None


def test_a_short_batch_under_a_deepspeed_config_is_not_said_to_be_accelerates():
    """Found in review: the short-batch hint said "A short last batch of an epoch: Accelerate's accumulate() steps
    on ..." to every config with accumulation, a DeepSpeed JSON's too (DeepSpeed's engine steps only at its
    accumulation boundary): Accelerate's rule is now named as Accelerate's, beside the fix."""
    import torch

    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    step = fzero.compile(lambda p, b: ((p["w"] * b["x"]).sum(-1) ** 2).mean(), config=cfg)
    state = step.init({"w": torch.ones(3)})
    with pytest.raises(ValueError, match=r"make 4 rows .* If it is the short last batch of an epoch, drop it "
                                         r"\(DataLoader\(\.\.\., drop_last=True\)\): a step here would split its rows "
                                         r"into 2 micro-batches at full weight \(under Accelerate"):
        step(state, {"x": torch.randn(2, 3)})


def test_a_relative_deepspeed_config_file_is_read_from_the_working_directory_as_accelerate_does(tmp_path, monkeypatch):
    """accelerate launch passes deepspeed_config_file as written and its processes open it from their working directory
    (HfDeepSpeedConfig). Read beside the YAML instead, a stage-3 file there was trained in place of the stage-2 file
    Accelerate would use, silently. Now the working directory's is read; where it has none, the one beside the YAML,
    with a note."""
    import json

    launch_dir, config_dir = tmp_path / "project", tmp_path / "configs"
    launch_dir.mkdir()
    config_dir.mkdir()
    (launch_dir / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}))
    (config_dir / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}))
    yaml = _write(config_dir, "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: ds.json\n"
                              "mixed_precision: 'no'\nnum_processes: 1\n")
    monkeypatch.chdir(launch_dir)
    got = from_accelerate(yaml)
    assert got.stages == 2 and not any("deepspeed_config_file" in n for n in got.notes)
    monkeypatch.chdir(tmp_path)  # no ds.json here: the one beside the YAML, said
    got = from_accelerate(yaml)
    assert got.stages == 3
    assert any(n.startswith("deepspeed_config_file='ds.json': not in the current directory") and str(config_dir) in n
               for n in got.notes), got.notes

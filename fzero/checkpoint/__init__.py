"""Checkpoints of a training state: sharded save, load at any stage and world size, consolidation, crash safety.

```python
fzero.checkpoint.save("ckpt", state, extra={"batch": k}, keep=3)   # ckpt/step_00000500, keeping the last 3
state = fzero.checkpoint.load("ckpt", like=step)                  # the latest complete one, sharded for `step`
k = fzero.checkpoint.read_extra("ckpt")["batch"]
fzero.checkpoint.consolidate("ckpt", "model.pt", model=model)     # one fp32 state dict for model.load_state_dict
fzero.checkpoint.consolidate("ckpt", "hf", model=model, format="safetensors", dtype="bf16")  # for from_pretrained("hf")
fzero.checkpoint.save_weights(step, state, "hf", model=model)      # the same from a live state, unit by unit
state = step.init(fzero.params_of(meta_model, copy=False),         # weights in: a Hugging Face checkpoint,
                  materialize=fzero.checkpoint.pretrained("hf", model=meta_model))  # read one unit at a time
```
or ``python -m fzero.checkpoint consolidate ckpt model.pt`` (``info ckpt`` prints what a checkpoint holds,
``verify ckpt`` checks every file, one line each, exit status 1 if any is wrong).

**Format.** A checkpoint is a directory in torch.distributed.checkpoint's file format holding one logical
tensor per parameter (see ``fzero/checkpoint/_state.py`` for the keys), so it loads into any stage, world
size, unit layout, mesh kind (none, ``local_mesh``, torchrun) and precision policy, plus ``fzero.json``
(parameter names and shapes, the optimizer-state entries, the step, the user's ``extra``) and the marker
``COMPLETE`` (the size and CRC-32 of every file, ``fzero.json`` included). Every rank writes only the window of each unit it owns and reads
only what it will hold: no collective moves parameters, and a save needs at most about 64 MiB beyond the
state (DCP copies the chunks of one data file). ``latest(parent)`` finds the complete checkpoint saved last (after
a rollback, the new line's, whatever its step), and ``keep=K`` keeps the K saved last. ``save(..., model=model)``
also writes the module's frozen parameters (which stay in the module, not in the state), as DeepSpeed does by
default, and ``load(..., model=model)`` puts them back (``_frozen``). Each process's random generators are saved and
restored as the Hugging Face Trainer's are (torch's CPU and CUDA ones, Python's ``random``, NumPy's, and a
``local_mesh``'s per-rank streams), so a resumed run draws what the straight run draws (``_rng``).

**Safety.** A save writes into ``.<name>.partial`` beside the target, fsyncs every file, writes the
marker last and renames the directory into place (an existing checkpoint is swapped out atomically with
``renameat2(RENAME_EXCHANGE)`` where Linux offers it), so a crash or ``kill -9`` leaves the previous
checkpoint loadable; the next successful save in the same directory removes the ``.partial`` leftovers of
crashed saves (a live save holds a lock on its own, so it is never taken for one). A failed save removes its
own ``.partial``; a full disk (ENOSPC, EDQUOT), a read-only filesystem (EROFS) or a denied permission (EACCES)
raises ``CheckpointWriteError`` saying so, with the path and the space needed. Ctrl-C during a save raises
``KeyboardInterrupt`` itself (never an ``Exception`` that ``except Exception`` would swallow) and leaves the previous
checkpoint as it was. A ``keep=K`` directory belongs to the first process that saves into it while that process
lives: another run saving there is refused, naming its pid.

**Groups.** ``fzero.json`` records each ``fzero.optim.multi_transform`` label of every param; ``load`` refuses a step
whose labels moved a param to another group, naming it and both labels (its state there is not that transform's).

**Verification.** ``load``, ``consolidate``, ``read_extra`` and ``info`` check the marker, every file's size,
and the CRC-32 of ``fzero.json``, DCP's ``.metadata`` and every data file before using it, and raise
``CheckpointCorrupted`` naming the file and both checksums (``verify=False``: sizes only, for checkpoints saved
before checksums existed, which are otherwise refused; load and save such a one again to add them). Nothing
executes code on load: tensors are read with ``torch.load(weights_only=True)``, DCP's ``.metadata`` with
an unpickler that resolves only DCP's metadata classes, everything else is JSON.

Under torchrun, ``save`` and ``load`` are collective (every rank calls them, with its own state) and the
directory must be on a filesystem every rank sees. Each starts by checking that every rank makes the same call (a
rank that does not is named, within seconds or at the mesh timeout), and ``load`` checks that every rank opened the
same checkpoint (its step and the checksum of its marker).

**Weights in.** ``pretrained(dir, model=model)`` reads ``save_pretrained``'s files (one or sharded) into ``step.init``
for a model built under ``fzero.empty_params()``, tensor by tensor as each unit is packed; keys, ties and shapes
are checked against the model from the headers before anything is read.

**From DeepSpeed.** ``from_deepspeed(save_dir, like=step)`` resumes a checkpoint of DeepSpeed's ``engine.save_checkpoint``
(ZeRO stage 1, 2 or 3, any world size) at any fzero stage and world size: fp32 masters, Adam's moments and step
count, buffers, an fp16 run's loss scale, and with ``model=`` the frozen parameters (``fzero/checkpoint/_deepspeed.py`` says how each parameter is found in DeepSpeed's partitions). Its
files are read with ``torch.load(weights_only=True)``, DeepSpeed's own pickled classes as inert stand-ins.

**From other tools.** A torch optimizer's state is not read (FSDP2's ``dcp.save`` directory, a Hugging Face Trainer's
``checkpoint-N``, Accelerate's ``save_state`` folder): ``load`` names such a directory and the way to its weights
(``_files._other_format``), with which a run goes on with a fresh optimizer.

**Weights out.** ``format="safetensors"`` and ``save_weights`` write Hugging Face's ``model.safetensors`` (or
``model-0000k-of-0000N.safetensors`` shards and ``model.safetensors.index.json`` past ``max_shard_size``), tied
weights once as ``save_pretrained`` does, streaming: a group of parameters (a checkpoint) or a unit (a live
stage-3 state) at a time, never the whole model twice.

Modules: ``_files`` (the directory format, finding and opening checkpoints, the atomic publish, the lock of
a save and the sweep of crashed ones), ``_verify`` (checksums and the marker), ``_oserrors`` (filesystem
failures named), ``_save``, ``_load``, ``_consolidate``, ``_weights`` (``save_weights``, state-dict names),
``_frozen`` (frozen parameters), ``_safetensors`` (the streaming writer), ``_pretrained`` (the streaming reader) and ``_initializers`` (its ``missing=``), ``_cli`` (``python -m fzero.checkpoint``), ``_collective`` (the ranks'
exchanges under torchrun), ``_groups`` (parameter groups), ``_interrupts`` (Ctrl-C), ``_rng`` (the random generators); ``_state``
maps rank states onto the logical tensors and ``_dcp`` reads and writes them with torch.distributed.checkpoint.
"""

from fzero.checkpoint._cli import main
from fzero.checkpoint._consolidate import consolidate
from fzero.checkpoint._dcp import CheckpointError
from fzero.checkpoint._deepspeed import from_deepspeed
from fzero.checkpoint._files import latest, read_extra, step_dir, verify
from fzero.checkpoint._load import load
from fzero.checkpoint._oserrors import CheckpointWriteError
from fzero.checkpoint._pretrained import pretrained
from fzero.checkpoint._save import save
from fzero.checkpoint._verify import CheckpointCorrupted
from fzero.checkpoint._weights import save_weights

__all__ = [
    "CheckpointCorrupted", "CheckpointError", "CheckpointWriteError", "consolidate", "latest", "load", "main", "pretrained",
    "read_extra", "save", "save_weights", "step_dir", "verify", "from_deepspeed"]

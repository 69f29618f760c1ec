"""Checkpoint faults (issue 16): damaged files are named (flipped byte, truncation, an edited fzero.json, a missing
file, a damaged marker), a full disk, a read-only filesystem and a denied permission are reported as such during
save and consolidate with the path and the space needed, the previous checkpoint survives, and crashed saves'
``.partial`` leftovers are swept by the next save. Each test asserts the error's type and words.

Filesystem faults run twice where the machine allows: simulated in this process (a write or fsync that fails with
the errno; a chmod that root ignores is replaced by a refusing ``mkdir``/``open``), and for real in a user
namespace (a full tmpfs, a read-only remount, a directory owned by an unmapped user), which needs no root.
"""

import errno
import fcntl
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from contextlib import contextmanager

import pytest
import torch

import fzero
from checkpoint_worker import crash_step, make_step
from fzero.checkpoint import CheckpointCorrupted, CheckpointError, CheckpointWriteError
from fzero.checkpoint._dcp import read_metadata
from fzero.testing import assert_trees_equal
from problems import mlp_problem

HERE = os.path.dirname(__file__)
WORKER = os.path.join(HERE, "checkpoint_worker.py")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": HERE + os.pathsep + os.environ.get("PYTHONPATH", "")}


def trained(steps: int = 1):
    prob = mlp_problem(steps=steps)
    step = make_step(prob, stages=1, mesh=fzero.local_mesh(2))
    state = step.init(fzero.params_of(prob.model))
    for b in prob.batches:
        state, _ = step(state, b)
    return step, state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    step, state = trained()
    return fzero.checkpoint.save(str(tmp_path_factory.mktemp("saved") / "ck"), state, extra={"k": 1}), step, state


@pytest.fixture
def ck(saved, tmp_path):
    """A fresh copy of the saved checkpoint, to damage."""
    return shutil.copytree(saved[0], str(tmp_path / "copy"))


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fzero.checkpoint", *args], env=ENV, capture_output=True, text=True, timeout=120)


def tensor_bytes_at(path: str, fqn: str) -> tuple[str, int, int]:
    """(data file, byte offset, byte length) of the raw data of the saved tensor ``fqn`` (its first chunk)."""
    md = read_metadata(path)
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == fqn)
    file = os.path.join(path, info.relative_path)
    with open(file, "rb") as f:
        f.seek(info.offset)
        blob = f.read(info.length)
    raw = torch.load(io.BytesIO(blob), weights_only=True).numpy().tobytes()
    at = blob.find(raw)
    assert at >= 0 and len(raw) >= 64
    return info.relative_path, info.offset + at, len(raw)


# -- damaged files ---------------------------------------------------------------------------------------------


def test_a_flipped_byte_in_tensor_data_is_named_by_load_consolidate_and_info(saved, ck, tmp_path):
    _, step, state = saved
    name, at, length = tensor_bytes_at(ck, "params/layers.2.weight")
    with open(os.path.join(ck, name), "r+b") as f:  # the high byte of a float32 in the middle of the tensor
        f.seek(at + (length // 2 // 4) * 4 + 3)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x40]))
    unverified = step.gather(fzero.checkpoint.load(ck, like=step, verify=False))  # what verification prevents: a silent change
    assert not torch.equal(unverified["layers.2.weight"], step.gather(state)["layers.2.weight"])
    pattern = rf"copy is corrupted: {name} has CRC-32 [0-9a-f]{{8}}, but [0-9a-f]{{8}} was recorded when it was saved"
    with pytest.raises(CheckpointCorrupted, match=pattern) as e:
        fzero.checkpoint.load(ck, like=step)
    assert e.value.file == name and e.value.expected != e.value.found
    with pytest.raises(CheckpointCorrupted, match=pattern):
        fzero.checkpoint.consolidate(ck, tmp_path / "out.pt")
    assert not os.path.exists(tmp_path / "out.pt") and not os.path.exists(tmp_path / "out.pt.partial")
    with pytest.raises(CheckpointCorrupted, match=pattern):
        fzero.checkpoint.verify(ck)
    info = cli("info", ck)
    assert info.returncode == 1 and f"{name} has CRC-32" in info.stderr, info.stderr
    assert cli("info", "--no-verify", ck).returncode == 0


def test_a_truncated_file_is_named(saved, ck):
    _, step, _ = saved
    name, _, _ = tensor_bytes_at(ck, "params/layers.0.weight")
    size = os.path.getsize(os.path.join(ck, name))
    with open(os.path.join(ck, name), "r+b") as f:
        f.truncate(size - 10)
    with pytest.raises(CheckpointCorrupted, match=rf"copy is damaged: {name} has {size - 10} bytes, {size} were written \(truncated or changed\)"):
        fzero.checkpoint.load(ck, like=step)
    with pytest.raises(CheckpointCorrupted, match="truncated"):  # sizes are checked even unverified
        fzero.checkpoint.load(ck, like=step, verify=False)


def test_an_edited_step_in_fzero_json_is_detected_so_info_and_the_state_cannot_disagree(saved, ck):
    _, step, state = saved
    with open(os.path.join(ck, "fzero.json")) as f:
        info = json.load(f)
    assert info["step"] == state.step_count == 1
    original = json.dumps(info, indent=1)  # as save wrote it; the edit keeps its size, so only the checksum can tell
    edited = original.replace('"step": 1,', '"step": 9,')
    assert edited != original and len(edited) == len(original)
    with open(os.path.join(ck, "fzero.json"), "w") as f:
        f.write(edited)
    pattern = r"copy is corrupted: fzero.json has CRC-32 [0-9a-f]{8}, but [0-9a-f]{8} was recorded"
    for call in (lambda: fzero.checkpoint.load(ck, like=step), lambda: fzero.checkpoint.read_extra(ck),
                 lambda: fzero.checkpoint.consolidate(ck, os.path.join(os.path.dirname(ck), "o.pt"))):
        with pytest.raises(CheckpointCorrupted, match=pattern):
            call()
    out = cli("info", ck)
    assert out.returncode == 1 and "fzero.json has CRC-32" in out.stderr and '"step": 9' not in out.stdout


def test_a_missing_file_and_a_damaged_marker_are_named(saved, ck, tmp_path):
    _, step, _ = saved
    os.remove(os.path.join(ck, ".metadata"))
    with pytest.raises(CheckpointCorrupted, match=r"copy is damaged: the file \.metadata is missing"):
        fzero.checkpoint.load(ck, like=step)
    shutil.rmtree(ck)
    ck = shutil.copytree(saved[0], str(tmp_path / "copy"))
    with open(os.path.join(ck, "COMPLETE")) as f:
        marker = json.load(f)
    name = sorted(marker["crc32"])[0]
    marker["crc32"][name] ^= 1  # the marker itself damaged: told apart from a damaged file
    with open(os.path.join(ck, "COMPLETE"), "w") as f:
        json.dump(marker, f)
    with pytest.raises(CheckpointCorrupted, match=r"copy/COMPLETE is corrupted \(its own checksum does not match its contents\)"):
        fzero.checkpoint.load(ck, like=step)


def test_a_checkpoint_without_checksums_is_refused_with_the_fix(saved, ck, tmp_path):
    """Checkpoints from before checksums existed: refused by default, loadable with verify=False, re-saved verified."""
    _, step, state = saved
    with open(os.path.join(ck, "COMPLETE")) as f:
        marker = json.load(f)
    with open(os.path.join(ck, "COMPLETE"), "w") as f:
        json.dump({"files": marker["files"]}, f)  # what the marker held before
    with pytest.raises(CheckpointError, match=r"copy was saved without checksums .* load it with verify=False and save it again"):
        fzero.checkpoint.load(ck, like=step)
    old = fzero.checkpoint.load(ck, like=step, verify=False)
    assert_trees_equal(old, state)
    again = fzero.checkpoint.save(tmp_path / "again", old)
    assert fzero.checkpoint.verify(again) == again
    out = cli("verify", ck)
    assert out.returncode == 1 and "BAD COMPLETE: records no checksums" in out.stdout


def test_the_verify_command_prints_one_line_per_file_and_exits_1_on_a_bad_one(saved, ck):
    out = cli("verify", ck)
    with open(os.path.join(ck, "COMPLETE")) as f:
        files = sorted(json.load(f)["files"])
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == f"checkpoint {ck}" and lines[1] == "ok  COMPLETE: ok"
    assert [line.split(":")[0] for line in lines[2:-1]] == [f"ok  {n}" for n in files]
    assert all(" bytes, CRC-32 " in line for line in lines[2:-1])
    assert lines[-1] == f"{len(files) + 1} files ok, 0 bad"
    name, at, _ = tensor_bytes_at(ck, "params/layers.0.bias")
    with open(os.path.join(ck, name), "r+b") as f:
        f.seek(at)
        first = f.read(1)
        f.seek(at)
        f.write(bytes([first[0] ^ 1]))
    os.remove(os.path.join(ck, "fzero.json"))
    out = cli("verify", os.path.dirname(ck) + "/copy")
    assert out.returncode == 1
    assert f"BAD {name}: corrupted: CRC-32 " in out.stdout and "BAD fzero.json: missing" in out.stdout
    assert out.stdout.splitlines()[-1].endswith(f"2 bad: {', '.join(sorted([name, 'fzero.json']))}")
    missing = cli("verify", os.path.dirname(ck) + "/nowhere")
    assert missing.returncode == 1 and "no checkpoint at" in missing.stderr


# -- full disk ----------------------------------------------------------------------------------------------------


@contextmanager
def writes_fail_after(monkeypatch, limit: int, error: BaseException):
    """Every file DCP opens for writing fails with ``error`` once ``limit`` bytes went into it (a disk filling up)."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    real = FileSystem.create_stream

    class Filling(io.RawIOBase):
        def __init__(self, f):
            self.f, self.n = f, 0

        def writable(self):
            return True

        def write(self, b):
            self.n += len(b)
            if self.n > limit:
                raise error
            return self.f.write(b)

        def tell(self):
            return self.f.tell()

        def fileno(self):
            return self.f.fileno()

    @contextmanager
    def create_stream(self, path, mode):
        with real(self, path, mode) as f:
            yield Filling(f) if "w" in mode else f

    monkeypatch.setattr(FileSystem, "create_stream", create_stream)
    yield
    monkeypatch.undo()


def assert_survives(path: str, step, params) -> None:
    """The previous checkpoint at ``path`` verifies and loads with ``params``, and no ``.partial`` is left beside it."""
    assert fzero.checkpoint.verify(path) == path
    assert_trees_equal(step.gather(fzero.checkpoint.load(path, like=step)), params)
    parent = os.path.dirname(path)
    assert not [e for e in os.listdir(parent) if e.endswith(".partial")]


def test_a_full_disk_during_save_is_named_and_the_previous_checkpoint_survives(tmp_path, monkeypatch):
    step, state = trained(1)
    path = fzero.checkpoint.save(tmp_path / "ck", state)
    params = {k: v.clone() for k, v in step.gather(state).items()}
    later, _ = step(state, mlp_problem(steps=2).batches[1])  # state is donated: params hold what was saved
    with writes_fail_after(monkeypatch, 4096, OSError(errno.ENOSPC, "No space left on device")):
        with pytest.raises(CheckpointWriteError, match=rf"fzero.checkpoint.save: cannot write {path}: no space left on the device \(ENOSPC\): "
                                                       r"it needs at least .* bytes\), .* are free there.* The previous checkpoint at .* is untouched") as e:
            fzero.checkpoint.save(path, later)
    assert e.value.errno == errno.ENOSPC
    assert_survives(path, step, params)


def test_a_full_disk_that_torch_hides_is_found_by_the_free_space(tmp_path, monkeypatch):
    """Under torchrun the other ranks' errors arrive pickled, without the OSError inside: only the free space tells."""
    step, state = trained(1)
    path = fzero.checkpoint.save(tmp_path / "ck", state)
    real_usage = shutil.disk_usage
    with writes_fail_after(monkeypatch, 4096, RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")):
        calls = []

        def usage(p):  # room before the write (the up-front check passes), none after it failed
            calls.append(p)
            u = real_usage(p)
            return u._replace(free=u.free if len(calls) == 1 else 0)

        monkeypatch.setattr(shutil, "disk_usage", usage)
        with pytest.raises(CheckpointWriteError, match=r"no space left on the device \(ENOSPC\): it needs at least [\d.]+ kB \([\d,]+ bytes\), [\d.]+ kB \([\d,]+ bytes\) are free there"):
            fzero.checkpoint.save(path, state)
    assert_survives(path, step, step.gather(state))


def test_a_save_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch):
    step, state = trained(1)
    path = fzero.checkpoint.save(tmp_path / "ck", state)
    needed = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    real_usage = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real_usage(p)._replace(free=1234))
    with pytest.raises(CheckpointWriteError, match=r"cannot write .*ck: no space left on the device \(ENOSPC\): it needs at least ([\d.]+) kB \(([\d,]+) bytes\), 1.23 kB \(1,234 bytes\) are free") as e:
        fzero.checkpoint.save(path, state)
    assert 0.5 * needed < int(e.value.args[0].split("(")[2].split(" ")[0].replace(",", "")) <= needed
    with pytest.raises(CheckpointWriteError, match=r"fzero.checkpoint.consolidate: cannot write .*out.pt: no space left on the device \(ENOSPC\)"):
        fzero.checkpoint.consolidate(path, tmp_path / "out.pt")
    monkeypatch.undo()
    assert_survives(path, step, step.gather(state))
    assert not os.path.exists(tmp_path / "out.pt.partial")


def test_a_full_disk_during_consolidate_is_named_and_leaves_nothing(saved, tmp_path, monkeypatch):
    path = saved[0]
    real_fsync = os.fsync

    def fsync(fd):  # a filesystem that reports ENOSPC when the data is flushed (NFS, thin provisioning)
        if os.readlink(f"/proc/self/fd/{fd}").endswith("out.pt.partial"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(CheckpointWriteError, match=rf"fzero.checkpoint.consolidate: cannot write {tmp_path}/out.pt: no space left on the device \(ENOSPC\)") as e:
        fzero.checkpoint.consolidate(path, tmp_path / "out.pt")
    assert e.value.errno == errno.ENOSPC and sorted(os.listdir(tmp_path)) == []
    def partial_files_fail(fd):  # the safetensors writer's .<file>.partial
        if ".partial" in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", partial_files_fail)
    step, state = saved[1], saved[2]
    for export in (lambda: fzero.checkpoint.consolidate(path, tmp_path / "hf", format="safetensors"),
                   lambda: fzero.checkpoint.save_weights(step, state, tmp_path / "hf")):
        with pytest.raises(CheckpointWriteError, match=rf"cannot write {tmp_path}/hf: no space left on the device \(ENOSPC\): it needs at least"):
            export()
        assert os.listdir(tmp_path / "hf") == []  # no partial file left


# -- read-only and missing directories ----------------------------------------------------------------------------


@contextmanager
def read_only(directory, monkeypatch, code: int = errno.EACCES):
    """``directory`` made unwritable: by chmod where that stops this user; as root (whom chmod does not stop) by making
    ``mkdir`` and ``open`` for writing refuse paths inside it with ``code``, as the kernel would."""
    directory = str(directory)
    os.chmod(directory, 0o555)
    try:
        probe = os.path.join(directory, ".probe")
        try:
            open(probe, "w").close()
            os.remove(probe)
            simulated = True
        except PermissionError:
            simulated = False
        if simulated or code != errno.EACCES:
            import builtins

            real_mkdir, real_open = os.mkdir, builtins.open

            def inside(p) -> bool:
                return isinstance(p, (str, os.PathLike)) and os.path.abspath(os.fspath(p)).startswith(directory + os.sep)

            def mkdir(p, *a, **k):
                if inside(p):
                    raise OSError(code, os.strerror(code), os.fspath(p))
                return real_mkdir(p, *a, **k)

            def open_(p, mode="r", *a, **k):
                if inside(p) and any(c in mode for c in "wax+"):
                    raise OSError(code, os.strerror(code), os.fspath(p))
                return real_open(p, mode, *a, **k)

            monkeypatch.setattr(os, "mkdir", mkdir)
            monkeypatch.setattr(builtins, "open", open_)
        yield
    finally:
        monkeypatch.undo()
        os.chmod(directory, 0o755)


@pytest.mark.parametrize("code,words", [(errno.EACCES, r"permission denied \(EACCES\)"), (errno.EROFS, r"the filesystem is read-only \(EROFS\)")])
def test_save_and_consolidate_into_a_read_only_directory(saved, tmp_path, monkeypatch, code, words):
    path, step, state = saved
    (tmp_path / "ro").mkdir()
    previous = fzero.checkpoint.save(tmp_path / "ro" / "ck", state)
    with read_only(tmp_path / "ro", monkeypatch, code):
        with pytest.raises(CheckpointWriteError, match=rf"fzero.checkpoint.save: cannot write {previous}: {words}.* The previous checkpoint at {previous} is untouched") as e:
            fzero.checkpoint.save(previous, state)
        assert e.value.errno == code
        with pytest.raises(CheckpointWriteError, match=rf"fzero.checkpoint.consolidate: cannot write {tmp_path}/ro/model.pt: {words}"):
            fzero.checkpoint.consolidate(path, tmp_path / "ro" / "model.pt")
        with pytest.raises(CheckpointWriteError, match=rf"cannot write {tmp_path}/ro/sub/ck: {words}"):
            fzero.checkpoint.save(tmp_path / "ro" / "sub" / "ck", state)
        with pytest.raises(CheckpointWriteError, match=rf"fzero.checkpoint.consolidate: cannot write {tmp_path}/ro/hf: {words}"):
            fzero.checkpoint.consolidate(path, tmp_path / "ro" / "hf", format="safetensors")
        with pytest.raises(CheckpointWriteError, match=rf"fzero.checkpoint.save_weights: cannot write {tmp_path}/ro/hf: {words}"):
            fzero.checkpoint.save_weights(step, state, tmp_path / "ro" / "hf")
    assert_survives(previous, step, step.gather(state))
    assert sorted(os.listdir(tmp_path / "ro")) == ["ck"]


def test_consolidate_into_a_missing_directory_says_so(saved, tmp_path):
    with pytest.raises(CheckpointWriteError, match=rf"fzero.checkpoint.consolidate: cannot write into {tmp_path}/nowhere: the directory does not exist. Create it first"):
        fzero.checkpoint.consolidate(saved[0], tmp_path / "nowhere" / "model.pt")
    (tmp_path / "file").write_text("")
    with pytest.raises(CheckpointWriteError, match="file: it is not a directory"):
        fzero.checkpoint.consolidate(saved[0], tmp_path / "file" / "model.pt")
    out = cli("consolidate", saved[0], str(tmp_path / "nowhere" / "model.pt"))
    assert out.returncode == 1 and "the directory does not exist" in out.stderr and "Traceback" not in out.stderr


# -- crashed saves ------------------------------------------------------------------------------------------------


def test_kill_9_during_a_save_then_the_next_save_removes_the_leftovers(tmp_path):
    """SIGKILL mid-save: the previous checkpoint verifies and loads; a later save into the same directory (to another
    path) removes the dead save's .partial, but never a live save's nor a directory that is not a save's."""
    path = str(tmp_path / "ck")
    with open(tmp_path / "log", "wb") as log:
        proc = subprocess.Popen([sys.executable, WORKER, "crash", "--save", path], env=ENV, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 60
        while not (os.path.exists(os.path.join(path, "COMPLETE")) and os.path.exists(tmp_path / ".ck.partial")):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    step, params = crash_step()
    state = fzero.checkpoint.load(path, like=step)
    assert fzero.checkpoint.verify(path) == path and state.step_count == fzero.checkpoint.read_extra(path)["k"] >= 1
    assert_trees_equal(step.gather(state), step.gather(step.init(params)))
    assert os.path.isdir(tmp_path / ".ck.partial")

    live = tmp_path / ".live.partial"  # a save in progress in another process: it holds the lock
    live.mkdir()
    (live / "__0_0.distcp").write_bytes(b"x")
    foreign = tmp_path / ".notes.partial"  # named like one, but holds what no save writes
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)
    small_step, small = trained(1)
    try:
        fzero.checkpoint.save(tmp_path / "other", small)
        assert not os.path.exists(tmp_path / ".ck.partial")  # swept
        assert (live / "__0_0.distcp").exists() and (foreign / "notes.txt").read_text() == "precious"
        with pytest.raises(CheckpointError, match=r"\.live.partial is being written by another running save; wait for it or save elsewhere"):
            fzero.checkpoint.save(tmp_path / "live", small)
        assert (live / "__0_0.distcp").exists()
    finally:
        os.close(fd)  # that save died
    fzero.checkpoint.save(tmp_path / "other", small)
    assert not live.exists() and (foreign / "notes.txt").exists()
    assert sorted(e for e in os.listdir(tmp_path) if not e.endswith("log")) == [".notes.partial", "ck", "other"]


# -- the real thing, in a user namespace ---------------------------------------------------------------------------


def _user_namespaces() -> bool:
    try:
        return subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


REAL = textwrap.dedent('''
    import errno, json, os, shutil, subprocess, sys
    import torch, fzero
    from fzero.checkpoint import CheckpointWriteError
    from fzero.checkpoint._state import entries, size_lower_bound
    from fzero.models import MLP
    full, ro, denied, out = sys.argv[1:5]
    results = {}

    def attempt(name, fn):
        try:
            fn()
            results[name] = None
        except CheckpointWriteError as e:
            results[name] = [e.errno, str(e)]

    def make(width, depth):
        torch.manual_seed(0)
        model = MLP([width] * depth)
        step = fzero.compile(lambda p, b: fzero.apply(model, p, b).sum(), optimizer=fzero.optim.adamw(1e-3), stages=1,
                             mesh=fzero.local_mesh(2), unit_elements=64)
        return step, step.init(fzero.params_of(model))

    step, small = make(4, 3)
    ck = fzero.checkpoint.save(os.path.join(full, "ck"), small)
    _, many = make(4, 200)  # many tiny tensors: DCP's per-record overhead outweighs their bytes
    needed = size_lower_bound(many[0], entries(many[0], api="test"), processes=1, rng_bytes=torch.get_rng_state().numel())
    with open(os.path.join(full, "filler"), "wb") as f:  # leave room for the bytes, not for the records
        f.write(b"0" * (shutil.disk_usage(full).free - needed - 8192))
    results["room_for_the_bound"] = shutil.disk_usage(full).free >= needed  # so the write itself fails, not the check before it
    attempt("save_full", lambda: fzero.checkpoint.save(ck, many))
    results["full_after"] = sorted(os.listdir(full))
    results["full_loads"] = fzero.checkpoint.verify(ck) == ck and fzero.checkpoint.load(ck, like=step).step_count == 0

    ck2 = fzero.checkpoint.save(os.path.join(ro, "ck"), small)
    subprocess.run(["mount", "-o", "remount,ro", ro], check=True)
    attempt("save_ro", lambda: fzero.checkpoint.save(ck2, small))
    attempt("consolidate_ro", lambda: fzero.checkpoint.consolidate(ck2, os.path.join(ro, "model.pt")))
    results["ro_loads"] = fzero.checkpoint.verify(ck2) == ck2
    attempt("save_denied", lambda: fzero.checkpoint.save(os.path.join(denied, "ck"), small))
    attempt("consolidate_denied", lambda: fzero.checkpoint.consolidate(ck2, os.path.join(denied, "model.pt")))
    with open(out, "w") as f:
        json.dump(results, f)
''')


@pytest.mark.skipif(not _user_namespaces(), reason="needs unprivileged user namespaces (unshare -rm) to mount a small tmpfs; the simulated tests above cover the same errors")
def test_real_full_read_only_and_denied_filesystems(tmp_path):
    full, ro, denied = (tmp_path / n for n in ("full", "ro", "denied"))
    for d in (full, ro, denied):
        d.mkdir()
    os.chown(denied, 65534, 65534)  # owned by a user the namespace does not map: its root gets EACCES like anyone
    os.chmod(denied, 0o555)
    (tmp_path / "real.py").write_text(REAL)
    out = tmp_path / "out.json"
    script = (f"mount -t tmpfs -o size=2m tmpfs {full} && mount -t tmpfs -o size=2m tmpfs {ro} && "
              f"{sys.executable} {tmp_path / 'real.py'} {full} {ro} {denied} {out}")
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script], env=ENV, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    code, message = r["save_full"]
    assert code == errno.ENOSPC and "no space left on the device (ENOSPC): it needs at least" in message
    assert r["room_for_the_bound"] and "The previous checkpoint at" in message and r["full_after"] == ["ck", "filler"] and r["full_loads"]
    assert r["save_ro"][0] == errno.EROFS and "the filesystem is read-only (EROFS)" in r["save_ro"][1]
    assert r["consolidate_ro"][0] == errno.EROFS and f"cannot write {ro}/model.pt: the filesystem is read-only" in r["consolidate_ro"][1]
    assert r["ro_loads"]
    assert r["save_denied"][0] == errno.EACCES and f"cannot write {denied}/ck: permission denied (EACCES)" in r["save_denied"][1]
    assert r["consolidate_denied"][0] == errno.EACCES and "permission denied (EACCES)" in r["consolidate_denied"][1]

"""Checksums of a checkpoint's files: written into the ``COMPLETE`` marker, checked before anything is used.

Why CRC-32 (``zlib.crc32``): it detects every burst error of up to 32 bits (a flipped byte, a torn sector
boundary) and, measured on this 2-core machine on a 256 MiB buffer, runs at 2.8 GB/s, against 1.75 for
SHA-256 (SHA-NI), 1.56 for SHA-1, 0.74 for MD5 and 0.72 for BLAKE2b; Adler-32 (3.2 GB/s) is weaker on short
files. It guards against damage, not against an adversary: whoever can edit the files can edit the marker.

The marker is JSON: ``files`` (name -> bytes, as before checksums existed, so older readers still read it),
``crc32`` (name -> CRC-32 of the file's bytes) and ``marker_crc32`` (of the two maps, so that a damaged
marker is told apart from a damaged file). ``fzero.json`` is one of the files: editing a field in it (the
step, say) is caught like a flipped byte in a tensor.

Small files (``fzero.json``, DCP's ``.metadata``) are checked whenever a checkpoint is opened; the data files
when they are read (``Manifest.check``), so that under torchrun each process reads back only the files it
loads from, or all of them by ``verify_all`` (``python -m fzero.checkpoint verify``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from typing import Iterable

from fzero.checkpoint._dcp import CheckpointError

MARKER = "COMPLETE"
SMALL = ("fzero.json", ".metadata")  # checked on every open: what every reader reads first
_CHUNK = 8 << 20


class CheckpointCorrupted(CheckpointError):
    """A file of a checkpoint differs from what was saved: its CRC-32 (or size) is not the one the marker recorded."""

    def __init__(self, message: str, *, file: str, expected: int | None = None, found: int | None = None) -> None:
        super().__init__(message)
        self.file, self.expected, self.found = file, expected, found


def crc32_file(path: str) -> int:
    """The CRC-32 of a file's bytes, read in 8 MiB chunks into one reused buffer."""
    crc, buf = 0, bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def _marker_crc(files: dict[str, int], crcs: dict[str, int]) -> int:
    return zlib.crc32(json.dumps([files, crcs], sort_keys=True).encode())


def marker_bytes(directory: str, crcs: dict[str, int]) -> bytes:
    """The marker for ``directory``: every file in it (the marker aside) with its size and the given CRC-32.

    ``crcs`` must name every file: a file that no process checksummed is a bug here, not the user's problem.
    """
    names = sorted(n for n in os.listdir(directory) if n != MARKER)
    if sorted(crcs) != names:
        raise CheckpointError(
            f"fzero.checkpoint.save: internal error: checksums for {sorted(crcs)} but {directory} holds {names}; please report it."
        )
    files = {n: os.path.getsize(os.path.join(directory, n)) for n in names}
    crcs = {n: crcs[n] for n in names}
    return json.dumps({"files": files, "crc32": crcs, "marker_crc32": _marker_crc(files, crcs)}, indent=1).encode()


@dataclasses.dataclass
class Manifest:
    """What the marker of the checkpoint at ``path`` says: the files' sizes and, when verifying, their CRC-32s."""

    path: str
    files: dict[str, int]
    crcs: dict[str, int] | None  # None: not verifying (verify=False)
    api: str
    checked: set[str] = dataclasses.field(default_factory=set)

    def check(self, names: Iterable[str]) -> None:
        """Raise ``CheckpointCorrupted`` unless each named file has the recorded CRC-32 (each is read once)."""
        if self.crcs is None:
            return
        for name in sorted(set(names) - self.checked):
            expected = self.crcs.get(name)
            if expected is None:
                raise CheckpointCorrupted(
                    f"{self.api}: {self.path} is damaged: {name} is read but is not listed in its {MARKER} marker.", file=name
                )
            found = crc32_file(os.path.join(self.path, name))
            if found != expected:
                raise CheckpointCorrupted(
                    f"{self.api}: {self.path} is corrupted: {name} has CRC-32 {found:08x}, but {expected:08x} was recorded when "
                    f"it was saved (the file changed on disk since). Restore the checkpoint from a copy, or load an older one.",
                    file=name, expected=expected, found=found,
                )
            self.checked.add(name)


def read_manifest(path: str, *, verify: bool, api: str) -> Manifest:
    """Read the marker of the complete checkpoint ``path``; check every file's presence and size, and (verify) the small files' CRC-32."""
    try:
        with open(os.path.join(path, MARKER), "rb") as f:
            marker = json.loads(f.read())
        files = marker["files"]
        if not isinstance(files, dict) or not all(isinstance(v, int) for v in files.values()):
            raise TypeError("'files' is not a map of names to sizes")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointCorrupted(f"{api}: {path}/{MARKER} is corrupted ({type(e).__name__}: {e}).", file=MARKER) from None
    crcs = marker.get("crc32")
    if verify:
        if crcs is None:
            raise CheckpointError(
                f"{api}: {path} was saved without checksums (by an fzero older than verified checkpoints), so it cannot be "
                f"verified. If you trust it, load it with verify=False and save it again: the new checkpoint carries checksums."
            )
        if not isinstance(crcs, dict) or marker.get("marker_crc32") != _marker_crc(files, crcs):
            raise CheckpointCorrupted(f"{api}: {path}/{MARKER} is corrupted (its own checksum does not match its contents).", file=MARKER)
    for name, size in files.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            raise CheckpointCorrupted(f"{api}: {path} is damaged: the file {name} is missing.", file=name)
        if os.path.getsize(file) != size:
            raise CheckpointCorrupted(
                f"{api}: {path} is damaged: {name} has {os.path.getsize(file)} bytes, {size} were written (truncated or changed).", file=name
            )
    manifest = Manifest(path, files, crcs if verify else None, api)
    manifest.check(n for n in SMALL if n in files)
    return manifest


@dataclasses.dataclass(frozen=True)
class FileCheck:
    """One line of ``python -m fzero.checkpoint verify``: a file and what was found."""

    name: str
    ok: bool
    detail: str


def verify_all(path: str) -> list[FileCheck]:
    """Check every file the marker of ``path`` lists (and flag files it does not list); never raises for a bad file."""
    try:
        with open(os.path.join(path, MARKER), "rb") as f:
            marker = json.loads(f.read())
        files, crcs = marker["files"], marker.get("crc32")
        marker_ok = isinstance(crcs, dict) and marker.get("marker_crc32") == _marker_crc(files, crcs)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [FileCheck(MARKER, False, f"unreadable or corrupted ({type(e).__name__}: {e})")]
    if crcs is None:
        return [FileCheck(MARKER, False, "records no checksums (saved by an fzero older than verified checkpoints): load with verify=False and save again")]
    out = [FileCheck(MARKER, marker_ok, "ok" if marker_ok else "corrupted: its own checksum does not match its contents")]
    for name in sorted(files):
        file, size, expected = os.path.join(path, name), files[name], crcs.get(name)
        if not os.path.isfile(file):
            out.append(FileCheck(name, False, "missing"))
        elif os.path.getsize(file) != size:
            out.append(FileCheck(name, False, f"truncated or changed: {os.path.getsize(file)} bytes, {size} were written"))
        elif expected is None:
            out.append(FileCheck(name, False, "no checksum recorded"))
        elif (found := crc32_file(file)) != expected:
            out.append(FileCheck(name, False, f"corrupted: CRC-32 {found:08x}, {expected:08x} was recorded"))
        else:
            out.append(FileCheck(name, True, f"ok ({size} bytes, CRC-32 {found:08x})"))
    for name in sorted(set(os.listdir(path)) - set(files) - {MARKER}):
        out.append(FileCheck(name, True, "extra: not part of the checkpoint (ignored)"))
    return out

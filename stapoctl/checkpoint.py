"""Checkpoints: written into a hidden temp dir, then renamed, so a crash never leaves a
half-written `step_NNNNNN/`; a manifest of every file's size and sha256, written last, lets a
resume tell a complete checkpoint from a damaged one (a truncated copy, a bad disk) and fall
back to the previous complete one instead of loading garbage.

Layout (a contract with `stapoctl eval` and `models.resolve`):
    <run_dir>/checkpoints/step_000020/model/              HF dir, loadable by vLLM and transformers
    <run_dir>/checkpoints/step_000020/state/              DeepSpeed: weights, optimizer, scheduler
    <run_dir>/checkpoints/step_000020/trainer_state.json  step, sampler position, RNG, run id
    <run_dir>/checkpoints/step_000020/manifest.json       path → size, sha256 of every other file
    <run_dir>/checkpoints/latest                          text: the newest step dir's name
    <run_dir>/checkpoints/.step_000020.XXXX/              a write in progress (or one a kill cut short)
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from stapoctl.errors import UserError, exception_chain
from stapoctl.paths import fsync_dir, write_atomic
from stapoctl.tracking.run_ids import looks_like_run_id, run_dir_of

TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"
_STEP_RE = re.compile(r"^step_(\d{6,})$")
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)  # no space left on the device; the user's disk quota is used up
# files hashed at once: hashlib releases the GIL while it reads and hashes, so a checkpoint's
# shards hash in parallel instead of one thread reading 100 GB at save and again at resume
HASH_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))


class CheckpointDamaged(ValueError):
    """A step dir named directly that fails its manifest check; the reason is the message."""


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def save(run_dir: Path, step: int, write_payload: Callable[[Path], None], trainer_state: dict) -> Path:
    """`write_payload(tmp_dir)` fills model/ and state/; we add trainer_state.json and publish.

    A write that fails because the disk is full raises an `OSError` ENOSPC / EDQUOT (whatever
    the writer raised, see `disk_full`) once the partial write is removed."""
    ckpt_root = Path(run_dir) / "checkpoints"
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / step_dir_name(step)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=ckpt_root))
    try:
        write_payload(tmp)
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state, indent=2, sort_keys=True) + "\n")
        write_manifest(tmp)
        _fsync_tree(tmp)
        if final.exists():  # the same step saved again (a resumed run re-reaching it): swap, then drop
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old.", dir=ckpt_root))
            os.rename(final, old / final.name)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
        if _fsync_on():  # the renames themselves on disk: a machine crash keeps the published dir
            fsync_dir(ckpt_root)
    except Exception as exc:
        full = disk_full(exc, tmp)  # probed before the partial write goes (it fills the disk)
        if full is None:
            raise
        raise full from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    try:
        write_atomic(ckpt_root / "latest", final.name + "\n", durable=_fsync_on())
    except OSError:
        pass  # only a hint: `latest_step_dir` takes the newest verified step dir anyway
    return final


def disk_full(exc: BaseException, where: Optional[Path] = None) -> Optional[OSError]:
    """The `OSError` ENOSPC / EDQUOT behind `exc`, else None.

    Looked for in the exception's chain (`__cause__`, `__context__`, and `cause`: what a Ray task
    raised); a writer that loses the errno (`torch.save` raises "iostream error" / "unexpected
    pos") is recognised by a small probe write at `where` that fails with it."""
    for e in exception_chain(exc, lambda e: (e.__cause__, e.__context__, getattr(e, "cause", None))):
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return OSError(e.errno, os.strerror(e.errno), e.filename or (str(where) if where else None))
    return _probe_full(Path(where)) if where is not None else None


def _probe_full(where: Path, size: int = 1 << 20) -> Optional[OSError]:
    if not where.is_dir():
        return None
    try:
        with tempfile.TemporaryFile(dir=where) as f:
            f.write(b"\0" * size)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        if e.errno in DISK_FULL:
            return OSError(e.errno, os.strerror(e.errno), str(where))
    return None


def step_size(step_dir: Path) -> int:
    """Bytes of a step dir's files."""
    return sum(p.stat().st_size for p in Path(step_dir).rglob("*") if p.is_file())


def prune(run_dir: Path, keep: int, newest: Path, protect: Sequence[Path] = ()) -> list[Path]:
    """Keep the `keep` newest step dirs (`trainer.keep_checkpoints`; 0 keeps all): an 8B run's
    checkpoint with its optimizer state is over 100 GB. Nothing goes unless `newest` (just
    written) verifies, and neither it, the one `latest` names, nor one in `protect` (the
    checkpoint a running resume started from: its rollout actors reload its model/ when Ray
    restarts them) ever goes. Each removed dir is first renamed to a hidden `.step_*` dir (debris
    a resume clears), so a kill mid-delete leaves no half checkpoint. Returns the removed dirs."""
    if keep <= 0 or verify(newest, checksums=False) is not None:  # sizes: the bytes were just fsynced
        return []
    root = Path(run_dir) / "checkpoints"
    marker = root / "latest"
    named = marker.read_text().strip() if marker.is_file() else ""
    kept = {Path(newest).name, named, *(Path(p).name for p in protect if Path(p).parent.resolve() == root.resolve())}
    removed = []
    for old in step_dirs(run_dir)[keep:]:
        if old.name in kept:
            continue
        trash = Path(tempfile.mkdtemp(prefix=f".{old.name}.old.", dir=root))
        os.rename(old, trash / old.name)
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(old)
    return removed


# -- the manifest ---------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


# (path, inode, size, mtime) -> sha256 of a file `verify` read: a process that resolves the same
# checkpoint again (`stapoctl eval`: its preflight, then the run) reads it once. Only files last
# written over RACY_NS ago are remembered (git's "racy clean" rule): a rewrite within the
# timestamp's granularity could keep all four
_READ_DIGESTS: dict[tuple, str] = {}
RACY_NS = 2_000_000_000


def _stamp(path: Path) -> Optional[tuple]:
    st = path.stat()
    if time.time_ns() - st.st_mtime_ns < RACY_NS:
        return None
    return str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns


def _sha256_many(paths: Sequence[Path], *, remember: bool = False) -> list[str]:
    """sha256 of each file, `HASH_THREADS` files at a time, in `paths`' order."""
    def one(path: Path) -> str:
        if not remember:
            return _sha256(path)
        key = _stamp(path)
        if key is None:
            return _sha256(path)
        if key not in _READ_DIGESTS:
            _READ_DIGESTS[key] = _sha256(path)
        return _READ_DIGESTS[key]

    if len(paths) <= 1 or HASH_THREADS == 1:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(min(HASH_THREADS, len(paths)), thread_name_prefix="stapoctl-sha256") as pool:
        return list(pool.map(one, paths))


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(step_dir: Path) -> dict:
    """Size and sha256 of every file in the (not yet published) step dir; written last."""
    step_dir = Path(step_dir)
    found = _files(step_dir)
    files = {p.relative_to(step_dir).as_posix(): {"size": p.stat().st_size, "sha256": digest}
             for p, digest in zip(found, _sha256_many(found))}
    manifest = {"version": 1, "files": files}
    (step_dir / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return manifest


def verify(step_dir: Path, *, checksums: bool = True) -> Optional[str]:
    """None when the step dir is complete; else why not (one phrase, for a warning).

    Sizes are cheap and catch truncation; checksums read every byte (on resume, once). A step
    dir without a manifest (written before manifests existed) passes if its state file reads.
    """
    step_dir = Path(step_dir)
    state = step_dir / TRAINER_STATE
    if not state.is_file():
        return f"no {TRAINER_STATE}"
    try:
        json.loads(state.read_text())
    except (OSError, ValueError) as exc:
        return f"{TRAINER_STATE} unreadable ({exc})"
    mpath = step_dir / MANIFEST
    if not mpath.is_file():
        return None
    try:
        files = json.loads(mpath.read_text())["files"]
    except (OSError, ValueError, KeyError) as exc:
        return f"{MANIFEST} unreadable ({exc})"
    for rel, want in files.items():  # sizes first: a truncated file is found without reading any
        path = step_dir / rel
        if not path.is_file():
            return f"{rel} is missing"
        size = path.stat().st_size
        if size != want["size"]:
            return f"{rel} has {size} bytes, the manifest says {want['size']}"
    if checksums:
        digests = _sha256_many([step_dir / rel for rel in files], remember=True)
        for (rel, want), digest in zip(files.items(), digests):
            if digest != want["sha256"]:
                return f"{rel} does not match its sha256"
    return None


def _fsync_on() -> bool:
    return os.environ.get("STAPOCTL_CKPT_FSYNC", "1") != "0"


def _fsync_tree(root: Path) -> None:
    """Data on disk before the rename publishes it (a crash of the machine, not just the process)."""
    if not _fsync_on():
        return
    for p in [*_files(root), root / MANIFEST]:
        try:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError:
            pass
    for d in [*(p for p in root.rglob("*") if p.is_dir()), root]:  # the files' entries in their dirs
        fsync_dir(d)


def step_dirs(run_dir: Path) -> list[Path]:
    """Published step dirs of a run, newest first."""
    root = Path(run_dir) / "checkpoints"
    return sorted((p for p in root.glob("step_*") if _STEP_RE.match(p.name) and p.is_dir()),
                  key=lambda p: -int(_STEP_RE.match(p.name).group(1)))  # type: ignore[union-attr]


def latest_step_dir(run_dir: Path, *, checksums: bool = False, warn: Optional[Callable[[str], None]] = None
                    ) -> Optional[Path]:
    """The newest complete step dir (manifest verified), else None.

    `latest` is only a hint: a kill between the rename and its update leaves it one behind, so
    the highest verified step wins. Damaged ones are skipped, each named through `warn`.
    """
    for candidate in step_dirs(run_dir):
        problem = verify(candidate, checksums=checksums)
        if problem is None:
            return candidate
        if warn is not None:
            warn(f"skipping checkpoint {candidate}: {problem}")
    return None


def is_step_dir(path: Path) -> bool:
    return (Path(path) / TRAINER_STATE).is_file() or (Path(path) / MANIFEST).is_file()


def find_checkpoint(path: Path, *, checksums: bool = True, warn: Optional[Callable[[str], None]] = None
                    ) -> Optional[Path]:
    """The one checkpoint lookup of every reader (`resume=`, `--model` / `model.path`, the plan):
    a step dir is itself once it verifies (else `CheckpointDamaged`, the reason); a run dir or its
    `checkpoints/` dir gives its newest complete step dir, the damaged ones skipped and each named
    through `warn` (None: it has none). `checksums` reads every byte, `HASH_THREADS` files at once."""
    path = Path(path)
    if is_step_dir(path):
        problem = verify(path, checksums=checksums)
        if problem is not None:
            raise CheckpointDamaged(problem)
        return path
    run_dir = path.parent if path.name == "checkpoints" and not (path / "checkpoints").is_dir() else path
    return latest_step_dir(run_dir, checksums=checksums, warn=warn)


def partial_writes(run_dir: Path) -> list[Path]:
    """Temp dirs of checkpoint writes that never finished (the writer was killed)."""
    root = Path(run_dir) / "checkpoints"
    return sorted(p for p in root.glob(".step_*") if p.is_dir())


def remove_partial_writes(run_dir: Path, warn: Optional[Callable[[str], None]] = None) -> None:
    """Only the run's own driver writes its checkpoints, so at resume every temp dir is debris."""
    for p in partial_writes(run_dir):
        if warn is not None:
            warn(f"removing {p.name}: a checkpoint write that was cut short")
        shutil.rmtree(p, ignore_errors=True)


def read_trainer_state(step_dir: Path) -> dict:
    return json.loads((Path(step_dir) / TRAINER_STATE).read_text())


def resolve_resume(spec: str, tracking_uri: Optional[str] = None,
                   warn: Optional[Callable[[str], None]] = None) -> Path:
    """`resume=` → the checkpoint step dir to continue from, its files checked against the manifest.

    Accepts a step dir, a run dir (its newest complete checkpoint), or an MLflow run id, full or
    short (its tag `stapoctl.run_dir`, then the newest complete checkpoint there).
    """
    value = str(spec).strip()
    path = Path(value).expanduser()
    if path.is_dir():
        try:
            found = find_checkpoint(path, checksums=True, warn=warn)
        except CheckpointDamaged as exc:
            raise UserError(f"resume={value}: that checkpoint is damaged ({exc}); resume from the "
                            "run dir instead to take its newest complete checkpoint") from None
        if found is None:
            raise UserError(f"resume={value}: no complete checkpoint under {path} (expected checkpoints/step_NNNNNN/)")
        return found.resolve()
    if looks_like_run_id(value):
        run_dir = run_dir_of(value, tracking_uri, what="resume")
        found = latest_step_dir(run_dir, checksums=True, warn=warn)
        if found is None:
            raise UserError(f"resume={value}: MLflow run's dir {run_dir} has no complete checkpoint yet")
        return found.resolve()
    raise UserError(
        f"resume={value}: not a directory and not a 32-hex MLflow run id (or a prefix of ≥ 7 digits, as "
        "`stapoctl runs` prints it); pass a run dir, a checkpoints/step_NNNNNN dir or the run id"
    )


def rng_state() -> dict[str, Any]:
    """The driver's RNG states, JSON-safe (the rollout seeds themselves derive from the step)."""
    import random

    import torch

    py = random.getstate()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "torch": torch.get_rng_state().tolist(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import random

    import torch

    if "python" in state:
        v, internal, gauss = state["python"]
        random.setstate((v, tuple(internal), gauss))
    if "torch" in state:
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))

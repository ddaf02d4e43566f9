"""What a training run sends to MLflow goes through a journal on disk and a background thread.

Why: a step must never wait on the tracking server (a slow or unreachable server would stall
hours of accelerator time for a dashboard), and nothing logged may be lost when the server is
down, the driver is killed or the run is resumed.

- `log_metrics`, `set_tags` and `log_text` append one JSON line to `<run_dir>/mlflow_journal.jsonl`
  and return (tens of microseconds); a thread sends the lines in order, in batches
  (`MlflowClient.log_batch`), and records the last one sent in `mlflow_journal.sent`.
- While the server is unreachable the thread retries with backoff; the lines wait on disk. When
  a run starts or resumes, lines a previous process did not get to send are sent first.
- A point keeps the timestamp it was logged with, so a line sent twice (a kill between the send
  and the bookkeeping) is the same point, which MLflow's SQL store keeps once.
- Each (key, step) is logged once per run. A resumed run recomputes the steps between its
  checkpoint and the interruption; those were logged already and the first record stands (the
  driver checks the recomputation against it; see README "Failures and resuming").
- `close(status)` sends the rest and ends the run, waiting at most `timeout_s`; what is still
  unsent then stays in the journal for the next `stapoctl train resume=…` of that run dir.
- A journal that cannot be written (its disk is full) does not stop the run: from the first
  failed write on, records are kept in memory and sent from there; what MLflow has not taken
  by `close` is written to a file elsewhere (`spill_dirs`), and `close_note` says which.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional

from stapoctl.paths import write_atomic

JOURNAL = "mlflow_journal.jsonl"
SENT = "mlflow_journal.sent"
_MAX_METRICS, _MAX_TAGS = 1000, 100  # MLflow's log_batch limits (params: as tags)
_BATCHED = ("metrics", "tags", "params")

_ACTIVE: Optional["MetricBuffer"] = None


def active() -> Optional["MetricBuffer"]:
    """The buffer of the run training in this process, if any (`mlflow_run.log_metrics` uses it)."""
    return _ACTIVE


@contextlib.contextmanager
def activated(buffer: "MetricBuffer") -> Iterator["MetricBuffer"]:
    global _ACTIVE
    previous, _ACTIVE = _ACTIVE, buffer
    try:
        yield buffer
    finally:
        _ACTIVE = previous


def _now_ms() -> int:
    return int(time.time() * 1000)


class MetricBuffer:
    """The journal + sender of one MLflow run."""

    def __init__(self, run_dir: Path, run_id: str, tracking_uri: str, *,
                 say: Optional[Callable[[str], None]] = None, backoff_max_s: float = 5.0):
        from stapoctl.tracking.store_init import client

        self.run_dir, self.run_id, self.uri = Path(run_dir), run_id, tracking_uri
        self.client = client(tracking_uri)
        self.say = say or (lambda msg: None)
        self.backoff_max_s = backoff_max_s
        self.path = self.run_dir / JOURNAL
        self.sent_path = self.run_dir / SENT
        self.logged: dict[int, dict[str, float]] = {}  # step → key → first value logged
        self.pending: list[dict] = []
        self.seq = 0
        self.sent_seq = self._read_sent()
        self.max_log_s = 0.0  # the longest any log call held its caller
        self.points_sent = 0
        self.outage_since: Optional[float] = None
        self.last_error = ""
        self.journal_error: Optional[OSError] = None  # the write that failed; nothing is journaled after it
        self.unjournaled = 0  # records since then, in memory only
        self.spilled: Optional[Path] = None  # where `close` wrote those MLflow did not take
        self._load()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        if self.path.stat().st_size and not self._ends_with_newline():  # a line cut short by a kill or a full disk
            self._journal("\n")
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._send_loop, name="stapoctl-mlflow-sender", daemon=True)
        self._thread.start()

    # -- the journal ------------------------------------------------------------------------
    def _read_sent(self) -> int:
        try:
            return int(self.sent_path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _load(self) -> None:
        """Replay the journal: what was logged (for de-duplication) and what was never sent."""
        if not self.path.is_file():
            return
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:  # a line cut short by a crash: never acknowledged, never sent
                    continue
                self.seq = max(self.seq, int(rec["seq"]))
                if "metrics" in rec:
                    seen = self.logged.setdefault(int(rec["step"]), {})
                    for k, v in rec["metrics"].items():
                        seen.setdefault(k, v)
                # an unsent end status belongs to the process that wrote it; this one ends the run itself
                if int(rec["seq"]) > self.sent_seq and "status" not in rec:
                    self.pending.append(rec)
        self.seq = max(self.seq, self.sent_seq)  # the marker may be ahead of a journal a full disk cut short

    def _ends_with_newline(self) -> bool:
        with open(self.path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            return f.read(1) == b"\n"

    def _journal(self, text: str) -> bool:
        """Append to the journal, unless a write failed before (False: the record is in memory only)."""
        if self.journal_error is None:
            try:
                self._file.write(text)
                self._file.flush()  # in the page cache: survives a kill of this process
                return True
            except OSError as exc:
                self.journal_error = exc
                with contextlib.suppress(OSError):
                    self._file.close()  # its buffer holds a partial line: never written after this
                self.say(f"{self.path} cannot be written ({exc.strerror or exc}): the run's records go to MLflow "
                         "from memory from now on")
        return False

    def _append(self, rec: dict) -> None:
        t0 = time.perf_counter()
        with self._cond:
            self.seq += 1
            rec["seq"] = self.seq
            if not self._journal(json.dumps(rec, separators=(",", ":")) + "\n"):
                self.unjournaled += 1
            self.pending.append(rec)
            self._cond.notify()
        self.max_log_s = max(self.max_log_s, time.perf_counter() - t0)

    # -- what the run logs ----------------------------------------------------------------------
    def log_metrics(self, metrics: Mapping[str, Any], step: int) -> dict[str, float]:
        """Queue finite values not yet logged at this step; returns those queued."""
        seen = self.logged.setdefault(int(step), {})
        fresh: dict[str, float] = {}
        for k, v in metrics.items():
            if v is None or k in seen:
                continue
            v = float(v)
            if math.isfinite(v):
                fresh[k] = v
        if fresh:
            seen.update(fresh)
            self._append({"t": _now_ms(), "step": int(step), "metrics": fresh})
        return fresh

    def logged_value(self, key: str, step: int) -> Optional[float]:
        return self.logged.get(int(step), {}).get(key)

    def logged_steps(self) -> list[int]:
        return sorted(self.logged)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        if tags:
            self._append({"tags": {str(k): str(v)[:5000] for k, v in tags.items()}})

    def log_params(self, params: Mapping[str, Any]) -> None:
        items = [(str(k), "" if v is None else str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), _MAX_TAGS):
            self._append({"params": dict(items[i:i + _MAX_TAGS])})

    def log_text(self, text: str, artifact_file: str) -> None:
        self._append({"text": text, "artifact_file": artifact_file})

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        """A directory that stays on disk (under the run dir) until the sender uploads it."""
        self._append({"artifacts": str(local_dir), "artifact_path": artifact_path})

    def end(self, status: str) -> None:
        """Queue the run's final status (FINISHED, FAILED, KILLED); `close` sends it."""
        self._append({"status": status, "t": _now_ms()})

    @property
    def unsent(self) -> int:
        with self._cond:
            return len(self.pending)

    # -- the sender -----------------------------------------------------------------------------
    def _take(self) -> list[dict]:
        """The next lines to send together: a run of metrics/tags/params lines, or one other line."""
        first = self.pending[0]
        if not any(k in first for k in _BATCHED):
            return [first]
        out, n_metrics, n_tags, n_params = [], 0, 0, 0
        for rec in self.pending:
            if not any(k in rec for k in _BATCHED):
                break
            m, t, p = (len(rec.get(k, ())) for k in _BATCHED)
            if out and p and n_params:  # a param is set once: a second value must reach the store alone
                break
            total = n_metrics + m + n_tags + t + n_params + p
            if out and (total > _MAX_METRICS or n_tags + t > _MAX_TAGS or n_params + p > _MAX_TAGS):
                break
            out.append(rec)
            n_metrics, n_tags, n_params = n_metrics + m, n_tags + t, n_params + p
        return out

    def _send(self, recs: list[dict]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        first = recs[0]
        if "text" in first:
            self.client.log_text(self.run_id, first["text"], first["artifact_file"])
            return
        if "artifacts" in first:
            if Path(first["artifacts"]).is_dir():  # a run dir removed meanwhile: nothing left to send
                self.client.log_artifacts(self.run_id, first["artifacts"], first["artifact_path"])
            return
        if "status" in first:
            self.client.set_terminated(self.run_id, first["status"], end_time=first["t"])
            return
        metrics, tags, params = [], {}, {}
        for rec in recs:
            for k, v in rec.get("metrics", {}).items():
                metrics.append(Metric(k, v, rec["t"], rec["step"]))
            tags.update(rec.get("tags", {}))  # the last value of a tag wins, as it would have
            params.update(rec.get("params", {}))
        self.client.log_batch(self.run_id, metrics=metrics, tags=[RunTag(k, v) for k, v in tags.items()],
                              params=[Param(k, v) for k, v in params.items()])
        self.points_sent += len(metrics)

    def _mark_sent(self, seq: int) -> None:
        """Best effort: a marker left behind (a full disk) only makes a resume send lines again."""
        self.sent_seq = seq
        with contextlib.suppress(OSError):  # the temp file is gone either way
            write_atomic(self.sent_path, f"{seq}\n")

    def _send_loop(self) -> None:
        backoff = 0.25
        while True:
            with self._cond:
                while not self.pending and not self._closing:
                    self._cond.wait()
                if not self.pending:
                    return
                recs = self._take()
            try:
                self._send(recs)
            except Exception as exc:
                if _rejected(exc):  # the store refuses the content itself: retrying cannot help
                    self._reject(recs, exc)
                    continue
                # unreachable, timed out, 5xx, a locked sqlite db: keep the lines, try again
                if self.outage_since is None:
                    self.outage_since = time.monotonic()
                    self.say(f"MLflow at {self.uri} is not answering ({_short(exc)}); training goes on, "
                             f"metrics wait in {self.path}")
                self.last_error = _short(exc)
                with self._cond:
                    self._cond.wait(timeout=backoff)
                backoff = min(backoff * 2, self.backoff_max_s)
                continue
            backoff = 0.25
            with self._cond:
                del self.pending[:len(recs)]
                self._mark_sent(recs[-1]["seq"])
            if self.outage_since is not None:
                self.say(f"MLflow is back after {time.monotonic() - self.outage_since:.0f} s; sending the "
                         f"buffered lines ({self.unsent} left)")
                self.outage_since = None

    def _reject(self, recs: list[dict], exc: BaseException) -> None:
        """Send a refused group line by line; drop (and name) only the lines refused on their own."""
        if len(recs) > 1:
            for rec in recs:
                try:
                    self._send([rec])
                except Exception as one:
                    if not _rejected(one):
                        return  # the store went away meanwhile: the sender loop retries what is left
                    self.say(f"MLflow refused a record of run {self.run_id} ({_short(one)}); it stays in {self.path}")
                with self._cond:
                    del self.pending[:1]
                    self._mark_sent(rec["seq"])
            return
        self.say(f"MLflow refused a record of run {self.run_id} ({_short(exc)}); it stays in {self.path}")
        with self._cond:
            del self.pending[:1]
            self._mark_sent(recs[0]["seq"])

    def flush(self, timeout_s: float) -> bool:
        """Wait until every line is sent (True) or `timeout_s` passes (False)."""
        deadline = time.monotonic() + timeout_s
        while self.unsent and self._thread.is_alive():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return not self.unsent

    def close(self, timeout_s: float = 60.0) -> bool:
        """Send everything (waiting at most `timeout_s`), stop the thread; False if lines remain."""
        done = self.flush(timeout_s)
        with self._cond:
            self._closing = True
            if not done:
                if self.journal_error is not None:
                    self._spill(list(self.pending))
                self.pending.clear()  # stays in the journal for the next resume
            self._cond.notify_all()
        self._thread.join(timeout=5)
        with contextlib.suppress(OSError):
            self._file.close()
        return done

    def _spill(self, recs: list[dict]) -> None:
        """Unsent records the journal could not hold: into the first of `spill_dirs` that takes them."""
        for where in spill_dirs():
            path = where / f"{self.run_id}.{JOURNAL}"
            try:
                where.mkdir(parents=True, exist_ok=True)
                with open(path, "a", encoding="utf-8") as f:
                    f.writelines(json.dumps(r, separators=(",", ":")) + "\n" for r in recs)
            except OSError:
                continue
            self.spilled = path
            return

    def close_note(self, done: bool, timeout_s: float) -> Optional[str]:
        """After `close`: where the records MLflow did not take are (None: it took them all, and the
        journal holds them too)."""
        late = f"MLflow at {self.uri} did not take the last records within {timeout_s:.0f} s"
        if self.journal_error is None:
            return None if done else (f"{late}; they are kept in {self.path} and sent by "
                                      f"`stapoctl train resume={self.run_dir}`")
        broken = (f"{self.path} could not be written ({self.journal_error.strerror or self.journal_error}), so "
                  f"its last {self.unjournaled} records are not in it")
        if done:
            return f"{broken}; they were sent to MLflow"
        if self.spilled is not None:
            return f"{broken}; {late}: they are in {self.spilled} (not sent by a resume)"
        return f"{broken}; {late}, and no other place could be written: they are lost"


def spill_dirs() -> list[Path]:
    """Where unsent records go when the run dir's disk is full: STAPOCTL_HOME, then the temp dir."""
    import tempfile

    from stapoctl import paths

    out = []
    with contextlib.suppress(OSError):
        out.append(paths.home() / "unsent")
    return out + [Path(tempfile.gettempdir()) / "stapoctl-unsent"]


_REFUSALS = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS", "INVALID_STATE",
             "BAD_REQUEST"}


def _rejected(exc: BaseException) -> bool:
    """The store answered and said no (a changed param, a deleted run), as opposed to not answering."""
    return getattr(exc, "error_code", None) in _REFUSALS


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]

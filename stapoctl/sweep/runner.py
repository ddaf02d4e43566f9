"""`stapoctl sweep NAME`: run a sweep's trials, by default one after another in this process.

The trials share one `EngineSession`: Ray, the vLLM actors, the learner ranks and the
verifier pool start once, and each later trial only resets the learner (base weights, fresh
optimizer) and pushes the base weights to vLLM. A failed trial is marked FAILED, its engines
are discarded (the trainer does that) and the next trial starts fresh ones. Ctrl-C or SIGTERM
ends the current trial's run and the parent KILLED before the engines shut down, so no run
is left RUNNING; `resume=SWEEP_ID` later runs only the trials that did not finish (a trial
with a checkpoint continues from it, the others start a new child run).

`max_parallel=K` runs K trials at once instead (`parallel.py`, through `launchers.py`: K
`stapoctl train` processes here, or Ray jobs on a job server); on SLURM it is the job array's
parallelism (`cluster.array_parallelism`).
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, Any, Optional

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from stapoctl.config import overrides as ov
from stapoctl.errors import AlarmStopped, RunStopped, UserError
from stapoctl.sweep import confirm, layout, store
from stapoctl.sweep.definition import SweepCommand, SweepDefinition, override_key, parse_command
from stapoctl.sweep.outcome import (Outcome, alarm_line, alarm_outcome, attempt_run, final_val, finish, pct,
                                    record_failure, resume_point)
from stapoctl.sweep.plan import Trial, check_plan, compose_trial, plan_trials
from stapoctl.sweep.signals import signals_as_interrupt, signals_deferred

if TYPE_CHECKING:
    from stapoctl.trainer.session import EngineSession

# on a resume, overrides may add or change where and how the trials run, not what they compute
RESUME_MAY_CHANGE = ("tracking.", "cluster.")


def sweep_command(name: str, args: list[str], console: Console, dry_run: bool = False,
                  session: Optional["EngineSession"] = None) -> int:
    """The CLI's entry: parse, run; returns the exit code (0 all finished, 1 some failed)."""
    return run_sweep(parse_command(name, args), console, dry_run=dry_run, session=session)


def run_sweep(command: SweepCommand, console: Console, dry_run: bool = False,
              session: Optional["EngineSession"] = None) -> int:
    """`session`: an `EngineSession` the caller owns (a script running several sweeps, the test
    suite's pool) for trials that run here one after another: they start on its engines when the
    key agrees, a failed or stopped trial discards them (as the sweep's own), and it stays open,
    its Ray too. Default: one of the sweep's own, closed at its end. Trials that run as their own
    processes or jobs (`max_parallel`, `cluster=ray|slurm`) start their own engines: it is unused."""
    definition, extra, parent, confirmation = _design(command, console, dry_run)
    confs = check_plan(definition, extra)
    first = next(iter(confs.values()))
    uri, experiment = first.tracking.uri, str(first.tracking.experiment)
    k = _parallelism(command, definition, extra, first)
    slots = _room(confs, first, k, len(definition.values) * len(definition.seeds))
    if dry_run:
        from stapoctl.preflight.plan_report import print_memory_plan

        print_memory_plan(first, console, here=first.cluster.name == "local" and not first.cluster.address)
        print_plan(definition, plan_trials(definition, parent.info.run_id if parent else "<sweep id>", extra), console)
        console.print(_how(first, k, slots), highlight=False, markup=False)
        return 0
    if parent is not None:
        _take_over(parent, uri, command.force, console)
        sweep_id = parent.info.run_id
        store.claim(sweep_id, uri)
    else:
        sweep_id = store.open_parent(definition, uri, experiment, confirmation.tags if confirmation else None)
        if confirmation is not None:
            confirm.record(sweep_id, uri, confirmation)
    trials = plan_trials(definition, sweep_id, extra)
    records = store.trial_records(sweep_id, len(trials), uri)
    todo = [t for t in trials if not records[t.index].finished]
    console.print(f"[bold]sweep {escape(definition.name)}[/] · id [bold]{sweep_id}[/] · {escape(definition.key)} ∈ "
                  + escape(f"{{{', '.join(definition.values)}}}")
                  + f" × seeds {list(definition.seeds)} = {len(trials)} trials"
                  + (f" · {len(trials) - len(todo)} already finished, running {len(todo)}" if parent else "")
                  + f" · MLflow {escape(store._uri(uri))}", highlight=False)
    if first.cluster.name == "slurm":
        return _submit_trials(definition, sweep_id, trials, todo, uri, console, k)
    if todo and (submits(first) or (slots and len(todo) > 1)):
        from stapoctl.sweep import launchers
        from stapoctl.sweep.parallel import Sweep, run_parallel

        sweep = Sweep(definition, sweep_id, trials, records, uri, experiment, console)
        if submits(first):
            return run_parallel(sweep, todo, launchers.RayJobTrials(definition.name, sweep_id), k or len(todo))
        slots = slots[:len(todo)]
        return run_parallel(sweep, todo, launchers.LocalTrials(slots, launchers.log_dir(sweep_id)), len(slots))
    return _run_trials(definition, sweep_id, trials, todo, records, uri, experiment, console, session)


def _design(command: SweepCommand, console: Console, dry_run: bool) -> tuple[SweepDefinition, tuple[str, ...],
                                                                           Any, Optional[confirm.Confirmation]]:
    """(definition, extra overrides, the parent a resume continues, a confirmation's design): the
    command's own sweep, a resume's recorded one, or a pilot's design on fresh seeds (its sizing
    printed on --dry-run; one line when it needs more than max_seeds)."""
    definition, extra = command.definition, ()
    if not (command.resume or command.confirm):
        return definition, extra, None, None
    base = compose_trial(plan_trials(definition, "")[0])
    uri, experiment = base.tracking.uri, str(base.tracking.experiment)
    if command.resume:
        parent = store.find_parent(command.resume, uri, experiment)
        definition, extra = reconcile(command, store.recorded_definition(parent, uri))
        return definition, extra, parent, None
    confirmation = confirm.design(command, uri, experiment)
    if dry_run:
        confirm.print_sizing(confirmation, console)
    refusal = confirmation.sizing.refusal()
    if refusal:
        raise UserError(refusal)
    return confirmation.definition, confirmation.extra, None, confirmation


def _parallelism(command: SweepCommand, definition: SweepDefinition, extra: tuple[str, ...], conf) -> Optional[int]:
    """`max_parallel=K`; on SLURM `cluster.array_parallelism` is its alias (the two may not disagree)."""
    k = command.max_parallel
    if conf.cluster.name != "slurm":
        return k
    given = [o for o in (*definition.overrides, *extra) if override_key(o) == "cluster.array_parallelism"]
    if k is not None and given and int(conf.cluster.array_parallelism) != k:
        raise UserError(f"max_parallel={k} and {given[-1]} disagree: give one of them (cluster.array_parallelism "
                        "is the older name of max_parallel on SLURM)")
    return k if k is not None else int(conf.cluster.array_parallelism)


def _room(confs: dict, conf, k: Optional[int], n_trials: int) -> list:
    """The slots of K trials at once here (empty: one after another on warm engines); refused in
    one line when K trials do not fit this machine. Joining a Ray cluster by its address: Ray
    places the K trials, so the slots carry nothing."""
    if submits(conf) or conf.cluster.name == "slurm" or not k or min(k, n_trials) < 2:
        return []
    from stapoctl.sweep import launchers

    k = min(k, n_trials)
    if conf.cluster.address:
        return [([], {}) for _ in range(k)]
    return launchers.room_here(confs.values(), k)


def _how(conf, k: Optional[int], slots: list) -> str:
    """Where the trials would run, for --dry-run."""
    if conf.cluster.name == "slurm":
        return f"the trials would go out as one SLURM job array ({k} at once); nothing was submitted"
    if submits(conf):
        return f"the trials would go out as one Ray job each ({k or 'all'} at once); nothing was submitted"
    if slots:
        share = f", {slots[0][0][0]} each" if slots[0][0] else f", joining {conf.cluster.address}"
        return f"the trials would run {len(slots)} at once as `stapoctl train` processes here{share}; nothing was started"
    return "the trials would run one after another here, on warm engines; nothing was started"


def submits(conf) -> bool:
    """SLURM, or a Ray cluster's job server (http://HOST:8265): the trials run there in parallel.
    Otherwise (here, or joining a Ray cluster by its GCS address) they run from this process: one
    after another on warm engines, or `max_parallel` at once as `train` processes."""
    address = str(conf.cluster.get("address") or "")
    return conf.cluster.name == "slurm" or (conf.cluster.name == "ray" and address.startswith(("http://", "https://")))


# what every submitted trial shares: the job's placement, the store, the experiment
_SHARED = ("experiment", "cluster", "tracking.uri", "tracking.experiment")


def _submit_trials(definition: SweepDefinition, sweep_id: str, trials: list[Trial], todo: list[Trial],
                   uri: Optional[str], console: Console, parallelism: Optional[int] = None) -> int:
    """The unfinished trials as one SLURM job array (`parallelism` tasks at once), followed to the
    end; the parent's status and the closing table then come from the children, as for local trials."""
    from stapoctl.jobs.submit import submit_trials, wait

    def shared(item: str) -> bool:
        key = override_key(item)
        return any(key == k or key.startswith(k + ".") for k in _SHARED)

    base = [o for o in todo[0].overrides if shared(o)] if todo else []
    if parallelism is not None:
        base.append(f"cluster.array_parallelism={parallelism}")
    per_trial = [[o for o in t.overrides if not shared(o) and override_key(o) != "tracking.parent_run_id"]
                 for t in todo]
    if todo:
        try:
            rec = submit_trials(base, per_trial, sweep_id, name=f"sweep-{definition.name}", console=console)
            console.print(f"following {len(todo)} trial(s) until they end (Ctrl-C stops following, not the jobs: "
                          f"`stapoctl jobs` lists them)", highlight=False)
            wait(rec, console, stream_logs=False)
        except KeyboardInterrupt:
            console.print(f"stopped following; the trials keep running. The sweep's status is set by "
                          f"`stapoctl sweep {definition.name} resume={sweep_id[:8]}` once they end", style="yellow",
                          markup=False)
            return 130
        except BaseException as exc:
            store.end_parent(sweep_id, uri, "FAILED", store.one_line(exc))
            raise
    return finish(definition, sweep_id, trials, {}, uri, console)


def reconcile(command: SweepCommand, recorded: SweepDefinition) -> tuple[SweepDefinition, tuple[str, ...]]:
    """A resume runs the recorded definition. The command line may repeat it, and may add
    tracking./cluster. overrides (where the trials run); anything else that differs is an error."""
    given, d = command.given, command.definition
    if d.name != recorded.name:
        raise UserError(f"resume={command.resume}: that is sweep '{recorded.name}', not '{d.name}': "
                        f"run `stapoctl sweep {recorded.name} resume={command.resume}`")
    for what in ("values", "seeds", "experiment"):
        if what in given and getattr(d, what) != getattr(recorded, what):
            raise UserError(f"resume={command.resume}: {what} {_show(getattr(d, what))} differ from the sweep's "
                            f"recorded {_show(getattr(recorded, what))}: drop {what}= (a resume runs the recorded "
                            "sweep) or start a new sweep")
    before = {override_key(o): o for o in recorded.overrides}
    extra = []
    for item in command.cli_overrides:
        key = override_key(item)
        if key in before:
            if _as_typed(before[key]) != _as_typed(item):
                raise UserError(f"resume={command.resume}: {item} differs from the sweep's recorded {before[key]}: "
                                "drop it (a resume runs the recorded sweep) or start a new sweep")
        elif key.startswith(RESUME_MAY_CHANGE):
            extra.append(item)
        else:
            raise UserError(f"resume={command.resume}: {item} was not part of the sweep's trials; a resume may only "
                            f"add {' / '.join(k + '*' for k in RESUME_MAY_CHANGE)} overrides: drop it or start a new sweep")
    return recorded, tuple(extra)


def _as_typed(item: str) -> tuple[bool, str]:
    """What a resume compares: a delete or not, and the value as typed (`2e-3` is not `0.002`)."""
    o = ov.parse(item)
    return o.kind == ov.DELETE, o.value


def _show(value) -> str:
    return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, tuple) else str(value)


def _take_over(parent, uri: Optional[str], force: bool, console: Console) -> None:
    """A sweep may be resumed when it ended, or when the process running it is gone."""
    if parent.info.status == "RUNNING":
        tags = parent.data.tags
        where = f"pid {tags.get(layout.PID, '?')} on {tags.get(layout.HOST, '?')}"
        alive = store.process_alive(parent)
        if alive:
            raise UserError(f"sweep {parent.info.run_id} is still running ({where}): wait for it, or stop it "
                            f"(kill {tags.get(layout.PID)}) and resume then")
        if alive is None and not force:
            raise UserError(f"sweep {parent.info.run_id} is RUNNING in {where} and this host cannot check that "
                            "process: resume it there, or add force=true if it is dead")
        console.print(f"sweep {parent.info.run_id[:8]} was left RUNNING by a process that is gone "
                      f"({where}); taking it over", style="yellow", markup=False)
    sweep_id = parent.info.run_id
    running = [run for run in store.children(sweep_id, uri) if run.info.status == "RUNNING"]
    _still_stopping(running, parent)
    for run in running:  # the dead sweep's trial: never leave it RUNNING
        store.end_child(run.info.run_id, uri, "KILLED", "its sweep process died before the trial ended")


def _still_stopping(running: list, parent) -> None:
    """A trial of a dead sweep may still be writing its checkpoint (`orphans`: it got a SIGTERM):
    resuming it now would find its run dir locked, so wait for it instead."""
    from pathlib import Path

    from stapoctl.trainer.run_status import run_dir_holder

    busy = [(run.data.tags.get(layout.TRIAL, "?"), holder) for run in running
            if run.data.tags.get("stapoctl.run_dir")
            and (holder := run_dir_holder(Path(run.data.tags["stapoctl.run_dir"]))) is not None]
    if busy:
        which = ", ".join(f"trial {int(t) + 1} (pid {pid})" if t.isdigit() else f"pid {pid}" for t, pid in busy)
        raise UserError(f"sweep {parent.info.run_id[:8]}: {which} still stopping (its step, then a checkpoint): "
                        "resume once it has ended")


# -- the loop ----------------------------------------------------------------------------------
def _session(own: Optional["EngineSession"], console: Console):
    """The caller's `EngineSession` (left open) or the sweep's own (closed at its end)."""
    from stapoctl.trainer.session import EngineSession

    return contextlib.nullcontext(own) if own is not None else EngineSession(console)


def _run_trials(definition: SweepDefinition, sweep_id: str, trials: list[Trial], todo: list[Trial],
                records: dict, uri: Optional[str], experiment: str, console: Console,
                own_session: Optional["EngineSession"] = None) -> int:
    from stapoctl.sweep.progress import SweepView
    from stapoctl.trainer.driver import train
    from stapoctl.trainer.signals import signal_name

    outcomes: dict[int, Outcome] = {}
    received: list[str] = []
    stop_reason: Optional[str] = None
    try:
        with signals_as_interrupt(received), _session(own_session, console) as session, \
                SweepView(console, definition.name, len(trials), len(trials) - len(todo)) as view:
            for pos, trial in enumerate(todo):
                view.start(trial.index, trial.run_name, len(todo) - pos)
                since, t0 = time.time(), time.perf_counter()
                resume = resume_point(records[trial.index])
                if resume:
                    console.print(f"trial {trial.index + 1} continues from its checkpoint {resume}", markup=False)
                try:
                    summary = train(compose_trial(trial, resume), console=console, session=session)
                except KeyboardInterrupt:
                    stop_reason = f"interrupted ({received[0] if received else 'SIGINT'}) during trial {trial.index + 1}"
                    _end_interrupted(sweep_id, trial, records, resume, uri, since, stop_reason)
                    raise
                except AlarmStopped as exc:  # a result, not a gap: checkpointed, ended KILLED; the sweep goes on
                    child = store.client(uri).get_run(attempt_run(sweep_id, trial, records, resume, uri, since))
                    outcomes[trial.index] = out = alarm_outcome(trial, child, time.perf_counter() - t0,
                                                                _engines(session))
                    view.finish(alarm_line(f"trial {trial.index + 1}/{len(trials)} {trial.run_name}", out,
                                           list(exc.alarms)))
                    continue
                except RunStopped as exc:  # a signal: train stopped after its step, checkpointed, ended KILLED
                    stop_reason = f"interrupted ({signal_name(exc.signum)}) during trial {trial.index + 1}"
                    _end_stopped(definition, sweep_id, uri, stop_reason, console)
                    return exc.exit_code
                except Exception as exc:  # the trial failed: record it, go on with fresh engines
                    error = store.one_line(exc)
                    child_id = record_failure(sweep_id, trial, records, resume, uri, since, experiment, error)
                    outcomes[trial.index] = Outcome(trial, "FAILED", child_id, wall_s=time.perf_counter() - t0)
                    view.finish(f"[bold red]✗ trial {trial.index + 1}/{len(trials)} {escape(trial.run_name)} "
                                f"FAILED[/]: {escape(error)}")  # an engine's message may hold `[/…]`
                    continue
                outcomes[trial.index] = out = _record_success(trial, summary, session, sweep_id, uri, since,
                                                              time.perf_counter() - t0)
                view.finish(f"[bold green]✓[/] trial {trial.index + 1}/{len(trials)} {escape(trial.run_name)}: "
                            f"final val {pct(out.val)} · {out.wall_s:.1f} s, of which {out.overhead_s:.1f} s "
                            f"outside steps and validation (engines {out.engines}) · run {out.run_id}")
    except KeyboardInterrupt:
        if stop_reason is None:  # between trials: no child was running
            stop_reason = f"interrupted ({received[0] if received else 'SIGINT'})"
            store.end_parent(sweep_id, uri, "KILLED", stop_reason)
        console.print(f"[yellow]sweep {sweep_id} {stop_reason}: runs ended KILLED; "
                      f"continue with `stapoctl sweep {escape(definition.name)} resume={sweep_id[:8]}`[/]")
        return 143 if received else 130
    except BaseException as exc:
        if stop_reason is None:
            store.end_parent(sweep_id, uri, "FAILED", store.one_line(exc))
        raise
    return finish(definition, sweep_id, trials, outcomes, uri, console)


def _end_interrupted(sweep_id: str, trial: Trial, records: dict, resume: Optional[str], uri: Optional[str],
                     since: float, stop_reason: str) -> None:
    """Ctrl-C or SIGTERM during a trial: its run and the parent end KILLED."""
    with signals_deferred():
        child_id = attempt_run(sweep_id, trial, records, resume, uri, since)
        if child_id is not None:
            store.end_child(child_id, uri, "KILLED", stop_reason)
        store.end_parent(sweep_id, uri, "KILLED", stop_reason)


def _end_stopped(definition: SweepDefinition, sweep_id: str, uri: Optional[str], stop_reason: str,
                 console: Console) -> None:
    """train() already ended the trial's run KILLED with a checkpoint; the parent follows."""
    with signals_deferred():
        store.end_parent(sweep_id, uri, "KILLED", stop_reason)
    console.print(f"sweep {sweep_id} {stop_reason}: the trial's run ended KILLED with a "
                  f"checkpoint; continue with `stapoctl sweep {definition.name} "
                  f"resume={sweep_id[:8]}`", style="yellow", markup=False)


def _record_success(trial: Trial, summary: dict, session, sweep_id: str, uri: Optional[str], since: float,
                    wall: float) -> Outcome:
    """Timing metrics on the child and the parent; FINISHED only with last-step validation."""
    run_id = summary["run_id"]
    engines = _engines(session)
    store.client(uri).set_tag(run_id, layout.ENGINES_REUSED, str(engines == "reused").lower())
    timing = store.log_trial_timing(sweep_id, run_id, trial.index, uri, since, wall)
    ok = store.trial_finished(store.client(uri).get_run(run_id), uri)
    if not ok:
        store.end_child(run_id, uri, "FAILED", "ended without validation metrics at its last step")
    return Outcome(trial, "FINISHED" if ok else "FAILED", run_id, final_val(summary), wall,
                   timing[layout.M_OVERHEAD], engines)


def _engines(session) -> str:
    """How the trial that just ended got its engines: "reused" from the trial before, or "started"."""
    return "reused" if session.engines is not None and session.engines.info.get("reused") else "started"


def print_plan(definition: SweepDefinition, trials: list[Trial], console: Console) -> None:
    """`stapoctl sweep NAME --dry-run`: the trials and their Hydra overrides; starts nothing."""
    table = Table(title=escape(f"sweep {definition.name}: {len(trials)} trials of experiment {definition.experiment}"))
    table.add_column("trial", justify="right")
    table.add_column("run name")
    table.add_column(escape(definition.key))
    table.add_column("seed", justify="right")
    table.add_column("overrides (besides the experiment's)")
    for t in trials:
        shown = [o for o in t.overrides[1:] if not o.startswith(("tracking.run_name=", "++tracking.tags="))]
        table.add_row(str(t.index + 1), escape(t.run_name), escape(t.value), str(t.seed), escape(" ".join(shown)))
    console.print(table)

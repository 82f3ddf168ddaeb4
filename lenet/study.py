"""lenet sweep --search optuna: an Optuna study chooses the configurations, a pack trains them (lenet/pack.py).

Each pack asks the study for K trials; every epoch each model reports its accuracy on the ranked split,
and a model the pruner stops (Optuna's median pruner) gives its slot to the next trial, which starts from
its own first step. The study's storage (--storage: a database URL, or a journal file) is Optuna's, not a
scheduler of ours: one `lenet sweep` worker per GPU, on any machine that reaches the storage, shares the
study. Start one worker per GPU, each pinned to its GPU, all with the same flags:

    for g in 0 1 2 3; do
        CUDA_VISIBLE_DEVICES=$g lenet sweep --search optuna --trials 256 --storage sqlite:///study.db \\
            --validation 10000 --out runs/worker$g &
    done; wait

(`lenet sweep --gpus all` does this for the GPUs of this machine: lenet/workers.py.) The test split is read
once, by the study's winner (Note [the ranked split] in lenet/sweep.py): by the worker that trained it, where
no trial of the study is left running when that worker ends; any other worker reads none and names the
winner's checkpoint. A journal file on a shared file system works as well as a database for workers on
several machines where the file system locks (NFS v4 does).

Note [trial budget]: --trials N counts the study's trials, over every worker. Optuna numbers trials in the
order the storage creates them, atomically, so a trial is admitted when fewer than N trials numbered
before it have not failed. A worker asks for none once N trials that have not failed are there (spent);
a trial asked beyond the budget all the same (two workers asking at once near the end) is told FAIL,
Optuna's state for a trial that gave nothing (samplers and pruners pass over it, the budget leaves it
out), with the user attribute "beyond the budget", never trained, and reported as what it is (outcome):
no failure of the study. Neither is a drawn combination that is no configuration (Nesterov with momentum
0), told FAIL with "not a configuration: ...". A trial is trained by the one worker that asked for it: no
trial runs twice. A worker stopped by a signal tells its running trials FAIL ("interrupted") and enqueues
their parameters again, so the study still runs those configurations.
"""

from __future__ import annotations

import os
import signal
import socket
import time

from .files import escaped, show
from .pack import MAX_PACK, Config, Pack, Result
from .sweep_results import RESUME_KEYS, SWEPT, Sweep, config_error, label_of, older_grid
from .train import Signals, StoppedAtOnce

INSTALL = "pip install '.[sweep]' (or pip install optuna)"
STUDY_KEYS = tuple(k for k in RESUME_KEYS if k not in ("pack_size", "study"))   # every worker's must agree


def optuna():
    """The optuna module, or a one-line ValueError naming the command that installs it."""
    try:
        import optuna as o
    except ImportError:
        raise ValueError(f"--search optuna needs the package optuna, not installed here: {INSTALL}") from None
    o.logging.set_verbosity(o.logging.WARNING)
    return o


def storage(url: str | None, create: bool = True):
    """Optuna's storage for --storage: None (in memory), an RDB URL, or a journal file; one line when it
    cannot be opened. ``create`` False: only one that is there already, opened without writing (None where
    there is none yet: Note [a storage checked, then made])."""
    o = optuna()
    if url is None:
        return None
    try:
        if "://" in url:
            if not create and _sqlite_file(url) is not None and not os.path.exists(_sqlite_file(url)):
                return None
            return o.storages.RDBStorage(url, skip_table_creation=not create,
                                         skip_compatibility_check=not create)
        from optuna.storages.journal import JournalFileBackend

        if not create and not os.path.exists(url):
            return None
        return o.storages.JournalStorage(JournalFileBackend(url))
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's, Optuna's, the OS's: one line each
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--storage {show(url)}: cannot open it ({escaped(first[:200])})") from None


def _sqlite_file(url: str) -> str | None:
    """The database file of a sqlite URL (sqlite:///study.db), or None (another database, or in memory)."""
    if not url.startswith("sqlite:"):
        return None
    try:
        from sqlalchemy.engine import make_url

        name = make_url(url).database
    except Exception:   # noqa: BLE001 - check() says what is wrong with the URL
        return None
    return name if name and name != ":memory:" and not name.startswith("file:") else None


def space(args) -> tuple[dict, dict]:
    """(Optuna's distributions of the swept settings, the fixed ones): a flag with one value is fixed,
    several are a categorical choice, a range LOW:HIGH a float (log-scaled for --lr) or integer range."""
    o = optuna()
    D = o.distributions
    values = {d: list(dict.fromkeys(getattr(args, d))) for d in SWEPT if d != "seed"}
    values["seed"] = list(dict.fromkeys(s for spec in args.seeds for s in spec))
    for d in ("batch_size", "epochs"):
        if len(values[d]) != 1:
            raise ValueError(f"--search optuna trains every trial at one --{d.replace('_', '-')}: give one value")
    dists, fixed = {}, {}
    for d, vs in values.items():
        ranges = [v for v in vs if isinstance(v, tuple)]
        if ranges and len(vs) > 1:
            raise ValueError(f"--{d.replace('_', '-')}: give one range LOW:HIGH or a list of values, not both")
        if ranges:
            lo, hi = ranges[0]
            dists[d] = (D.IntDistribution(int(lo), int(hi)) if d in ("shift", "cutout") else
                        D.FloatDistribution(float(lo), float(hi), log=(d == "lr" and lo > 0)))
        elif len(vs) > 1:
            dists[d] = D.CategoricalDistribution(vs)
        else:
            fixed[d] = vs[0]
    if not dists:
        raise ValueError("--search optuna has nothing to choose: give some flag two or more values or a range")
    for d, dist in dists.items():   # every value a trial may draw is a configuration: its ends and choices
        for v in getattr(dist, "choices", None) or (dist.low, dist.high):
            try:
                Config(**{**fixed, d: v})
            except ValueError as e:
                raise ValueError(config_error(e)) from None
    return dists, fixed


# Note [a storage checked, then made]: --storage is checked whole before the data is read and nothing is
# written to it before every check that needs no GPU passed (Note [nothing written before the checks] in
# lenet/files.py): a journal file or a sqlite database is a regular file or nothing yet (a pipe would block
# the open for ever), a journal holds whole lines of JSON objects (Optuna's own reader stops at a byte it
# cannot decode, with a line naming neither), a sqlite file starts with SQLite's header; a study that is
# there is read without writing and its flags compared with this worker's (``check_study``). The study is
# made (or loaded: never made twice, which appends to a journal) by ``open_study`` once the checks passed and
# the GPU is there: a run that cannot train leaves the storage as it was.
JOURNAL_LIMIT = 1 << 30   # bytes of a journal file read to check it


def check(args) -> None:
    """Before the data is read, nothing written: the extra, the space, the storage's form (a URL that
    parses, or a journal file in a folder that exists) and what is there already (Note [a storage checked,
    then made])."""
    space(args)
    if not args.study or not args.study.isprintable():
        raise ValueError(f"--study '{show(args.study)}': give a name of printable characters (default: lenet-sweep)")
    url = args.storage
    if url is None:
        return
    if url == "":
        raise ValueError("--storage is empty: give a journal file (study.log) or a database URL "
                         "(sqlite:///study.db)")

    if "://" in url:
        try:
            from sqlalchemy.engine import make_url

            make_url(url)
        except ImportError:
            pass
        except Exception as e:  # noqa: BLE001 - SQLAlchemy's ArgumentError: one line
            raise ValueError(f"--storage {show(url)}: not a database URL ({escaped(str(e))}); use e.g. "
                             f"sqlite:///study.db") from None
        db = _sqlite_file(url)
        if db is not None:
            _check_file(db, url, b"SQLite format 3\0", "a sqlite database")
        return
    _check_file(url, url, None, "a journal file")


def _check_file(path: str, url: str, header: bytes | None, what: str) -> None:
    """The file of --storage: nothing yet in a writable folder, or a regular file of the right form."""
    from . import files

    shown = f"--storage {show(url)}"
    kind, words = files.what_is(path)
    if kind == "missing":
        folder = os.path.dirname(os.path.abspath(path))
        if files.what_is(folder)[0] != "folder":
            raise ValueError(f"{shown}: the folder {show(folder)} does not exist")
        return
    if kind == "folder":
        raise ValueError(f"{shown} is a folder; give {what} (or a database URL)")
    if kind != "file":
        raise ValueError(f"{shown} is {words}, not a regular file; give {what}")
    if header is not None:
        with files.open_input(path, "--storage", what[2:]) as f:
            data = f.read(len(header))
        if data and not data.startswith(header):
            raise ValueError(f"{shown}: {show(path)} is not {what} (no SQLite header); give another file")
        return
    lines = files.read_input(path, "--storage", what[2:], limit=JOURNAL_LIMIT).split(b"\n")
    for i, line in enumerate(lines[:-1]):   # the last, unfinished line: a write in flight, as Optuna reads it
        try:
            op = files.json_of(line.decode("utf-8"))
        except ValueError:
            op = None
        if not isinstance(op, dict) or "op_code" not in op:
            raise ValueError(f"{shown}: line {i + 1} is not an entry of Optuna's journal (a JSON object with an "
                             f"op_code); give a journal file, or a new name")


def check_study(args, settings: dict) -> None:
    """A study already in --storage under --study was made with this worker's flags: one line naming the
    first flag that differs otherwise. Reads only (Note [a storage checked, then made])."""
    st = storage(args.storage, create=False)
    if st is None:
        return
    try:
        study_id = st.get_study_id_from_name(args.study)
    except KeyError:
        return
    except Exception as e:  # noqa: BLE001 - a database without Optuna's tables, say
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"--storage {show(args.storage)}: cannot read it ({escaped(first[:200])})") from None
    made = st.get_study_user_attrs(study_id).get("lenet")
    if made is not None:
        _same_flags(args, made, {k: settings.get(k) for k in STUDY_KEYS})


def _same_flags(args, made: dict, mine: dict) -> None:
    made = older_grid(made)
    if made == mine:
        return
    k = next((k for k in STUDY_KEYS if made.get(k) != mine.get(k)), None)
    if k is None:
        return
    theirs, ours, flag = made.get(k), mine.get(k), f"--{k.replace('_', '-')}"
    if k == "grid" and isinstance(theirs, dict) and isinstance(ours, dict):
        d = next((d for d in list(ours) + list(theirs) if theirs.get(d) != ours.get(d)), None)
        if d is not None:
            theirs, ours, flag = theirs.get(d), ours.get(d), "--seeds" if d == "seed" else f"--{d.replace('_', '-')}"
    elif k == "data_fingerprint":
        flag = "--data-dir (the dataset's files)"

    def short(v) -> str:
        r = escaped(repr(v))
        return r if len(r) <= 60 else r[:57] + "..."
    raise ValueError(f"--study {show(args.study)} in --storage {show(args.storage)} was made with other flags: "
                     f"{flag} {short(theirs)} there, {short(ours)} here; run every worker with the same flags, or "
                     f"name another --study")


def open_study(args, settings: dict):
    """The study (created, or loaded with the same flags): one line when it was made with others."""
    o = optuna()
    pruner = o.pruners.MedianPruner(n_startup_trials=4, n_warmup_steps=1) if args.prune else o.pruners.NopPruner()
    seed = None if args.storage else 0   # one worker alone: reproducible choices
    if args.sampler == "grid":
        dists, _ = space(args)
        if any(not isinstance(d, o.distributions.CategoricalDistribution) for d in dists.values()):
            raise ValueError("--sampler grid takes lists of values, not ranges LOW:HIGH")
        sampler = grid_sampler({k: list(d.choices) for k, d in dists.items()}, seed)
    elif args.sampler == "random":
        sampler = o.samplers.RandomSampler(seed=seed)
    else:
        sampler = o.samplers.TPESampler(seed=seed, constant_liar=True)
    st = storage(args.storage)
    mine = {k: settings.get(k) for k in STUDY_KEYS}
    try:
        try:   # loaded where it is there: creating it again would append to a journal
            study = o.load_study(study_name=args.study, storage=st, sampler=sampler, pruner=pruner)
        except KeyError:
            study = o.create_study(study_name=args.study, storage=st, direction="maximize", sampler=sampler,
                                   pruner=pruner, load_if_exists=True)
    except Exception as e:  # noqa: BLE001
        raise ValueError(f"--storage {show(args.storage)}: cannot open the study {show(args.study)} "
                         f"({escaped(str(e)[:200])})") from None
    made = study.user_attrs.get("lenet")
    if made is None:
        study.set_user_attr("lenet", mine)
    else:
        _same_flags(args, made, mine)
    return study


def grid_sampler(search_space: dict, seed=None):
    """Optuna's grid sampler, but the budget (--trials) ends a worker, not the grid: GridSampler stops the
    study once every point ran, and Study.stop() raises outside Study.optimize (ask and tell, here)."""
    class Grid(optuna().samplers.GridSampler):
        def after_trial(self, study, trial, state, values) -> None:
            pass
    return Grid(search_space, seed=seed)


BEYOND = "beyond the budget"    # the user attribute "lenet" of a trial asked beyond it (Note [trial budget])


def admitted(study, trial, budget: int) -> bool:
    """Note [trial budget]."""
    fail = optuna().trial.TrialState.FAIL
    before = sum(1 for t in study.get_trials(deepcopy=False) if t.number < trial.number and t.state != fail)
    return before < budget


def spent(study, budget: int) -> bool:
    """Whether no trial asked now could be admitted: ``budget`` trials neither failed nor waiting (a waiting
    trial, enqueued again, takes the place of one that failed: Note [trial budget])."""
    S = optuna().trial.TrialState
    return sum(1 for t in study.get_trials(deepcopy=False) if t.state not in (S.FAIL, S.WAITING)) >= budget


def outcome(t) -> str:
    """What a finished study says of a trial: its state, but for a trial told FAIL that never trained
    because it was asked beyond the budget or drew no configuration (Note [trial budget])."""
    why = str(t.user_attrs.get("lenet", ""))
    if t.state.name == "FAIL" and why == BEYOND:
        return "asked beyond the budget (never trained)"
    if t.state.name == "FAIL" and why.startswith("not a configuration"):
        return "drew no configuration (never trained)"
    if t.state.name == "FAIL" and why == "interrupted":
        return "interrupted (enqueued again)"
    return t.state.name.lower()


class StudySweep(Sweep):
    """One worker of the study (module docstring)."""

    def __init__(self, args, run, policy, plotter):
        super().__init__(args, run, policy, plotter)
        self.study = run["study"]
        self.dists, self.fixed = space(args)
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.exhausted = False

    def may_average(self) -> bool:
        """Whether a trial may keep a moving average of the weights (the pack then keeps the buffer)."""
        if "ema" in self.dists:
            d = self.dists["ema"]
            return any(v is not None for v in getattr(d, "choices", (1.0,)))
        return self.fixed.get("ema") is not None

    def ask(self):
        """(trial, configuration) of the next admitted trial, or None when the budget is spent."""
        if self.exhausted:
            return None
        o = optuna()
        while True:
            if spent(self.study, self.args.trials):   # no trial made to be told it is beyond the budget
                self.exhausted = True
                return None
            trial = self.study.ask(self.dists)
            if not admitted(self.study, trial, self.args.trials):   # another worker asked at the same time
                trial.set_user_attr("lenet", BEYOND)
                self.study.tell(trial, state=o.trial.TrialState.FAIL)
                self.exhausted = True
                return None
            trial.set_user_attr("worker", self.worker)
            if self.out is not None:   # where its checkpoint goes, should it win (evaluate_winner)
                trial.set_user_attr("out", str(self.out.resolve()))
            kw = {**self.fixed, **trial.params}
            try:
                return trial, Config(**kw)
            except ValueError as e:   # e.g. nesterov with momentum 0 drawn together: not a configuration
                trial.set_user_attr("lenet", f"not a configuration: {e}")
                self.study.tell(trial, state=o.trial.TrialState.FAIL)

    def run(self) -> int:
        args, o = self.args, optuna()
        K = min(args.trials, args.pack_size or MAX_PACK)
        first = []
        for _ in range(K):
            got = self.ask()
            if got is None:
                break
            first.append(got)
        if not first:
            self.say(f"nothing to do: the study {args.study!r} has its {args.trials} trials")
            return self.finish(self.policy)
        self.say(f"study {args.study!r}: {len(self.study.trials)} trials so far, budget {args.trials}; this worker "
                 f"trains {K} at a time, ranked on the {self.split} split")
        pack = Pack([c for _, c in first], *self.datasets(), policy=self.policy, models=max(K, 2),
                    plan_cache=args.plan_cache, eval_batch=args.eval_batch_size, tta=args.tta,
                    cuda_graph=args.cuda_graph, keep_average=self.may_average())
        for r, (trial, _) in zip(pack.results, first):
            r.tag = trial
        self.progress(None)
        try:
            with Signals() as sig:
                while pack.active:
                    t = time.perf_counter()
                    orders = pack.begin_epoch()
                    at = pack.steps_of(orders, 0, lambda: sig.signum is not None)
                    if self.bar is not None:
                        self.bar.update(at)
                    if at < pack.steps:
                        return self.interrupted(pack, sig.signum, sig.name)
                    done = pack.end_epoch(time.perf_counter() - t)
                    self.report(pack, done, o)
        except StoppedAtOnce as e:
            return self.interrupted(pack, e.signum, Signals.NAMES.get(e.signum, str(e.signum)))
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        pack.close()
        return self.finish(self.policy)

    def report(self, pack, done: list[Result], o) -> None:
        """Each model's epoch to the study: done ones told complete, pruned ones pruned; freed slots take
        the next trials."""
        for k in list(pack.active) + [r.slot for r in done]:
            r = pack.slots[k]
            if r is None:
                continue
            trial, epoch = r.tag, len(r.accuracy)
            trial.report(r.final, epoch)
            if r in done:
                self.study.tell(trial, r.final)
            elif self.args.prune and trial.should_prune():
                r.pruned = True
                self.study.tell(trial, state=o.trial.TrialState.PRUNED)
            else:
                continue
            self.record(r, trial.number)
            pack.release(k)
            got = self.ask()
            if got is not None:
                pack.assign(k, got[1], tag=got[0])
        if self.bar is not None:
            self.bar.set_postfix_str(self.best_line(), refresh=False)

    def interrupted(self, pack, signum: int, name: str) -> int:
        """Note [stopping a sweep] in lenet/sweep.py: the running trials failed and enqueued again."""
        o = optuna()
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        again = 0
        for r in pack.slots:
            if r is None or r.done:
                continue
            r.tag.set_user_attr("lenet", "interrupted")
            self.study.tell(r.tag, state=o.trial.TrialState.FAIL)
            self.study.enqueue_trial(r.tag.params, skip_if_exists=False)
            again += 1
        print(f"stopped by {name}: {len(self.rows)} trials finished here; {again} running trials marked failed and "
              f"enqueued again in the study {self.args.study!r}", flush=True)
        return 130 if signum == signal.SIGINT else 143

    def evaluate_winner(self, best: dict, policy):
        """The test split for the study's winner alone, once (Note [the ranked split] in lenet/sweep.py): read
        by the worker that trained the study's best trial, once no trial of the study is left to run (until
        then another worker's may still win); a worker whose best is not the study's reads nothing, and
        says where the winner's checkpoint is."""
        S = optuna().trial.TrialState
        if any(t.state in (S.RUNNING, S.WAITING) for t in self.study.get_trials(deepcopy=False)):
            self.say("this worker reads no test split: trials of the study still run elsewhere, and its winner is "
                     "not known yet")
            return None
        try:
            top = self.study.best_trial
        except ValueError:
            return None
        if top.number != best["trial"]:
            out = top.user_attrs.get("out")
            self.say(f"the study's winner is trial {top.number} (worker {top.user_attrs.get('worker', '?')}), not "
                     f"this worker's best: this worker reads no test split"
                     + (f"; the winner's checkpoint: {out}/best/checkpoint.npz" if out else ""))
            return None
        return super().evaluate_winner(best, policy)

    def finish(self, policy) -> int:
        code = super().finish(policy)
        try:
            best = self.study.best_trial
        except ValueError:
            return code
        states = {}
        for t in self.study.get_trials(deepcopy=False):
            states[outcome(t)] = states.get(outcome(t), 0) + 1
        self.say(f"study {self.args.study!r}: {', '.join(f'{v} {k}' for k, v in sorted(states.items()))}; best trial "
                 f"{best.number}: {100 * best.value:.2f}% on the {self.split} split "
                 f"({label_of({**Config().as_dict(), **self.fixed, **best.params})})")
        return code


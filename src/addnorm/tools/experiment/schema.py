"""results.json, typed: what ``addnorm train`` measured, as dataclasses that read and write it.

A plain run (:attr:`Results.arms`, with the gradient norms at initialisation) and a depth sweep
(:attr:`Results.sweep`) share the other fields. In memory a value that is not finite is a NaN;
in the file it is ``null``, so that results.json stays standard JSON. ``first_within`` and
``first_below_fail`` are ``None`` in both when the level was never reached.

The measures stored with every arm (:func:`summarize`, :func:`aggregate`) live here too, with
the levels they are read against (:data:`WITHIN`, :data:`FAIL_RATIO`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib

import numpy as np

from .config import Config

WITHIN = 2.0  # "reached the floor": test MSE within this factor of the floor
FAIL_RATIO = 10.0  # "failed": final test MSE above this factor of the floor (or not finite)

GradNorms = dict[str, dict[str, list[float]]]  # {"post"|"pre": {"encoder"|"decoder": one per layer}}


def _finite_or_none(obj):
    """NaN/inf -> None, all the way down (results.json stays standard JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    return obj


def _number(v: float | None) -> float:
    """A number read from results.json: ``null`` (written for a NaN or inf) back to NaN."""
    return math.nan if v is None else v


def _numbers(values: list) -> list[float]:
    return [_number(v) for v in values]


def _object(value, what: str) -> dict:
    """A JSON object of results.json, or a TypeError naming the field."""
    if not isinstance(value, dict):
        raise TypeError(f"{what} must be an object, got {type(value).__name__}")
    return value


@dataclasses.dataclass
class Run:
    """One arm trained from one seed."""

    seed: int
    lr: float
    test_mse: list[float]  # after every epoch, autoregressive
    train_loss: list[float]  # mean over every epoch's batches, teacher forcing
    seconds: float
    cpu_seconds: float

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> Run:
        return cls(
            doc["seed"],
            doc["lr"],
            _numbers(doc["test_mse"]),
            _numbers(doc["train_loss"]),
            doc["seconds"],
            doc["cpu_seconds"],
        )


@dataclasses.dataclass(frozen=True)
class RunSummary:
    """How one run's test MSE went, against the noise floor (:func:`summarize`)."""

    final: float
    best: float
    ratio: float  # final ÷ floor
    first_within: int | None  # first epoch (1-based) within WITHIN x floor; None: never
    first_below_fail: int | None  # first epoch within FAIL_RATIO x floor (off the plateau)
    failed: bool


@dataclasses.dataclass
class Summary:
    """An arm's row: the medians of its runs' :class:`RunSummary` over seeds (:func:`aggregate`)."""

    final: float
    best: float
    ratio: float
    first_within: float | None  # None: most seeds never got there
    first_below_fail: float | None
    failed: int  # how many runs failed
    runs: int
    seconds: float  # all its runs together

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> Summary:
        return cls(
            _number(doc["final"]),
            _number(doc["best"]),
            _number(doc["ratio"]),
            doc["first_within"],
            doc["first_below_fail"],
            doc["failed"],
            doc["runs"],
            doc["seconds"],
        )


@dataclasses.dataclass
class ArmResult:
    """One arm at one depth: how it was trained, its runs (one per seed) and their summary."""

    label: str  # "post-LN + warmup"
    norm_position: str  # "post", "pre" or "none"
    lr: float
    warmup_steps: int
    steps: int
    runs: list[Run]
    summary: Summary

    def to_json(self) -> dict:
        return {
            "label": self.label,
            "norm_position": self.norm_position,
            "lr": self.lr,
            "warmup_steps": self.warmup_steps,
            "steps": self.steps,
            "runs": [r.to_json() for r in self.runs],
            "summary": self.summary.to_json(),
        }

    @classmethod
    def from_json(cls, doc: dict) -> ArmResult:
        return cls(
            doc["label"],
            doc["norm_position"],
            doc["lr"],
            doc["warmup_steps"],
            doc["steps"],
            [Run.from_json(r) for r in doc["runs"]],
            Summary.from_json(doc["summary"]),
        )


@dataclasses.dataclass
class Interruption:
    """A run stopped by Ctrl-C: how many of the planned runs had finished."""

    finished: int
    planned: int


@dataclasses.dataclass
class Sweep:
    """A depth sweep: the arms at each depth (depths without a finished run left out)."""

    depth: list[int]
    arms: dict[int, dict[str, ArmResult]]

    def by_arm(self) -> dict[str, dict[int, ArmResult]]:
        """``{arm: {depth: its result}}``, depths in increasing order."""
        out: dict[str, dict[int, ArmResult]] = {}
        for depth, arms in self.arms.items():
            for name, arm in arms.items():
                out.setdefault(name, {})[depth] = arm
        return {name: dict(sorted(by_depth.items())) for name, by_depth in out.items()}

    def to_json(self) -> dict:
        arms = {str(d): {name: arm.to_json() for name, arm in by_name.items()} for d, by_name in self.arms.items()}
        return {"depth": list(self.depth), "arms": arms}

    @classmethod
    def from_json(cls, doc: dict) -> Sweep:
        arms = {
            int(d): {name: ArmResult.from_json(arm) for name, arm in _object(by_name, f"'sweep.arms.{d}'").items()}
            for d, by_name in _object(doc["arms"], "'sweep.arms'").items()
        }
        return cls(list(doc["depth"]), arms)


@dataclasses.dataclass
class Results:
    """Everything ``addnorm train`` measured: results.json.

    Exactly one of ``arms`` (a plain run, with ``grad_norms`` and ``grad_inits``) and ``sweep``
    (a depth sweep) is set. ``command`` is the command line that made them, once written.
    """

    config: Config
    data: str  # what the data were
    floor: float  # the noise floor of the test set
    n_train: int
    n_test: int
    torch: str  # torch.__version__
    workers: int  # training processes
    seconds: float  # wall clock
    cpu_seconds: float  # in every process
    interrupted: Interruption | None
    arms: dict[str, ArmResult] | None = None
    grad_norms: GradNorms | None = None
    grad_inits: int | None = None  # how many initialisations grad_norms is the mean of
    sweep: Sweep | None = None
    command: str | None = None

    def all_arms(self) -> list[ArmResult]:
        """Every arm entry: of the plain run, or of every depth of the sweep."""
        if self.sweep is not None:
            return [arm for by_name in self.sweep.arms.values() for arm in by_name.values()]
        return list(self.arms.values())

    def to_json(self) -> dict:
        """The results.json document: the keys in the order ``addnorm train`` writes them,
        NaN and inf as ``null``."""
        doc = {
            "config": self.config.to_json(),
            "data": self.data,
            "floor": self.floor,
            "n_train": self.n_train,
            "n_test": self.n_test,
            "torch": self.torch,
            "workers": self.workers,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
            "interrupted": None if self.interrupted is None else dataclasses.asdict(self.interrupted),
        }
        if self.sweep is None:
            doc["arms"] = {name: arm.to_json() for name, arm in self.arms.items()}
            doc["grad_norms"] = self.grad_norms
            doc["grad_inits"] = self.grad_inits
        else:
            doc["sweep"] = self.sweep.to_json()
        if self.command is not None:
            doc["command"] = self.command
        return _finite_or_none(doc)

    @classmethod
    def from_json(cls, doc: dict) -> Results:
        """Results from a results.json document; a missing field is a KeyError, a field of the
        wrong kind a TypeError or ValueError."""
        stopped = doc["interrupted"]
        results = cls(
            config=Config.from_json(_object(doc["config"], "'config'")),
            data=doc["data"],
            floor=doc["floor"],
            n_train=doc["n_train"],
            n_test=doc["n_test"],
            torch=doc["torch"],
            workers=doc.get("workers", 1),
            seconds=doc["seconds"],
            cpu_seconds=doc["cpu_seconds"],
            interrupted=None if stopped is None else Interruption(stopped["finished"], stopped["planned"]),
            command=doc.get("command"),
        )
        if "sweep" in doc:
            results.sweep = Sweep.from_json(_object(doc["sweep"], "'sweep'"))
            return results
        results.arms = {name: ArmResult.from_json(arm) for name, arm in _object(doc["arms"], "'arms'").items()}
        results.grad_norms = {
            pos: {part: _numbers(v) for part, v in _object(parts, f"'grad_norms.{pos}'").items()}
            for pos, parts in _object(doc["grad_norms"], "'grad_norms'").items()
        }
        results.grad_inits = doc["grad_inits"]
        return results

    def write(self, path: pathlib.Path) -> None:
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def read(cls, path: str | pathlib.Path) -> Results:
        return cls.from_json(json.loads(pathlib.Path(path).read_text()))


# --------------------------------------------------------------------------- the measures


def first_epoch(curve: list[float], level: float) -> int | None:
    """The first epoch (1-based) whose test MSE is at or below ``level``; None if none is."""
    return next((i + 1 for i, v in enumerate(curve) if v <= level), None)


def summarize(curve: list[float], floor: float) -> RunSummary:
    """Final and best test MSE, ratio to the floor, first epoch (1-based) within WITHIN x floor and
    within FAIL_RATIO x floor (off the plateau), failed."""
    finite = [v for v in curve if math.isfinite(v)]
    final = curve[-1] if curve else math.nan
    return RunSummary(
        final=final,
        best=min(finite) if finite else math.nan,
        ratio=final / floor,
        first_within=first_epoch(curve, WITHIN * floor),
        first_below_fail=first_epoch(curve, FAIL_RATIO * floor),
        failed=not math.isfinite(final) or final > FAIL_RATIO * floor,
    )


def _median_epoch(epochs: list[int | None]) -> float | None:
    """Median over seeds, ``None`` (never) if most seeds never got there."""
    m = float(np.median([math.inf if e is None else e for e in epochs]))
    return None if math.isinf(m) else m


def aggregate(runs: list[Run], floor: float) -> Summary:
    """One row per arm: medians over seeds."""
    rows = [summarize(r.test_mse, floor) for r in runs]
    return Summary(
        final=float(np.median([r.final for r in rows])),
        best=float(np.median([r.best for r in rows])),
        ratio=float(np.median([r.ratio for r in rows])),
        first_within=_median_epoch([r.first_within for r in rows]),
        first_below_fail=_median_epoch([r.first_below_fail for r in rows]),
        failed=sum(r.failed for r in rows),
        runs=len(rows),
        seconds=sum(r.seconds for r in runs),
    )

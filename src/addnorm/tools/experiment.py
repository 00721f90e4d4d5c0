"""What the norm and its placement do to training: the square-corners experiment.

The task comes from Godoy's *Deep Learning with PyTorch Step-by-Step* (seed 003): each
sequence is the four corners of the square ``[-1, 1]²`` in order, starting at a random corner,
clockwise or counter-clockwise, with Gaussian noise (σ = 0.1) on every coordinate. Given the
first two corners, the model predicts the last two (teacher forcing in training,
autoregressive at test). Even a perfect model cannot beat the noise: the *noise floor* is the
test MSE of predicting the exact corners (≈ σ² = 0.01), reported beside every result.

Each *arm* trains the same deep encoder-decoder (:class:`addnorm.transformer.Seq2SeqTransformer`)
with one norm placement and learning-rate schedule; :func:`run_experiment` runs the arms side
by side, and the outputs (``results.json``, ``curves.png``, ``grad_norms.png``, ``report.md``)
are written by :func:`write_outputs`.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import time
from collections.abc import Callable

import numpy as np
import torch

from ..transformer import Seq2SeqTransformer

CORNERS = np.array([[-1.0, -1.0], [-1.0, 1.0], [1.0, 1.0], [1.0, -1.0]])  # clockwise
NOISE = 0.1
TRAIN_SEED, TEST_SEED = 13, 19  # Godoy's seeds: the same sequences as the book
N_TRAIN, N_TEST = 256, 128
WITHIN = 2.0  # "reached the floor": test MSE within this factor of the floor
FAIL_RATIO = 10.0  # "failed": final test MSE above this factor of the floor (or not finite)


# --------------------------------------------------------------------------- data


def square_sequences(n: int, seed: int, noise: float = NOISE) -> tuple[np.ndarray, np.ndarray]:
    """``n`` noisy square-corner sequences, ``(points [n, 4, 2], directions [n])``.

    ``directions[i]`` is 1 for clockwise, 0 for counter-clockwise. The random draws follow
    Godoy's ``generate_sequences`` (seed 13 and 19 give the book's train and test sets).
    """
    rng = np.random.RandomState(seed)
    bases = rng.randint(4, size=n)
    directions = rng.randint(2, size=n)
    clean = [CORNERS[[(b + i) % 4 for i in range(4)]][:: 2 * d - 1] for b, d in zip(bases, directions, strict=True)]
    points = np.stack([c + rng.randn(4, 2) * noise for c in clean]) if n else np.zeros((0, 4, 2))
    return points.astype(np.float32), directions


def noise_floor(points: np.ndarray) -> float:
    """MSE of the perfect-corner predictor on the last two points: each target against the
    corner of ``[-1, 1]²`` nearest to it (for σ = 0.1 always its true corner)."""
    target = points[:, 2:].astype(np.float64)
    return float(np.mean((target - np.sign(target)) ** 2))


def load_sequences(path: str | pathlib.Path) -> np.ndarray:
    """Sequences from a ``.npy`` file or a ``.csv`` file, as float32 ``[n, 4, 2]``.

    A ``.csv`` holds one sequence per row: ``x0, y0, x1, y1, x2, y2, x3, y3`` (a header line
    is allowed). Raises ValueError naming the file and what was expected.
    """
    path = pathlib.Path(path)
    if not path.is_file():
        raise ValueError(f"--data {path}: {'is a folder, not a file' if path.is_dir() else 'no such file'}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            data = np.load(path, allow_pickle=False)
        elif suffix == ".csv":
            with path.open() as f:
                header = not _is_number(f.readline().split(",")[0])
            data = np.loadtxt(path, delimiter=",", ndmin=2, skiprows=int(header))
            if data.shape[1:] == (8,):
                data = data.reshape(-1, 4, 2)
        else:
            raise ValueError(f"--data {path}: expected a .npy or .csv file, got {suffix or 'no suffix'!r}")
    except (OSError, ValueError) as err:
        if str(err).startswith("--data"):
            raise
        raise ValueError(f"--data {path}: could not read it as {suffix}: {err}") from err
    if not np.issubdtype(data.dtype, np.number):
        raise ValueError(f"--data {path}: expected numbers, got dtype {data.dtype}")
    if data.ndim != 3 or data.shape[1:] != (4, 2) or len(data) < 2:
        want = "8 columns per row" if suffix == ".csv" else "shape [n, 4, 2]"
        raise ValueError(
            f"--data {path}: expected {want} with n >= 2 (four 2-D points per sequence), got shape {list(data.shape)}"
        )
    if not np.isfinite(data).all():
        raise ValueError(f"--data {path}: contains NaN or infinite values")
    return data.astype(np.float32)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def split(points: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """``(source, target)``: the first two points and the last two, as tensors."""
    t = torch.from_numpy(np.ascontiguousarray(points, dtype=np.float32))
    return t[:, :2], t[:, 2:]


def decoder_input(source: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Teacher forcing: the last source point, then the target shifted right by one."""
    return torch.cat([source[:, -1:], target[:, :-1]], dim=1)


# --------------------------------------------------------------------------- arms


@dataclasses.dataclass(frozen=True)
class Arm:
    """One training configuration: where the norm sits, the learning rate, the warmup."""

    name: str
    label: str  # {N} stands for the norm: LN or RMSNorm
    norm_position: str
    lr_scale: float = 1.0  # times the base --lr
    warmup: bool = False  # linear warmup over the first WARMUP_FRACTION of the steps

    def title(self, norm: str) -> str:
        return self.label.format(N="LN" if norm == "layer" else "RMSNorm")


LARGE_LR = 2.0  # the larger-lr arms: where warmup no longer rescues post-LN (docs/experiment.md)
ARMS = {
    a.name: a
    for a in [
        Arm("none", "no norm", "none"),
        Arm("post", "post-{N}", "post"),
        Arm("pre", "pre-{N}", "pre"),
        Arm("post-warmup", "post-{N} + warmup", "post", warmup=True),
        Arm("post-small-lr", "post-{N} lr/10", "post", lr_scale=0.1),
        Arm("post-large-lr", "post-{N} lr×2", "post", lr_scale=LARGE_LR),
        Arm("post-warmup-large-lr", "post-{N} + warmup lr×2", "post", lr_scale=LARGE_LR, warmup=True),
        Arm("pre-large-lr", "pre-{N} lr×2", "pre", lr_scale=LARGE_LR),
    ]
}
DEFAULT_ARMS = ["none", "post", "pre", "post-warmup", "post-warmup-large-lr", "pre-large-lr"]
WARMUP_FRACTION = 0.25


@dataclasses.dataclass
class Config:
    """Everything a run depends on (stored in results.json)."""

    arms: list[str] = dataclasses.field(default_factory=lambda: list(DEFAULT_ARMS))
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0, 1, 2])
    epochs: int = 20
    depth: int = 6  # encoder layers = decoder layers
    d_model: int = 32
    n_heads: int = 4
    d_ff: int = 64
    lr: float = 6e-3  # where post-LN needs warmup (docs/experiment.md: the sweep that chose it)
    dropout: float = 0.0  # residual dropout of every sublayer, fused into its Add & Norm
    batch_size: int = 16
    norm: str = "layer"
    betas: tuple[float, float] = (0.9, 0.98)
    data: str | None = None  # --data FILE, else the generated square sequences
    threads: int = 1


def build_model(cfg: Config, norm_position: str) -> Seq2SeqTransformer:
    return Seq2SeqTransformer(
        2,
        cfg.d_model,
        cfg.n_heads,
        cfg.d_ff,
        cfg.depth,
        cfg.depth,
        norm_position=norm_position,
        norm=cfg.norm,
        dropout=cfg.dropout,
    )


def warmup_steps(arm: Arm, total_steps: int) -> int:
    return max(1, round(WARMUP_FRACTION * total_steps)) if arm.warmup else 0


def lr_lambda(arm: Arm, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the learning rate at each step: a linear warmup (warmup arms only), then a
    linear decay to zero at the end (every arm), so that the last epochs settle."""
    warmup = warmup_steps(arm, total_steps)

    def multiplier(step: int) -> float:
        return (step + 1) / warmup if step < warmup else (total_steps - step) / (total_steps - warmup)

    return multiplier


def evaluate_mse(model: Seq2SeqTransformer, source: torch.Tensor, target: torch.Tensor) -> float:
    model.eval()
    pred = model.predict(source, target.size(1))
    model.train()
    return float(torch.mean((pred - target) ** 2))


def train_arm(
    arm: Arm,
    seed: int,
    cfg: Config,
    train: np.ndarray,
    test: np.ndarray,
    on_epoch: Callable[[int, float], None] | None = None,
) -> dict:
    """Train one arm from ``seed``; returns the per-epoch curves and the time taken."""
    torch.manual_seed(seed)
    model = build_model(cfg, arm.norm_position)
    source, target = split(train)
    test_source, test_target = split(test)
    lr = cfg.lr * arm.lr_scale
    opt = torch.optim.Adam(model.parameters(), lr=lr, betas=cfg.betas, fused=True)
    steps_per_epoch = math.ceil(len(source) / cfg.batch_size)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(arm, cfg.epochs * steps_per_epoch))
    gen = torch.Generator().manual_seed(seed)
    curve, train_loss = [], []
    start, cpu_start = time.perf_counter(), time.process_time()
    for epoch in range(cfg.epochs):
        perm = torch.randperm(len(source), generator=gen)
        total = 0.0
        for i in range(0, len(source), cfg.batch_size):
            idx = perm[i : i + cfg.batch_size]
            src, tgt = source[idx], target[idx]
            loss = torch.mean((model(src, decoder_input(src, tgt)) - tgt) ** 2)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total += loss.item() * len(idx)
        train_loss.append(total / len(source))
        curve.append(evaluate_mse(model, test_source, test_target))
        if on_epoch is not None:
            on_epoch(epoch, curve[-1])
    return {
        "seed": seed,
        "lr": lr,
        "test_mse": curve,
        "train_loss": train_loss,
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu_start,
    }


def grad_norms_at_init(cfg: Config, norm_position: str, seed: int, train: np.ndarray) -> dict[str, list[float]]:
    """Gradient norm of each layer's feed-forward output weight (Xiong et al. 2020, Fig. 3),
    at initialisation from ``seed``, for the loss on the whole training set (teacher forcing);
    encoder and decoder layers, first to last."""
    torch.manual_seed(seed)
    model = build_model(cfg, norm_position)
    source, target = split(train)
    loss = torch.mean((model(source, decoder_input(source, target)) - target) ** 2)
    loss.backward()
    return {
        part: [float(layer.ffn[-1].weight.grad.norm()) for layer in getattr(model, part)]
        for part in ("encoder", "decoder")
    }


# --------------------------------------------------------------------------- the run


def load_data(cfg: Config) -> tuple[np.ndarray, np.ndarray, str]:
    """``(train, test, description)``: the generated sets, or ``cfg.data`` split 2/3 : 1/3
    after a fixed shuffle."""
    if cfg.data is None:
        train, _ = square_sequences(N_TRAIN, TRAIN_SEED)
        test, _ = square_sequences(N_TEST, TEST_SEED)
        return (
            train,
            test,
            (
                f"generated square corners, noise σ={NOISE}: train {N_TRAIN} "
                f"(seed {TRAIN_SEED}), test {N_TEST} (seed {TEST_SEED})"
            ),
        )
    data = load_sequences(cfg.data)
    perm = np.random.RandomState(TEST_SEED).permutation(len(data))
    n_test = max(1, len(data) // 3)
    return (
        data[perm[n_test:]],
        data[perm[:n_test]],
        f"{cfg.data}: {len(data)} sequences, train {len(data) - n_test}, test {n_test} (fixed shuffle)",
    )


def _first_epoch(curve: list[float], level: float) -> int | None:
    return next((i + 1 for i, v in enumerate(curve) if v <= level), None)


def summarize(curve: list[float], floor: float) -> dict:
    """Final and best test MSE, ratio to the floor, first epoch (1-based) within WITHIN x floor and
    within FAIL_RATIO x floor (off the plateau), failed."""
    finite = [v for v in curve if math.isfinite(v)]
    final = curve[-1] if curve else math.nan
    return {
        "final": final,
        "best": min(finite) if finite else math.nan,
        "ratio": final / floor,
        "first_within": _first_epoch(curve, WITHIN * floor),
        "first_below_fail": _first_epoch(curve, FAIL_RATIO * floor),
        "failed": not math.isfinite(final) or final > FAIL_RATIO * floor,
    }


def _median_epoch(epochs: list[int | None]) -> float | None:
    """Median over seeds, ``None`` (never) if most seeds never got there."""
    m = float(np.median([math.inf if e is None else e for e in epochs]))
    return None if math.isinf(m) else m


def aggregate(runs: list[dict], floor: float) -> dict:
    """One row per arm: medians over seeds."""
    rows = [summarize(r["test_mse"], floor) for r in runs]
    return {
        "final": float(np.median([r["final"] for r in rows])),
        "best": float(np.median([r["best"] for r in rows])),
        "ratio": float(np.median([r["ratio"] for r in rows])),
        "first_within": _median_epoch([r["first_within"] for r in rows]),
        "first_below_fail": _median_epoch([r["first_below_fail"] for r in rows]),
        "failed": sum(r["failed"] for r in rows),
        "runs": len(rows),
        "seconds": sum(r["seconds"] for r in runs),
    }


GRAD_INITS = 5  # the gradient norms at initialisation are averaged over at least this many inits


def grad_seeds(cfg: Config) -> list[int]:
    return list(range(max(GRAD_INITS, len(cfg.seeds))))


Job = tuple[str, int, int]  # (arm name, seed, depth): one training run
Progress = Callable[[Job, int, float], None]  # (job, epochs done, test MSE) after every epoch


def jobs_of(cfg: Config, depths: list[int] | None = None) -> list[Job]:
    """The training runs of ``cfg``: every arm x seed, at ``cfg.depth`` or at each of ``depths``."""
    return [(name, seed, depth) for depth in depths or [cfg.depth] for name in cfg.arms for seed in cfg.seeds]


def _train_job(cfg: Config, job: Job, train: np.ndarray, test: np.ndarray, progress: Progress) -> dict:
    name, seed, depth = job
    return train_arm(
        ARMS[name], seed, dataclasses.replace(cfg, depth=depth), train, test, lambda e, v: progress(job, e + 1, v)
    )


_worker: dict = {}  # in a worker process: the config, the data and the progress queue


def _worker_start(cfg: Config, queue) -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    torch.set_num_threads(cfg.threads)
    torch.set_flush_denormal(True)
    _worker.update(cfg=cfg, data=load_data(cfg)[:2], queue=queue)


def _worker_train(job: Job) -> tuple[Job, dict]:
    queue = _worker["queue"]
    return job, _train_job(_worker["cfg"], job, *_worker["data"], lambda *msg: queue.put(msg))


def train_all(cfg: Config, jobs: list[Job], progress: Progress | None = None, workers: int = 1) -> tuple[dict, bool]:
    """Run ``jobs``, in ``workers`` processes when more than one; returns ``({job: run}, interrupted)``.

    Every run seeds itself, so the results do not depend on ``workers`` or on the order the runs
    finish in. Ctrl-C stops the runs under way and returns the finished ones, with ``interrupted``
    True, so that a long experiment never loses the arms it has finished.
    """
    report = progress or (lambda *msg: None)
    done: dict[Job, dict] = {}
    try:
        if workers <= 1 or len(jobs) <= 1:
            train, test, _ = load_data(cfg)
            for job in jobs:
                done[job] = _train_job(cfg, job, train, test, report)
        else:
            _train_in_pool(cfg, jobs, report, min(workers, len(jobs)), done)
    except KeyboardInterrupt:
        return done, True
    return done, False


def _train_in_pool(cfg: Config, jobs: list[Job], report: Progress, workers: int, done: dict) -> None:
    import multiprocessing
    import queue as queues

    # fork: the workers start at once, with torch imported and the kernels compiled. Only for
    # one thread per worker: a forked child that runs OpenMP on more threads than one waits
    # forever for the team its parent had (GNU libgomp); spawn starts afresh.
    fork = cfg.threads == 1 and "fork" in multiprocessing.get_all_start_methods()
    ctx = multiprocessing.get_context("fork" if fork else "spawn")
    messages = ctx.Queue()
    with ctx.Pool(workers, _worker_start, (cfg, messages)) as pool:  # leaving it terminates the workers
        pending = [pool.apply_async(_worker_train, (job,)) for job in jobs]
        try:
            while pending:
                try:
                    report(*messages.get(timeout=0.2))
                except queues.Empty:
                    pass
                for result in [r for r in pending if r.ready()]:
                    job, run = result.get()  # a failure in a worker is raised here
                    done[job] = run
                    pending.remove(result)
        except KeyboardInterrupt:  # keep the runs that had finished, then stop the rest
            done.update(r.get() for r in pending if r.ready() and r.successful())
            raise


def _arm_entry(cfg: Config, name: str, runs: list[dict], floor: float, n_train: int) -> dict:
    arm = ARMS[name]
    steps = cfg.epochs * math.ceil(n_train / cfg.batch_size)
    return {
        "label": arm.title(cfg.norm),
        "norm_position": arm.norm_position,
        "lr": cfg.lr * arm.lr_scale,
        "warmup_steps": warmup_steps(arm, steps),
        "steps": steps,
        "runs": runs,
        "summary": aggregate(runs, floor),
    }


def _arms(cfg: Config, done: dict, depth: int, floor: float, n_train: int) -> dict:
    """The finished runs at ``depth``, arm by arm in ``cfg.arms``'s order (arms with none left out)."""
    arms = {}
    for name in cfg.arms:
        runs = [done[(name, seed, depth)] for seed in cfg.seeds if (name, seed, depth) in done]
        if runs:
            arms[name] = _arm_entry(cfg, name, runs, floor, n_train)
    return arms


def run_experiment(
    cfg: Config, progress: Progress | None = None, workers: int = 1, depths: list[int] | None = None
) -> dict:
    """Train every arm for every seed (at each of ``depths``, a depth sweep, if given) and measure
    the gradient norms at initialisation; returns the results dict.

    ``progress(job, epochs_done, test_mse)`` is called after every epoch of every run. If the run
    is interrupted (Ctrl-C), the results hold the finished runs and ``interrupted`` says how many.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)  # tiny matrices: more threads only add overhead
    torch.set_flush_denormal(True)
    try:
        train, test, description = load_data(cfg)
        floor = noise_floor(test)
        start, cpu_start = time.perf_counter(), time.process_time()
        grads = {}  # a depth sweep measures none
        if depths is None:
            for pos in ("post", "pre"):
                per_seed = [grad_norms_at_init(cfg, pos, seed, train) for seed in grad_seeds(cfg)]
                grads[pos] = {
                    part: np.mean([g[part] for g in per_seed], axis=0).tolist() for part in ("encoder", "decoder")
                }
        grads_cpu = time.process_time() - cpu_start
        jobs = jobs_of(cfg, depths)
        done, interrupted = train_all(cfg, jobs, progress, workers)
        results = {
            "config": dataclasses.asdict(cfg),
            "data": description,
            "floor": floor,
            "n_train": len(train),
            "n_test": len(test),
            "torch": torch.__version__,
            "workers": workers,
            "seconds": time.perf_counter() - start,
            "cpu_seconds": grads_cpu + sum(r["cpu_seconds"] for r in done.values()),  # in every process
            "interrupted": {"finished": len(done), "planned": len(jobs)} if interrupted else None,
        }
        if depths is None:
            arms = _arms(cfg, done, cfg.depth, floor, len(train))
            return {**results, "arms": arms, "grad_norms": grads, "grad_inits": len(grad_seeds(cfg))}
        by_depth = {str(d): _arms(cfg, done, d, floor, len(train)) for d in depths}
        return {**results, "sweep": {"depth": depths, "arms": {d: a for d, a in by_depth.items() if a}}}
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)  # torch's default: leave the process as we found it


# --------------------------------------------------------------------------- outputs


def _json_safe(obj):
    """NaN/inf -> None (results.json stays standard JSON)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    return obj


def _nan(values: list) -> np.ndarray:
    return np.array([math.nan if v is None else v for v in values], dtype=float)


def _pyplot():
    try:
        import matplotlib
    except ImportError as err:
        raise RuntimeError("the plots need matplotlib: pip install 'addnorm[plot]'") from err
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


CLIP = 10.0  # test MSE above this is drawn at the top edge of curves.png


def plot_results(results_json_path: str | pathlib.Path, out_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """(Re)draw ``curves.png`` and ``grad_norms.png`` (``depth.png`` for a depth sweep) in ``out_dir``
    from a ``results.json``."""
    import json

    plt = _pyplot()
    results = json.loads(pathlib.Path(results_json_path).read_text())
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if "sweep" in results:
        return [plot_sweep(results, out)]
    floor = results["floor"]

    fig, ax = plt.subplots(figsize=(10, 5))
    clipped = False
    for arm in results["arms"].values():
        curves = np.array([_nan(r["test_mse"]) for r in arm["runs"]])
        median = np.nanmedian(np.where(np.isfinite(curves), curves, np.inf), axis=0)
        clipped |= bool((median > CLIP).any())
        epochs = np.arange(1, curves.shape[1] + 1)
        style = "--" if arm["norm_position"] == "pre" else ":" if arm["norm_position"] == "none" else "-"
        (line,) = ax.plot(epochs, np.minimum(median, CLIP), style, marker="o", ms=3, label=arm["label"])
        if len(curves) > 1:
            lo, hi = np.nanmin(curves, axis=0), np.nanmax(curves, axis=0)
            ax.fill_between(epochs, np.minimum(lo, CLIP), np.minimum(hi, CLIP), color=line.get_color(), alpha=0.15)
    ax.axhline(floor, color="black", lw=1)
    ax.text(1, floor * 0.8, f"noise floor {floor:.4f}", va="top", fontsize=9)
    ax.axhline(WITHIN * floor, color="gray", lw=0.8, ls="--")
    ax.text(1, WITHIN * floor * 1.1, f"{WITHIN:g}x floor", va="bottom", fontsize=9, color="gray")
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, CLIP * 1.5)
    ax.set_xlabel("epoch")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("test MSE (autoregressive, log scale)")
    seeds = len(results["config"]["seeds"])
    title = f"Test MSE per epoch ({f'median of {seeds} seeds, band: min-max' if seeds > 1 else '1 seed'})"
    ax.set_title(title + (f"\nvalues above {CLIP:g} drawn at {CLIP:g}" if clipped else ""), fontsize=11)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    curves_png = out / "curves.png"
    fig.savefig(curves_png, dpi=120)
    plt.close(fig)

    grads = results["grad_norms"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 4), sharey=True)
    for ax, part in zip(axes, ("encoder", "decoder"), strict=True):
        for pos, style in (("post", "-o"), ("pre", "--s")):
            values = grads[pos][part]
            label = f"{pos}-{'LN' if results['config']['norm'] == 'layer' else 'RMSNorm'}"
            ax.plot(np.arange(1, len(values) + 1), values, style, label=label)
        ax.set_title(f"{part} layers")
        ax.set_xlabel("layer (1 = nearest the input)")
        ax.set_xticks(np.arange(1, len(grads["post"][part]) + 1))
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[0].set_ylim(bottom=0)  # shared: after both panels are drawn
    axes[0].set_ylabel("‖∂loss/∂W‖ of the FFN output weight")
    fig.suptitle(
        f"Gradient norm per layer at initialisation, mean of {results['grad_inits']} inits "
        "(cf. Xiong et al. 2020, Fig. 3)"
    )
    fig.tight_layout()
    grads_png = out / "grad_norms.png"
    fig.savefig(grads_png, dpi=120)
    plt.close(fig)
    return [curves_png, grads_png]


def _g(v: float | None) -> str:
    return "—" if v is None or not math.isfinite(v) else f"{v:.3g}"


def table_rows(results: dict) -> list[list[str]]:
    """The results table: one row per arm (medians over seeds)."""
    rows = []
    for arm in results["arms"].values():
        s = arm["summary"]
        lr = f"{arm['lr']:.2g}"
        first = "never" if s["first_within"] is None else f"{s['first_within']:g}"
        failed = ("yes" if s["failed"] else "no") if s["runs"] == 1 else f"{s['failed']}/{s['runs']}"
        rows.append(
            [arm["label"], lr, _g(s["final"]), _g(s["best"]), _g(s["ratio"]), first, failed, f"{s['seconds']:.1f}"]
        )
    return rows


TABLE_HEADER = [
    "arm",
    "lr",
    "final MSE",
    "best MSE",
    "final ÷ floor",
    f"epoch ≤ {WITHIN:g}x floor",
    "failed",
    "time (s)",
]


def _describe(arm: dict) -> str:
    s = arm["summary"]
    off = (
        ""
        if s["first_below_fail"] is None or s["first_within"] is None
        else f"fell below {FAIL_RATIO:g}x the floor at epoch {s['first_below_fail']:g}, "
    )
    when = (
        f"never came within {WITHIN:g}x the floor"
        if s["first_within"] is None
        else f"came within {WITHIN:g}x at epoch {s['first_within']:g}"
    )
    return f"{arm['label']} {off}{when} and ended at {_g(s['final'])} ({_g(s['ratio'])}x floor)"


def _speed(s: dict) -> tuple[float, float]:
    """How well a run (or an arm's medians) trained: arriving within WITHIN x the floor earlier,
    then a lower final MSE, is better (smaller)."""
    final = s["final"] if s["final"] is not None and math.isfinite(s["final"]) else math.inf
    return (math.inf if s["first_within"] is None else s["first_within"], final)


VERDICTS = ("Held", "Partly held", "Did not hold")
GROWTH = 1.2  # post-LN's gradient norm "grows toward the output": last / first layer at least this


def _judge(holds: list[bool]) -> tuple[str, str]:
    """A verdict from the seeds: held on all of them, on some (says how many), or on none."""
    n, k = len(holds), sum(holds)
    verdict = VERDICTS[0] if k == n else VERDICTS[2] if k == 0 else VERDICTS[1]
    return verdict, "" if n == 1 else f" ({k} of {n} seeds)"


def _seeds(results: dict, *names: str) -> list[tuple[dict, ...]]:
    """Per seed, the summaries of the runs of ``names`` from that seed (seeds all of them ran)."""
    floor = results["floor"]
    runs = [{r["seed"]: summarize(_curve(r), floor) for r in results["arms"][n]["runs"]} for n in names]
    common = [seed for seed in runs[0] if all(seed in r for r in runs)]
    return [tuple(r[seed] for r in runs) for seed in common]


def _curve(run: dict) -> list[float]:
    return [math.nan if v is None else v for v in run["test_mse"]]


def readings(results: dict) -> list[tuple[str, str, str]]:
    """``(prediction, verdict, what happened)`` for each prediction whose arms were run; the verdict
    is one of :data:`VERDICTS`, judged seed by seed (each seed's runs against each other)."""
    if "sweep" in results:
        return sweep_readings(results)
    a = results["arms"]
    out = []

    def add(prediction: str, holds: list[bool], what: str) -> None:
        verdict, seeds = _judge(holds)
        out.append((prediction, verdict, f"{what}{seeds}."))

    if {"pre", "post"} <= a.keys():
        add(
            "Pre-LN trains without warmup; post-LN without warmup struggles (Xiong et al. 2020).",
            [not pre["failed"] and _speed(pre) < _speed(post) for pre, post in _seeds(results, "pre", "post")],
            f"{_describe(a['pre'])}; {_describe(a['post'])}",
        )
    if {"post-warmup", "post"} <= a.keys():
        add(
            "Warmup rescues post-LN (Vaswani et al. 2017; Xiong et al. 2020).",
            [not w["failed"] and _speed(w) < _speed(p) for w, p in _seeds(results, "post-warmup", "post")],
            f"{_describe(a['post-warmup'])}; without warmup, {_describe(a['post'])}",
        )
    if "post-small-lr" in a:
        add(
            "A smaller learning rate keeps post-LN stable without warmup, at the cost of speed.",
            [not s["failed"] for (s,) in _seeds(results, "post-small-lr")],
            _describe(a["post-small-lr"]),
        )
    for large in ("post-warmup-large-lr", "post-large-lr"):
        if {large, "pre-large-lr"} <= a.keys():
            pre, post = a["pre-large-lr"], a[large]
            warm = " even with warmup" if large == "post-warmup-large-lr" else ""
            add(
                f"At a larger learning rate pre-LN still trains without warmup; post-LN{warm} does not "
                "(Xiong et al. 2020).",
                [not p["failed"] and _speed(p) < _speed(q) for p, q in _seeds(results, "pre-large-lr", large)],
                f"{_describe(pre)}; {_describe(post)}",
            )
    normed = [n for n in ("post", "pre") if n in a]
    if "none" in a and normed:
        add(
            "Without a norm the deep residual stack trains worse than with one.",
            [r[0]["failed"] or all(_speed(r[0]) > _speed(n) for n in r[1:]) for r in _seeds(results, "none", *normed)],
            _describe(a["none"]),
        )
    g = results["grad_norms"]
    if len(g["post"]["encoder"]) < 2:  # a trend over layers needs at least two
        return out
    growth = {pos: {part: g[pos][part][-1] / g[pos][part][0] for part in g[pos]} for pos in g}
    # "grows": the last layer's gradient norm at least GROWTH x the first's, and more than pre-LN's
    parts = [growth["post"][p] >= GROWTH and growth["post"][p] > growth["pre"][p] for p in growth["post"]]
    held = VERDICTS[0] if all(parts) else VERDICTS[1] if any(parts) else VERDICTS[2]
    scale = {p: np.mean(g["post"][p]) / np.mean(g["pre"][p]) for p in g["post"]}
    out.append(
        (
            "At initialisation post-LN's gradient norm grows toward the last layers, pre-LN's does not "
            "(Xiong et al. 2020, Fig. 3).",
            held,
            f"mean of {results['grad_inits']} initialisations, last layer ÷ first layer: post-LN encoder "
            f"{growth['post']['encoder']:.2f}, decoder {growth['post']['decoder']:.2f}; pre-LN encoder "
            f"{growth['pre']['encoder']:.2f}, decoder {growth['pre']['decoder']:.2f} (a trend counts "
            f"from {GROWTH:g}). Post-LN's gradients are {scale['encoder']:.1f}x pre-LN's in the encoder "
            f"and {scale['decoder']:.1f}x in the decoder, on average.",
        )
    )
    return out


def _sweep_arms(results: dict) -> dict[str, dict[int, dict]]:
    """A depth sweep's arms: ``{arm: {depth: arm entry}}``, depths in increasing order."""
    out: dict[str, dict[int, dict]] = {}
    for depth, arms in results["sweep"]["arms"].items():
        for name, arm in arms.items():
            out.setdefault(name, {})[int(depth)] = arm
    return {name: dict(sorted(by_depth.items())) for name, by_depth in out.items()}


def _failed(arm: dict) -> str:
    return f"{arm['summary']['failed']}/{arm['summary']['runs']}"


def sweep_readings(results: dict) -> list[tuple[str, str, str]]:
    """The depth sweep's reading: post-LN fails more often as it gets deeper, pre-LN at no depth."""
    arms = _sweep_arms(results)
    if not {"post", "pre"} <= arms.keys() or len(arms["post"]) < 2:
        return []
    post, pre = arms["post"], arms["pre"]
    shallow, deep = min(post), max(post)
    grows = post[deep]["summary"]["failed"] / post[deep]["summary"]["runs"] > (
        post[shallow]["summary"]["failed"] / post[shallow]["summary"]["runs"]
    )
    pre_ok = not any(arm["summary"]["failed"] for arm in pre.values())
    verdict = VERDICTS[0] if grows and pre_ok else VERDICTS[1] if grows or pre_ok else VERDICTS[2]
    seen = ", ".join(f"depth {d}: {_failed(arm)}" for d, arm in post.items())
    seen_pre = ", ".join(f"depth {d}: {_failed(arm)}" for d, arm in pre.items())
    return [
        (
            "Post-LN's trouble grows with depth; pre-LN's does not (Liu et al. 2020).",
            verdict,
            f"failed runs, post-LN {seen}; pre-LN {seen_pre}.",
        )
    ]


def sweep_rows(results: dict) -> tuple[list[str], list[list[str]]]:
    """The depth sweep's table: per arm and depth, the median final test MSE ÷ floor and the failed runs."""
    arms = _sweep_arms(results)
    depths = sorted({d for by_depth in arms.values() for d in by_depth})
    header = ["arm", "lr", *(f"depth {d}" for d in depths)]
    rows = []
    for by_depth in arms.values():
        first = next(iter(by_depth.values()))
        cells = [
            f"{_g(by_depth[d]['summary']['ratio'])}x ({_failed(by_depth[d])} failed)" if d in by_depth else "—"
            for d in depths
        ]
        rows.append([first["label"], f"{first['lr']:.2g}", *cells])
    return header, rows


def plot_sweep(results: dict, out: pathlib.Path) -> pathlib.Path:
    """``depth.png``: final test MSE against depth, per arm (median, band min-max over seeds)."""
    plt = _pyplot()
    floor = results["floor"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for by_depth in _sweep_arms(results).values():
        depths = list(by_depth)
        finals = [[_clip(v) for v in (_curve(r)[-1] for r in arm["runs"])] for arm in by_depth.values()]
        first = next(iter(by_depth.values()))
        style = "--s" if first["norm_position"] == "pre" else "-o"
        (line,) = ax.plot(depths, [np.median(f) for f in finals], style, label=first["label"])
        ax.fill_between(depths, [min(f) for f in finals], [max(f) for f in finals], color=line.get_color(), alpha=0.15)
    ax.axhline(floor, color="black", lw=1)
    ax.text(min(results["sweep"]["depth"]), floor * 0.8, f"noise floor {floor:.4f}", va="top", fontsize=9)
    ax.axhline(FAIL_RATIO * floor, color="gray", lw=0.8, ls="--")
    ax.text(
        min(results["sweep"]["depth"]),
        FAIL_RATIO * floor * 1.1,
        f"failed above {FAIL_RATIO:g}x floor",
        va="bottom",
        fontsize=9,
        color="gray",
    )
    ax.set_yscale("log")
    ax.set_ylim(floor / 2, CLIP * 1.5)
    ax.set_xticks(results["sweep"]["depth"])
    ax.set_xlabel("encoder layers = decoder layers")
    ax.set_ylabel("final test MSE (log scale)")
    seeds = len(results["config"]["seeds"])
    ax.set_title(
        f"Final test MSE against depth ({f'median of {seeds} seeds, band: min-max' if seeds > 1 else '1 seed'})"
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    path = out / "depth.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _clip(v: float) -> float:
    return CLIP if not math.isfinite(v) or v > CLIP else v


def _wobble(results: dict) -> str:
    """How much the test MSE moves once a run has come within WITHIN x the floor."""
    after = []
    for arm in results["arms"].values():
        for r in arm["runs"]:
            curve = [math.nan if v is None else v for v in r["test_mse"]]
            first = _first_epoch(curve, WITHIN * results["floor"])
            after += [v for v in curve[first - 1 :] if math.isfinite(v)] if first else []
    if not after:
        return ""
    lo, hi = min(after) / results["floor"], max(after) / results["floor"]
    return (
        f"Once within {WITHIN:g}x the floor, runs kept moving between {lo:.1f}x and {hi:.1f}x of it from "
        "epoch to epoch, so a difference of an epoch or two in the "
        f"{WITHIN:g}x column, or a small one in the final MSE, is within that noise. "
    )


def _schedule_text(results: dict) -> str:
    arms = _all_arms(results)
    warm = next((arm for arm in arms if arm["warmup_steps"]), None)
    decay = f"Learning rate: decays linearly to zero over the {arms[0]['steps']} steps"
    if warm is None:
        return decay + "."
    return (
        f"{decay}; the arms with warmup ({', '.join(dict.fromkeys(a['label'] for a in arms if a['warmup_steps']))}) "
        f"first rise linearly from zero over the first {warm['warmup_steps']} steps, then decay to zero."
    )


def _all_arms(results: dict) -> list[dict]:
    if "sweep" in results:
        return [arm for arms in results["sweep"]["arms"].values() for arm in arms.values()]
    return list(results["arms"].values())


def _small(depth: int, epochs: int) -> bool:
    return depth < Config.depth or epochs < Config.epochs


def _floor_text(data: str | None) -> str:
    """What the noise floor is, for the generated sequences or for ``--data``."""
    if data is None:
        return f"the test MSE of predicting the exact corners (≈ σ² = {NOISE**2:g}); no model can do better on average"
    return (
        "the test MSE of predicting, for each target point, the corner of [-1, 1]² nearest to it; "
        "if the data are noisy corners, no model can do better on average"
    )


def report_markdown(results: dict, command: str) -> str:
    cfg = results["config"]
    sweep = results.get("sweep")
    layers = (
        f"{', '.join(map(str, sweep['depth']))} encoder and as many decoder layers (a depth sweep)"
        if sweep
        else f"{cfg['depth']} + {cfg['depth']} layers"
    )
    dropout = f", residual dropout {cfg['dropout']:g}" if cfg.get("dropout") else ""
    lines = [
        "# What the norm and its placement do to training" + (": a depth sweep" if sweep else ""),
        "",
        f"Command: `{command}` — {results['seconds']:.0f} s wall clock, "
        f"{results['cpu_seconds']:.0f} s of CPU time in all ({results.get('workers', 1)} process(es)), "
        f"torch {results['torch']}, {cfg['threads']} thread(s) per process.",
        "",
    ]
    stopped = results.get("interrupted")
    if stopped:
        lines += [
            f"**Interrupted:** {stopped['finished']} of {stopped['planned']} runs had finished; "
            "the tables and readings below are of those alone.",
            "",
        ]
    lines += [
        f"Model: encoder-decoder Transformer, {layers}, d_model {cfg['d_model']}, "
        f"{cfg['n_heads']} heads, FFN {cfg['d_ff']}, norm `{cfg['norm']}`{dropout}; Adam betas "
        f"{tuple(cfg['betas'])}, batch {cfg['batch_size']}, {cfg['epochs']} epochs, seeds {cfg['seeds']}. "
        f"Data: {results['data']}. Given the first two corners the model predicts the last two; test MSE is "
        "measured autoregressively after every epoch.",
        "",
        f"**Noise floor: {results['floor']:.4f}** — {_floor_text(cfg['data'])}. A run *failed* if its "
        f"final test MSE is above {FAIL_RATIO:g}x the floor or not finite.",
        "",
    ]
    if sweep:
        header, rows = sweep_rows(results)
        lines += [
            _schedule_text(results) + " Each cell: the median over seeds of the final test MSE ÷ floor, and "
            "how many runs failed.",
            "",
            *_markdown_table(header, rows),
            "",
            "![final test MSE against depth](depth.png)",
            "",
            "## Reading",
            "",
        ]
    else:
        lines += [
            _schedule_text(results) + f" *epoch ≤ {WITHIN:g}x floor* is the first epoch whose test MSE is "
            f"within {WITHIN:g}x the floor; the table shows medians over seeds (failed: how many seeds failed).",
            "",
            *_markdown_table(TABLE_HEADER, table_rows(results)),
            "",
            "![test MSE per epoch](curves.png)",
            "",
            "![gradient norm per layer at initialisation](grad_norms.png)",
            "",
            "## Reading: what the literature predicts, and what happened here",
            "",
        ]
        if _small(cfg["depth"], cfg["epochs"]):
            lines += [
                f"This run is smaller than the default ({Config.depth} + {Config.depth} layers, "
                f"{Config.epochs} epochs); the predictions are about deep models trained for longer, "
                "so the verdicts below say little.",
                "",
            ]
    for prediction, held, what in readings(results):
        lines += [f"- **{prediction}** {held} here: {what}", ""]
    n_seeds = len(cfg["seeds"])
    lines += [
        "These readings are generated from the numbers above by fixed rules, seed by seed (each seed's "
        f"runs against each other): arriving within {WITHIN:g}x the floor earlier, then a lower final MSE, "
        f"counts as training better; a run fails above {FAIL_RATIO:g}x the floor. "
        + ("" if sweep else _wobble(results))
        + (
            "One seed on one small task is a demonstration, not a benchmark: rerun with `--seeds 3` to see "
            "how much of it is luck."
            if n_seeds == 1
            else f"{n_seeds} seeds on one small task are a demonstration, not a benchmark."
        ),
        "",
    ]
    return "\n".join(lines)


def _markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def write_results_json(results: dict, path: pathlib.Path, command: str) -> dict:
    """Write ``results`` and the ``command`` that made them to ``path`` as standard JSON; returns
    what was written."""
    import json

    results = _json_safe({**results, "command": command})
    path.write_text(json.dumps(results, indent=1) + "\n")
    return results


def write_outputs(results: dict, out_dir: str | pathlib.Path, command: str) -> list[pathlib.Path]:
    """Write ``results.json``, the plots (:func:`plot_results`) and ``report.md`` into ``out_dir``."""
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_json = out / "results.json"
    results = write_results_json(results, results_json, command)
    pngs = plot_results(results_json, out)
    report = out / "report.md"
    report.write_text(report_markdown(results, command))
    return [results_json, *pngs, report]


# --------------------------------------------------------------------------- `addnorm train`

QUICK = dict(epochs=2, depth=1, seeds=[0])  # the whole pipeline in seconds (tests, CI)
SWEEP_DEPTHS = [2, 4, 6, 8]  # --sweep depth (Liu et al. 2020: post-LN's trouble grows with depth)
SWEEP_ARMS = ["post", "pre", "post-warmup"]
QUICK_DEPTHS = [1, 2]


def _int_list(text: str, flag: str) -> list[int]:
    from .cli import UsageError

    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise UsageError(f"{flag}: expected positive whole numbers separated by commas, got {text!r}")
    return sorted(set(values))


def config_from_args(args) -> tuple[Config, list[int] | None]:
    """The run's :class:`Config`, and the depths of a depth sweep (None without ``--sweep``)."""
    from .cli import UsageError, check_threads

    default_arms = SWEEP_ARMS if args.sweep else DEFAULT_ARMS
    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else list(default_arms)
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise UsageError(f"--arms: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    for name in ("seeds", "epochs", "depth", "jobs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be at least 1, got {value}")
    check_threads(args.threads)
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    if not 0 <= args.dropout < 1:  # NaN fails too
        raise UsageError(f"--dropout must be in [0, 1), got {args.dropout}")
    if args.sweep and args.depth is not None:
        raise UsageError("--depth: a depth sweep trains at every depth of --depths; give those instead")
    if args.depths is not None and not args.sweep:
        raise UsageError("--depths only applies to '--sweep depth'")
    cfg = Config(
        arms=list(dict.fromkeys(arms)), norm=args.norm, data=args.data, threads=args.threads, dropout=args.dropout
    )
    if args.quick:
        cfg = dataclasses.replace(cfg, **QUICK)
    for name in ("epochs", "depth", "lr"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if args.seeds is not None:
        cfg.seeds = list(range(args.seeds))
    if not args.sweep:
        return cfg, None
    default_depths = QUICK_DEPTHS if args.quick else SWEEP_DEPTHS
    return cfg, default_depths if args.depths is None else _int_list(args.depths, "--depths")


def default_workers() -> int:
    """One worker process per CPU this process may run on."""
    import os

    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def command_line(args) -> str:
    """The ``addnorm train`` command that reproduces ``args`` (options left at their default
    omitted; ``--jobs`` changes how long a run takes, not its results)."""
    import shlex

    words = ["addnorm", "train"]
    for name in ("sweep", "depths", "arms", "seeds", "epochs", "depth", "lr", "data", "out"):
        if getattr(args, name) is not None:
            words += [f"--{name}", str(getattr(args, name))]
    if args.dropout:
        words += ["--dropout", f"{args.dropout:g}"]
    if args.norm != "layer":
        words += ["--norm", args.norm]
    if args.threads != 1:
        words += ["--threads", str(args.threads)]
    return shlex.join(words + (["--quick"] if args.quick else []))


def rich_table(results: dict):
    from rich import box
    from rich.table import Table

    table = Table(
        title=f"test MSE, noise floor {results['floor']:.4f} (medians over {len(results['config']['seeds'])} seed(s))",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
        collapse_padding=True,
    )
    if "sweep" in results:
        headers, rows = sweep_rows(results)  # one column per depth: "ratio x (k/n failed)"
        headers = [h.replace("depth ", "depth\n") for h in headers]
        rows = [[*row[:2], *(c.replace(" (", "\n(").replace(" failed", "") for c in row[2:])] for row in rows]
        table.title = f"final test MSE ÷ noise floor {results['floor']:.4f}, median over seeds (failed runs)"
        for i, header in enumerate(headers):
            table.add_column(header, justify="left" if i < 2 else "right", no_wrap=True)
        for row in rows:
            table.add_row(*row)
        return table
    rows = [row[:3] + row[4:] for row in table_rows(results)]  # report.md also has the best MSE
    headers = [
        "arm",
        "lr",
        "final\nMSE",
        "final\n÷ floor",
        f"epoch\n≤{WITHIN:g}x fl.",
        "failed",
        "time\n(s)",
    ]  # TABLE_HEADER on two lines: fits 80 columns
    for i, header in enumerate(headers):
        table.add_column(header, justify="left" if i < 2 else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    return table


def run(args) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from .cli import CommandError, Interrupted, UsageError, output_dir

    cfg, depths = config_from_args(args)
    try:
        _pyplot()
        if cfg.data is not None and noise_floor(load_data(cfg)[1]) == 0:
            raise ValueError(
                f"--data {cfg.data}: the test points lie exactly on the corners of [-1, 1]², so the noise "
                "floor is 0 and the results, read against it, would mean nothing; give noisy sequences"
            )
    except (RuntimeError, ValueError) as err:
        raise UsageError(str(err)) from err
    writes = (
        "a depth sweep writes results.json, depth.png and report.md"
        if depths
        else "train writes results.json, curves.png, grad_norms.png and report.md"
    )
    out_dir = output_dir(args.out, "--out", writes)
    jobs = jobs_of(cfg, depths)
    workers = min(args.jobs or default_workers(), len(jobs))
    console = Console()
    layers = f"depth {','.join(map(str, depths))}" if depths else f"{cfg.depth}+{cfg.depth} layers"
    console.print(
        f"[bold]addnorm train[/]: {len(cfg.arms)} arm(s) x {len(cfg.seeds)} seed(s), {layers}, "
        f"{cfg.epochs} epochs, norm {cfg.norm!r}, base lr {cfg.lr:g}"
        + (f", dropout {cfg.dropout:g}" if cfg.dropout else "")
        + f"; {len(jobs)} runs in {workers} process(es)"
    )
    columns = (
        TextColumn("{task.description:<22}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("test MSE {task.fields[mse]}"),
        TimeElapsedColumn(),
    )
    epochs_done: dict[Job, int] = {}
    # no refresh thread: the training processes are forked from this one (see _train_in_pool)
    with Progress(*columns, console=console, auto_refresh=False) as bar:
        tasks = {}
        for name, _, depth in jobs:
            label = ARMS[name].title(cfg.norm) + (f", depth {depth}" if depths else "")
            if (name, depth) not in tasks:
                tasks[name, depth] = bar.add_task(label, total=cfg.epochs * len(cfg.seeds), mse="—")

        def progress(job: Job, done: int, mse: float) -> None:
            epochs_done[job] = done
            name, _, depth = job
            total = sum(n for (a, _, d), n in epochs_done.items() if (a, d) == (name, depth))
            bar.update(tasks[name, depth], completed=total, mse=_g(mse))
            bar.refresh()

        results = run_experiment(cfg, progress, workers, depths)
    stopped = results["interrupted"]
    if stopped and not stopped["finished"]:
        raise Interrupted("interrupted before any run finished; nothing written")
    console.print(rich_table(results))
    if _small(cfg.depth, cfg.epochs) and not depths:
        console.print(
            f"(smaller than the default {Config.depth}+{Config.depth} layers, "
            f"{Config.epochs} epochs: the verdicts below say little)"
        )
    colours = dict(zip(VERDICTS, ("green", "yellow", "red"), strict=True))
    for prediction, held, _ in readings(results):
        console.print(f"[{colours[held]}]{held.lower()}[/]: {prediction}")
    command = command_line(args)
    try:
        written = write_outputs(results, out_dir, command)
    except OSError as err:  # the folder was checked at the start; keep the results if it went away since
        raise CommandError(f"--out: cannot write into {args.out!r} ({err}); {_rescue(results, command)}") from None
    console.print(f"wrote {', '.join(str(p) for p in written)} ({results['seconds']:.0f} s)")
    if stopped:
        raise Interrupted(
            f"interrupted: {stopped['finished']} of {stopped['planned']} runs had finished; {out_dir} holds those"
        )
    return 0


def _rescue(results: dict, command: str) -> str:
    """Save ``results`` to a fresh temporary folder; says where (or that it could not)."""
    import tempfile

    try:
        path = pathlib.Path(tempfile.mkdtemp(prefix="addnorm-train-")) / "results.json"
        write_results_json(results, path, command)
    except OSError as err:
        return f"could not save the results anywhere either ({err})"
    return f"the results are saved in {path}: 'addnorm plot train --results {path}' draws them"


def register(sub) -> None:
    p = sub.add_parser(
        "train",
        help="train a deep Transformer with the norm after, before, or nowhere; compare",
        description="Train the same deep encoder-decoder Transformer on the square-corners task with "
        "different norm placements and learning-rate schedules (arms), side by side, and report "
        "test MSE against the noise floor, gradient norms at initialisation, plots and a "
        "reading.",
    )
    p.add_argument(
        "--arms",
        help=f"comma-separated arms to run (default: {','.join(DEFAULT_ARMS)}; with --sweep depth: "
        f"{','.join(SWEEP_ARMS)}); all: {', '.join(ARMS)}",
    )
    p.add_argument("--seeds", type=int, help=f"number of seeds per arm (seeds 0..N-1; default {len(Config().seeds)})")
    p.add_argument("--epochs", type=int, help=f"training epochs (default {Config.epochs})")
    p.add_argument("--depth", type=int, help=f"encoder layers = decoder layers (default {Config.depth})")
    p.add_argument("--lr", type=float, help=f"base learning rate (default {Config.lr:g})")
    p.add_argument(
        "--dropout",
        type=float,
        default=0.0,
        metavar="P",
        help="residual dropout on every sublayer's output, fused into its Add & Norm (the original "
        "Transformer: 0.1; default 0)",
    )
    p.add_argument(
        "--sweep",
        choices=["depth"],
        help=f"train the arms at several depths instead (default arms {','.join(SWEEP_ARMS)}); writes depth.png",
    )
    p.add_argument(
        "--depths", metavar="D,D,...", help=f"the depths of --sweep depth (default {','.join(map(str, SWEEP_DEPTHS))})"
    )
    p.add_argument(
        "--jobs",
        type=int,
        help="training processes run side by side (default: one per CPU); the results do not depend on it",
    )
    p.add_argument("--norm", choices=["layer", "rms"], default="layer", help="LayerNorm or RMSNorm")
    p.add_argument("--data", metavar="FILE", help="your own sequences: .npy or .csv of shape [n, 4, 2]")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: the model is tiny)")
    p.add_argument("--out", default="addnorm-train", metavar="DIR", help="output folder (default ./addnorm-train)")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"tiny run for a smoke test: {QUICK['depth']}+{QUICK['depth']} layers, {QUICK['epochs']} epochs",
    )
    p.set_defaults(func=run)

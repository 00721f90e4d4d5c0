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

from .transformer import Seq2SeqTransformer

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


ARMS = {
    a.name: a
    for a in [
        Arm("none", "no norm", "none"),
        Arm("post", "post-{N}", "post"),
        Arm("pre", "pre-{N}", "pre"),
        Arm("post-warmup", "post-{N} + warmup", "post", warmup=True),
        Arm("post-small-lr", "post-{N} lr/10", "post", lr_scale=0.1),
        Arm("post-large-lr", "post-{N} lr×5", "post", lr_scale=5.0),
        Arm("pre-large-lr", "pre-{N} lr×5", "pre", lr_scale=5.0),
    ]
}
WARMUP_FRACTION = 0.25


@dataclasses.dataclass
class Config:
    """Everything a run depends on (stored in results.json)."""

    arms: list[str] = dataclasses.field(default_factory=lambda: list(ARMS))
    seeds: list[int] = dataclasses.field(default_factory=lambda: [0])
    epochs: int = 20
    depth: int = 6  # encoder layers = decoder layers
    d_model: int = 32
    n_heads: int = 4
    d_ff: int = 64
    lr: float = 1e-3
    batch_size: int = 16
    norm: str = "layer"
    betas: tuple[float, float] = (0.9, 0.98)
    data: str | None = None  # --data FILE, else the generated square sequences
    threads: int = 1


def build_model(cfg: Config, norm_position: str) -> Seq2SeqTransformer:
    return Seq2SeqTransformer(
        2, cfg.d_model, cfg.n_heads, cfg.d_ff, cfg.depth, cfg.depth, norm_position=norm_position, norm=cfg.norm
    )


def warmup_steps(arm: Arm, total_steps: int) -> int:
    return max(1, round(WARMUP_FRACTION * total_steps)) if arm.warmup else 0


def lr_lambda(arm: Arm, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the learning rate at each step: linear warmup, then constant."""
    warmup = warmup_steps(arm, total_steps)
    return lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0


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


def run_experiment(cfg: Config, progress: Callable[[str, int, float], None] | None = None) -> dict:
    """Train every arm for every seed, measure the gradient norms at init; returns the results dict.

    ``progress(arm_name, epoch_done, test_mse)`` is called after every epoch.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)  # tiny matrices: more threads only add overhead
    torch.set_flush_denormal(True)
    try:
        train, test, description = load_data(cfg)
        floor = noise_floor(test)
        start, cpu_start = time.perf_counter(), time.process_time()
        arms = {}
        for name in cfg.arms:
            arm = ARMS[name]
            runs = []
            for k, seed in enumerate(cfg.seeds):
                on_epoch = (
                    None if progress is None else (lambda e, v, n=name, k=k: progress(n, k * cfg.epochs + e + 1, v))
                )
                runs.append(train_arm(arm, seed, cfg, train, test, on_epoch))
            steps = cfg.epochs * math.ceil(len(train) / cfg.batch_size)
            arms[name] = {
                "label": arm.title(cfg.norm),
                "norm_position": arm.norm_position,
                "lr": cfg.lr * arm.lr_scale,
                "warmup_steps": warmup_steps(arm, steps),
                "steps": steps,
                "runs": runs,
                "summary": aggregate(runs, floor),
            }
        grads = {}
        for pos in ("post", "pre"):
            per_seed = [grad_norms_at_init(cfg, pos, seed, train) for seed in grad_seeds(cfg)]
            grads[pos] = {
                part: np.mean([g[part] for g in per_seed], axis=0).tolist() for part in ("encoder", "decoder")
            }
        return {
            "config": dataclasses.asdict(cfg),
            "data": description,
            "floor": floor,
            "n_train": len(train),
            "n_test": len(test),
            "arms": arms,
            "grad_norms": grads,
            "grad_inits": len(grad_seeds(cfg)),
            "torch": torch.__version__,
            "seconds": time.perf_counter() - start,
            "cpu_seconds": time.process_time() - cpu_start,
        }
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
    """(Re)draw ``curves.png`` and ``grad_norms.png`` in ``out_dir`` from a ``results.json``."""
    import json

    plt = _pyplot()
    results = json.loads(pathlib.Path(results_json_path).read_text())
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
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


def _speed(arm: dict) -> tuple[float, float]:
    s = arm["summary"]
    final = s["final"] if math.isfinite(s["final"]) else math.inf
    return (math.inf if s["first_within"] is None else s["first_within"], final)


def _fails(arm: dict) -> bool:
    return arm["summary"]["failed"] * 2 > arm["summary"]["runs"]  # most seeds failed


VERDICTS = ("Held", "Partly held", "Did not hold")
GROWTH = 1.2  # post-LN's gradient norm "grows toward the output": last / first layer at least this


def _verdict(held: bool) -> str:
    return VERDICTS[0] if held else VERDICTS[2]


def readings(results: dict) -> list[tuple[str, str, str]]:
    """``(prediction, verdict, what happened)`` for each prediction whose arms were run; the verdict
    is one of :data:`VERDICTS`."""
    a = results["arms"]
    out = []
    if {"pre", "post"} <= a.keys():
        held = _verdict(_speed(a["pre"]) < _speed(a["post"]) and not _fails(a["pre"]))
        out.append(
            (
                "Pre-LN trains without warmup; post-LN without warmup struggles (Xiong et al. 2020).",
                held,
                f"{_describe(a['pre'])}; {_describe(a['post'])}.",
            )
        )
    if {"post-warmup", "post"} <= a.keys():
        held = _verdict(_speed(a["post-warmup"]) < _speed(a["post"]))
        out.append(
            (
                "Warmup helps post-LN (Vaswani et al. 2017; Xiong et al. 2020).",
                held,
                f"{_describe(a['post-warmup'])}; without warmup, {_describe(a['post'])}.",
            )
        )
    if "post-small-lr" in a:
        held = _verdict(not _fails(a["post-small-lr"]))
        out.append(
            (
                "A smaller learning rate keeps post-LN stable without warmup, at the cost of speed.",
                held,
                f"{_describe(a['post-small-lr'])}.",
            )
        )
    if {"post-large-lr", "pre-large-lr"} <= a.keys():
        pre, post = a["pre-large-lr"], a["post-large-lr"]
        held = _verdict(not _fails(pre) and _speed(pre) < _speed(post))
        out.append(
            (
                "At a large learning rate pre-LN still trains and post-LN does not (Xiong et al. 2020).",
                held,
                f"{_describe(a['pre-large-lr'])}; {_describe(a['post-large-lr'])}.",
            )
        )
    normed = [a[n] for n in ("post", "pre") if n in a]
    if "none" in a and normed:
        held = _verdict(_fails(a["none"]) or all(_speed(a["none"]) > _speed(n) for n in normed))
        out.append(
            ("Without a norm the deep residual stack trains worse than with one.", held, f"{_describe(a['none'])}.")
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
        "epoch to epoch (the learning rate is never decayed), so a difference of an epoch or two in the "
        f"{WITHIN:g}x column, or a small one in the final MSE, is within that noise. "
    )


def _schedule_text(results: dict) -> str:
    warm = [arm for arm in results["arms"].values() if arm["warmup_steps"]]
    if not warm:
        return "Learning rate: constant."
    return (
        f"Learning rate: constant, except {warm[0]['label']}: linear warmup over the first "
        f"{warm[0]['warmup_steps']} of {warm[0]['steps']} steps, then constant."
    )


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
    lines = [
        "# What the norm and its placement do to training",
        "",
        f"Command: `{command}` — {results['seconds']:.0f} s wall clock, "
        f"{results['cpu_seconds']:.0f} s of CPU time (training and gradient norms), "
        f"torch {results['torch']}, {cfg['threads']} thread(s).",
        "",
        f"Model: encoder-decoder Transformer, {cfg['depth']} + {cfg['depth']} layers, "
        f"d_model {cfg['d_model']}, "
        f"{cfg['n_heads']} heads, FFN {cfg['d_ff']}, norm `{cfg['norm']}`; Adam betas {tuple(cfg['betas'])}, "
        f"batch {cfg['batch_size']}, {cfg['epochs']} epochs, seeds {cfg['seeds']}. "
        f"Data: {results['data']}. Given the first two corners the model predicts the last two; test MSE is "
        "measured autoregressively after every epoch.",
        "",
        f"**Noise floor: {results['floor']:.4f}** — {_floor_text(cfg['data'])}. An arm *failed* if its "
        f"final test MSE is above {FAIL_RATIO:g}x the floor or not finite.",
        "",
        _schedule_text(results) + f" *epoch ≤ {WITHIN:g}x floor* is the first epoch whose test MSE is within "
        f"{WITHIN:g}x the floor; the table shows medians over seeds (failed: how many seeds failed).",
        "",
        "| " + " | ".join(TABLE_HEADER) + " |",
        "|" + "---|" * len(TABLE_HEADER),
        *("| " + " | ".join(row) + " |" for row in table_rows(results)),
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
    lines += [
        "These readings are generated from the numbers above by fixed rules: arriving within "
        f"{WITHIN:g}x the floor earlier, then a lower final MSE, counts as training better; a run "
        f"fails above {FAIL_RATIO:g}x the floor. {_wobble(results)}"
        + (
            "One seed on one small task is a demonstration, not a benchmark: rerun with `--seeds 3` to see "
            "how much of it is luck."
            if len(cfg["seeds"]) == 1
            else f"{len(cfg['seeds'])} seeds on one small task are a demonstration, not a benchmark."
        ),
        "",
    ]
    return "\n".join(lines)


def write_results_json(results: dict, path: pathlib.Path, command: str) -> dict:
    """Write ``results`` and the ``command`` that made them to ``path`` as standard JSON; returns
    what was written."""
    import json

    results = _json_safe({**results, "command": command})
    path.write_text(json.dumps(results, indent=1) + "\n")
    return results


def write_outputs(results: dict, out_dir: str | pathlib.Path, command: str) -> list[pathlib.Path]:
    """Write ``results.json``, ``curves.png``, ``grad_norms.png`` and ``report.md`` into ``out_dir``."""
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


def config_from_args(args) -> Config:
    from .cli import UsageError, check_threads

    arms = [a.strip() for a in args.arms.split(",") if a.strip()] if args.arms else list(ARMS)
    unknown = [a for a in arms if a not in ARMS]
    if unknown or not arms:
        raise UsageError(f"--arms: unknown arm(s) {unknown}; choose from {', '.join(ARMS)}")
    for name in ("seeds", "epochs", "depth"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name} must be at least 1, got {value}")
    check_threads(args.threads)
    if args.lr is not None and not (args.lr > 0 and math.isfinite(args.lr)):
        raise UsageError(f"--lr must be a positive number, got {args.lr}")
    cfg = Config(arms=list(dict.fromkeys(arms)), norm=args.norm, data=args.data, threads=args.threads)
    if args.quick:
        cfg = dataclasses.replace(cfg, **QUICK)
    for name in ("epochs", "depth", "lr"):
        if getattr(args, name) is not None:
            setattr(cfg, name, getattr(args, name))
    if args.seeds is not None:
        cfg.seeds = list(range(args.seeds))
    return cfg


def command_line(args) -> str:
    """The ``addnorm train`` command that reproduces ``args`` (options left at their default omitted)."""
    import shlex

    words = ["addnorm", "train"]
    for name in ("arms", "seeds", "epochs", "depth", "lr", "data", "out"):
        if getattr(args, name) is not None:
            words += [f"--{name}", str(getattr(args, name))]
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
    rows = table_rows(results)
    headers = [
        "arm",
        "lr",
        "final\nMSE",
        "best\nMSE",
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

    from .cli import CommandError, UsageError, output_dir

    cfg = config_from_args(args)
    try:
        _pyplot()
        if cfg.data is not None and noise_floor(load_data(cfg)[1]) == 0:
            raise ValueError(
                f"--data {cfg.data}: the test points lie exactly on the corners of [-1, 1]², so the noise "
                "floor is 0 and the results, read against it, would mean nothing; give noisy sequences"
            )
    except (RuntimeError, ValueError) as err:
        raise UsageError(str(err)) from err
    out_dir = output_dir(args.out, "--out", "train writes results.json, curves.png, grad_norms.png and report.md")
    console = Console()
    console.print(
        f"[bold]addnorm train[/]: {len(cfg.arms)} arm(s) x {len(cfg.seeds)} seed(s), "
        f"{cfg.depth}+{cfg.depth} layers, {cfg.epochs} epochs, norm {cfg.norm!r}, "
        f"base lr {cfg.lr:g}"
    )
    columns = (
        TextColumn("{task.description:<18}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("test MSE {task.fields[mse]}"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as bar:
        tasks = {
            name: bar.add_task(ARMS[name].title(cfg.norm), total=cfg.epochs * len(cfg.seeds), mse="—")
            for name in cfg.arms
        }

        def progress(name: str, done: int, mse: float) -> None:
            bar.update(tasks[name], completed=done, mse=_g(mse))

        results = run_experiment(cfg, progress)
    console.print(rich_table(results))
    if _small(cfg.depth, cfg.epochs):
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
    p.add_argument("--arms", help=f"comma-separated arms to run (default: all): {', '.join(ARMS)}")
    p.add_argument("--seeds", type=int, help="number of seeds per arm (seeds 0..N-1; default 1)")
    p.add_argument("--epochs", type=int, help=f"training epochs (default {Config.epochs})")
    p.add_argument("--depth", type=int, help=f"encoder layers = decoder layers (default {Config.depth})")
    p.add_argument("--lr", type=float, help=f"base learning rate (default {Config.lr:g})")
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

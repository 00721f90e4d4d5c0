"""Training: one arm from one seed (:func:`train_arm`), its learning-rate schedule, the
gradient norms at initialisation, and every arm x seed of an experiment side by side in worker
processes (:func:`run_experiment`).

Each *arm* trains the same deep encoder-decoder (:class:`addnorm.transformer.Seq2SeqTransformer`)
with one norm placement and learning-rate schedule (:mod:`.config`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

import numpy as np
import torch

from ...transformer import Seq2SeqTransformer
from .config import ARMS, WARMUP_FRACTION, Arm, Config
from .data import decoder_input, load_data, noise_floor, split
from .schema import ArmResult, GradNorms, Interruption, Results, Run, Sweep, aggregate


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
) -> Run:
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
    return Run(
        seed=seed,
        lr=lr,
        test_mse=curve,
        train_loss=train_loss,
        seconds=time.perf_counter() - start,
        cpu_seconds=time.process_time() - cpu_start,
    )


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


GRAD_INITS = 5  # the gradient norms at initialisation are averaged over at least this many inits


def grad_seeds(cfg: Config) -> list[int]:
    return list(range(max(GRAD_INITS, len(cfg.seeds))))


Job = tuple[str, int, int]  # (arm name, seed, depth): one training run
Progress = Callable[[Job, int, float], None]  # (job, epochs done, test MSE) after every epoch


def jobs_of(cfg: Config, depths: list[int] | None = None) -> list[Job]:
    """The training runs of ``cfg``: every arm x seed, at ``cfg.depth`` or at each of ``depths``."""
    return [(name, seed, depth) for depth in depths or [cfg.depth] for name in cfg.arms for seed in cfg.seeds]


def _train_job(cfg: Config, job: Job, train: np.ndarray, test: np.ndarray, progress: Progress) -> Run:
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


def _worker_train(job: Job) -> tuple[Job, Run]:
    queue = _worker["queue"]
    return job, _train_job(_worker["cfg"], job, *_worker["data"], lambda *msg: queue.put(msg))


def train_all(
    cfg: Config, jobs: list[Job], progress: Progress | None = None, workers: int = 1
) -> tuple[dict[Job, Run], bool]:
    """Run ``jobs``, in ``workers`` processes when more than one; returns ``({job: run}, interrupted)``.

    Every run seeds itself, so the results do not depend on ``workers`` or on the order the runs
    finish in. Ctrl-C stops the runs under way and returns the finished ones, with ``interrupted``
    True, so that a long experiment never loses the arms it has finished.
    """
    report = progress or (lambda *msg: None)
    done: dict[Job, Run] = {}
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


def _train_in_pool(cfg: Config, jobs: list[Job], report: Progress, workers: int, done: dict[Job, Run]) -> None:
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


def _arm_entry(cfg: Config, name: str, runs: list[Run], floor: float, n_train: int) -> ArmResult:
    arm = ARMS[name]
    steps = cfg.epochs * math.ceil(n_train / cfg.batch_size)
    return ArmResult(
        label=arm.title(cfg.norm),
        norm_position=arm.norm_position,
        lr=cfg.lr * arm.lr_scale,
        warmup_steps=warmup_steps(arm, steps),
        steps=steps,
        runs=runs,
        summary=aggregate(runs, floor),
    )


def _arms(cfg: Config, done: dict[Job, Run], depth: int, floor: float, n_train: int) -> dict[str, ArmResult]:
    """The finished runs at ``depth``, arm by arm in ``cfg.arms``'s order (arms with none left out)."""
    arms = {}
    for name in cfg.arms:
        runs = [done[(name, seed, depth)] for seed in cfg.seeds if (name, seed, depth) in done]
        if runs:
            arms[name] = _arm_entry(cfg, name, runs, floor, n_train)
    return arms


def run_experiment(
    cfg: Config, progress: Progress | None = None, workers: int = 1, depths: list[int] | None = None
) -> Results:
    """Train every arm for every seed (at each of ``depths``, a depth sweep, if given) and measure
    the gradient norms at initialisation.

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
        grads: GradNorms = {}  # a depth sweep measures none
        if depths is None:
            for pos in ("post", "pre"):
                per_seed = [grad_norms_at_init(cfg, pos, seed, train) for seed in grad_seeds(cfg)]
                grads[pos] = {
                    part: np.mean([g[part] for g in per_seed], axis=0).tolist() for part in ("encoder", "decoder")
                }
        grads_cpu = time.process_time() - cpu_start
        jobs = jobs_of(cfg, depths)
        done, interrupted = train_all(cfg, jobs, progress, workers)
        results = Results(
            config=Config.from_json(cfg.to_json()),  # a copy: the caller's cfg may change afterwards
            data=description,
            floor=floor,
            n_train=len(train),
            n_test=len(test),
            torch=torch.__version__,
            workers=workers,
            seconds=time.perf_counter() - start,
            cpu_seconds=grads_cpu + sum(r.cpu_seconds for r in done.values()),  # in every process
            interrupted=Interruption(len(done), len(jobs)) if interrupted else None,
        )
        if depths is None:
            results.arms = _arms(cfg, done, cfg.depth, floor, len(train))
            results.grad_norms, results.grad_inits = grads, len(grad_seeds(cfg))
        else:
            by_depth = {d: _arms(cfg, done, d, floor, len(train)) for d in depths}
            results.sweep = Sweep(depths, {d: a for d, a in by_depth.items() if a})
        return results
    finally:
        torch.set_num_threads(threads)
        torch.set_flush_denormal(False)  # torch's default: leave the process as we found it

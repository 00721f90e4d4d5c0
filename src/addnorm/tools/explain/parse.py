"""What ``addnorm explain`` is given: matrix literals and files, ``--gamma``/``--beta``,
``--normalized-shape``, and the checks that the options fit together, each refused with a
:class:`~addnorm.tools.cli.UsageError` that names the option."""

from __future__ import annotations

import math
import pickle
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ... import reference
from ..cli import UsageError, check_seed, is_number, read_numbers
from ..info import WORKED_INPUT

MATRIX_HELP = 'a matrix literal like "[[0.2,0.1,0.3],[0.5,0.1,0.1]]" or a .npy, .pt or .csv file'
PARAM_HELP = "one number, or one per feature like 1.5,-0.5,2"
FILE_SUFFIXES = (".npy", ".pt", ".pth", ".csv")
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)  # what addnorm's ops take
_TOKEN = re.compile(r"\s*(?:([\[\],])|([^\s\[\],]+))")


def parse_literal(text: str, what: str, expected: str = MATRIX_HELP) -> float | list:
    """Parse a number or nested list of numbers (``[[1, 2], [3, 4]]``) without ``eval``;
    ``expected`` says what ``what`` takes, in the error messages."""
    tokens = []
    pos = 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        tokens.append(m.group(1) or m.group(2))
        pos = m.end()
    if not tokens:
        raise UsageError(f"{what} is empty; expected {expected}")

    def value(i: int) -> tuple[float | list, int]:
        tok = tokens[i] if i < len(tokens) else None
        if tok == "[":
            items: list = []
            i += 1
            while i < len(tokens) and tokens[i] != "]":
                item, i = value(i)
                items.append(item)
                if i < len(tokens) and tokens[i] == ",":
                    i += 1
                elif i < len(tokens) and tokens[i] != "]":
                    raise UsageError(f"{what}: expected ',' or ']' before {tokens[i]!r}")
            if i >= len(tokens):
                raise UsageError(f"{what}: unbalanced brackets, a ']' is missing")
            return items, i + 1
        if tok is None or tok in "],":
            raise UsageError(f"{what}: expected a number or '[' but found {tok or 'the end'!r}")
        try:
            number = float(tok)
        except ValueError:
            raise UsageError(f"{what}: non-numeric value {tok!r}; expected {expected}") from None
        if not math.isfinite(number):
            raise UsageError(f"{what}: {tok!r} is not a finite number")
        return number, i + 1

    try:
        result, end = value(0)
    except RecursionError:
        raise UsageError(f"{what}: nested too deeply") from None
    if end != len(tokens):
        raise UsageError(f"{what}: unexpected {tokens[end]!r} after the end of the matrix")
    return result


def _shape_of(value: float | list, what: str, path: str = "") -> tuple[int, ...]:
    """The rectangular shape of a nested list, or a clear error naming the ragged row."""
    if not isinstance(value, list):
        return ()
    if not value:
        raise UsageError(f"{what}: empty list {path or 'at the top'}")
    shapes = [_shape_of(v, what, f"{path}[{i}]") for i, v in enumerate(value)]

    def describe(sh: tuple[int, ...]) -> str:
        return "a single number" if not sh else f"{sh[0]} values" if len(sh) == 1 else f"shape {list(sh)}"

    for i, sh in enumerate(shapes):
        if sh != shapes[0]:
            raise UsageError(
                f"{what}: ragged rows: {path}[{i}] has {describe(sh)} but {path}[0] has {describe(shapes[0])}"
            )
    return (len(value), *shapes[0])


def literal_tensor(text: str, what: str) -> Tensor:
    """A matrix literal as float64: Python's own parsing of each number, so ``0.1`` stays 0.1
    and ``1e300`` or ``1e-300`` keep their value."""
    value = parse_literal(text, what)
    _shape_of(value, what)
    return torch.tensor(value, dtype=torch.float64)


def load_matrix(text: str, what: str) -> Tensor:
    """A tensor from a matrix literal (float64) or a ``.npy``/``.pt``/``.csv`` file (a floating
    dtype is kept, integers become float64)."""
    stripped = text.strip()
    if stripped.startswith("[") or is_number(stripped):
        t = literal_tensor(stripped, what)
    elif stripped.lower().endswith(FILE_SUFFIXES):
        t = _load_file(Path(stripped), what)
    else:
        raise UsageError(f"{what} must be {MATRIX_HELP}, got {text!r}")
    if t.dim() == 0:
        raise UsageError(f"{what} must have at least one dimension (a row of features), got a scalar")
    if t.numel() == 0:
        raise UsageError(f"{what} is empty (shape {tuple(t.shape)})")
    if t.dtype not in FLOAT_DTYPES and (t.is_floating_point() or t.is_complex() or t.is_quantized):
        raise UsageError(
            f"{what} is {str(t.dtype).removeprefix('torch.')}; expected real numbers "
            f"({', '.join(str(d).removeprefix('torch.') for d in FLOAT_DTYPES)} or integers)"
        )
    if not t.is_floating_point():
        t = t.to(torch.float64)
    if not bool(torch.isfinite(t).all()):
        raise UsageError(f"{what} contains NaN or infinite values")
    return t


def _load_file(path: Path, what: str) -> Tensor:
    if not path.is_file():
        raise UsageError(f"{what}: file {str(path)!r} not found")
    suffix = path.suffix.lower()
    try:
        if suffix in (".npy", ".csv"):
            return torch.from_numpy(read_numbers(path))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "sparse/nested tensors are in beta": rejected below anyway
            t = torch.load(path, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError:  # (torch's message advises loading it as pickled code: never here)
        raise UsageError(
            f"{what}: {str(path)!r} holds more than tensors (pickled Python objects, which are never "
            "loaded here); save one tensor: torch.save(t, path)"
        ) from None
    except Exception as err:  # any reader's complaint becomes one line
        raise UsageError(f"{what}: cannot read {str(path)!r}: {str(err).splitlines()[0]}") from None
    if not isinstance(t, Tensor):
        raise UsageError(f"{what}: {str(path)!r} holds a {type(t).__name__}, expected one tensor")
    if t.is_meta:
        raise UsageError(f"{what}: {str(path)!r} holds a tensor on the meta device, which has no values")
    if t.is_nested or t.layout != torch.strided:
        kind = "nested" if t.is_nested else str(t.layout).removeprefix("torch.")
        hint = "" if t.is_nested else " (save t.to_dense())"
        raise UsageError(f"{what}: {str(path)!r} holds a {kind} tensor; expected a dense one{hint}")
    return t.detach()


def parse_shape(text: str) -> tuple[int, ...]:
    """``"1,3"`` (or ``"[1,3]"``, ``"3"``) -> ``(1, 3)``."""
    parts = [p for p in re.split(r"[\s,x×]+", text.strip().strip("[]()")) if p]
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or min(shape) <= 0:
        raise UsageError(f"--normalized-shape must be positive ints like 3 or 1,3; got {text!r}")
    return shape


def parse_param(text: str | None, shape: tuple[int, ...], what: str, default: float) -> Tensor:
    """``--gamma``/``--beta``: a scalar (every feature) or one value per feature, as float64."""
    n = math.prod(shape)
    if text is None:
        return torch.full(shape, float(default), dtype=torch.float64)
    stripped = text.strip()
    if not stripped.startswith("[") and "," in stripped:
        stripped = f"[{stripped}]"
    value = parse_literal(stripped, what, PARAM_HELP)
    _shape_of(value, what)
    t = torch.tensor(value, dtype=torch.float64)
    if t.dim() == 0:
        return t.expand(shape).clone()
    if t.numel() != n:
        raise UsageError(f"{what} needs 1 or {n} values (normalized shape {list(shape)}), got {t.numel()}")
    return t.reshape(shape)


def check_precision(precision: int) -> None:
    if precision < 0 or precision > 12:
        raise UsageError(f"--precision must be between 0 and 12, got {precision}")


@dataclass
class Inputs:
    """The options of ``addnorm explain``, read and checked: tensors in float64 (``x`` keeps a
    file's floating dtype), ``eps`` resolved to its default."""

    x: Tensor
    normalized_shape: tuple[int, ...]
    rms: bool
    eps: float
    gamma: Tensor
    beta: Tensor | None
    residual: Tensor | None
    grad: Tensor | None


def read_inputs(args) -> Inputs:
    """The options of ``addnorm explain`` (all but ``--textbook``), or the first one that is
    wrong or does not fit with the others, as a :class:`UsageError`."""
    x = torch.tensor(WORKED_INPUT, dtype=torch.float64) if args.input is None else load_matrix(args.input, "--input")
    normalized_shape = parse_shape(args.normalized_shape) if args.normalized_shape else (x.shape[-1],)
    k = len(normalized_shape)
    if x.dim() < k or tuple(x.shape[-k:]) != normalized_shape:
        raise UsageError(
            f"--normalized-shape {','.join(map(str, normalized_shape))} must equal the trailing "
            f"dims of the input, whose shape is {list(x.shape)}; e.g. {x.shape[-1]}"
        )
    rms = args.norm == "rms"
    if rms and args.beta is not None:
        raise UsageError("--beta: RMSNorm has no bias (β); drop --beta or use --norm layer")
    if args.compare:
        given = ["--norm rms"] * rms + ["--residual"] * (args.residual is not None) + ["--backward"] * args.backward
        if given:
            raise UsageError(f"--compare batchnorm compares plain LayerNorm; drop {' and '.join(given)}")
        if x.numel() // math.prod(normalized_shape) < 2:
            raise UsageError(
                "--compare batchnorm needs at least 2 rows: BatchNorm normalizes each feature over the "
                f"rows of the batch; an input of shape {list(x.shape)} normalized over its trailing "
                f"{list(normalized_shape)} is a single row"
            )
    if args.dropout and args.residual is None:
        raise UsageError("--dropout drops the sublayer output x before it is added to --residual: add --residual")
    if not 0 <= args.dropout < 1:
        raise UsageError(f"--dropout must be a probability in [0, 1), got {args.dropout}")
    if args.grad is not None and not args.backward:
        raise UsageError("--grad is the upstream gradient of --backward; add --backward")
    check_precision(args.precision)
    eps = args.eps
    if eps is None:
        eps = torch.finfo(reference.stats_dtype(x.dtype)).eps if rms else 1e-5
    if not math.isfinite(eps) or eps < 0:
        raise UsageError(f"--eps must be a non-negative number, got {eps}")
    if args.compare and eps == 0:
        raise UsageError("--eps 0 with --compare batchnorm: torch's batch_norm needs eps > 0")
    if args.seed is not None:
        if not args.dropout:
            raise UsageError("--seed is the seed of --dropout's mask: add --dropout")
        check_seed(args.seed, "--seed")
    gamma = parse_param(args.gamma, normalized_shape, "--gamma", 1.0)
    beta = None if rms else parse_param(args.beta, normalized_shape, "--beta", 0.0)
    residual = grad = None
    if args.residual is not None:
        residual = load_matrix(args.residual, "--residual")
        if residual.shape != x.shape:
            raise UsageError(f"--residual must have the input's shape {list(x.shape)}, got {list(residual.shape)}")
    if args.grad is not None:
        grad = load_matrix(args.grad, "--grad")
        if grad.shape != x.shape:
            raise UsageError(f"--grad must have the input's shape {list(x.shape)}, got {list(grad.shape)}")
    return Inputs(x, normalized_shape, rms, eps, gamma, beta, residual, grad)

"""What an experiment is configured by: the arms (where the norm sits, the learning rate, the
warmup) and :class:`Config`, everything a run depends on (the ``config`` of results.json)."""

from __future__ import annotations

import dataclasses


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

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> Config:
        """The config a results.json holds: a key it lacks takes its default, a key that
        :class:`Config` does not have is a TypeError."""
        fields = dict(doc)
        if "betas" in fields:
            fields["betas"] = tuple(fields["betas"])  # a JSON list; a tuple, as Config() holds it
        return cls(**fields)

"""What :func:`addnorm.patch` did, module by module and add by add."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Add:
    """One residual add of one block: ``norm`` is the norm it now runs inside (a module name), or
    ``None`` with ``why`` saying why it stays a plain add."""

    block: str
    cls: str
    add: str  # the sublayer whose output it adds ("self_attn", "mlp", "attention+mlp", ...)
    norm: str | None
    why: str = ""

    @property
    def fused(self) -> bool:
        return self.norm is not None


@dataclass
class PatchReport:
    """What :func:`patch` did: ``replaced`` (module name, original class, style), ``fused`` (blocks
    whose forward now runs their adds inside the norms), ``adds`` (every add of the blocks of
    ``FAMILIES``, fused or not and why: a block none of whose adds is fused keeps its own forward),
    ``skipped`` (name, class, why: norms and blocks left alone) and ``already`` (the modules an
    earlier call patched, left as they are)."""

    replaced: list[tuple[str, str, str]] = field(default_factory=list)
    fused: list[str] = field(default_factory=list)
    adds: list[Add] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    already: list[str] = field(default_factory=list)

    @property
    def fused_adds(self) -> list[Add]:
        return [a for a in self.adds if a.fused]

    def by_class(self) -> dict[str, dict[str, Counter]]:
        """Per block class, per add: how many were fused (key ``"fused"``) or not, by reason."""
        table: dict[str, dict[str, Counter]] = {}
        for a in self.adds:
            table.setdefault(a.cls, {}).setdefault(a.add, Counter())["fused" if a.fused else a.why] += 1
        return table

    def __str__(self) -> str:
        lines = [
            f"replaced {len(self.replaced)} norm(s), fused {len(self.fused_adds)} of "
            f"{len(self.adds)} residual add(s) in {len(self.fused)} block(s)"
        ]
        lines += [f"  {name or '<model>'}: {cls} -> {style}" for name, cls, style in self.replaced]
        for cls, adds in self.by_class().items():
            for add, outcomes in adds.items():
                for outcome, n in outcomes.items():
                    what = "fused" if outcome == "fused" else f"not fused: {outcome}"
                    lines.append(f"  {cls} {add} add x{n}: {what}")
        lines += [f"  skipped {name or '<model>'} ({cls}): {why}" for name, cls, why in self.skipped]
        if self.already:
            lines.append(f"  {len(self.already)} module(s) patched by an earlier call, left as they are")
        return "\n".join(lines)

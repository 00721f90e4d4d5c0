"""The vocabulary of a fused block: a :class:`Family` of :class:`Step` (sublayer, the norm before
it, dropout, ...) says how :mod:`.blocks` runs a block class with each add fused; :mod:`.families`
maps the Hugging Face block classes to theirs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn


class _NoResidual:
    """The residual handed to a sublayer that adds one itself (:attr:`Step.adds`): ``NO_RESIDUAL +
    t`` is ``t``, the very tensor, so that the sublayer returns its own output and the block's fused
    op adds the stream."""

    def __add__(self, other):
        return other

    __radd__ = __add__

    def __repr__(self) -> str:
        return "NO_RESIDUAL"


NO_RESIDUAL = _NoResidual()


@dataclass(frozen=True)
class Step:
    """One sublayer and its add: ``s = s + branch(post(sublayer(norm(s))))``."""

    # a module, or several applied in turn ("fc1 activation_fn fc2": OPT's MLP), a float attribute
    # among them a dropout probability (Whisper's "activation_dropout"); "a+b": the sum of two
    # modules on the same input, in that order (Granite 4's experts and shared MLP); "*name": the
    # output so far times the block argument ``name``, which ``call`` passes (Gemma 4's per-layer input)
    sublayer: str
    # the pre-norm (None: the sublayer reads the stream itself); this, ``sublayer`` and ``post`` may
    # be dotted paths (DBRX's "norm_attn_norm.norm_1")
    norm: str | None = None
    post: str | None = None  # a norm of the sublayer's output before the add (sandwich norms)
    dropout: str | None = None  # an nn.Dropout (module) or a float attribute path ("config.p")
    layer_scale: str | None = None  # a module whose ``lambda1`` (DINOv2) or ``scale`` (Mimi) scales the output
    # an attribute of the block scaling the output: a float (Granite; an item of a list of floats,
    # "conv_residual_weights.1": LASR), or a tensor of one scale per channel (BEiT's and InternVL's
    # ``lambda_1``); or a float itself, a constant of the block's forward (the Conformer's
    # half-step feed-forwards: 0.5)
    multiplier: str | float | None = None
    # an attribute of the block the output is divided by before the add, a float (ESM C's
    # ``scaling_factor``): divided as the block divides, then added by the fused op
    divisor: str | None = None
    # an attribute of the block scaling the stream before the add: a float (MiniMax; LASR's item of a
    # list, "conv_residual_weights.0") or a tensor (Doge)
    residual_scale: str | None = None
    drop_path: str | None = None  # a per-sample drop path module with ``drop_prob``
    first: bool = False  # the sublayer returns a tuple whose first item is its output (GPT-OSS's MoE)
    # a module run on the step's input beside its sublayer, whose output the block's last add adds
    # after that step's own output (Longcat-Flash's shortcut MoE: s + out + shortcut)
    beside: str | None = None
    # with ``first``, after the first step: the tuple's other items join the block's extras, after
    # the first step's (TrOCR's cross-attention weights, returned after its self-attention's)
    extras: bool = False
    flat: bool = False  # the sublayer returns the rows flat, (tokens, hidden) (Llama 4's MoE)
    # after the first step: block argument -> sublayer keyword, passed with the block's **kwargs
    # (Whisper's cross-attention: encoder_hidden_states -> key_value_states)
    call: tuple[tuple[str, str], ...] = ()
    needs: str | None = None  # a block argument without which the step is skipped (cross-attention)
    kwargs: bool = True  # with ``call``: the block's **kwargs go to the sublayer too (not Moonshine's)
    # the sublayer adds a residual it takes as this keyword (BLOOM's attention: ``residual``): it is
    # given :data:`NO_RESIDUAL`, and returns its output alone, which is then added as any other
    adds: str | None = None
    # the sublayer when it is more than modules called in turn: ``run(block, h, s, named)`` of the
    # norm's output ``h``, the stream ``s`` it adds to and the arguments a first step's sublayer
    # takes (``call``'s after it), returning what a sublayer would (Falcon-H1's Mamba and
    # attention side by side, each scaled; Gemma 4's MLP beside its experts routed from ``s``)
    run: Callable[[nn.Module, Tensor, Tensor, dict], Tensor | tuple] | None = None

    def __post_init__(self):
        if self.layer_scale and self.multiplier:  # (the fused op takes one scale per channel)
            raise ValueError("Step: a layer_scale and a multiplier on one step")
        if self.divisor and (self.layer_scale or self.multiplier):  # (which first: the block's order)
            raise ValueError("Step: a divisor with a layer_scale or a multiplier on one step")
        if self.extras and not self.first:
            raise ValueError("Step: extras from a sublayer that returns no tuple (first=False)")


def modules(sublayer: str) -> list[str]:
    """The attribute paths a :attr:`Step.sublayer` names, in order (not its ``*`` block arguments)."""
    return [path for word in sublayer.split() if word[0] != "*" for path in word.split("+")]


@dataclass(frozen=True)
class Family:
    """How to run a block class: its steps, the final norm of the stack it sits in (an attribute
    of the nearest ancestor that has it), and how its first sublayer is called."""

    steps: tuple[Step, ...]
    final: str | tuple[str, ...] | None = None  # the stack's final norm (the first name its holder has)
    rename: tuple[tuple[str, str], ...] = ()  # block argument -> attention argument
    drop: tuple[str, ...] = ()  # block arguments the attention does not take
    fallback: tuple[str, ...] = ()  # arguments which, when given, make the block run its own forward
    # an argument which, when not given (None), makes the block run its own forward (Table
    # Transformer's decoder layers without encoder states: their MLP then reads another norm)
    requires: str | None = None
    extras: bool = False  # the block returns (stream, *the attention's other outputs)
    # with extras, the attention's outputs from this index on (GLM-5's and Mistral Large 4's
    # top-k indices: 2, past the attention weights the block drops)
    extras_from: int = 1
    padded: int = 0  # with extras, at least this many, None for those missing (Bamba's Mamba layers)
    # with extras, only when this block argument is true (Chameleon's ``output_attentions``): else
    # the block returns ``(stream,)``
    extras_if: str | None = None
    kwargs: bool = True  # the block passes its ``**kwargs`` on to the attention
    # parallel blocks: "x1" adds both outputs, each with its dropout (GPT-NeoX: mlp + attn + s);
    # "chain" the same in the stream's order (Cohere: s + attn + mlp); "sum" adds their sum with
    # one dropout (Falcon); the steps' norms may be one module
    parallel: str | None = None
    post_norm: bool = False  # (BERT) the block is ``norm(dropout(sublayer(h)) + input_tensor)``
    norm_after: bool = False  # (BART) each step's norm reads the stream after its add: s = norm(s + out)
    # (Mamba) the first norm reads the stream cast to its weight's dtype, and the add takes the stream
    # in float32 where the block has a ``residual_in_fp32`` that is set (Nemotron-H's has none)
    cast: bool = False
    # the model changes the stream after each block (merged or added tokens or embeddings: MiniCPM's
    # vision tower, EoMT): its last add hands nothing on; "but_last": after each block but the
    # last of its stack, which hands its last add on (YOLOS's mid-layer position embeddings)
    alone: bool | str = False
    clamp16: bool = False  # (Whisper) float16 streams are clamped after the last add: they run the original
    # the attribute of the block's ``cache`` its first sublayer takes (T5Gemma's decoder: the
    # self-attention's part of an EncoderDecoderCache, whose whole the cross-attention takes)
    self_cache: str | None = None
    # a tensor attribute of the block the stream is multiplied by, in place, after the last add
    # (Gemma 4's ``layer_scalar``): that add then hands nothing on
    scale: str | None = None
    # (MiniMax) each step's residual is its norm's output, not the stream the norm read
    normed_residual: bool = False
    # (Llama 3.2 Vision's cross-attention layers) the model skips the block when this block argument
    # is None: the block before hands its last add on only in calls that pass it
    skipped_without: str | None = None
    # (Swin) a module of the stage holding the block's list, run after the list's last block when
    # the stage has one (patch merging): that block's last add then hands nothing on
    then: str | None = None
    # (Conformer) a norm of the block that its last add goes through, whose output the block
    # returns (Parakeet's ``norm_out``): the last add is fused with it and hands nothing on
    out_norm: str | None = None

    @property
    def final_names(self) -> tuple[str, ...]:
        """The names the final norm of the block's stack may have, in the order they are looked for."""
        return (self.final,) if isinstance(self.final, str) else self.final or ()

    @property
    def unfused_same_bits(self) -> bool:
        """Whether the block's own forward, its norms patched, gives the fused forward's bits in
        every dtype: no step scales its output or the stream (a half-precision block multiplies in
        its dtype, the fused op in float32)."""
        return not any(step.layer_scale or step.multiplier or step.residual_scale for step in self.steps)

    @property
    def entry_norms(self) -> tuple[str | None, ...]:
        """The norms the stream entering the block goes through first (both of a parallel block's)."""
        if self.post_norm or self.norm_after:
            return ()
        steps = self.steps[:2] if self.parallel else self.steps[:1]
        return tuple(dict.fromkeys(step.norm for step in steps))

    def __post_init__(self):
        last = self.steps[-1]
        if any(step.beside for step in self.steps) and (
            self.parallel or self.post_norm or self.norm_after or self.scale or last.dropout or last.layer_scale
            or last.multiplier or last.drop_path or last.divisor or last.residual_scale
        ):  # fmt: skip
            raise ValueError("Family: a step's beside output is added at a plain last add of sequential steps")
        if self.out_norm and (self.parallel or self.post_norm or self.norm_after or self.scale):
            raise ValueError(
                "Family: an out_norm ends sequential pre-norm steps (not parallel, post_norm, norm_after, scale)"
            )
        if (self.parallel or self.post_norm) and any(step.divisor for step in self.steps):
            raise ValueError("Family: a step's divisor needs sequential steps (not parallel or post_norm)")

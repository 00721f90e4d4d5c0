"""``addnorm explain``: LayerNorm, RMSNorm or Add & Norm step by step, for learners.

Every intermediate is computed in float64 by :func:`addnorm.reference.forward_steps`
(and :func:`~addnorm.reference.backward_steps` for ``--backward``), the same formulas the
library runs, and is printed with its shape. addnorm's own op (in the input's dtype) and
torch's are then run on the same input, and their difference from the steps is shown.
``--compare batchnorm`` puts BatchNorm beside LayerNorm on the same rows.
``--textbook`` puts the textbook form (:mod:`addnorm.textbook`) beside the exact one on rows
where the textbook breaks, and names the step of the reference that prevents each.

The modules: :mod:`.parse` reads and checks the options, :mod:`.compute` computes the steps,
:mod:`.textbook` the textbook comparison, :mod:`.show` prints tables or JSON, and
:mod:`.command` is the command itself.
"""

from .command import register, run
from .textbook import TEXTBOOK_ROWS, TextbookRow, textbook_comparison

__all__ = ["TEXTBOOK_ROWS", "TextbookRow", "register", "run", "textbook_comparison"]

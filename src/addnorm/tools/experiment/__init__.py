"""``addnorm train``: what the norm and its placement do to training, on the square-corners task.

Each *arm* trains the same deep encoder-decoder (:class:`addnorm.transformer.Seq2SeqTransformer`)
with one norm placement and learning-rate schedule, from several seeds, and is read against the
task's noise floor. The modules:

- :mod:`.data`: the noisy square-corners sequences (or ``--data``) and their noise floor;
- :mod:`.config`: the arms and :class:`~.config.Config`, everything a run depends on;
- :mod:`.training`: one run, the schedules, the gradient norms at initialisation, and
  :func:`~.training.run_experiment`, every arm x seed side by side in worker processes;
- :mod:`.schema`: results.json as dataclasses (:class:`~.schema.Results`), and the measures
  stored in it;
- :mod:`.report`: the results table, the readings judged seed by seed, ``report.md``;
- :mod:`.plots`: ``curves.png``, ``grad_norms.png``, ``depth.png`` from results.json alone;
- :mod:`.command`: the ``addnorm train`` command.
"""

from .command import register, run
from .plots import plot_results
from .schema import Results

__all__ = ["Results", "plot_results", "register", "run"]

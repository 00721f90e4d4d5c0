"""The tools around the library: the ``addnorm`` command line and one module per command
(``info``, ``explain``, ``experiment``, ``plot``, ``bench``). They use the library through its
modules; ``import addnorm`` never loads them."""

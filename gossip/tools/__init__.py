"""The tools built on the library: what people run beside training, never imported by it.

- :mod:`gossip.tools.analysis`: run directories and sweeps as pandas tables, and their
  plots (the ``analysis`` extra: pandas, matplotlib);
- :mod:`gossip.tools.crossover`: will compression pay on my link?
  (``python -m gossip.tools.crossover``);
- :mod:`gossip.tools.leaderboard`: the benchmark's measured answer for a link;
- :mod:`gossip.tools.units`: the one reader of link rates and latencies, as tc reads them.

``import gossip.tools`` loads none of them; the library never imports this package.
"""

__all__: list[str] = []

"""Benchmarks of apex against torch (and outside peers), run by ``python bench/run.py`` / ``nox -s bench``.

Modules: ``registry`` (Entry, Registry, how to add entries), ``shapes`` (the standard regimes), ``timing``
(interleaved rounds, roofline), ``report`` (JSON / Markdown / PNG), ``env`` (machine facts, RSS),
``entries_*`` (the comparisons; each defines ``register(reg)``).
"""

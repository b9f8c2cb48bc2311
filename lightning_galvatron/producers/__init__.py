"""Profile producers that measure nothing: they write a :class:`~lightning_galvatron.profiles.Profile` from
other sources, for the search to read.

* :mod:`.analytic`: a model's shape (a Hugging Face config, or a module on the meta device) scaled from a
  measured reference profile -- ``lightning-galvatron estimate`` and ``dry-run``;
* :mod:`.galvatron_import`: the reference system's (Hetu-Galvatron's) profile files --
  ``lightning-galvatron import-galvatron``.

The measuring producer is :mod:`lightning_galvatron.profiler` (torch, on the machine itself). Like the search,
this package is torch-free.
"""

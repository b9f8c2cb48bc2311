"""Per-call state that models hand to their blocks: key/value caches; where a call's hidden states are.

Hugging Face models create a KV cache object for every forward call at their default config
(``use_cache=True``, in training too) and pass it to each block (``past_key_values=``), which
appends its keys and values to it. The object belongs to one call of the model: a block run a
second time with it -- re-run by the profiler at other batch sizes, or recomputed in backward --
would append again and attend over twice the keys. Where blocks are re-run, the cache is replaced
by ``None``: on a cache that was empty for this block (a training step's), the block computes the
same thing without one.
"""

from __future__ import annotations

# Defined with the runtime's block conventions (the runtime never imports model/); kept here by name.
from lightning_galvatron.runtime.structure import hidden_states_of, is_kv_cache, without_kv_caches

__all__ = ["hidden_states_of", "is_kv_cache", "without_kv_caches"]

"""Built-in tensor-parallel plans of known model families, one module per family.

Each module registers its block classes by qualified name with
:func:`~lightning_galvatron.model.tensor_parallel_plans.register_tensor_parallel_plan` (the function
users call for their own blocks), so importing this package imports neither ``transformers`` nor
``litgpt``. BERT-style encoder layers are recognised by structure (:mod:`.bert`), DistilBERT's by class.
"""

from lightning_galvatron.model.families import (  # noqa: F401 - each module registers its plans
    bert,
    falcon_bloom,
    gpt2,
    gpt_bigcode,
    gpt_neo,
    gpt_neox,
    gptj,
    litgpt,
    llama,
    moe,
    mpt_codegen,
    opt_bart,
    t5,
    torch_layers,
    vit,
)

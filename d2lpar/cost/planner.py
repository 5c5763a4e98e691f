"""The planner: which layout trains a model fastest on a cluster, and what any layout costs.

It is four small ideas, each in its module, gathered here under the names notebooks and scripts use:

* ``transformer``: the model (``Model``: sizes, grouped-query attention, SwiGLU, tied embeddings,
  FlashAttention) and its parameters, FLOPs and saved activations per layer;
* ``cluster`` and ``presets``: the GPUs (``Cluster``), their links and the rank order that decides
  which link each group uses; the models and clusters of published runs (``MODELS``,
  ``CLUSTERS``);
* ``layout`` and ``pricing``: a layout (``Layout``: dp x tp x pp x cp, ZeRO, micro-batches,
  checkpointing, sequence parallelism, schedule) and its price, ``memory`` per GPU by category and
  ``step_time`` by part, every term a formula the course teaches (``pricing``'s docstring names
  each and its source);
* ``plan_search``: every layout priced, the fastest that fit (``plan``), why the others lost;
  ``plan_cli``: ``python -m d2lpar plan``.

MFU = ``model_flops_per_step`` / (step time x GPUs x peak FLOP/s), the model's FLOPs counted as
PaLM counts them (6 N per token without the input embedding, plus attention's 12 L d s).
"""

from __future__ import annotations

from d2lpar.cost.cluster import Cluster, check_cluster, usable_bytes
from d2lpar.cost.layout import Layout, check_layout, parse_layout
from d2lpar.cost.plan_cli import main
from d2lpar.cost.plan_search import (MAX_MICRO, MIN_CP_TOKENS, _bytes, _cluster, _stage_parameters,
                                     by_degrees, describe, figures, layouts, plan, search,
                                     why_lost)
from d2lpar.cost.presets import CLUSTERS, MODELS
from d2lpar.cost.pricing import (GB, Plan, evaluate, hardware_flops_per_step, memory,
                                 model_flops_per_step, step_time)
from d2lpar.cost.transformer import PRECISIONS, Model, check_model

__all__ = ["Model", "Cluster", "Layout", "Plan", "memory", "step_time", "evaluate", "plan",
           "describe", "layouts", "model_flops_per_step", "check_cluster", "by_degrees", "why_lost",
           "PRECISIONS", "check_layout", "MODELS", "CLUSTERS", "main", "MAX_MICRO", "GB",
           "MIN_CP_TOKENS",
           "search", "figures", "check_model", "parse_layout", "usable_bytes",
           "hardware_flops_per_step", "_bytes", "_cluster", "_stage_parameters"]

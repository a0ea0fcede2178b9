"""Uptraining: continue pretraining a converted model, from one CPU to many GPUs, driven by YAML recipes.

Usage::

    from gqakit.uptrain import load_recipe, uptrain

    result = uptrain(load_recipe("recipes/smollm2-135m-mqa.yaml", ["budget.steps=20"]))
"""

from gqakit.uptrain.api import check_inputs, uptrain
from gqakit.uptrain.loop import UptrainLoop, UptrainResult, validation_perplexity
from gqakit.uptrain.objectives import Objective, distill_kl, lm_loss
from gqakit.uptrain.recipe import Recipe, RecipeError, load_recipe, recipe_from_dict
from gqakit.uptrain.schedule import Budget, lr_multiplier, resolve_budget

__all__ = [
    "Budget",
    "Objective",
    "Recipe",
    "RecipeError",
    "UptrainLoop",
    "UptrainResult",
    "check_inputs",
    "distill_kl",
    "load_recipe",
    "lm_loss",
    "lr_multiplier",
    "recipe_from_dict",
    "resolve_budget",
    "uptrain",
    "validation_perplexity",
]

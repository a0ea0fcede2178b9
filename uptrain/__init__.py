"""Uptraining: continue pretraining a converted model, from one CPU to many GPUs, driven by YAML recipes.

Usage::

    from gqakit.uptrain import load_recipe, uptrain

    result = uptrain(load_recipe("recipes/smollm2-135m-mqa.yaml", ["budget.steps=20"]))
"""

from gqakit.uptrain.checkpoints import read_history
from gqakit.uptrain.preflight import resolve_precision
from gqakit.uptrain.recipe import RecipeError, load_recipe, recipe_from_dict
from gqakit.uptrain.recipe_schema import Recipe
from gqakit.uptrain.train import UptrainResult, uptrain, validation_perplexity

__all__ = [
    "Recipe",
    "RecipeError",
    "UptrainResult",
    "load_recipe",
    "read_history",
    "recipe_from_dict",
    "resolve_precision",
    "uptrain",
    "validation_perplexity",
]

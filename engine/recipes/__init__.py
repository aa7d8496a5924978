"""Recipes: a federated job written in Python, exported as an ordinary job folder and run in the simulator.

Example:
    >>> from engine.recipes import FedAvgRecipe
    >>> recipe = FedAvgRecipe(model="net.Net", model_args={"hidden": 64}, train_script="train.py",
    ...                       train_args="--epochs 1", custom_files=["net.py", "digits.py", "data"],
    ...                       num_rounds=2, num_clients=2)
    >>> recipe.add_server_config({"streaming_per_request_timeout": 300})
    >>> recipe.export("jobs/my-fedavg")     # a job folder that `flengine validate` accepts
    >>> result = recipe.run()               # or recipe.execute(SimEnv(num_clients=2))
    >>> result.state                        # JobState.FINISHED_COMPLETED

The job folder is the source of truth: a recipe only writes it.
"""

from engine.recipes.fedavg import FedAvgRecipe, FedOptRecipe
from engine.recipes.recipe import Recipe, SimEnv
from engine.recipes.swarm import CrossSiteEvalRecipe, SwarmRecipe

__all__ = ["CrossSiteEvalRecipe", "FedAvgRecipe", "FedOptRecipe", "Recipe", "SimEnv", "SwarmRecipe"]

"""A recipe: one YAML file that describes a whole run, every stage included.

Stage commands read the sections they need; `pyvision run` reads all of them. The shipped recipes
live in ``pipelines/recipes/`` and are validated by ``tests/pipelines/config/test_config.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, model_validator

from pipelines.config.agent import AgentConfig
from pipelines.config.base import Section
from pipelines.config.data import DataConfig
from pipelines.config.eval import EvalConfig
from pipelines.config.loader import load_config
from pipelines.config.model import ModelConfig
from pipelines.config.report import ReportConfig
from pipelines.config.reward import RewardConfig
from pipelines.config.rl import RLConfig
from pipelines.config.sandbox import SandboxConfig
from pipelines.config.sft import SFTConfig
from pipelines.errors import ConfigError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"
DEFAULT_RECIPE = RECIPES_DIR / "tiny-cpu.yaml"


class Recipe(Section):
    """Everything a run needs, stage by stage."""

    name: str = Field("unnamed", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    """Short name, used in run ids and reports."""

    description: str = ""
    """What the recipe runs, on what hardware, and how long it takes."""

    seed: int = Field(0, ge=0, le=2**31 - 1)
    """Global seed: data generation, sampling, training."""

    runs_dir: str = "runs"
    """Directory holding `<run-id>/<stage>/` run directories."""

    model: ModelConfig = ModelConfig()
    """The base model."""

    data: DataConfig = DataConfig()
    """Data stage."""

    agent: AgentConfig = AgentConfig()
    """Agent loop limits and sampling."""

    sandbox: SandboxConfig = SandboxConfig()
    """Sandbox limits."""

    sft: SFTConfig = SFTConfig()
    """SFT stage (LLaMA-Factory)."""

    rl: RLConfig = RLConfig()
    """RL stage (local engine or verl)."""

    reward: RewardConfig = RewardConfig()
    """Reward terms and judge."""

    eval: EvalConfig = EvalConfig()
    """Evaluation stage."""

    report: ReportConfig = ReportConfig()
    """Report stage."""

    @model_validator(mode="before")
    @classmethod
    def _one_seed(cls, data: Any) -> Any:
        """The SFT trainer follows the global seed unless `sft.seed` is set, so `--set seed=N`
        (and `make demo SEED=N`) changes every stage."""
        if isinstance(data, dict) and isinstance(data.get("sft", {}), dict) \
                and "seed" not in data.get("sft", {}):
            data = {**data, "sft": {**data.get("sft", {}), "seed": data.get("seed", 0)}}
        return data


def shipped_recipes() -> list[str]:
    """The names of the recipes that ship in ``pipelines/recipes/``."""
    return sorted(f.stem for f in RECIPES_DIR.glob("*.yaml"))


def recipe_path(path: str | Path) -> Path:
    """``path`` itself where it exists, else a shipped recipe named so (``tiny-cpu``,
    ``pyvision-image-7b.yaml``: usable from any folder); else a ConfigError listing those."""
    p = Path(path)
    if p.exists():
        return p
    shipped = RECIPES_DIR / f"{p.name.removesuffix('.yaml')}.yaml"
    if len(p.parts) == 1 and shipped.is_file():
        return shipped
    raise ConfigError(f"recipe not found: {p}",
                      hint=f"pass a recipe YAML file or a shipped recipe's name "
                           f"({', '.join(shipped_recipes())})")


def load_recipe(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Recipe:
    """Load a recipe file or a shipped recipe's name (default: the embedded tiny-cpu recipe) with
    `--set` overrides."""
    return load_config(Recipe, recipe_path(path) if path is not None else DEFAULT_RECIPE,
                       overrides)

"""lmms-eval entry point: ``lmms-eval --model pyvision_agent ...`` runs our agent loop.

Registered in ``pyproject.toml`` under ``[project.entry-points."lmms_eval.models"]``. This module
only declares the manifest (lmms-eval loads every plugin's entry point at start-up, so it must stay
light); the model class is in :mod:`pipelines.eval.lmms_model`.
"""

from __future__ import annotations

from lmms_eval.models.registry_v2 import ModelManifest

MANIFEST = ModelManifest(model_id="pyvision_agent",
                         simple_class_path="pipelines.eval.lmms_model.PyVisionAgent",
                         aliases=("pyvision",))

"""The code location: ``dagster dev`` (workspace.yaml / ``[tool.dagster]``) and
``dagster asset materialize -m assets.definitions`` load ``defs`` from here.

The experiment is chosen when this module loads: ``$LM_PIPELINE_EXPERIMENT`` (default
``configs/default.yaml``) plus ``$LM_PIPELINE_OVERRIDES``; see :mod:`assets.experiment`.
"""

from assets.pipeline import build_definitions

defs = build_definitions()

"""The code location: ``dagster dev`` (workspace.yaml / ``[tool.dagster]``) and
``dagster asset materialize -m assets.definitions`` load ``defs`` from here.

Every experiment file of ``configs/experiments/`` (or ``$LM_PIPELINE_EXPERIMENTS_DIR``; one file
only: ``$LM_PIPELINE_EXPERIMENT``), with ``$LM_PIPELINE_OVERRIDES``, read each time the code
location loads: add a file and reload to see it. See :mod:`assets.experiment` and
:mod:`assets.deployment`.
"""

from assets import console
from assets.pipeline import build_definitions

console.install()  # a step failing on purpose prints its one-line reason, not a stack trace
defs = build_definitions()

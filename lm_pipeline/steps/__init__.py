"""The pipeline's stages as content-addressed steps (no Dagster here).

raw_shards -> tokenizer -> token_cache -> train_ckpt -> eval_report, hf_export

Each stage's fingerprint is a hash of (its semantic config, its code version, its inputs'
fingerprints); its output lives at ``<store root>/<stage>/<fingerprint>/`` and is complete when
its manifest exists. A complete stage is a cache hit: it does no work. The Dagster assets and
the command line both call these functions.

=========================  ==================================================================
``steps.stage``            :class:`Stage` (a stage's one declaration), what a builder receives
``steps.stages``           the stage table: :data:`STAGES` (one declaration each)
``steps.pipeline``         :class:`Pipeline`: addresses and config versions (once each), running
``steps.artifact``         one artifact built at its address: cache hit, lock, manifest last
``steps.builders``         what each stage of the table does (one build function per stage)
``steps.shown``            what each stage of the table shows (plain data: ``steps.display``)
``steps.comparison``       every experiment's final evaluation side by side
``steps.fanout``           the token cache over shard groups: groups, parts, one commit
``steps.plan``             hit or miss per stage, and what changed
``steps.checkpoints``      the complete checkpoints of a run directory
``steps.result``           :class:`StageResult`, :class:`Address`
=========================  ==================================================================
"""

from lm_pipeline.steps.checkpoints import complete_checkpoints
from lm_pipeline.steps.fanout import CacheGroup
from lm_pipeline.steps.pipeline import Pipeline
from lm_pipeline.steps.plan import diff_fields
from lm_pipeline.steps.result import Address, StageResult
from lm_pipeline.steps.stages import STAGE_NAMES, STAGES, Stage, stage_table

__all__ = ["STAGES", "STAGE_NAMES", "Address", "CacheGroup", "Pipeline", "Stage", "StageResult",
           "complete_checkpoints", "diff_fields", "stage_table"]

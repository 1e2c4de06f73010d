"""Block drafters: one backbone (`backbone.DraftModel`, the interface the step calls), DFlash and DSpark
as its two families, and their checkpoint formats behind one loader (`formats.load_drafter`)."""

from blockspec.drafters.backbone import DraftModel
from blockspec.drafters.config import DrafterConfig, DSparkHeads, build_target_layer_ids
from blockspec.drafters.dflash import DFlashDraft
from blockspec.drafters.dspark import DSparkDraft
from blockspec.drafters.formats import (
    load_dflash,
    load_drafter,
    load_dspark,
    restore_target_copies,
    save_dflash,
    save_drafter,
    save_dspark,
    strip_target_copies,
)

__all__ = ["DraftModel", "DrafterConfig", "DSparkHeads", "build_target_layer_ids", "DFlashDraft", "DSparkDraft",
           "load_drafter", "load_dflash", "load_dspark", "save_drafter", "save_dflash", "save_dspark",
           "strip_target_copies", "restore_target_copies"]

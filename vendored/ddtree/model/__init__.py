from .dflash import DFlashDraftModel
from .utils import build_target_layer_ids, extract_context_feature, load_and_process_dataset, sample

__all__ = [
    "DFlashDraftModel",
    "build_target_layer_ids",
    "extract_context_feature",
    "load_and_process_dataset",
    "sample",
]

"""Extras beyond amp: combined (flat-buffer) tensors, as in the Ascend patch."""

from apex.contrib.combine_tensors import (
    ALIGN_ELEMENTS,
    change_data_ptr,
    combine_npu,
    combine_tensors,
    compact_state_dict,
    get_part_combined_tensor,
    is_combined_tensor_valid,
    npu_combine_tensors,
    plan_layout,
    register_compact_state_dict_hook,
)

__all__ = [
    "ALIGN_ELEMENTS",
    "change_data_ptr",
    "combine_npu",
    "combine_tensors",
    "compact_state_dict",
    "get_part_combined_tensor",
    "is_combined_tensor_valid",
    "npu_combine_tensors",
    "plan_layout",
    "register_compact_state_dict_hook",
]

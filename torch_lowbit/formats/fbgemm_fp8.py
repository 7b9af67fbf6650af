"""fbgemm_fp8 (transformers' ``FbgemmFp8Config``): per-channel ``weight_scale [N, 1]``, dynamic per-row
activations bounded by ``activation_scale_ub`` (``input_scale_ub`` per module); ``modules_to_not_convert``."""
from __future__ import annotations

from ..granularity import PerChannel
from .registry import CheckpointFormat, Example, config_field, name_list


class FbgemmFp8(CheckpointFormat):
    name = "fbgemm_fp8"
    quant_methods = ("fbgemm_fp8",)

    def parse(self, qc, side, where):
        ub = config_field(qc, "activation_scale_ub", (int, float), where.qc)
        return self.make(ignore=name_list(qc, "modules_to_not_convert", where.qc), extra_keys=("input_scale_ub",),
                         details={"activation_scale_ub": ub})

    def examples(self):
        return {"fbgemm": Example(PerChannel(), "N1", extra=("input_scale_ub",))}

    def example_config(self, example, keep):
        return {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0, "modules_to_not_convert": list(keep)}, None


FORMAT = FbgemmFp8()

"""hf-zero estimate: the paper's formulas (formulas), exact per-rank bytes from hf_zero's own plan (plan), the
activation estimate (activations) and the command line (cli)."""
from .activations import activation_bytes, activation_report, activation_shape
from .formulas import (Recipe, comm_elements_per_step, hierarchical_comm_elements, hierarchical_state_bytes,
                       inter_bytes_per_host, model_state_bytes, paper_table, recipe, zeropp_bytes_per_step,
                       zeropp_collectives)
from .plan import estimate_plan, model_states_per_device, plan_bytes

__all__ = ["Recipe", "activation_bytes", "activation_report", "activation_shape", "comm_elements_per_step",
           "estimate_plan", "hierarchical_comm_elements", "hierarchical_state_bytes", "inter_bytes_per_host",
           "model_state_bytes", "model_states_per_device", "paper_table", "plan_bytes", "recipe",
           "zeropp_bytes_per_step", "zeropp_collectives"]

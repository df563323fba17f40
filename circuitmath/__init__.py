"""circuitmath: machine-checked linear algebra behind transformer interpretability.

Each identity is stated once and seen three ways: a sympy proof for symbolic dimensions, a
numeric check on weights, and the weight transform it licenses.
"""

from ._config import Config as Config
from ._errors import (
    AlreadyAppliedError as AlreadyAppliedError,
    ArgumentTypeError as ArgumentTypeError,
    CircuitMathError as CircuitMathError,
    ConfigError as ConfigError,
    InputError as InputError,
    OverflowedError as OverflowedError,
    PreconditionError as PreconditionError,
    StateDictError as StateDictError,
    UnknownNameError as UnknownNameError,
)
from ._processing import (
    center_reading_weights as center_reading_weights,
    center_unembed as center_unembed,
    center_writing_weights as center_writing_weights,
    fold_value_biases as fold_value_biases,
    fold_embedding_scale as fold_embedding_scale,
    fold_layer_norm as fold_layer_norm,
    fold_logit_scale as fold_logit_scale,
    hadamard as hadamard,
    fold_rms_norm as fold_rms_norm,
    layer_norm_to_rms_norm as layer_norm_to_rms_norm,
    migrate_norm_scales as migrate_norm_scales,
    orthogonal_fixing_ones as orthogonal_fixing_ones,
    permute_heads as permute_heads,
    permute_experts as permute_experts,
    permute_neurons as permute_neurons,
    rescale_residual_stream as rescale_residual_stream,
    process_weights as process_weights,
    random_orthogonal as random_orthogonal,
    refactor_factored_attn_matrices as refactor_factored_attn_matrices,
    recover_expert_permutation as recover_expert_permutation,
    recover_head_permutation as recover_head_permutation,
    recover_neuron_permutation as recover_neuron_permutation,
    recover_head_rotations as recover_head_rotations,
    recover_norm_scales as recover_norm_scales,
    recover_neuron_scales as recover_neuron_scales,
    rotate_heads as rotate_heads,
    scale_neurons as scale_neurons,
    recover_rotation as recover_rotation,
    remove_key_biases as remove_key_biases,
    rotate_residual_stream as rotate_residual_stream,
    rotation_mismatches as rotation_mismatches,
    shortformer_to_tables as shortformer_to_tables,
)
from ._proof import Proof as Proof, ProofReport as ProofReport
from ._reference import forward as forward, log_probs as log_probs
from ._identities import get_identity as get_identity, identities as identities
from ._registry import Identity as Identity
from ._state import expected_shapes as expected_shapes, validate_state_dict as validate_state_dict
from ._weights import random_state_dict as random_state_dict
from .testing import assert_equivalent as assert_equivalent

__version__ = "0.1.0"

__all__ = [
    "AlreadyAppliedError",
    "ArgumentTypeError",
    "CircuitMathError",
    "Config",
    "ConfigError",
    "Identity",
    "InputError",
    "OverflowedError",
    "PreconditionError",
    "Proof",
    "ProofReport",
    "StateDictError",
    "UnknownNameError",
    "assert_equivalent",
    "center_reading_weights",
    "center_unembed",
    "center_writing_weights",
    "expected_shapes",
    "fold_embedding_scale",
    "fold_layer_norm",
    "fold_logit_scale",
    "fold_rms_norm",
    "fold_value_biases",
    "forward",
    "get_identity",
    "hadamard",
    "identities",
    "layer_norm_to_rms_norm",
    "log_probs",
    "migrate_norm_scales",
    "orthogonal_fixing_ones",
    "permute_heads",
    "permute_experts",
    "permute_neurons",
    "process_weights",
    "random_orthogonal",
    "random_state_dict",
    "recover_expert_permutation",
    "recover_head_permutation",
    "recover_neuron_permutation",
    "recover_head_rotations",
    "recover_norm_scales",
    "recover_rotation",
    "refactor_factored_attn_matrices",
    "remove_key_biases",
    "rescale_residual_stream",
    "recover_neuron_scales",
    "rotate_heads",
    "rotate_residual_stream",
    "rotation_mismatches",
    "scale_neurons",
    "shortformer_to_tables",
    "validate_state_dict",
]

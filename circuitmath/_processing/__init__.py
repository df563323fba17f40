"""Pure weight transforms: a state dict and config in, a new state dict and config out.

Every transform validates its input, refuses a model it cannot rewrite exactly (raising
:class:`~circuitmath.PreconditionError` naming the identity and the broken precondition: one of
the :class:`~circuitmath._errors.Precondition` objects its module defines and its identity
registers, raised through ``_common.require``; ``_common.refuse_reapplication`` is the one
already-applied guard), keeps
every dtype, records itself in ``cfg.applied`` and refuses to run twice (except a rotation or a
permutation, which composes with itself into another one, exact too). Inputs are never
mutated; tensors a transform does not change are shared with the input, not copied. One module
per family of identities.
"""

from ._common import readers as readers
from .attention import (
    fold_value_biases as fold_value_biases,
    refactor_factored_attn_matrices as refactor_factored_attn_matrices,
    remove_key_biases as remove_key_biases,
)
from .centering import center_unembed as center_unembed, center_writing_weights as center_writing_weights, writers as writers
from .experts import permute_experts as permute_experts, recover_expert_permutation as recover_expert_permutation
from .layer_norm import center_reading_weights as center_reading_weights, fold_layer_norm as fold_layer_norm
from .norms import (
    fold_rms_norm as fold_rms_norm,
    layer_norm_to_rms_norm as layer_norm_to_rms_norm,
    rescale_residual_stream as rescale_residual_stream,
)
from .pipeline import process_weights as process_weights
from .quantisation import (
    migrate_norm_scales as migrate_norm_scales,
    recover_head_rotations as recover_head_rotations,
    recover_norm_scales as recover_norm_scales,
    recover_neuron_scales as recover_neuron_scales,
    rotate_heads as rotate_heads,
    scale_neurons as scale_neurons,
)
from .rotation import (
    hadamard as hadamard,
    orthogonal_fixing_ones as orthogonal_fixing_ones,
    permute_heads as permute_heads,
    permute_neurons as permute_neurons,
    random_orthogonal as random_orthogonal,
    recover_head_permutation as recover_head_permutation,
    recover_neuron_permutation as recover_neuron_permutation,
    recover_rotation as recover_rotation,
    rotate_residual_stream as rotate_residual_stream,
    rotation_mismatches as rotation_mismatches,
)
from .scales import fold_embedding_scale as fold_embedding_scale, fold_logit_scale as fold_logit_scale
from .shortformer import shortformer_to_tables as shortformer_to_tables
